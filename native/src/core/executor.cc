// Runs negotiated responses: the Runtime::Exec* members.
#include <cstring>
#include <numeric>

#include "common/reduce.h"
#include "core/fusion.h"
#include "core/runtime.h"

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

// Average is Sum followed by a division; integers divide exactly (toward zero).
void Finalize(void* buf, size_t n, DataType dt, ReduceOp op, double postscale, int size) {
  if (op == ReduceOp::kAverage) {
    if (IsFloating(dt)) {
      postscale /= size;
    } else {
      switch (dt) {
#define SDL_DIV(T)                                                          \
  for (size_t i = 0; i < n; ++i) static_cast<T*>(buf)[i] /= static_cast<T>(size); \
  break;
        case DataType::kUInt8: SDL_DIV(uint8_t)
        case DataType::kInt8: SDL_DIV(int8_t)
        case DataType::kInt16: SDL_DIV(int16_t)
        case DataType::kInt32: SDL_DIV(int32_t)
        case DataType::kInt64: SDL_DIV(int64_t)
        case DataType::kUInt64: SDL_DIV(uint64_t)
#undef SDL_DIV
        default: break;
      }
    }
  }
  Scale(buf, n, dt, postscale);
}

ReduceOp TransportOp(ReduceOp op) { return op == ReduceOp::kAverage ? ReduceOp::kSum : op; }

std::shared_ptr<Buffer> Allocate(DataType dt, std::vector<int64_t> shape) {
  auto b = std::make_shared<Buffer>(static_cast<size_t>(Elements(shape)) * DataTypeSize(dt));
  b->dtype = dt;
  b->shape = std::move(shape);
  return b;
}

}  // namespace

void Runtime::Finish(ProcessSet& ps, const std::string& name, Result result) {
  auto it = ps.pending.find(name);
  if (it == ps.pending.end()) return;  // a joined rank runs names it never enqueued
  const OpType op = it->second.req.op;
  const bool tensor_op = op == OpType::kAllreduce || op == OpType::kAllgather ||
                         op == OpType::kBroadcast || op == OpType::kAlltoall ||
                         op == OpType::kReducescatter;
  if (result.code == ErrorCode::kOk && tensor_op) {
    counters_.tensors++;
    counters_.bytes += Elements(it->second.req.shape) * DataTypeSize(it->second.req.dtype);
  }
  // An output the core allocated (out-of-place allreduce) goes to the caller.
  if (result.code == ErrorCode::kOk && it->second.output)
    result.outputs.insert(result.outputs.begin(), std::move(it->second.output));
  int64_t h = it->second.handle;
  ps.pending.erase(it);
  {
    std::lock_guard<std::mutex> lk(ps.mu);
    ps.inflight.erase(name);
  }
  handles_.Complete(h, std::move(result));
}

void Runtime::Execute(ProcessSet& ps, const Response& r, bool from_cache) {
  if (!r.error.empty()) {
    for (const std::string& name : r.names) {
      ps.cache.Erase(name);
      Result res;
      res.code = r.error_code;
      res.message = r.error;
      Finish(ps, name, std::move(res));
    }
    return;
  }
  // Negotiated responses enter the cache under this rank's own request, in
  // response order, identically on every member (see response_cache.h).
  std::vector<Request> to_cache;
  if (r.cacheable && !from_cache && ps.cache.capacity() > 0) {
    for (const std::string& name : r.names) {
      auto it = ps.pending.find(name);
      if (it != ps.pending.end()) to_cache.push_back(it->second.req);
    }
    if (to_cache.size() != r.names.size()) to_cache.clear();
  }
  switch (r.op) {
    case OpType::kAllreduce: ExecAllreduce(ps, r); break;
    case OpType::kAllgather: ExecAllgather(ps, r); break;
    case OpType::kBroadcast: ExecBroadcast(ps, r); break;
    case OpType::kAlltoall: ExecAlltoall(ps, r); break;
    case OpType::kReducescatter: ExecReducescatter(ps, r); break;
    case OpType::kBarrier:
      ps.comm->Barrier();
      counters_.collectives++;
      Finish(ps, r.names[0], Result());
      break;
    case OpType::kJoin:
      if (ps.joined) {
        ps.joined = false;
        Result res;
        res.ints = {r.last_joined};
        {
          std::lock_guard<std::mutex> lk(ps.mu);
          ps.inflight.erase("join");
        }
        handles_.Complete(ps.join_handle, std::move(res));
      }
      break;
    case OpType::kProcessSetAdd:
    case OpType::kProcessSetRemove: ExecProcessSetChange(ps, r); break;
  }
  for (size_t i = 0; i < to_cache.size(); ++i) {
    Response single = r;
    single.names = {r.names[i]};
    single.shapes = {r.shapes[i]};
    ps.cache.Put(to_cache[i], single);
  }
}

void Runtime::ExecAllreduce(ProcessSet& ps, const Response& r) {
  const size_t es = DataTypeSize(r.dtype);
  const int size = ps.size();
  std::vector<Entry*> entries;
  for (const std::string& name : r.names) {
    auto it = ps.pending.find(name);
    entries.push_back(it == ps.pending.end() ? nullptr : &it->second);
  }
  if (entries.size() == 1 && entries[0]) {
    Entry& e = *entries[0];
    size_t n = static_cast<size_t>(Elements(r.shapes[0]));
    if (r.prescale == 1.0) {
      // Out of place the transport reads the input itself: no copy first.
      ps.comm->AllreduceInto(e.in, e.out, n, r.dtype, TransportOp(r.reduce));
    } else {
      if (e.out != e.in && n) std::memcpy(e.out, e.in, n * es);
      Scale(e.out, n, r.dtype, r.prescale);
      ps.comm->Allreduce(e.out, n, r.dtype, TransportOp(r.reduce));
    }
    Finalize(e.out, n, r.dtype, r.reduce, r.postscale, size);
  } else {
    // Fused (or this rank joined and contributes zeros): pack, reduce once, unpack.
    std::vector<size_t> offsets;
    size_t total = 0;
    for (const auto& shape : r.shapes) {
      offsets.push_back(total);
      total += static_cast<size_t>(Elements(shape));
    }
    if (ps.fusion_buffer.size() < total * es) ps.fusion_buffer.resize(total * es);
    char* buf = ps.fusion_buffer.data();
    for (size_t i = 0; i < entries.size(); ++i) {
      size_t bytes = static_cast<size_t>(Elements(r.shapes[i])) * es;
      if (!bytes) continue;
      if (entries[i]) std::memcpy(buf + offsets[i] * es, entries[i]->in, bytes);
      else std::memset(buf + offsets[i] * es, 0, bytes);
    }
    Scale(buf, total, r.dtype, r.prescale);
    ps.comm->Allreduce(buf, total, r.dtype, TransportOp(r.reduce));
    Finalize(buf, total, r.dtype, r.reduce, r.postscale, size);
    for (size_t i = 0; i < entries.size(); ++i) {
      size_t bytes = static_cast<size_t>(Elements(r.shapes[i])) * es;
      if (entries[i] && bytes) std::memcpy(entries[i]->out, buf + offsets[i] * es, bytes);
    }
    if (entries.size() > 1) counters_.fused_tensors += static_cast<int64_t>(entries.size());
  }
  counters_.collectives++;
  for (const std::string& name : r.names) Finish(ps, name, Result());
}

void Runtime::ExecAllgather(ProcessSet& ps, const Response& r) {
  Entry& e = ps.pending.at(r.names[0]);
  const size_t row = static_cast<size_t>(RowElements(e.req.shape)) * DataTypeSize(r.dtype);
  std::vector<size_t> bytes;
  int64_t rows = 0;
  for (int64_t d : r.first_dims) {
    bytes.push_back(static_cast<size_t>(d) * row);
    rows += d;
  }
  std::vector<int64_t> shape = e.req.shape;
  shape[0] = rows;
  Result res;
  res.outputs.push_back(Allocate(r.dtype, shape));
  ps.comm->Allgatherv(e.in, res.outputs[0]->data.get(), bytes);
  counters_.collectives++;
  Finish(ps, r.names[0], std::move(res));
}

void Runtime::ExecBroadcast(ProcessSet& ps, const Response& r) {
  Entry& e = ps.pending.at(r.names[0]);
  size_t bytes = static_cast<size_t>(Elements(e.req.shape)) * DataTypeSize(r.dtype);
  if (e.out != e.in && ps.my_rank == r.root && bytes) std::memcpy(e.out, e.in, bytes);
  ps.comm->Broadcast(e.out, bytes, r.root);
  counters_.collectives++;
  Finish(ps, r.names[0], Result());
}

void Runtime::ExecAlltoall(ProcessSet& ps, const Response& r) {
  Entry& e = ps.pending.at(r.names[0]);
  const int n = ps.size();
  const size_t row = static_cast<size_t>(RowElements(e.req.shape)) * DataTypeSize(r.dtype);
  std::vector<size_t> matrix(r.split_matrix.size());
  for (size_t i = 0; i < matrix.size(); ++i) matrix[i] = static_cast<size_t>(r.split_matrix[i]) * row;
  Result res;
  int64_t rows = 0;
  for (int q = 0; q < n; ++q) {
    int64_t got = r.split_matrix[q * n + ps.my_rank];
    res.ints.push_back(got);
    rows += got;
  }
  std::vector<int64_t> shape = e.req.shape;
  shape[0] = rows;
  res.outputs.push_back(Allocate(r.dtype, shape));
  ps.comm->Alltoallv(e.in, res.outputs[0]->data.get(), matrix);
  counters_.collectives++;
  Finish(ps, r.names[0], std::move(res));
}

void Runtime::ExecReducescatter(ProcessSet& ps, const Response& r) {
  Entry& e = ps.pending.at(r.names[0]);
  const int n = ps.size();
  const int64_t dim0 = e.req.shape[0];
  const int64_t row = RowElements(e.req.shape);
  std::vector<size_t> counts;
  for (int q = 0; q < n; ++q)
    counts.push_back(static_cast<size_t>((dim0 / n + (q < dim0 % n ? 1 : 0)) * row));
  std::vector<int64_t> shape = e.req.shape;
  shape[0] = dim0 / n + (ps.my_rank < dim0 % n ? 1 : 0);
  Result res;
  res.outputs.push_back(Allocate(r.dtype, shape));
  void* out = res.outputs[0]->data.get();
  const void* in = e.in;
  std::vector<char> scaled;
  if (r.prescale != 1.0) {
    size_t bytes = static_cast<size_t>(dim0 * row) * DataTypeSize(r.dtype);
    scaled.assign(static_cast<const char*>(e.in), static_cast<const char*>(e.in) + bytes);
    Scale(scaled.data(), static_cast<size_t>(dim0 * row), r.dtype, r.prescale);
    in = scaled.data();
  }
  ps.comm->Reducescatter(in, out, counts, r.dtype, TransportOp(r.reduce));
  Finalize(out, counts[ps.my_rank], r.dtype, r.reduce, r.postscale, n);
  counters_.collectives++;
  Finish(ps, r.names[0], std::move(res));
}

void Runtime::FailSet(ProcessSet& ps, ErrorCode code, const std::string& msg) {
  std::vector<std::string> names;
  for (auto& [name, e] : ps.pending) names.push_back(name);
  for (const std::string& name : names) {
    Result res;
    res.code = code;
    res.message = msg;
    Finish(ps, name, std::move(res));
  }
  std::lock_guard<std::mutex> lk(ps.mu);
  for (Entry& e : ps.incoming) {
    Result res;
    res.code = code;
    res.message = msg;
    handles_.Complete(e.handle, std::move(res));
  }
  ps.incoming.clear();
  ps.inflight.clear();
}

void Runtime::ExecProcessSetChange(ProcessSet& ps, const Response& r) {
  const int32_t id = r.root;
  std::shared_ptr<ProcessSet> removed;
  {
    std::lock_guard<std::mutex> lk(sets_mu_);
    if (r.op == OpType::kProcessSetAdd) {
      auto it = staged_.find(id);
      if (it != staged_.end()) {
        active_[id] = it->second;
        staged_.erase(it);
      }
    } else {
      auto it = active_.find(id);
      if (it != active_.end()) {
        removed = it->second;
        active_.erase(it);
      }
    }
  }
  if (removed) {
    FailSet(*removed, ErrorCode::kInvalidArgument,
            "process set " + std::to_string(id) + " was removed");
    removed->comm.reset();
  }
  Finish(ps, r.names[0], Result());
}

}  // namespace sdl
