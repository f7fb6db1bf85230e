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
// Hierarchical allreduce (HierarchicalOptions::enabled, SDL_HIERARCHICAL_ALLREDUCE):
// allreduces of a set whose hosts hold equally many members run as NCCL
// reduce-scatter on a per-host communicator (one per set and device, created
// like the set's, its id from the host's first member), the CPU transport
// across hosts on the shard (ops/hierarchical.h), NCCL allgather on the host.
// Other operations, and sets with unequal hosts, use the set's communicator.
//
// Asynchronous errors: a collective returns once queued, so NCCL reports a
// failure of the work itself (a peer died mid-collective) later. Poll(), run
// once per background cycle, asks every communicator (ncclCommGetAsyncError,
// non-blocking); on an error it aborts them all and fails the runtime with a
// message naming the communicator, so in-flight and later handles fail.
//
// Ranks sharing a GPU: NCCL refuses two ranks of one communicator on one
// device. Before creating the communicator of (set, device) every member
// allgathers (host, PCI id of its device) over the set's CPU communicator; when
// two members share a GPU, every member sees it and runs that (set, device)
// through host staging instead, so the choice stays the same on every member.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gpu/nccl_comm.h"
#include "ops/backend.h"
#include "ops/cuda_memory.h"
#include "ops/hierarchical.h"
#include "ops/host_backends.h"

namespace sdl {

// The device-neutral part of the choice, shared with the tests.
// nccl_usable: NCCL loaded and CUDA usable; reduction_supported: NCCL has the
// response's (dtype, op) (only asked for reducing operations).
bool NcclTakes(const Response& r, Device d, bool nccl_usable, bool reduction_supported);

struct HierarchicalOptions {
  bool enabled = false;  // SDL_HIERARCHICAL_ALLREDUCE
  // Global rank -> host identity (the runtime's map, the one shared memory
  // uses); filled before the background thread starts. Not owned.
  const std::vector<std::string>* host_of_rank = nullptr;
};

class NcclBackend : public OpBackend {
 public:
  // memory: the CUDA memory whose streams the layer packs on (not owned).
  // usable: whether NCCL can run here; default gpu::QueryNccl().usable (tests
  // pass a fake to check the choice on a machine without a GPU).
  NcclBackend(CudaMemory* memory, gpu::NcclOptions options, bool (*usable)() = nullptr,
              HierarchicalOptions hierarchical = HierarchicalOptions())
      : memory_(memory), usable_(usable), hierarchical_(hierarchical), comms_(options),
        local_comms_(options), staged_(memory, &host_), scratch_(memory) {}
  const char* name() const override { return "NCCL"; }
  const char* key() const override { return "nccl"; }
  // "nccl.hierarchical": allreduces that took the hierarchical path;
  // "nccl.shared_gpu": allreduces staged through host memory because members
  // share a GPU (NCCL refuses that).
  void AddCounters(std::map<std::string, int64_t>* out) const override {
    (*out)["nccl.hierarchical"] = hierarchical_runs_.load();
    (*out)["nccl.shared_gpu"] = shared_runs_.load();
  }
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
  Status Poll() override;
  void Abort(const std::string& why) override { AbortAll(why); }

 private:
  std::atomic<int64_t> hierarchical_runs_{0};
  std::atomic<int64_t> shared_runs_{0};
  // The communicator of (ctx.ps, ctx.device), its stream ordered after the core
  // stream; then `run` enqueues the collective; then the core stream waits for it.
  template <typename Fn>
  Status Run(const OpContext& ctx, const char* what, Fn run);
  // The same bracketing around `run` on a given communicator.
  template <typename Fn>
  Status RunOn(const OpContext& ctx, const char* what, gpu::NcclCommunicator* comm, Fn run);
  // The host layout of ctx.ps when hierarchical allreduce applies to it, else null.
  const HostLayout* LayoutFor(const OpContext& ctx);
  Status HierarchicalRun(const OpContext& ctx, const HostLayout& layout, const void* in,
                         void* out, size_t count, DataType dt, ReduceOp op);
  void AbortAll(const std::string& why);

  // True when two members of ctx.ps run on one GPU (then host staging);
  // collective over the set on the first call per (set, device).
  Status SharesGpu(const OpContext& ctx, bool* shared);

  CudaMemory* memory_;
  bool (*usable_)();
  HierarchicalOptions hierarchical_;
  gpu::NcclCommunicators comms_;        // one per (set, device): every member
  gpu::NcclCommunicators local_comms_;  // one per (set, device): the members on this host
  HostTransportBackend host_;
  HostStagedBackend staged_;
  HierarchicalScratch scratch_;
  std::map<int32_t, std::unique_ptr<HostLayout>> layouts_;  // per set; null: flat
  std::map<std::pair<int32_t, int>, bool> shared_;  // (set, device) -> members share a GPU
};

}  // namespace sdl
