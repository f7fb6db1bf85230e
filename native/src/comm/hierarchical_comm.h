// Hierarchical communicator for a process set that spans hosts: shared memory
// among the members on each host, a Gloo or MPI communicator among one leader
// per host, and a flat communicator among all members.
//
// Why: an allreduce then moves each host's data across the network once (by
// its leader) instead of once per rank, and local ranks combine at memory
// speed. Allreduce is local-reduce / leaders-allreduce / local-broadcast;
// every other primitive uses the flat communicator, whose results do not
// depend on how ranks are grouped.
//
// Large allreduces are pipelined (chunk_bytes, SDL_HIERARCHICAL_CHUNK_BYTES):
// the buffer goes through the three phases in chunks, and the leader runs each
// chunk's cross-host allreduce on a thread of its own (CrossPipe) while the
// host's members reduce the next chunk and broadcast the previous one through
// shared memory. Done one after the other over the whole buffer, the two
// shared-memory phases added their time to the wire's (a 64 MiB allreduce on
// 2 hosts x 2 ranks at 1 Gbit/s: 565 ms on the wire, 639-670 ms in all;
// pipelined in 4 MiB chunks, 574 ms).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

#include "comm/comm.h"

namespace sdl {

// Runs allreduces over one communicator on a thread of its own, in the order
// they were submitted. The communicator must not be used by anybody else until
// every submitted allreduce has ended (Wait/Drain).
class CrossPipe {
 public:
  explicit CrossPipe(Comm* comm);
  ~CrossPipe();  // every submitted allreduce must have ended

  // Queues an in-place allreduce of n elements at p; returns its ticket.
  uint64_t Submit(char* p, size_t n, DataType dt, ReduceOp op);
  // Waits until allreduce `ticket` (and every one before it) has ended, then
  // rethrows the first failure so far: after one, the communicator is unusable
  // and the allreduces queued behind it are skipped.
  void Wait(uint64_t ticket);
  // Waits until every submitted allreduce has ended; failures are kept.
  void Drain() noexcept;

 private:
  struct Job {
    char* p;
    size_t n;
    DataType dt;
    ReduceOp op;
  };
  void Run();

  Comm* comm_;
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<Job> jobs_;
  uint64_t submitted_ = 0, done_ = 0;
  std::exception_ptr error_;
  bool stop_ = false;
  std::thread thread_;  // last: starts once the members above exist
};

class HierarchicalComm : public Comm {
 public:
  // local: this host's members (local rank 0 is the leader); cross: the
  // leaders (null on non-leaders); flat: every member, ranks as in the set.
  // chunk_bytes: pipeline allreduces larger than this in chunks of this size
  // (0: never). Every member of a host must pass the same value, since it
  // decides their sequence of shared-memory collectives.
  HierarchicalComm(std::unique_ptr<Comm> local, std::unique_ptr<Comm> cross,
                   std::unique_ptr<Comm> flat, size_t chunk_bytes = 0)
      : local_(std::move(local)),
        cross_(std::move(cross)),
        flat_(std::move(flat)),
        chunk_bytes_(chunk_bytes) {}

  int rank() const override { return flat_->rank(); }
  int size() const override { return flat_->size(); }
  const char* kind() const override { return "hierarchical"; }

  // Off (autotune): allreduce over the flat communicator, like a flat set.
  void SetHierarchical(bool on) override { hierarchical_ = on; }

  void Allreduce(void* buf, size_t count, DataType dt, ReduceOp op) override {
    if (!hierarchical_) return flat_->Allreduce(buf, count, dt, op);
    Phases(buf, buf, count, dt, op);
  }
  void AllreduceInto(const void* in, void* out, size_t count, DataType dt, ReduceOp op) override {
    if (!hierarchical_) return flat_->AllreduceInto(in, out, count, dt, op);
    Phases(in, out, count, dt, op);
  }
  void AgreeBits(uint64_t* bits, size_t words) override {
    local_->AgreeBits(bits, words);
    if (cross_) cross_->AgreeBits(bits, words);
    local_->Broadcast(bits, words * sizeof(uint64_t), 0);
  }
  void Allgatherv(const void* in, void* out, const std::vector<size_t>& bytes) override {
    flat_->Allgatherv(in, out, bytes);
  }
  bool Gatherv(const void* in, void* out, const std::vector<size_t>& bytes, int root) override {
    return flat_->Gatherv(in, out, bytes, root);
  }
  std::vector<std::string> GatherBytes(const std::string& mine, int root) override {
    return flat_->GatherBytes(mine, root);
  }
  void Broadcast(void* buf, size_t bytes, int root) override { flat_->Broadcast(buf, bytes, root); }
  void Alltoallv(const void* in, void* out, const std::vector<size_t>& matrix) override {
    flat_->Alltoallv(in, out, matrix);
  }
  void Barrier() override { flat_->Barrier(); }

 private:
  // The hierarchical allreduce of in into out (in == out: in place); see the
  // file comment.
  void Phases(const void* in, void* out, size_t count, DataType dt, ReduceOp op);
  void Pipelined(const char* in, char* out, size_t count, size_t chunk, DataType dt, ReduceOp op);

  std::unique_ptr<Comm> local_, cross_, flat_;
  size_t chunk_bytes_;
  bool hierarchical_ = true;  // cycle thread only
  std::unique_ptr<CrossPipe> pipe_;  // after cross_: it goes first; made on first use
};

}  // namespace sdl
