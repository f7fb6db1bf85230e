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

// Handles are consecutive integers: a batch of n operations (Runtime::
// EnqueueMany) gets [first, first + n), so a binding can hold one integer pair
// for a whole step's tensors and wait for all of them in one call.
//
// Wake-ups: Complete signals only when a caller sleeps on that very handle
// (State::waited). A fused collective completes hundreds of handles in a row;
// signalling each would wake the waiting thread hundreds of times, and on a
// machine with fewer cores than busy threads every wake-up is a context switch
// that steals time from the background thread still completing the rest.
class HandleTable {
 public:
  int64_t Create() { return CreateRange(1); }
  // n >= 1 consecutive handles; returns the first.
  int64_t CreateRange(int64_t n);
  void Complete(int64_t h, Result r);
  bool Poll(int64_t h);
  // True when done; false when timeout_s (< 0: no limit) passed first.
  bool Wait(int64_t h, double timeout_s) { return WaitRange(h, 1, timeout_s); }
  // True when every handle of [first, first + n) is done; false when timeout_s
  // (< 0: no limit) passed first. Throws when one of them is unknown.
  bool WaitRange(int64_t first, int64_t n, double timeout_s) {
    return WaitRange(first, n, timeout_s, nullptr);
  }
  // As above, but also returns false as soon as Kick() was called after
  // kicks() returned *kick (when kick is not null): how a thread that waits
  // for the runtime's cycle lock learns that it came free (Runtime::WaitRange).
  bool WaitRange(int64_t first, int64_t n, double timeout_s, const uint64_t* kick);
  uint64_t kicks();
  // Wakes every sleeping WaitRange that passed a kick (the others sleep on).
  void Kick();
  // Removes and returns a finished handle's result. Throws when unknown.
  Result Take(int64_t h);
  // Take of every handle of [first, first + n), which must all be finished
  // (checked before any is removed).
  std::vector<Result> TakeRange(int64_t first, int64_t n);
  // Completes every unfinished handle with this error (shutdown / failure).
  void FailAll(ErrorCode code, const std::string& msg);

 private:
  struct State {
    bool done = false;
    bool waited = false;  // a caller sleeps until this one is done
    Result result;
  };
  std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_map<int64_t, State> states_;
  int64_t next_ = 1;
  uint64_t kicks_ = 0;
};

}  // namespace sdl
