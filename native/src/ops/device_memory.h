// Memory of one kind of device, as the operations layer sees it: allocation,
// copies to and from the host, batched pack/unpack with scaling, and the
// stream hooks that order the core's work after the framework's.
//
// HostMemory (below) serves CPU and pinned host tensors. A GPU build adds one
// implementation for kCUDA (CUDA runtime calls and the batched-copy kernel in
// src/gpu/); tests use a fake device backed by host memory. Everything here
// runs on the background thread only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "common/status.h"
#include "common/types.h"

namespace sdl {

// One copy of a batch: count elements from src to dst, both on the same
// device. src == nullptr writes zeros (a joined rank's contribution); src ==
// dst scales in place.
struct CopyEntry {
  const void* src = nullptr;
  void* dst = nullptr;
  size_t count = 0;
};

// Applied to each copied element: integer types are first divided by divisor
// (exactly, toward zero), then every type is multiplied by factor (integers in
// double, truncated toward zero). Floating types never use divisor: it is
// folded into factor, so pack/unpack is one multiply per element.
struct Scaling {
  double factor = 1.0;
  int64_t divisor = 1;
  bool identity() const { return factor == 1.0 && divisor == 1; }
};

// Scaling before the reduction (prescale).
Scaling PreScaling(double prescale);
// Scaling after the reduction: postscale, and for Average the division by the
// number of ranks (the transports reduce Average as Sum).
Scaling PostScaling(DataType dt, ReduceOp op, double postscale, int size);

// A point in a framework stream's work: what the stream had queued when a
// device tensor was enqueued (its producer), captured on the caller's thread.
// Only the memory that made it reads it.
class ReadyMark {
 public:
  virtual ~ReadyMark() = default;
};

class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;
  // The device type this memory serves; every call passes the device (ordinal).
  virtual DeviceType type() const = 0;
  virtual Status Alloc(Device d, size_t bytes, void** p) = 0;
  virtual void Free(Device d, void* p) = 0;
  // CopyToHost returns once the bytes are in place (host staging reads them
  // next); CopyFromHost too, except from a staging buffer (see StagingFence).
  virtual Status CopyToHost(Device d, void* host, const void* src, size_t bytes) = 0;
  virtual Status CopyFromHost(Device d, void* dst, const void* host, size_t bytes) = 0;
  // Pack/unpack: every copy of the batch (one kernel launch on a GPU), each
  // element scaled as s says. Ordered after WaitForStream and before any later
  // collective on d.
  virtual Status BatchedCopy(Device d, const CopyEntry* entries, int n, DataType dt,
                             const Scaling& s) = 0;
  // Stream hooks. stream is the framework's stream the tensor was produced on
  // (DLPack's stream protocol; 0: the default stream). Host memory has nothing
  // to order.
  // MarkReady, at enqueue on the caller's thread (any thread may call it):
  // captures what stream has queued now (an event recorded there). null *out:
  // nothing captured.
  // WaitForStream, per response: the core's next work on d waits for mark
  // (MarkReady's, on stream), or without one for what stream has queued now;
  // on the device, never a host wait. Later framework work is not waited for.
  // SignalStream, per response: work queued on stream later waits for the
  // core's work on d so far (the outputs).
  virtual Status MarkReady(Device d, uintptr_t stream, std::shared_ptr<const ReadyMark>* out) {
    out->reset();
    return Status::OK();
  }
  virtual Status WaitForStream(Device d, uintptr_t stream, const ReadyMark* mark) {
    return Status::OK();
  }
  virtual Status SignalStream(Device d, uintptr_t stream) { return Status::OK(); }

  // Host memory for staging device d's tensors through a CPU transport. The
  // default is plain host memory; CUDA hands out page-locked buffers (DMA
  // without a bounce copy) reused per size class, and pageable memory when
  // pinning fails. Free only what AllocStaging returned.
  virtual Status AllocStaging(Device d, size_t bytes, void** p);
  virtual void FreeStaging(Device d, void* p);
  // CopyFromHost from a staging buffer may return before the device read it
  // (pinned memory: the copy is queued on the core's stream, and the device's
  // later work is ordered after it). Call StagingFence(d) before the host
  // writes into a staging buffer that a CopyFromHost read: it returns once
  // every such copy finished.
  virtual Status StagingFence(Device d) { return Status::OK(); }
};

// CPU memory (and CUDA host memory, which the CPU addresses directly).
class HostMemory : public DeviceMemory {
 public:
  DeviceType type() const override { return DeviceType::kCPU; }
  Status Alloc(Device d, size_t bytes, void** p) override;
  void Free(Device d, void* p) override;
  Status CopyToHost(Device d, void* host, const void* src, size_t bytes) override;
  Status CopyFromHost(Device d, void* dst, const void* host, size_t bytes) override;
  Status BatchedCopy(Device d, const CopyEntry* entries, int n, DataType dt,
                     const Scaling& s) override;
};

// Scales count elements of buf in place as s says (the host half of BatchedCopy).
void ApplyScaling(void* buf, size_t count, DataType dt, const Scaling& s);

}  // namespace sdl
