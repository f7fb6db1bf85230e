// Asynchronous handles: every enqueued operation gets one; the background
// thread completes it with a Result; callers poll or wait with a timeout.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/types.h"

namespace sdl {

// Output memory the core allocates (allgather, alltoall): handed to the
// caller as a DLPack tensor that keeps this buffer alive.
struct Buffer {
  explicit Buffer(size_t n) : data(n ? new char[n] : nullptr), bytes(n) {}
  std::unique_ptr<char[]> data;
  size_t bytes;
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
