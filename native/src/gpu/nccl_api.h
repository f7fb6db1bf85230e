// NCCL, loaded at run time (see dynlib.h): the entry points spark_dl uses,
// resolved once per process from libnccl.so.2 (the nvidia-nccl-cu12/-cu13
// wheel's copy, the one PyTorch already loaded, or the system's). Compiled only
// when the build found nccl.h (SDL_HAVE_NCCL); the header gives the types.
#pragma once

#include <nccl.h>

#include <string>

#include "common/types.h"
#include "gpu/dynlib.h"
#include "gpu/status.h"

namespace sdl {
namespace gpu {

// Oldest NCCL the operations accept: point-to-point send/recv (2.7) for
// alltoall, bfloat16 (2.10), ncclCommGetAsyncError with ncclInProgress (2.14).
constexpr int kMinNcclVersion = 21400;

struct NcclApi {
  DynLib lib;
  int version = 0;  // ncclGetVersion: 22809 for 2.28.9

  decltype(&::ncclGetVersion) GetVersion = nullptr;
  decltype(&::ncclGetUniqueId) GetUniqueId = nullptr;
  decltype(&::ncclGetErrorString) GetErrorString = nullptr;
  decltype(&::ncclGetLastError) GetLastError = nullptr;
  decltype(&::ncclCommInitRank) CommInitRank = nullptr;
  decltype(&::ncclCommInitRankConfig) CommInitRankConfig = nullptr;
  decltype(&::ncclCommFinalize) CommFinalize = nullptr;
  decltype(&::ncclCommDestroy) CommDestroy = nullptr;
  decltype(&::ncclCommAbort) CommAbort = nullptr;
  decltype(&::ncclCommGetAsyncError) CommGetAsyncError = nullptr;
  decltype(&::ncclAllReduce) AllReduce = nullptr;
  decltype(&::ncclBroadcast) Broadcast = nullptr;
  decltype(&::ncclReduce) Reduce = nullptr;
  decltype(&::ncclAllGather) AllGather = nullptr;
  decltype(&::ncclReduceScatter) ReduceScatter = nullptr;
  decltype(&::ncclSend) Send = nullptr;
  decltype(&::ncclRecv) Recv = nullptr;
  decltype(&::ncclGroupStart) GroupStart = nullptr;
  decltype(&::ncclGroupEnd) GroupEnd = nullptr;

  // "what failed: <NCCL's error string> (<last error detail>)".
  std::string Describe(ncclResult_t r, const char* what, ncclComm_t comm = nullptr) const;
  // "2.28.9"
  std::string VersionString() const;
};

// The process's NCCL, loaded on first call (thread-safe). nullptr when none
// could be loaded or it is older than kMinNcclVersion; then *error says why.
const NcclApi* Nccl(std::string* error = nullptr);

// Whether NCCL operations can run here: the library loaded and CUDA is usable.
struct NcclAvailability {
  bool usable = false;
  std::string reason;
  std::string library;
  int version = 0;
};
const NcclAvailability& QueryNccl();

// NCCL's element type for a reduction of `dt`, or an error naming the dtype
// (int16 has none: such tensors go through host staging). bool maps to uint8,
// where Max is logical or and Min/Product logical and; its Sum/Average are
// refused as in the CPU transports.
Status NcclReduceType(DataType dt, ReduceOp op, ncclDataType_t* out);
// NCCL's operation for `op` (Average is not one: reduce with Sum and scale).
Status NcclReduceOp(ReduceOp op, ncclRedOp_t* out);
// OK when Allreduce/Reducescatter can run (dt, op) on NCCL; the operations
// layer asks before choosing NCCL over host staging.
Status NcclSupportsReduction(DataType dt, ReduceOp op);

}  // namespace gpu
}  // namespace sdl
