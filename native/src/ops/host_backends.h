// The CPU backends: the process set's own transport for host tensors, and the
// same transport staged through host memory for device tensors.
#pragma once

#include <vector>

#include "ops/backend.h"
#include "ops/device_memory.h"

namespace sdl {

// Host tensors over the process set's communicator (shared memory, Gloo, MPI
// or their hierarchical combination, chosen when the set was built).
class HostTransportBackend : public OpBackend {
 public:
  const char* name() const override { return "host transport"; }
  const char* key() const override { return "host"; }
  bool Enabled(const Response& r, Device d) const override { return d.host(); }
  Status Allreduce(const OpContext& ctx, const void* in, void* out, size_t count, DataType dt,
                   ReduceOp op) override;
  Status AllreduceSpans(const OpContext& ctx, const std::vector<Comm::Span>& spans, size_t count,
                        DataType dt, ReduceOp op, bool* done) override;
  Status Allgatherv(const OpContext& ctx, const void* in, void* out,
                    const std::vector<size_t>& bytes) override;
  Status Broadcast(const OpContext& ctx, void* buf, size_t bytes, int root) override;
  Status Alltoallv(const OpContext& ctx, const void* in, void* out,
                   const std::vector<size_t>& matrix) override;
  Status Reducescatter(const OpContext& ctx, const void* in, void* out,
                       const std::vector<size_t>& counts, DataType dt, ReduceOp op) override;
};

// Device tensors without a device-native backend (no NCCL, or ranks sharing a
// GPU): copy device -> host, run the host backend, copy host -> device. One
// staging copy per collective: fused responses arrive here already packed on
// the device, so a fused allreduce crosses the bus once each way.
class HostStagedBackend : public OpBackend {
 public:
  // memory: the device type's memory (not owned); host: the host backend (not owned).
  HostStagedBackend(DeviceMemory* memory, OpBackend* host) : memory_(memory), host_(host) {}
  const char* name() const override { return "host-staged transport"; }
  const char* key() const override { return "host_staged"; }
  bool Enabled(const Response& r, Device d) const override { return d.type == memory_->type(); }
  Status Allreduce(const OpContext& ctx, const void* in, void* out, size_t count, DataType dt,
                   ReduceOp op) override;
  Status Allgatherv(const OpContext& ctx, const void* in, void* out,
                    const std::vector<size_t>& bytes) override;
  Status Broadcast(const OpContext& ctx, void* buf, size_t bytes, int root) override;
  Status Alltoallv(const OpContext& ctx, const void* in, void* out,
                   const std::vector<size_t>& matrix) override;
  Status Reducescatter(const OpContext& ctx, const void* in, void* out,
                       const std::vector<size_t>& counts, DataType dt, ReduceOp op) override;

 ~HostStagedBackend() override;

 private:
  // A host staging buffer from memory_->AllocStaging (pinned for CUDA), grown
  // on demand and kept: the background thread is its only user.
  struct Staging {
    void* data = nullptr;
    size_t capacity = 0;
    Device device;
  };
  // A buffer of at least `bytes` for device d in *p. Fences first: the
  // previous collective's CopyFromHost may still read the buffer.
  Status Stage(Staging& buf, Device d, size_t bytes, char** p);
  OpContext HostContext(const OpContext& ctx) const {
    return OpContext{ctx.ps, ctx.response, Device{DeviceType::kCPU, 0}};
  }

  DeviceMemory* memory_;
  OpBackend* host_;
  Staging in_, out_;
};

}  // namespace sdl
