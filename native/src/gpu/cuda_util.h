// Owned CUDA objects (streams, events, device and pinned host buffers) over the
// run-time-loaded runtime. Each remembers its device and makes it current where
// the runtime requires it, so the owner need not track the current device.
#pragma once

#include <cstddef>

#include "gpu/cuda_api.h"

namespace sdl {
namespace gpu {

// A non-blocking stream: it does not synchronize with the legacy default
// stream, so spark_dl's work never serializes behind unrelated framework work
// (ordering with the framework comes only from events).
class Stream {
 public:
  Stream() = default;
  ~Stream();
  Stream(Stream&& o) noexcept { *this = std::move(o); }
  Stream& operator=(Stream&& o) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  // priority: as cudaStreamCreateWithPriority (lower is more urgent; 0 default).
  static Status Create(int device, int priority, Stream* out);
  cudaStream_t get() const { return stream_; }
  int device() const { return device_; }
  Status Synchronize() const;

 private:
  const CudaApi* api_ = nullptr;
  cudaStream_t stream_ = nullptr;
  int device_ = -1;
};

// An event without timing (the cheap kind, for ordering and completion only).
class Event {
 public:
  Event() = default;
  ~Event();
  Event(Event&& o) noexcept { *this = std::move(o); }
  Event& operator=(Event&& o) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  static Status Create(int device, Event* out);
  cudaEvent_t get() const { return event_; }

  // Captures the work submitted to `stream` so far.
  Status Record(cudaStream_t stream) const;
  // Makes `stream` wait (on the device, not the host) for the recorded work.
  Status MakeStreamWait(cudaStream_t stream) const;
  // true when the recorded work finished; false while it runs; an error status
  // when the device reported one (then *done is true).
  Status Query(bool* done) const;
  Status Synchronize() const;

 private:
  const CudaApi* api_ = nullptr;
  cudaEvent_t event_ = nullptr;
  int device_ = -1;
};

// Device memory that grows on demand (fusion buffers). Growing frees the old
// allocation first; cudaFree waits for the device to finish using it, so work
// already queued on any stream stays valid.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // Makes data() hold at least `bytes` on `device` (contents are not kept).
  Status Reserve(int device, size_t bytes);
  void* data() const { return data_; }
  size_t capacity() const { return capacity_; }
  int device() const { return device_; }

 private:
  void Release();
  const CudaApi* api_ = nullptr;
  void* data_ = nullptr;
  size_t capacity_ = 0;
  int device_ = -1;
};

// Page-locked host memory for staging CUDA tensors through a CPU transport
// (cudaMemcpyAsync from and to it overlaps with compute).
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer();
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  Status Reserve(size_t bytes);
  void* data() const { return data_; }
  size_t capacity() const { return capacity_; }

 private:
  void Release();
  const CudaApi* api_ = nullptr;
  void* data_ = nullptr;
  size_t capacity_ = 0;
};

// cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream): the direction is
// inferred from the pointers (unified addressing), so one call serves
// device-to-host staging, host-to-device and device-to-device.
Status CopyAsync(void* dst, const void* src, size_t bytes, cudaStream_t stream);

// The device a pointer lives on, or -1 for host memory (pageable or pinned).
Status PointerDevice(const void* ptr, int* device);

}  // namespace gpu
}  // namespace sdl
