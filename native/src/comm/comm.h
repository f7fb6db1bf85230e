// The transport primitives a process set's communicator provides.
//
// Contract: every member of the communicator calls the same primitives in the
// same order with consistent sizes (the controller guarantees this: only
// negotiated responses reach a communicator). Primitives block until done and
// throw sdl::Error(kPeerFailure) naming the peer when one dies, hangs past the
// timeout, or the transport breaks; after that the communicator is unusable.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/types.h"

namespace sdl {

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* kind() const = 0;

  // In place over count elements of buf.
  virtual void Allreduce(void* buf, size_t count, DataType dt, ReduceOp op) = 0;
  // Out of place: out (count elements) receives the reduction of every rank's
  // in, which stays unchanged; in == out is Allreduce. Bit-identical to
  // copying in to out and reducing out in place (the default does just that;
  // shared memory reads in directly, saving the copy).
  virtual void AllreduceInto(const void* in, void* out, size_t count, DataType dt, ReduceOp op);
  // In place over spans (each whole elements of dt) taken as one buffer of
  // count elements laid back to back: what packing them into a fusion buffer,
  // Allreduce of it and unpacking gives, bit for bit, without the two copies.
  // The spans must not overlap. Returns false without communicating when the
  // transport has no such path (then no member has: the transport is the same
  // on all of them), and the caller packs.
  struct Span {
    char* data;
    size_t bytes;
  };
  virtual bool AllreduceSpans(const std::vector<Span>& spans, size_t count, DataType dt,
                              ReduceOp op) {
    return false;
  }
  // Rank r contributes bytes[r] bytes from in; out receives every rank's bytes
  // concatenated in rank order. in may be null when bytes[rank] == 0.
  virtual void Allgatherv(const void* in, void* out, const std::vector<size_t>& bytes) = 0;
  virtual void Broadcast(void* buf, size_t bytes, int root) = 0;
  // matrix[src * size + dst]: bytes src sends to dst. in holds this rank's
  // pieces in dst order, out receives pieces in src order.
  virtual void Alltoallv(const void* in, void* out, const std::vector<size_t>& matrix) = 0;
  // Autotune: switches a hierarchical transport's allreduce between its
  // hierarchical and its flat path (every member switches in the same cycle).
  // Others ignore it.
  virtual void SetHierarchical(bool on) {}
  virtual void Barrier() = 0;
  // The negotiation cycle's agreement: bits (words words) becomes the AND of
  // every member's bits. Every member calls it once per cycle with the same
  // words, and words stays the same for the communicator's life (transports
  // may post the next call's receives ahead). Default: Allreduce.
  virtual void AgreeBits(uint64_t* bits, size_t words) {
    Allreduce(bits, words, DataType::kUInt64, ReduceOp::kBitAnd);
  }
  // out (counts[rank] elements) receives this rank's slice of the reduction of
  // in (sum of counts elements). Default: allreduce a copy and slice it.
  virtual void Reducescatter(const void* in, void* out, const std::vector<size_t>& counts,
                             DataType dt, ReduceOp op);

  // Rank r contributes bytes[r] bytes from in; root's out receives every
  // rank's bytes concatenated in rank order. Root must pass every rank's true
  // size; the others need only their own entry right (they may not know the
  // rest) and their out is unused (may be null). Returns false without
  // communicating when the transport has no gather (then every member does,
  // the transport being the same on all of them).
  virtual bool Gatherv(const void* in, void* out, const std::vector<size_t>& bytes, int root) {
    return false;
  }

  // Variable-size byte exchange used by negotiation: every rank gets every
  // rank's message.
  std::vector<std::string> AllgatherBytes(const std::string& mine);
  // The same towards root only: root gets every rank's message in rank order,
  // the others an empty vector. Root receives what allgather delivers to
  // everybody, while each other rank only sends its own message (on Gloo
  // in one exchange round instead of a ring of size - 1 steps).
  virtual std::vector<std::string> GatherBytes(const std::string& mine, int root);
  void BroadcastBytes(std::string* msg, int root);
};

// A communicator of one rank: every primitive is a local copy.
class SelfComm : public Comm {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const char* kind() const override { return "self"; }
  void Allreduce(void*, size_t, DataType, ReduceOp) override {}
  // The spans already hold the result: no pack and unpack for nothing.
  bool AllreduceSpans(const std::vector<Span>&, size_t, DataType, ReduceOp) override {
    return true;
  }
  void Allgatherv(const void* in, void* out, const std::vector<size_t>& bytes) override;
  bool Gatherv(const void* in, void* out, const std::vector<size_t>& bytes, int) override {
    Allgatherv(in, out, bytes);
    return true;
  }
  void Broadcast(void*, size_t, int) override {}
  void Alltoallv(const void* in, void* out, const std::vector<size_t>& matrix) override;
  void Barrier() override {}
};

}  // namespace sdl
