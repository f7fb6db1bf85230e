// Hierarchical communicator for a process set that spans hosts: shared memory
// among the members on each host, a Gloo or MPI communicator among one leader
// per host, and a flat communicator among all members.
//
// Why: an allreduce then moves each host's data across the network once (by
// its leader) instead of once per rank, and local ranks combine at memory
// speed. Allreduce is local-reduce / leaders-allreduce / local-broadcast;
// every other primitive uses the flat communicator, whose results do not
// depend on how ranks are grouped.
#pragma once

#include <memory>

#include "comm/comm.h"

namespace sdl {

class HierarchicalComm : public Comm {
 public:
  // local: this host's members (local rank 0 is the leader); cross: the
  // leaders (null on non-leaders); flat: every member, ranks as in the set.
  HierarchicalComm(std::unique_ptr<Comm> local, std::unique_ptr<Comm> cross,
                   std::unique_ptr<Comm> flat)
      : local_(std::move(local)), cross_(std::move(cross)), flat_(std::move(flat)) {}

  int rank() const override { return flat_->rank(); }
  int size() const override { return flat_->size(); }
  const char* kind() const override { return "hierarchical"; }

  // Off (autotune): allreduce over the flat communicator, like a flat set.
  void SetHierarchical(bool on) override { hierarchical_ = on; }

  void Allreduce(void* buf, size_t count, DataType dt, ReduceOp op) override {
    if (!hierarchical_) return flat_->Allreduce(buf, count, dt, op);
    local_->Allreduce(buf, count, dt, op);
    if (cross_) cross_->Allreduce(buf, count, dt, op);
    local_->Broadcast(buf, count * DataTypeSize(dt), 0);
  }
  void AllreduceInto(const void* in, void* out, size_t count, DataType dt, ReduceOp op) override {
    if (!hierarchical_) return flat_->AllreduceInto(in, out, count, dt, op);
    local_->AllreduceInto(in, out, count, dt, op);
    if (cross_) cross_->Allreduce(out, count, dt, op);
    local_->Broadcast(out, count * DataTypeSize(dt), 0);
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
  std::unique_ptr<Comm> local_, cross_, flat_;
  bool hierarchical_ = true;  // cycle thread only
};

}  // namespace sdl
