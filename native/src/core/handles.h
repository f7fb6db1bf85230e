// Asynchronous handles: every enqueued operation gets one; the background
// thread completes it with a Result; callers poll or wait with a timeout.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/types.h"

namespace sdl {

// Frees output memory: through release when set (device memory), else back
// to the output pool when it came from there (capacity > 0), else delete[].
struct OutputDeleter {
  size_t capacity = 0;
  std::function<void(char*)> release;
  void operator()(char* p) const;
};

// Output memory the core allocates (allgather, alltoall, out-of-place
// allreduce): handed to the caller as a DLPack tensor that keeps this buffer
// alive.
//
// Why a pool: a fresh large allocation is a fresh mapping whose every page
// faults (and is zeroed) on first write, which for 64 MiB costs more than the
// shared-memory allreduce itself, and those faults would land inside the
// collective where they stall every peer. Buffers of at least 1 MiB therefore
// come from anonymous mappings (2 MiB aligned, advised for transparent huge
// pages, pre-faulted) that return to a per-process pool when the caller drops
// the tensor; the next output of a similar size reuses one without faulting.
// The pool keeps at most 256 MiB idle and unmaps buffers idle for over 30 s
// (checked whenever an output is taken or released).
// Smaller buffers come from the heap.
// Device outputs (CUDA tensors) come from the device's memory instead and are
// freed through release.
struct Buffer {
  explicit Buffer(size_t n);
  Buffer(Device d, char* p, size_t n, std::function<void(char*)> release);
  std::unique_ptr<char[], OutputDeleter> data;
  size_t bytes;
  Device device;
  DataType dtype = DataType::kUInt8;
  std::vector<int64_t> shape;
};

struct Result {
  ErrorCode code = ErrorCode::kOk;
  std::string message;
  std::vector<std::shared_ptr<Buffer>> outputs;  // core-allocated outputs, if any
  std::vector<int64_t> ints;                     // alltoall: received splits; join: last rank
};

class HandleTable {
 public:
  int64_t Create();
  void Complete(int64_t h, Result r);
  bool Poll(int64_t h);
  // True when done; false when timeout_s (< 0: no limit) passed first.
  bool Wait(int64_t h, double timeout_s);
  // Removes and returns a finished handle's result. Throws when unknown.
  Result Take(int64_t h);
  // Completes every unfinished handle with this error (shutdown / failure).
  void FailAll(ErrorCode code, const std::string& msg);

 private:
  struct State {
    bool done = false;
    Result result;
  };
  std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_map<int64_t, State> states_;
  int64_t next_ = 1;
};

}  // namespace sdl
