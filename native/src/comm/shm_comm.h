// Shared-memory communicator for ranks on one host.
//
// Why: on one host a TCP loopback exchange costs several copies and kernel
// round trips per message; a shared segment lets each rank read its peers'
// data with plain memory copies, and a per-rank step counter lets peers meet
// in a few microseconds (spin, then yield, then a futex sleep the peer's next
// step ends).
//
// Layout: a header with one cache line of control per rank (step counter, pid,
// failure flag) followed by one staging slot per rank. Every data round uses
// one half of each slot, alternating halves from round to round, so a rank may
// start writing round k+1 while slower peers still read round k; round k+2
// only starts after every rank has arrived at round k+1, so nothing is
// overwritten while it is read. Large collectives are pipelined through the
// halves in chunks.
#pragma once

#include <string>
#include <vector>

#include "comm/comm.h"

namespace sdl {

class ShmComm : public Comm {
 public:
  // Every member calls this with the same name/size/slot_bytes; member 0
  // creates the segment, the others attach; the name is unlinked once all
  // are attached, so nothing is left in /dev/shm when processes die.
  // global_ranks[i] is member i's rank in the job (for error messages).
  ShmComm(const std::string& name, int rank, int size, std::vector<int> global_ranks,
          size_t slot_bytes, double timeout_s, double start_timeout_s);
  ~ShmComm() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* kind() const override { return "shm"; }

  void Allreduce(void* buf, size_t count, DataType dt, ReduceOp op) override;
  void AllreduceInto(const void* in, void* out, size_t count, DataType dt, ReduceOp op) override;
  bool AllreduceSpans(const std::vector<Span>& spans, size_t count, DataType dt,
                      ReduceOp op) override;
  void Allgatherv(const void* in, void* out, const std::vector<size_t>& bytes) override;
  std::vector<std::string> GatherBytes(const std::string& mine, int root) override;
  void Broadcast(void* buf, size_t bytes, int root) override;
  void Alltoallv(const void* in, void* out, const std::vector<size_t>& matrix) override;
  void Barrier() override;

 private:
  struct Control;
  Control* ctl(int r) const;
  char* half(int r, uint64_t round) const;
  // Publishes this rank's arrival at the next step and waits for every peer.
  void Sync();
  void WaitFor(int peer, uint64_t step);
  // Bumps this rank's futex word and wakes peers sleeping on it.
  void Publish();
  // Adjusts yield_s_ after a wait of waited_s seconds (see shm_comm.cc).
  void AdaptYield(double waited_s);
  [[noreturn]] void Fail(const std::string& msg);

  int rank_, size_;
  std::vector<int> global_ranks_;
  size_t slot_bytes_, half_bytes_;
  double timeout_s_;
  std::string name_;
  char* base_ = nullptr;
  size_t total_bytes_ = 0;
  size_t header_bytes_ = 0;
  uint64_t step_ = 0;
  uint64_t round_ = 0;
  double yield_s_ = 0.00005;  // how long WaitFor yields before it sleeps
};

}  // namespace sdl
