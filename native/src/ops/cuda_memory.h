// CUDA device memory for the operations layer (compiled with SDL_HAVE_CUDA):
// allocation, host staging copies, the batched pack/unpack kernel, and the
// stream hooks that order the core's work after the framework's and the
// framework's later work after the core's.
//
// The core's work on device d runs on one stream of its own per device
// (StreamFor(d), non-blocking, created on first use). Ordering, never a
// device-wide synchronize:
//   framework stream --record--> event --wait--> core stream   (WaitForStream)
//   core stream      --record--> event --wait--> framework stream (SignalStream)
// A device-native backend (NCCL) runs on its own stream and brackets its
// collective with the same two waits against StreamFor(d), so pack -> collective
// -> unpack stay in order. Host staging copies synchronize the core stream only
// (the host transport reads the bytes right after).
//
// Everything here runs on the background thread (as DeviceMemory says), except
// Free, which a core-allocated output's deleter may call from any thread:
// cudaFree needs no stream and the runtime makes it safe.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "gpu/cuda_util.h"
#include "ops/device_memory.h"
#include "ops/staging_pool.h"

namespace sdl {

class CudaMemory : public DeviceMemory {
 public:
  DeviceType type() const override { return DeviceType::kCUDA; }
  Status Alloc(Device d, size_t bytes, void** p) override;
  void Free(Device d, void* p) override;
  Status CopyToHost(Device d, void* host, const void* src, size_t bytes) override;
  Status CopyFromHost(Device d, void* dst, const void* host, size_t bytes) override;
  Status BatchedCopy(Device d, const CopyEntry* entries, int n, DataType dt,
                     const Scaling& s) override;
  // Any thread: an event from a per-device pool, recorded on the framework's
  // stream with d current (the legacy and per-thread default streams are the
  // caller's); it returns to the pool when the mark is dropped.
  Status MarkReady(Device d, uintptr_t stream, std::shared_ptr<const ReadyMark>* out) override;
  Status WaitForStream(Device d, uintptr_t stream, const ReadyMark* mark) override;
  Status SignalStream(Device d, uintptr_t stream) override;
  // Pinned staging (cudaHostAlloc, portable), pooled per (device, size class)
  // (ops/staging_pool.h). When pinning fails the buffer is pageable (one log
  // line on stderr) and copies from it synchronize as before.
  Status AllocStaging(Device d, size_t bytes, void** p) override;
  void FreeStaging(Device d, void* p) override;
  Status StagingFence(Device d) override;
  ~CudaMemory() override;

  // The core's stream on device d (created on first use).
  Status StreamFor(Device d, cudaStream_t* out);
  // An event of device d for ordering the core stream with another stream
  // (re-recorded per use: cudaStreamWaitEvent captures the record at call time).
  Status EventFor(Device d, const gpu::Event** out);

 private:
  struct PerDevice {
    gpu::Stream stream;
    gpu::Event event;
  };
  Status Get(Device d, PerDevice** out);

  std::map<int, std::unique_ptr<PerDevice>> devices_;

  // Events of dropped ready marks per device, for the next MarkReady; shared
  // with the marks, which may outlive this memory (entries of a runtime that
  // is being torn down).
  struct MarkPool {
    std::mutex mu;
    std::map<int, std::vector<gpu::Event>> free;
  };
  class CudaMark;
  std::shared_ptr<MarkPool> marks_ = std::make_shared<MarkPool>();

  // Pinned staging buffers per (device, size class); created on first use.
  StagingPool& Staging();
  std::unique_ptr<StagingPool> staging_;
  // Devices with a CopyFromHost from pinned staging possibly still in flight.
  std::map<int, bool> staging_pending_;
};

// The operations layer's Status for a GPU layer status.
inline Status FromGpu(const gpu::Status& s) { return s.As<Status>(); }

// A framework stream as DLPack passes it (0: default, 1: legacy default, 2:
// per-thread default, else a cudaStream_t) as the runtime's handle: CUDA's
// cudaStreamLegacy is 0x1 and cudaStreamPerThread 0x2, so the value is the handle.
constexpr uintptr_t kPerThreadDefaultStream = 2;
inline cudaStream_t FrameworkStream(uintptr_t stream) {
  return reinterpret_cast<cudaStream_t>(stream);
}

}  // namespace sdl
