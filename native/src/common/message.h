// Requests (what one rank wants to run) and responses (what the coordinator
// decided every rank runs), with their wire format for negotiation.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/types.h"

namespace sdl {

struct Request {
  OpType op = OpType::kAllreduce;
  DataType dtype = DataType::kFloat32;
  ReduceOp reduce = ReduceOp::kSum;
  int32_t root = 0;            // broadcast root (rank within the process set)
  double prescale = 1.0;
  double postscale = 1.0;
  std::string name;
  std::vector<int64_t> shape;
  std::vector<int64_t> splits;  // alltoall: rows sent to each rank
  std::string group;            // grouped allreduce: group key ("" = none)
  int32_t group_size = 0;
  std::vector<int32_t> ranks;   // process-set add: member ranks; remove: {id}
  Device device;                // where this rank's tensor lives

  int64_t NumElements() const;
  // True when two ranks' requests for the same name may run together
  // (used for response-cache hits: the request equals the cached one).
  bool SameSignature(const Request& o) const;
};

struct Response {
  OpType op = OpType::kAllreduce;
  DataType dtype = DataType::kFloat32;
  ReduceOp reduce = ReduceOp::kSum;
  // The memory kind every member agreed on (MemoryKind of their requests'
  // devices: kCPU or kCUDA). The GPU ordinal is each member's own (its Entry).
  DeviceType device = DeviceType::kCPU;
  int32_t root = 0;
  double prescale = 1.0;
  double postscale = 1.0;
  std::vector<std::string> names;             // >1 when fused
  std::vector<std::vector<int64_t>> shapes;   // per name (joined ranks build zeros from it)
  std::vector<int64_t> first_dims;            // allgather: per rank
  std::vector<int64_t> split_matrix;          // alltoall: [src * size + dst] rows
  std::vector<int32_t> ranks;                 // process-set add/remove payload
  std::string group;
  std::string error;                          // non-empty: every rank fails these names
  ErrorCode error_code = ErrorCode::kOk;
  int32_t last_joined = -1;                   // join: the last rank that joined
  bool cacheable = false;                     // every rank may keep it in its response cache
};

// Little-endian length-prefixed encoding; Decode* throw std::runtime_error on
// truncated input.
std::string EncodeRequests(const std::vector<Request>& reqs, bool joined, bool shutdown);
std::vector<Request> DecodeRequests(const std::string& buf, bool* joined, bool* shutdown);
std::string EncodeResponses(const std::vector<Response>& resps);
std::vector<Response> DecodeResponses(const std::string& buf);

std::string ShapeString(const std::vector<int64_t>& shape);

}  // namespace sdl
