#include "comm/hierarchical_comm.h"

#include <algorithm>

namespace sdl {

CrossPipe::CrossPipe(Comm* comm) : comm_(comm), thread_([this] { Run(); }) {}

CrossPipe::~CrossPipe() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  thread_.join();
}

uint64_t CrossPipe::Submit(char* p, size_t n, DataType dt, ReduceOp op) {
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lk(mu_);
    jobs_.push_back(Job{p, n, dt, op});
    ticket = ++submitted_;
  }
  work_cv_.notify_one();
  return ticket;
}

void CrossPipe::Wait(uint64_t ticket) {
  std::unique_lock<std::mutex> lk(mu_);
  done_cv_.wait(lk, [&] { return done_ >= ticket; });
  if (error_) std::rethrow_exception(error_);
}

void CrossPipe::Drain() noexcept {
  std::unique_lock<std::mutex> lk(mu_);
  done_cv_.wait(lk, [&] { return done_ >= submitted_; });
}

void CrossPipe::Run() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    work_cv_.wait(lk, [&] { return stop_ || !jobs_.empty(); });
    if (jobs_.empty()) return;  // stopped, nothing left
    const Job job = jobs_.front();
    jobs_.pop_front();
    if (!error_) {
      lk.unlock();
      std::exception_ptr err;
      try {
        comm_->Allreduce(job.p, job.n, job.dt, job.op);
      } catch (...) {
        err = std::current_exception();
      }
      lk.lock();
      if (err && !error_) error_ = err;
    }
    ++done_;
    done_cv_.notify_all();
  }
}

void HierarchicalComm::Phases(const void* in, void* out, size_t count, DataType dt, ReduceOp op) {
  const size_t es = DataTypeSize(dt);
  const size_t chunk = chunk_bytes_ ? std::max<size_t>(chunk_bytes_ / es, 1) : count;
  if (count > chunk) {
    return Pipelined(static_cast<const char*>(in), static_cast<char*>(out), count, chunk, dt, op);
  }
  local_->AllreduceInto(in, out, count, dt, op);
  if (cross_) cross_->Allreduce(out, count, dt, op);
  local_->Broadcast(out, count * es, 0);
}

// Every member runs the same shared-memory collectives in the same order:
// reduce chunk 0, then for each next chunk k: reduce k, broadcast k-1; and
// broadcast the last. The leader hands chunk k to the pipe as soon as the
// host has reduced it and waits for it just before broadcasting it, so the
// wire carries chunk k while the host reduces chunk k+1 (and broadcasts k-1).
void HierarchicalComm::Pipelined(const char* in, char* out, size_t count, size_t chunk,
                                 DataType dt, ReduceOp op) {
  const size_t es = DataTypeSize(dt);
  const size_t chunks = (count + chunk - 1) / chunk;
  auto len = [&](size_t k) { return std::min(chunk, count - k * chunk); };
  if (cross_ && !pipe_) pipe_ = std::make_unique<CrossPipe>(cross_.get());
  std::vector<uint64_t> tickets(chunks, 0);
  try {
    for (size_t k = 0; k <= chunks; ++k) {
      if (k < chunks) {
        local_->AllreduceInto(in + k * chunk * es, out + k * chunk * es, len(k), dt, op);
        if (pipe_) tickets[k] = pipe_->Submit(out + k * chunk * es, len(k), dt, op);
      }
      if (k == 0) continue;
      const size_t prev = k - 1;
      if (pipe_) pipe_->Wait(tickets[prev]);
      local_->Broadcast(out + prev * chunk * es, len(prev) * es, 0);
    }
  } catch (...) {
    // The pipe may still be writing into out: let it end (every wait on the
    // wire is bounded by the transport's timeout) before the caller sees the
    // failure and the buffer goes away.
    if (pipe_) pipe_->Drain();
    throw;
  }
}

}  // namespace sdl
