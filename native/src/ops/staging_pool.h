// Host staging buffers for one kind of device, pooled per (device, size class).
//
// Staging a device tensor through a CPU transport copies it into host memory and
// back for every collective; page-locked ("pinned") memory makes those copies DMA
// that can run asynchronously on a stream, but pinning is slow (it maps pages for
// the driver), so buffers are kept and reused: a request takes a free buffer of its
// size class (powers of two from 64 KiB) or allocates one; Release returns it to
// its class. When pinning fails (locked-memory limits, no driver) the buffer is
// pageable and the caller is told (IsPinned), so it keeps copies synchronous.
//
// Device-neutral: the pinning functions are injected (CudaMemory passes
// cudaHostAlloc/cudaFreeHost), so the C++ tests run the pool without a GPU.
// Not thread-safe: the background thread is its only user.
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"

namespace sdl {

class StagingPool {
 public:
  // pin(bytes, &p, &why): page-locked memory, or false with the reason in why.
  using Pin = std::function<bool(int device, size_t bytes, void** p, std::string* why)>;
  using Unpin = std::function<void(void* p)>;
  // log: called once, on the first pinning failure, with a one-line message.
  StagingPool(Pin pin, Unpin unpin, std::function<void(const std::string&)> log)
      : pin_(std::move(pin)), unpin_(std::move(unpin)), log_(std::move(log)) {}
  ~StagingPool();
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;

  // At least `bytes` of host memory for staging device `device`'s tensors.
  Status Acquire(int device, size_t bytes, void** p);
  // Gives a buffer from Acquire back to its class (kept for reuse, not freed).
  void Release(void* p);
  // True when [p, p + bytes) lies in one pinned buffer of this pool.
  bool IsPinned(const void* p, size_t bytes) const;

  // The size class of a request (for tests and the docs).
  static size_t SizeClass(size_t bytes);
  // Buffers allocated so far (handed out or free), and how many are pinned.
  size_t allocated() const { return buffers_.size(); }
  size_t pinned() const;

 private:
  struct Info {
    int device;
    size_t size_class;
    bool pinned;
  };
  Pin pin_;
  Unpin unpin_;
  std::function<void(const std::string&)> log_;
  bool logged_ = false;
  std::map<void*, Info> buffers_;                               // every buffer, by address
  std::map<std::pair<int, size_t>, std::vector<void*>> free_;  // (device, class) -> free ones
};

}  // namespace sdl
