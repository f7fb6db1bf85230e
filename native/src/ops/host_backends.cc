#include "ops/host_backends.h"

#include <numeric>

#include "core/process_set.h"

namespace sdl {

Status HostTransportBackend::Allreduce(const OpContext& ctx, const void* in, void* out,
                                       size_t count, DataType dt, ReduceOp op) {
  if (in == out) ctx.ps.comm->Allreduce(out, count, dt, op);
  else ctx.ps.comm->AllreduceInto(in, out, count, dt, op);
  return Status::OK();
}

Status HostTransportBackend::AllreduceSpans(const OpContext& ctx,
                                            const std::vector<Comm::Span>& spans, size_t count,
                                            DataType dt, ReduceOp op, bool* done) {
  *done = ctx.ps.comm->AllreduceSpans(spans, count, dt, op);
  return Status::OK();
}

Status HostTransportBackend::Allgatherv(const OpContext& ctx, const void* in, void* out,
                                        const std::vector<size_t>& bytes) {
  ctx.ps.comm->Allgatherv(in, out, bytes);
  return Status::OK();
}

Status HostTransportBackend::Broadcast(const OpContext& ctx, void* buf, size_t bytes, int root) {
  ctx.ps.comm->Broadcast(buf, bytes, root);
  return Status::OK();
}

Status HostTransportBackend::Alltoallv(const OpContext& ctx, const void* in, void* out,
                                       const std::vector<size_t>& matrix) {
  ctx.ps.comm->Alltoallv(in, out, matrix);
  return Status::OK();
}

Status HostTransportBackend::Reducescatter(const OpContext& ctx, const void* in, void* out,
                                           const std::vector<size_t>& counts, DataType dt,
                                           ReduceOp op) {
  ctx.ps.comm->Reducescatter(in, out, counts, dt, op);
  return Status::OK();
}

HostStagedBackend::~HostStagedBackend() {
  for (Staging* b : {&in_, &out_})
    if (b->data) memory_->FreeStaging(b->device, b->data);
}

Status HostStagedBackend::Stage(Staging& buf, Device d, size_t bytes, char** p) {
  SDL_RETURN_IF_ERROR(memory_->StagingFence(d));
  if (buf.capacity < bytes || !(buf.device == d) || !buf.data) {
    if (buf.data) memory_->FreeStaging(buf.device, buf.data);
    buf = Staging();
    SDL_RETURN_IF_ERROR(memory_->AllocStaging(d, bytes, &buf.data));
    buf.capacity = bytes;
    buf.device = d;
  }
  *p = static_cast<char*>(buf.data);
  return Status::OK();
}

Status HostStagedBackend::Allreduce(const OpContext& ctx, const void* in, void* out,
                                    size_t count, DataType dt, ReduceOp op) {
  const size_t bytes = count * DataTypeSize(dt);
  char* h = nullptr;
  SDL_RETURN_IF_ERROR(Stage(in_, ctx.device, bytes, &h));
  SDL_RETURN_IF_ERROR(memory_->CopyToHost(ctx.device, h, in, bytes));
  SDL_RETURN_IF_ERROR(host_->Allreduce(HostContext(ctx), h, h, count, dt, op));
  return memory_->CopyFromHost(ctx.device, out, h, bytes);
}

Status HostStagedBackend::Allgatherv(const OpContext& ctx, const void* in, void* out,
                                     const std::vector<size_t>& bytes) {
  const size_t mine = bytes[ctx.ps.my_rank];
  const size_t total = std::accumulate(bytes.begin(), bytes.end(), size_t{0});
  char *hin = nullptr, *hout = nullptr;
  SDL_RETURN_IF_ERROR(Stage(in_, ctx.device, mine, &hin));
  SDL_RETURN_IF_ERROR(Stage(out_, ctx.device, total, &hout));
  SDL_RETURN_IF_ERROR(memory_->CopyToHost(ctx.device, hin, in, mine));
  SDL_RETURN_IF_ERROR(host_->Allgatherv(HostContext(ctx), hin, hout, bytes));
  return memory_->CopyFromHost(ctx.device, out, hout, total);
}

Status HostStagedBackend::Broadcast(const OpContext& ctx, void* buf, size_t bytes, int root) {
  char* h = nullptr;
  SDL_RETURN_IF_ERROR(Stage(in_, ctx.device, bytes, &h));
  if (ctx.ps.my_rank == root) SDL_RETURN_IF_ERROR(memory_->CopyToHost(ctx.device, h, buf, bytes));
  SDL_RETURN_IF_ERROR(host_->Broadcast(HostContext(ctx), h, bytes, root));
  if (ctx.ps.my_rank == root) return Status::OK();
  return memory_->CopyFromHost(ctx.device, buf, h, bytes);
}

Status HostStagedBackend::Alltoallv(const OpContext& ctx, const void* in, void* out,
                                    const std::vector<size_t>& matrix) {
  const int n = ctx.ps.size(), me = ctx.ps.my_rank;
  size_t send = 0, recv = 0;
  for (int q = 0; q < n; ++q) {
    send += matrix[me * n + q];
    recv += matrix[q * n + me];
  }
  char *hin = nullptr, *hout = nullptr;
  SDL_RETURN_IF_ERROR(Stage(in_, ctx.device, send, &hin));
  SDL_RETURN_IF_ERROR(Stage(out_, ctx.device, recv, &hout));
  SDL_RETURN_IF_ERROR(memory_->CopyToHost(ctx.device, hin, in, send));
  SDL_RETURN_IF_ERROR(host_->Alltoallv(HostContext(ctx), hin, hout, matrix));
  return memory_->CopyFromHost(ctx.device, out, hout, recv);
}

Status HostStagedBackend::Reducescatter(const OpContext& ctx, const void* in, void* out,
                                        const std::vector<size_t>& counts, DataType dt,
                                        ReduceOp op) {
  const size_t es = DataTypeSize(dt);
  const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0}) * es;
  const size_t mine = counts[ctx.ps.my_rank] * es;
  char *hin = nullptr, *hout = nullptr;
  SDL_RETURN_IF_ERROR(Stage(in_, ctx.device, total, &hin));
  SDL_RETURN_IF_ERROR(Stage(out_, ctx.device, mine, &hout));
  SDL_RETURN_IF_ERROR(memory_->CopyToHost(ctx.device, hin, in, total));
  SDL_RETURN_IF_ERROR(host_->Reducescatter(HostContext(ctx), hin, hout, counts, dt, op));
  return memory_->CopyFromHost(ctx.device, out, hout, mine);
}

}  // namespace sdl
