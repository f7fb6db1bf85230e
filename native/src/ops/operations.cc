#include "ops/operations.h"

#include <algorithm>
#include <cctype>
#include <cstring>

#include "core/timeline.h"
#include "ops/host_backends.h"

namespace sdl {
namespace {

int64_t Elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t RowElements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}

ReduceOp TransportOp(ReduceOp op) { return op == ReduceOp::kAverage ? ReduceOp::kSum : op; }

// Fused device entries start at multiples of this (gpu::kFusionAlignment: the
// kernels' vector width, whole cache sectors); a multiple of every element size.
constexpr size_t kDeviceFusionAlignment = 64;

bool DataOp(OpType op) {
  return op == OpType::kAllreduce || op == OpType::kAllgather || op == OpType::kBroadcast ||
         op == OpType::kAlltoall || op == OpType::kReducescatter;
}

}  // namespace

Operations::Operations() {
  auto host = std::make_unique<HostTransportBackend>();
  host_backend_ = host.get();
  AddBackend(kPriorityHost, std::move(host));
}

Operations::~Operations() {
  // Backends first: the staged ones return their staging buffers to the
  // memories, and NCCL's communicators end before the fusion buffers go
  // (cudaFree waits for the device, which a collective might still occupy).
  backends_.clear();
  for (auto& [key, buf] : fusion_) MemoryFor(std::get<0>(key))->Free(std::get<0>(key), buf.data);
}

void Operations::AddBackend(int priority, std::unique_ptr<OpBackend> backend) {
  auto at = std::upper_bound(backends_.begin(), backends_.end(), priority,
                             [](int p, const Registered& r) { return p < r.priority; });
  backends_.insert(at, Registered{priority, std::move(backend)});
}

void Operations::AddDeviceMemory(std::unique_ptr<DeviceMemory> memory) {
  DeviceMemory* m = memory.get();
  // Backends hold the memory they were registered with: it is never replaced.
  if (memories_.count(m->type()))
    throw Error(ErrorCode::kInvalidArgument, "a memory for " + DeviceName(Device{m->type(), 0}) +
                                                 " tensors is registered already");
  memories_[m->type()] = std::shared_ptr<DeviceMemory>(std::move(memory));
  AddBackend(kPriorityStaged, std::make_unique<HostStagedBackend>(m, host_backend_));
}

OpBackend* Operations::Choose(const Response& r, Device d) const {
  for (const Registered& b : backends_)
    if (b.backend->Enabled(r, d)) return b.backend.get();
  return nullptr;
}

std::vector<std::string> Operations::BackendNames() const {
  std::vector<std::string> out;
  for (const Registered& b : backends_) out.push_back(b.backend->name());
  return out;
}

void Operations::CheckServable(const Request& req) const {
  // The host transport backend is always registered and serves every host
  // tensor (this runs for each tensor of every step: no probe for those).
  if (!DataOp(req.op) || req.device.host()) return;
  Response probe;
  probe.op = req.op;
  probe.dtype = req.dtype;
  probe.reduce = req.reduce;
  probe.device = MemoryKind(req.device);
  probe.names = {req.name};
  probe.shapes = {req.shape};
  if (Choose(probe, req.device)) return;
  std::string names;
  for (const std::string& n : BackendNames()) names += (names.empty() ? "" : ", ") + n;
  throw Error(ErrorCode::kInvalidArgument,
              std::string(OpTypeName(req.op)) + " of '" + req.name + "' is a " +
                  DeviceName(req.device) + " tensor, but no backend of this spark_dl build can "
                  "run it (backends: " + names + "; CUDA tensors need a build with CUDA and a "
                  "usable CUDA runtime, see cuda_built()). Move the tensor to the CPU, or "
                  "install a GPU build.");
}

DeviceMemory* Operations::MemoryFor(Device d) const {
  if (d.host()) return const_cast<HostMemory*>(&host_memory_);
  auto it = memories_.find(d.type);
  return it == memories_.end() ? nullptr : it->second.get();
}

// A joined rank runs allreduces it never enqueued: it has no entry to take the
// device from, and must pick the same backend as its peers, so it uses the
// response's memory kind and the ordinal of the last tensor of that kind it saw.
Device Operations::DeviceFor(const Response& r, const std::vector<Entry*>& entries) {
  for (Entry* e : entries) {
    if (!e) continue;
    if (!e->req.device.host()) last_ordinal_[e->req.device.type] = e->req.device.index;
    return e->req.device;
  }
  if (r.device == DeviceType::kCPU) return Device{};
  auto it = last_ordinal_.find(r.device);
  return Device{r.device, it == last_ordinal_.end() ? 0 : it->second};
}

Status Operations::Select(const Response& r, Device d, OpBackend** backend,
                          DeviceMemory** memory) {
  *backend = Choose(r, d);
  *memory = MemoryFor(d);
  if (*backend && *memory) {
    std::lock_guard<std::mutex> lk(counts_mu_);
    runs_[*backend]++;
    return Status::OK();
  }
  return Status::Fail(ErrorCode::kInvalidArgument,
                      std::string(OpTypeName(r.op)) + " of '" + r.names[0] + "': no backend for " +
                          DeviceName(d) + " tensors on this rank");
}

Status Operations::Fusion(Device d, DataType dt, int32_t ps_id, size_t bytes, void** p) {
  FusionBuffer& buf = fusion_[FusionKey{d, dt, ps_id}];
  if (buf.capacity < bytes) {
    DeviceMemory* m = MemoryFor(d);
    if (buf.data) m->Free(d, buf.data);
    buf = FusionBuffer();
    SDL_RETURN_IF_ERROR(m->Alloc(d, bytes, &buf.data));
    buf.capacity = bytes;
  }
  *p = buf.data;
  return Status::OK();
}

std::map<std::string, int64_t> Operations::Counters() const {
  std::map<std::string, int64_t> out;
  {
    std::lock_guard<std::mutex> lk(counts_mu_);
    for (const auto& [backend, runs] : runs_) out[std::string("backend.") + backend->key()] = runs;
  }
  for (const Registered& b : backends_) b.backend->AddCounters(&out);
  return out;
}

Status Operations::Poll() {
  for (Registered& b : backends_) SDL_RETURN_IF_ERROR(b.backend->Poll());
  return Status::OK();
}

void Operations::Abort(const std::string& why) {
  for (Registered& b : backends_) b.backend->Abort(why);
}

void Operations::ReleaseSet(int32_t ps_id) {
  for (Registered& b : backends_) b.backend->ReleaseSet(ps_id);
  for (auto it = fusion_.begin(); it != fusion_.end();) {
    if (std::get<2>(it->first) == ps_id) {
      Device d = std::get<0>(it->first);
      MemoryFor(d)->Free(d, it->second.data);
      it = fusion_.erase(it);
    } else {
      ++it;
    }
  }
}

std::vector<std::tuple<Device, DataType, int32_t>> Operations::FusionKeys() const {
  std::vector<FusionKey> keys;
  for (auto& [k, v] : fusion_) keys.push_back(k);
  return keys;
}

Status Operations::AllocateOutput(Device d, DataType dt, std::vector<int64_t> shape,
                                  std::shared_ptr<Buffer>* out) {
  const size_t bytes = static_cast<size_t>(Elements(shape)) * DataTypeSize(dt);
  if (d.host()) {
    *out = std::make_shared<Buffer>(bytes);
  } else {
    std::shared_ptr<DeviceMemory> m = memories_.at(d.type);
    void* p = nullptr;
    SDL_RETURN_IF_ERROR(m->Alloc(d, bytes, &p));
    // The release keeps the device memory alive: the caller's tensor may outlive the runtime.
    *out = std::make_shared<Buffer>(d, static_cast<char*>(p), bytes,
                                    [m, d](char* q) { m->Free(d, q); });
  }
  (*out)->dtype = dt;
  (*out)->shape = std::move(shape);
  return Status::OK();
}

Status Operations::MarkReady(Device d, uintptr_t stream,
                             std::shared_ptr<const ReadyMark>* out) const {
  out->reset();
  if (d.host()) return Status::OK();
  DeviceMemory* m = MemoryFor(d);
  return m ? m->MarkReady(d, stream, out) : Status::OK();
}

Status Operations::WaitInputs(DeviceMemory* m, Device d, const std::vector<Entry*>& entries) {
  if (d.host()) return Status::OK();
  // One wait per framework stream, for its entry enqueued last: marks on one
  // stream were recorded in seq order, so that mark covers the others'.
  std::vector<Entry*> last;
  for (Entry* e : entries) {
    if (!e) continue;
    auto same = std::find_if(last.begin(), last.end(),
                             [e](const Entry* l) { return l->stream == e->stream; });
    if (same == last.end())
      last.push_back(e);
    else if (e->seq > (*same)->seq)
      *same = e;
  }
  for (Entry* e : last) SDL_RETURN_IF_ERROR(m->WaitForStream(d, e->stream, e->ready.get()));
  // The core's stream holds the waits now: the marks can be recorded again.
  for (Entry* e : entries)
    if (e) e->ready.reset();
  return Status::OK();
}

Status Operations::SignalOutputs(DeviceMemory* m, Device d, const std::vector<Entry*>& entries) {
  if (d.host()) return Status::OK();
  std::vector<uintptr_t> done;
  for (Entry* e : entries) {
    if (!e || std::find(done.begin(), done.end(), e->stream) != done.end()) continue;
    done.push_back(e->stream);
    SDL_RETURN_IF_ERROR(m->SignalStream(d, e->stream));
  }
  return Status::OK();
}

// A fused allreduce of host tensors in place, without prescaling, with every
// entry present (not joined) and no two overlapping: the transport's
// AllreduceSpans over the tensors themselves, then the postscaling in place.
// *done false: not eligible or not supported, nothing happened.
Status Operations::AllreduceInPlace(OpBackend* b, DeviceMemory* m, const OpContext& ctx,
                                    const std::vector<Entry*>& entries, const Scaling& post,
                                    bool* done) {
  *done = false;
  const Response& r = ctx.response;
  if (!ctx.device.host() || r.prescale != 1.0) return Status::OK();
  const size_t es = DataTypeSize(r.dtype);
  std::vector<Comm::Span> spans;
  std::vector<CopyEntry> scale;
  size_t count = 0;
  spans.reserve(entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    const Entry* e = entries[i];
    if (!e || e->in != e->out || !e->out) return Status::OK();
    const size_t n = static_cast<size_t>(Elements(r.shapes[i]));
    spans.push_back(Comm::Span{static_cast<char*>(e->out), n * es});
    scale.push_back(CopyEntry{e->out, e->out, n});
    count += n;
  }
  std::vector<Comm::Span> sorted = spans;
  std::sort(sorted.begin(), sorted.end(),
            [](const Comm::Span& x, const Comm::Span& y) { return x.data < y.data; });
  for (size_t i = 1; i < sorted.size(); ++i)
    if (sorted[i - 1].data + sorted[i - 1].bytes > sorted[i].data) return Status::OK();
  SDL_RETURN_IF_ERROR(b->AllreduceSpans(ctx, spans, count, r.dtype, TransportOp(r.reduce), done));
  if (*done && !post.identity() && count)
    SDL_RETURN_IF_ERROR(m->BatchedCopy(ctx.device, scale.data(), static_cast<int>(scale.size()),
                                       r.dtype, post));
  return Status::OK();
}

// The timeline's name of the transport phase: the backend, or for host
// tensors the set's transport (SHM_ALLREDUCE, GLOO_..., HIERARCHICAL_...,
// HOST_STAGED_SHM_... for device memory staged through the host).
static std::string TransportPhase(const OpBackend* b, const ProcessSet& ps, OpType op) {
  std::string kind = std::strcmp(b->name(), "host transport") == 0 ? ps.transport
                     : std::strcmp(b->name(), "host-staged transport") == 0
                         ? "host_staged_" + ps.transport
                         : std::string(b->name());
  kind = kind + "_" + OpTypeName(op);
  for (char& c : kind) c = c == ' ' || c == '-' ? '_' : static_cast<char>(std::toupper(c));
  return kind;
}

Status Operations::Allreduce(ProcessSet& ps, const Response& r, const std::vector<Entry*>& entries) {
  const Device d = DeviceFor(r, entries);
  OpBackend* b = nullptr;
  DeviceMemory* m = nullptr;
  SDL_RETURN_IF_ERROR(Select(r, d, &b, &m));
  const OpContext ctx{ps, r, d};
  const size_t es = DataTypeSize(r.dtype);
  const Scaling post = PostScaling(r.dtype, r.reduce, r.postscale, ps.size());
  // Device tensors that asked the core for their output (core_output): allocate
  // it here, on the device; the executor hands e->output back on success.
  for (size_t i = 0; i < entries.size(); ++i) {
    Entry* e = entries[i];
    if (!e || e->out || d.host()) continue;
    SDL_RETURN_IF_ERROR(AllocateOutput(d, r.dtype, r.shapes[i], &e->output));
    e->out = e->output->data.get();
  }
  SDL_RETURN_IF_ERROR(WaitInputs(m, d, entries));
  if (entries.size() == 1 && entries[0]) {
    Entry& e = *entries[0];
    const size_t n = static_cast<size_t>(Elements(r.shapes[0]));
    const double t0 = timeline_ && timeline_->on() ? TimelineNow() : 0;
    if (r.prescale == 1.0) {
      // Out of place the backend reads the input itself: no copy first.
      SDL_RETURN_IF_ERROR(b->Allreduce(ctx, e.in, e.out, n, r.dtype, TransportOp(r.reduce)));
    } else {
      CopyEntry c{e.in, e.out, n};
      SDL_RETURN_IF_ERROR(m->BatchedCopy(d, &c, 1, r.dtype, PreScaling(r.prescale)));
      SDL_RETURN_IF_ERROR(b->Allreduce(ctx, e.out, e.out, n, r.dtype, TransportOp(r.reduce)));
    }
    if (!post.identity() && n) {
      CopyEntry c{e.out, e.out, n};
      SDL_RETURN_IF_ERROR(m->BatchedCopy(d, &c, 1, r.dtype, post));
    }
    if (t0 > 0) timeline_->Phase(TransportPhase(b, ps, r.op), t0, TimelineNow());
    return SignalOutputs(m, d, entries);
  }
  // Fused host tensors reduced in place: the transport may take them where they
  // are (shared memory does), sparing the pack and unpack copies.
  bool done = false;
  const double t0 = timeline_ && timeline_->on() ? TimelineNow() : 0;
  SDL_RETURN_IF_ERROR(AllreduceInPlace(b, m, ctx, entries, post, &done));
  if (done && t0 > 0) timeline_->Phase(TransportPhase(b, ps, r.op) + "_IN_PLACE", t0, TimelineNow());
  if (done) return SignalOutputs(m, d, entries);
  // Fused (or this rank joined and contributes zeros): pack, reduce once, unpack.
  // On a device each entry starts at a kDeviceFusionAlignment boundary, so the
  // batched-copy kernel uses 16-byte vector accesses; the padding is reduced with
  // the rest and never read back. Every member computes the same layout (same
  // shapes, dtype and memory kind). Host tensors stay back to back.
  const size_t align = d.host() ? es : kDeviceFusionAlignment;
  std::vector<CopyEntry> pack, unpack;
  std::vector<size_t> at;  // byte offset of each entry
  size_t bytes = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const size_t n = static_cast<size_t>(Elements(r.shapes[i]));
    pack.push_back(CopyEntry{entries[i] ? entries[i]->in : nullptr, nullptr, n});
    if (entries[i]) unpack.push_back(CopyEntry{nullptr, entries[i]->out, n});
    at.push_back(bytes);
    bytes = (bytes + n * es + align - 1) / align * align;
  }
  const size_t total = bytes / es;
  void* fused = nullptr;
  SDL_RETURN_IF_ERROR(Fusion(d, r.dtype, ps.id, bytes, &fused));
  char* buf = static_cast<char*>(fused);
  size_t u = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    pack[i].dst = buf + at[i];
    if (entries[i]) unpack[u++].src = buf + at[i];
  }
  const double t1 = t0 > 0 ? TimelineNow() : 0;
  SDL_RETURN_IF_ERROR(m->BatchedCopy(d, pack.data(), static_cast<int>(pack.size()), r.dtype,
                                     PreScaling(r.prescale)));
  const double t2 = t0 > 0 ? TimelineNow() : 0;
  SDL_RETURN_IF_ERROR(b->Allreduce(ctx, buf, buf, total, r.dtype, TransportOp(r.reduce)));
  const double t3 = t0 > 0 ? TimelineNow() : 0;
  SDL_RETURN_IF_ERROR(m->BatchedCopy(d, unpack.data(), static_cast<int>(unpack.size()), r.dtype,
                                     post));
  if (t0 > 0) {  // one call per phase, after the copies (device copies are only queued)
    timeline_->Phase("MEMCPY_IN_FUSION_BUFFER", t1, t2);
    timeline_->Phase(TransportPhase(b, ps, r.op), t2, t3);
    timeline_->Phase("MEMCPY_OUT_FUSION_BUFFER", t3, TimelineNow());
  }
  return SignalOutputs(m, d, entries);
}

Status Operations::Allgather(ProcessSet& ps, const Response& r, Entry& e, Result* res) {
  const Device d = e.req.device;
  OpBackend* b = nullptr;
  DeviceMemory* m = nullptr;
  SDL_RETURN_IF_ERROR(Select(r, d, &b, &m));
  const size_t row = static_cast<size_t>(RowElements(e.req.shape)) * DataTypeSize(r.dtype);
  std::vector<size_t> bytes;
  int64_t rows = 0;
  for (int64_t n : r.first_dims) {
    bytes.push_back(static_cast<size_t>(n) * row);
    rows += n;
  }
  std::vector<int64_t> shape = e.req.shape;
  shape[0] = rows;
  std::shared_ptr<Buffer> out;
  SDL_RETURN_IF_ERROR(AllocateOutput(d, r.dtype, shape, &out));
  SDL_RETURN_IF_ERROR(WaitInputs(m, d, {&e}));
  SDL_RETURN_IF_ERROR(b->Allgatherv(OpContext{ps, r, d}, e.in, out->data.get(), bytes));
  res->outputs.push_back(std::move(out));
  return SignalOutputs(m, d, {&e});
}

Status Operations::Broadcast(ProcessSet& ps, const Response& r, Entry& e) {
  const Device d = e.req.device;
  OpBackend* b = nullptr;
  DeviceMemory* m = nullptr;
  SDL_RETURN_IF_ERROR(Select(r, d, &b, &m));
  const size_t n = static_cast<size_t>(Elements(e.req.shape));
  SDL_RETURN_IF_ERROR(WaitInputs(m, d, {&e}));
  if (e.out != e.in && ps.my_rank == r.root && n) {
    CopyEntry c{e.in, e.out, n};
    SDL_RETURN_IF_ERROR(m->BatchedCopy(d, &c, 1, r.dtype, Scaling()));
  }
  SDL_RETURN_IF_ERROR(b->Broadcast(OpContext{ps, r, d}, e.out, n * DataTypeSize(r.dtype), r.root));
  return SignalOutputs(m, d, {&e});
}

Status Operations::Alltoall(ProcessSet& ps, const Response& r, Entry& e, Result* res) {
  const Device d = e.req.device;
  OpBackend* b = nullptr;
  DeviceMemory* m = nullptr;
  SDL_RETURN_IF_ERROR(Select(r, d, &b, &m));
  const int n = ps.size();
  const size_t row = static_cast<size_t>(RowElements(e.req.shape)) * DataTypeSize(r.dtype);
  std::vector<size_t> matrix(r.split_matrix.size());
  for (size_t i = 0; i < matrix.size(); ++i) matrix[i] = static_cast<size_t>(r.split_matrix[i]) * row;
  int64_t rows = 0;
  for (int q = 0; q < n; ++q) {
    int64_t got = r.split_matrix[q * n + ps.my_rank];
    res->ints.push_back(got);
    rows += got;
  }
  std::vector<int64_t> shape = e.req.shape;
  shape[0] = rows;
  std::shared_ptr<Buffer> out;
  SDL_RETURN_IF_ERROR(AllocateOutput(d, r.dtype, shape, &out));
  SDL_RETURN_IF_ERROR(WaitInputs(m, d, {&e}));
  SDL_RETURN_IF_ERROR(b->Alltoallv(OpContext{ps, r, d}, e.in, out->data.get(), matrix));
  res->outputs.push_back(std::move(out));
  return SignalOutputs(m, d, {&e});
}

Status Operations::Reducescatter(ProcessSet& ps, const Response& r, Entry& e, Result* res) {
  const Device d = e.req.device;
  OpBackend* b = nullptr;
  DeviceMemory* m = nullptr;
  SDL_RETURN_IF_ERROR(Select(r, d, &b, &m));
  const int n = ps.size();
  const int64_t dim0 = e.req.shape[0];
  const int64_t row = RowElements(e.req.shape);
  std::vector<size_t> counts;
  for (int q = 0; q < n; ++q)
    counts.push_back(static_cast<size_t>((dim0 / n + (q < dim0 % n ? 1 : 0)) * row));
  std::vector<int64_t> shape = e.req.shape;
  shape[0] = dim0 / n + (ps.my_rank < dim0 % n ? 1 : 0);
  std::shared_ptr<Buffer> out;
  SDL_RETURN_IF_ERROR(AllocateOutput(d, r.dtype, shape, &out));
  SDL_RETURN_IF_ERROR(WaitInputs(m, d, {&e}));
  const void* in = e.in;
  if (r.prescale != 1.0) {
    // The caller's input stays unchanged: scale a copy in the set's fusion buffer
    // (free here: one response runs at a time).
    const size_t total = static_cast<size_t>(dim0 * row);
    void* scaled = nullptr;
    SDL_RETURN_IF_ERROR(Fusion(d, r.dtype, ps.id, total * DataTypeSize(r.dtype), &scaled));
    CopyEntry c{e.in, scaled, total};
    SDL_RETURN_IF_ERROR(m->BatchedCopy(d, &c, 1, r.dtype, PreScaling(r.prescale)));
    in = scaled;
  }
  SDL_RETURN_IF_ERROR(b->Reducescatter(OpContext{ps, r, d}, in, out->data.get(), counts, r.dtype,
                                       TransportOp(r.reduce)));
  const Scaling post = PostScaling(r.dtype, r.reduce, r.postscale, n);
  if (!post.identity() && counts[ps.my_rank]) {
    CopyEntry c{out->data.get(), out->data.get(), counts[ps.my_rank]};
    SDL_RETURN_IF_ERROR(m->BatchedCopy(d, &c, 1, r.dtype, post));
  }
  res->outputs.push_back(std::move(out));
  return SignalOutputs(m, d, {&e});
}

}  // namespace sdl
