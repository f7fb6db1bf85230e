// Runs negotiated responses: the Runtime::Exec* members.
#include "common/status.h"
#include "core/runtime.h"

namespace sdl {
namespace {

int64_t Elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace

void Runtime::Finish(ProcessSet& ps, const std::string& name, Result result) {
  auto it = ps.pending.find(name);
  if (it == ps.pending.end()) return;  // a joined rank runs names it never enqueued
  const OpType op = it->second.req.op;
  const bool tensor_op = op == OpType::kAllreduce || op == OpType::kAllgather ||
                         op == OpType::kBroadcast || op == OpType::kAlltoall ||
                         op == OpType::kReducescatter;
  recorder_.Done(it->second.flight_id, result.code);
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
    // A stall shutdown ends the runtime on every member (they all run this response).
    if (r.error_code == ErrorCode::kPeerFailure) throw Error(r.error_code, r.error);
    DumpFlightRecorder("MismatchError: " + r.error);
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
  const bool traced = timeline_ && timeline_->on() && r.op <= OpType::kBarrier;
  if (traced) timeline_->Begin(ps.id, r, TimelineNow());
  recorder_.Started(ps, r, from_cache);
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
  if (traced) timeline_->End(ps.transport, TimelineNow());
  for (size_t i = 0; i < to_cache.size(); ++i) {
    Response single = r;
    single.names = {r.names[i]};
    single.shapes = {r.shapes[i]};
    ps.cache.Put(to_cache[i], single);
  }
}

// The data collectives go through the operations layer (ops/operations.h),
// which picks the backend and packs, scales and unpacks; a failed Status ends
// the runtime like a transport failure (the peers are out of step otherwise).
void Runtime::ExecAllreduce(ProcessSet& ps, const Response& r) {
  std::vector<Entry*> entries;
  for (const std::string& name : r.names) {
    auto it = ps.pending.find(name);
    entries.push_back(it == ps.pending.end() ? nullptr : &it->second);
  }
  ThrowIfError(ops_.Allreduce(ps, r, entries));
  if (entries.size() > 1) counters_.fused_tensors += static_cast<int64_t>(entries.size());
  counters_.collectives++;
  for (const std::string& name : r.names) Finish(ps, name, Result());
}

void Runtime::ExecAllgather(ProcessSet& ps, const Response& r) {
  Result res;
  ThrowIfError(ops_.Allgather(ps, r, ps.pending.at(r.names[0]), &res));
  counters_.collectives++;
  Finish(ps, r.names[0], std::move(res));
}

void Runtime::ExecBroadcast(ProcessSet& ps, const Response& r) {
  ThrowIfError(ops_.Broadcast(ps, r, ps.pending.at(r.names[0])));
  counters_.collectives++;
  Finish(ps, r.names[0], Result());
}

void Runtime::ExecAlltoall(ProcessSet& ps, const Response& r) {
  Result res;
  ThrowIfError(ops_.Alltoall(ps, r, ps.pending.at(r.names[0]), &res));
  counters_.collectives++;
  Finish(ps, r.names[0], std::move(res));
}

void Runtime::ExecReducescatter(ProcessSet& ps, const Response& r) {
  Result res;
  ThrowIfError(ops_.Reducescatter(ps, r, ps.pending.at(r.names[0]), &res));
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
    ops_.ReleaseSet(id);
  }
  Finish(ps, r.names[0], Result());
}

}  // namespace sdl
