// Element types, reduction and collective kinds shared by the whole core.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace sdl {

enum class DataType : uint8_t {
  kUInt8, kInt8, kInt16, kInt32, kInt64, kFloat16, kBFloat16, kFloat32, kFloat64, kBool,
  kUInt16,
  kUInt64,  // internal: negotiation bit vectors; kept last (tables are sized by it)
};

enum class ReduceOp : uint8_t {
  kAverage, kSum, kMin, kMax, kProduct,
  kBitAnd,  // internal: negotiation bit vectors
};

enum class OpType : uint8_t {
  kAllreduce, kAllgather, kBroadcast, kAlltoall, kReducescatter, kBarrier, kJoin,
  kProcessSetAdd, kProcessSetRemove,  // world-set ops that change the set registry
};

// Where a tensor's memory lives, as DLPack says (kDLCPU, kDLCUDA, kDLCUDAHost).
// CUDA host (pinned) memory is host memory: CPU transports read it directly.
enum class DeviceType : uint8_t { kCPU = 0, kCUDA = 1, kCUDAHost = 2 };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int32_t index = 0;  // the GPU's ordinal on this host (0 for host memory)

  // True for memory the CPU can address (CPU and pinned CUDA host memory).
  bool host() const { return type != DeviceType::kCUDA; }
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
  bool operator<(const Device& o) const {
    return type != o.type ? type < o.type : index < o.index;
  }
};

// "cpu", "cuda:1", "cuda_host".
std::string DeviceName(Device d);
// The kind every rank must agree on for one tensor: kCPU for host memory, kCUDA
// for device memory (the GPU ordinal may differ between ranks).
DeviceType MemoryKind(Device d);
const char* MemoryKindName(DeviceType kind);

size_t DataTypeSize(DataType dt);
const char* DataTypeName(DataType dt);
const char* ReduceOpName(ReduceOp op);
const char* OpTypeName(OpType op);
bool IsFloating(DataType dt);

// Error categories carried from the background thread to the caller. The Python
// layer maps each to an exception class (spark_dl.common.exceptions).
enum class ErrorCode : uint8_t {
  kOk = 0,
  kInvalidArgument = 1,  // bad call on this rank (raised before enqueue)
  kMismatch = 2,         // ranks disagree on a tensor's op/dtype/shape/root...
  kPeerFailure = 3,      // a rank died, hung past the timeout, or the transport broke
  kShutdown = 4,         // the runtime shut down (here or on another rank)
  kNotInitialized = 5,
  kDuplicateName = 6,
  kTimeout = 7,          // a caller's wait(timeout) expired (the op is still pending)
};

// An error raised inside the core with its category.
struct Error : std::runtime_error {
  ErrorCode code;
  Error(ErrorCode c, const std::string& msg) : std::runtime_error(msg), code(c) {}
};

}  // namespace sdl
