// Gloo (TCP) communicator: used between hosts, and on one host when shared
// memory is disabled (SDL_SHM=0).
#pragma once

#include <memory>
#include <cstdint>
#include <string>
#include <vector>

#include "comm/comm.h"

namespace gloo {
class Context;
namespace rendezvous { class Store; }
namespace transport {
class Device;
class UnboundBuffer;
}  // namespace transport
}  // namespace gloo

namespace sdl {

// One TCP device per process, shared by every Gloo communicator.
// iface (e.g. "eth0") wins over hostname; both empty: the host name.
std::shared_ptr<gloo::transport::Device> MakeGlooDevice(const std::string& iface,
                                                         const std::string& hostname);

class RingLinks;  // gloo_comm.cc: the ring's links and the thread that sends
class PeerLinks;  // gloo_comm.cc: links to the partners of latency-bound exchanges

class GlooComm : public Comm {
 public:
  // Connects a full mesh among size members through the store (keys under the
  // store's own prefix), the ring's two links (RingAllreduce) and the peer
  // links (AgreeBits, allreduces up to 64 KiB). Blocks until
  // every member has called it or start_timeout_s passes.
  GlooComm(std::shared_ptr<gloo::transport::Device> device, gloo::rendezvous::Store& store,
           int rank, int size, std::vector<int> global_ranks, double timeout_s,
           double start_timeout_s);
  ~GlooComm() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* kind() const override { return "gloo"; }

  void Allreduce(void* buf, size_t count, DataType dt, ReduceOp op) override;
  // On the ring's path the first steps read in directly (no copy to out first).
  void AllreduceInto(const void* in, void* out, size_t count, DataType dt, ReduceOp op) override;
  // Over the peer links (gloo_comm.cc).
  void AgreeBits(uint64_t* bits, size_t words) override;
  void Allgatherv(const void* in, void* out, const std::vector<size_t>& bytes) override;
  std::vector<std::string> GatherBytes(const std::string& mine, int root) override;
  void Broadcast(void* buf, size_t bytes, int root) override;
  void Alltoallv(const void* in, void* out, const std::vector<size_t>& matrix) override;
  void Barrier() override;

 private:
  [[noreturn]] void Rethrow(const char* what, const std::exception& e);
  void GatherReduce(void* buf, size_t count, size_t bytes, DataType dt, ReduceOp op);
  // The algorithm an allreduce of count elements of dt runs (gloo_comm.cc).
  enum class Path { kDoubling, kGather, kRing, kGloo };
  Path AllreducePath(size_t count, DataType dt) const;
  // buf receives the reduction of every member's src (src == buf: in place).
  void RingAllreduce(const char* src, char* buf, size_t count, DataType dt, ReduceOp op);
  // The ring's path: RingAllreduce, or on 2 ranks ExchangeAllreduce.
  void LargeAllreduce(const char* src, char* buf, size_t count, DataType dt, ReduceOp op);
  // The ring's path on 2 ranks: one exchange of the whole buffers (gloo_comm.cc).
  void ExchangeAllreduce(const char* src, char* buf, size_t count, DataType dt, ReduceOp op);
  void DoublingAllreduce(char* buf, size_t count, DataType dt, ReduceOp op);
  // AgreeBits' schedule (agree_steps_); its partners get the peer links.
  void PlanAgreement();
  std::shared_ptr<gloo::Context> ctx_;
  int rank_, size_;
  std::vector<int> global_ranks_;
  uint32_t tag_ = 0;
  std::vector<uint8_t> gather_;    // GatherReduce: this rank's values, reused
  std::unique_ptr<RingLinks> ring_;  // RingAllreduce's links to the left and right neighbours
  std::vector<char> ring_tmp_;     // RingAllreduce: one received block, reused
  std::unique_ptr<PeerLinks> links_; // AgreeBits, DoublingAllreduce, GatherReduce
  struct AgreeStep {
    int peer;
    int phase;  // the message's slot within a call, the same on both ends
    bool send, recv;
  };
  std::vector<AgreeStep> agree_steps_;
  size_t agree_words_ = 0;  // set by the first call (0: none yet)
};

}  // namespace sdl
