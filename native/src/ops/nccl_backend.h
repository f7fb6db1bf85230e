// NCCL for CUDA tensors (compiled with SDL_HAVE_NCCL): the device-native
// backend, first in the priority order (kPriorityDevice).
//
// One NCCL communicator per (process set, device), created on the set's first
// CUDA response from rank 0's unique id, which goes through the set's own CPU
// communicator (the controller's transport: BroadcastBytes), bounded by
// NcclOptions::timeout_s. The operations layer has already packed the inputs on
// the core's stream of the device (CudaMemory::StreamFor); each collective here
// makes the communicator's stream wait for that stream, runs on it, and makes the
// core stream wait for it again, so pack -> NCCL -> unpack -> SignalStream are in
// order without any host synchronization.
//
// Which responses it takes (the same answer on every member, as OpBackend
// requires): CUDA tensors when NCCL loaded and CUDA is usable here, and, for
// allreduce/reducescatter, when NCCL has the reduction (NcclSupportsReduction:
// int16 has none, bool has no Sum/Average); the rest are staged through host
// memory. Every host of a job must therefore have NCCL when one does.
//
// Ranks sharing a GPU: NCCL refuses two ranks of one communicator on one
// device. Before creating the communicator of (set, device) every member
// allgathers (host, PCI id of its device) over the set's CPU communicator; when
// two members share a GPU, every member sees it and runs that (set, device)
// through host staging instead, so the choice stays the same on every member.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "gpu/nccl_comm.h"
#include "ops/backend.h"
#include "ops/cuda_memory.h"
#include "ops/host_backends.h"

namespace sdl {

// The device-neutral part of the choice, shared with the tests.
// nccl_usable: NCCL loaded and CUDA usable; reduction_supported: NCCL has the
// response's (dtype, op) (only asked for reducing operations).
bool NcclTakes(const Response& r, Device d, bool nccl_usable, bool reduction_supported);

class NcclBackend : public OpBackend {
 public:
  // memory: the CUDA memory whose streams the layer packs on (not owned).
  // usable: whether NCCL can run here; default gpu::QueryNccl().usable (tests
  // pass a fake to check the choice on a machine without a GPU).
  NcclBackend(CudaMemory* memory, gpu::NcclOptions options, bool (*usable)() = nullptr)
      : memory_(memory), usable_(usable), comms_(options), staged_(memory, &host_) {}
  const char* name() const override { return "NCCL"; }
  bool Enabled(const Response& r, Device d) const override;
  Status Allreduce(const OpContext& ctx, const void* in, void* out, size_t count, DataType dt,
                   ReduceOp op) override;
  Status Allgatherv(const OpContext& ctx, const void* in, void* out,
                    const std::vector<size_t>& bytes) override;
  Status Broadcast(const OpContext& ctx, void* buf, size_t bytes, int root) override;
  Status Alltoallv(const OpContext& ctx, const void* in, void* out,
                   const std::vector<size_t>& matrix) override;
  Status Reducescatter(const OpContext& ctx, const void* in, void* out,
                       const std::vector<size_t>& counts, DataType dt, ReduceOp op) override;
  void ReleaseSet(int32_t ps_id) override;

 private:
  // The communicator of (ctx.ps, ctx.device), its stream ordered after the core
  // stream; then `run` enqueues the collective; then the core stream waits for it.
  template <typename Fn>
  Status Run(const OpContext& ctx, const char* what, Fn run);

  // True when two members of ctx.ps run on one GPU (then host staging);
  // collective over the set on the first call per (set, device).
  Status SharesGpu(const OpContext& ctx, bool* shared);

  CudaMemory* memory_;
  bool (*usable_)();
  gpu::NcclCommunicators comms_;
  HostTransportBackend host_;
  HostStagedBackend staged_;
  std::map<std::pair<int32_t, int>, bool> shared_;  // (set, device) -> members share a GPU
};

}  // namespace sdl
