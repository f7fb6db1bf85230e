#include "ops/nccl_backend.h"

#include <unistd.h>

#include <fstream>
#include <functional>
#include <memory>
#include <set>

#include "core/process_set.h"

namespace sdl {

bool NcclTakes(const Response& r, Device d, bool nccl_usable, bool reduction_supported) {
  if (d.type != DeviceType::kCUDA || !nccl_usable) return false;
  const bool reducing = r.op == OpType::kAllreduce || r.op == OpType::kReducescatter;
  return !reducing || reduction_supported;
}

bool NcclBackend::Enabled(const Response& r, Device d) const {
  if (d.type != DeviceType::kCUDA) return false;  // no NCCL query for host tensors
  const bool usable = usable_ ? usable_() : gpu::QueryNccl().usable;
  const bool reducing = r.op == OpType::kAllreduce || r.op == OpType::kReducescatter;
  // Average reaches NCCL as Sum (the layer divides in the unpack).
  const ReduceOp op = r.reduce == ReduceOp::kAverage ? ReduceOp::kSum : r.reduce;
  return NcclTakes(r, d, usable, reducing && usable && gpu::NcclSupportsReduction(r.dtype, op).ok());
}

namespace {

// This host (its name and boot) and the PCI location of device d: the same
// string on two members means one GPU, whatever CUDA_VISIBLE_DEVICES renumbered.
Status GpuIdentity(int d, std::string* out) {
  const gpu::CudaApi* api = gpu::Cuda();
  if (!api) return Status::Fail(ErrorCode::kInvalidArgument, "CUDA runtime not loaded");
  int domain = 0, bus = 0, dev = 0;
  SDL_RETURN_IF_ERROR(FromGpu(api->Check(
      api->DeviceGetAttribute(&domain, cudaDevAttrPciDomainId, d), "cudaDeviceGetAttribute")));
  SDL_RETURN_IF_ERROR(FromGpu(api->Check(
      api->DeviceGetAttribute(&bus, cudaDevAttrPciBusId, d), "cudaDeviceGetAttribute")));
  SDL_RETURN_IF_ERROR(FromGpu(api->Check(
      api->DeviceGetAttribute(&dev, cudaDevAttrPciDeviceId, d), "cudaDeviceGetAttribute")));
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  std::string boot;
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::getline(f, boot);
  *out = std::string(host) + "/" + boot + "/" + std::to_string(domain) + ":" +
         std::to_string(bus) + ":" + std::to_string(dev);
  return Status::OK();
}

}  // namespace

void NcclBackend::ReleaseSet(int32_t ps_id) {
  comms_.Erase(ps_id);
  local_comms_.Erase(ps_id);
  layouts_.erase(ps_id);
  for (auto it = shared_.begin(); it != shared_.end();)
    it = it->first.first == ps_id ? shared_.erase(it) : std::next(it);
}

Status NcclBackend::SharesGpu(const OpContext& ctx, bool* shared) {
  const auto key = std::make_pair(ctx.ps.id, ctx.device.index);
  auto it = shared_.find(key);
  if (it == shared_.end()) {
    std::string mine;
    // A member that cannot tell still takes part in the exchange (an empty
    // identity shares nothing), so no member waits for it.
    Status s = GpuIdentity(ctx.device.index, &mine);
    std::vector<std::string> all;
    try {
      all = ctx.ps.comm->AllgatherBytes(s.ok() ? mine : std::string());
    } catch (const Error& e) {
      return Status::Fail(e.code, std::string("exchanging GPU identities: ") + e.what());
    }
    std::set<std::string> seen;
    bool dup = false;
    for (const std::string& id : all) dup |= !id.empty() && !seen.insert(id).second;
    it = shared_.emplace(key, dup).first;
  }
  *shared = it->second;
  return Status::OK();
}

void NcclBackend::AbortAll(const std::string& why) {
  comms_.AbortAll(why);
  local_comms_.AbortAll(why);
}

Status NcclBackend::Poll() {
  Status s = FromGpu(comms_.CheckAsyncErrors("process set's"));
  if (s.ok()) s = FromGpu(local_comms_.CheckAsyncErrors("per-host (hierarchical allreduce)"));
  if (!s.ok()) AbortAll(s.message);
  return s;
}

template <typename Fn>
Status NcclBackend::Run(const OpContext& ctx, const char* what, Fn run) {
  ProcessSet& ps = ctx.ps;
  // Rank 0's unique id to every member over the set's CPU communicator (the
  // controller's transport; its own timeouts bound the wait).
  gpu::BroadcastFromRoot broadcast = [&ps](std::string* id) -> gpu::Status {
    try {
      ps.comm->BroadcastBytes(id, 0);
      return gpu::Status::OK();
    } catch (const Error& e) {
      return gpu::Status::Error(e.code, std::string("exchanging the NCCL id: ") + e.what());
    }
  };
  gpu::NcclCommunicator* comm = nullptr;
  Status s = FromGpu(comms_.Get(ps.id, ctx.device.index, ps.my_rank, ps.size(), broadcast, &comm));
  if (!s.ok()) {
    s.message = std::string(what) + " on " + DeviceName(ctx.device) + ": " + s.message;
    return s;
  }
  return RunOn(ctx, what, comm, run);
}

template <typename Fn>
Status NcclBackend::RunOn(const OpContext& ctx, const char* what, gpu::NcclCommunicator* comm,
                          Fn run) {
  cudaStream_t core = nullptr;
  const gpu::Event* event = nullptr;
  SDL_RETURN_IF_ERROR(memory_->StreamFor(ctx.device, &core));
  SDL_RETURN_IF_ERROR(memory_->EventFor(ctx.device, &event));
  gpu::DeviceGuard guard(gpu::Cuda(), ctx.device.index);
  SDL_RETURN_IF_ERROR(FromGpu(guard.status()));
  SDL_RETURN_IF_ERROR(FromGpu(comm->WaitForStream(core)));  // inputs packed / waited for
  Status s = FromGpu(run(comm));
  if (s.ok()) s = FromGpu(comm->RecordDone(*event));
  if (s.ok()) s = FromGpu(event->MakeStreamWait(core));  // unpack after the collective
  if (s.ok()) s = FromGpu(comm->CheckAsyncError());
  if (!s.ok()) {
    // The other ranks may be inside the collective: end them (the runtime
    // fails every pending op on this error, as for a transport failure).
    AbortAll(s.message);
    s.message = std::string("NCCL ") + what + " on " + DeviceName(ctx.device) + " (rank " +
                std::to_string(comm->rank()) + " of " + std::to_string(comm->size()) +
                " in its communicator, process set " + std::to_string(ctx.ps.id) + "): " +
                s.message;
  }
  return s;
}

const HostLayout* NcclBackend::LayoutFor(const OpContext& ctx) {
  if (!hierarchical_.enabled || !hierarchical_.host_of_rank) return nullptr;
  auto it = layouts_.find(ctx.ps.id);
  if (it == layouts_.end()) {
    // From the runtime's host map: every member builds the same layout.
    const std::vector<std::string>& hosts = *hierarchical_.host_of_rank;
    std::vector<std::string> of_member;
    bool known = true;
    for (int32_t r : ctx.ps.ranks) {
      known &= r >= 0 && static_cast<size_t>(r) < hosts.size();
      of_member.push_back(known ? hosts[r] : std::string());
    }
    auto layout = std::make_unique<HostLayout>();
    if (!known || !MakeHostLayout(of_member, ctx.ps.my_rank, layout.get())) layout.reset();
    it = layouts_.emplace(ctx.ps.id, std::move(layout)).first;
  }
  return it->second.get();
}

namespace {

// IntraHost over callables (the NCCL backend's per-host communicator).
class FnIntraHost : public IntraHost {
 public:
  using Rs = std::function<Status(const void*, void*, const std::vector<size_t>&, DataType,
                                  ReduceOp)>;
  using Ag = std::function<Status(const void*, void*, const std::vector<size_t>&, DataType)>;
  FnIntraHost(Rs rs, Ag ag) : rs_(std::move(rs)), ag_(std::move(ag)) {}
  Status Reducescatter(const void* in, void* out, const std::vector<size_t>& counts, DataType dt,
                       ReduceOp op) override {
    return rs_(in, out, counts, dt, op);
  }
  Status Allgather(const void* in, void* out, const std::vector<size_t>& counts,
                   DataType dt) override {
    return ag_(in, out, counts, dt);
  }

 private:
  Rs rs_;
  Ag ag_;
};

}  // namespace

Status NcclBackend::HierarchicalRun(const OpContext& ctx, const HostLayout& layout, const void* in,
                                    void* out, size_t count, DataType dt, ReduceOp op) {
  ProcessSet& ps = ctx.ps;
  // The host's first member makes the per-host id; one allgather over the set
  // carries every host's id, and each member keeps its own host's.
  gpu::BroadcastFromRoot broadcast = [&ps, &layout](std::string* id) -> gpu::Status {
    try {
      ExchangeHostIds(*ps.comm, layout, id);
      return gpu::Status::OK();
    } catch (const Error& e) {
      return gpu::Status::Error(e.code, std::string("exchanging the per-host NCCL ids: ") +
                                            e.what());
    }
  };
  gpu::NcclCommunicator* local = nullptr;
  Status s = FromGpu(local_comms_.Get(ps.id, ctx.device.index, layout.local_rank(),
                                      layout.local_size, broadcast, &local));
  if (!s.ok()) {
    s.message = "hierarchical allreduce on " + DeviceName(ctx.device) +
                ": creating the per-host NCCL communicator: " + s.message;
    return s;
  }
  FnIntraHost intra(
      [&](const void* i, void* o, const std::vector<size_t>& counts, DataType t, ReduceOp r) {
        return RunOn(ctx, "hierarchical reduce-scatter (per host)", local,
                     [&](gpu::NcclCommunicator* c) {
                       return c->Reducescatter(i, o, counts, t, r);
                     });
      },
      [&](const void* i, void* o, const std::vector<size_t>& counts, DataType t) {
        return RunOn(ctx, "hierarchical allgather (per host)", local,
                     [&](gpu::NcclCommunicator* c) { return c->Allgather(i, o, counts, t); });
      });
  CommAcrossHosts across(ps.comm.get(), &layout);
  SDL_RETURN_IF_ERROR(HierarchicalAllreduce(layout, intra, across, *memory_, scratch_, ctx.device,
                                            in, out, count, dt, op));
  hierarchical_runs_++;
  return Status::OK();
}

Status NcclBackend::Allreduce(const OpContext& ctx, const void* in, void* out, size_t count,
                              DataType dt, ReduceOp op) {
  bool shared = false;
  SDL_RETURN_IF_ERROR(SharesGpu(ctx, &shared));
  if (shared) {
    shared_runs_++;
    return staged_.Allreduce(ctx, in, out, count, dt, op);
  }
  if (const HostLayout* layout = LayoutFor(ctx))
    return HierarchicalRun(ctx, *layout, in, out, count, dt, op);
  return Run(ctx, "allreduce", [&](gpu::NcclCommunicator* c) {
    return c->Allreduce(in, out, count, dt, op);
  });
}

Status NcclBackend::Allgatherv(const OpContext& ctx, const void* in, void* out,
                               const std::vector<size_t>& bytes) {
  bool shared = false;
  SDL_RETURN_IF_ERROR(SharesGpu(ctx, &shared));
  if (shared) return staged_.Allgatherv(ctx, in, out, bytes);
  return Run(ctx, "allgather", [&](gpu::NcclCommunicator* c) {
    return c->Allgather(in, out, bytes, DataType::kUInt8);
  });
}

Status NcclBackend::Broadcast(const OpContext& ctx, void* buf, size_t bytes, int root) {
  bool shared = false;
  SDL_RETURN_IF_ERROR(SharesGpu(ctx, &shared));
  if (shared) return staged_.Broadcast(ctx, buf, bytes, root);
  return Run(ctx, "broadcast", [&](gpu::NcclCommunicator* c) {
    return c->Broadcast(buf, bytes, DataType::kUInt8, root);
  });
}

Status NcclBackend::Alltoallv(const OpContext& ctx, const void* in, void* out,
                              const std::vector<size_t>& matrix) {
  bool shared = false;
  SDL_RETURN_IF_ERROR(SharesGpu(ctx, &shared));
  if (shared) return staged_.Alltoallv(ctx, in, out, matrix);
  const int n = ctx.ps.size(), me = ctx.ps.my_rank;
  std::vector<size_t> send(n), recv(n);
  for (int p = 0; p < n; ++p) {
    send[p] = matrix[static_cast<size_t>(me) * n + p];
    recv[p] = matrix[static_cast<size_t>(p) * n + me];
  }
  return Run(ctx, "alltoall", [&](gpu::NcclCommunicator* c) {
    return c->Alltoall(in, send, out, recv, DataType::kUInt8);
  });
}

Status NcclBackend::Reducescatter(const OpContext& ctx, const void* in, void* out,
                                  const std::vector<size_t>& counts, DataType dt, ReduceOp op) {
  bool shared = false;
  SDL_RETURN_IF_ERROR(SharesGpu(ctx, &shared));
  if (shared) return staged_.Reducescatter(ctx, in, out, counts, dt, op);
  return Run(ctx, "reducescatter", [&](gpu::NcclCommunicator* c) {
    return c->Reducescatter(in, out, counts, dt, op);
  });
}

}  // namespace sdl
