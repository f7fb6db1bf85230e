#include "comm/gloo_comm.h"

#include <unistd.h>

#include <chrono>
#include <cstring>

#include <gloo/allgather.h>
#include <gloo/allgatherv.h>
#include <gloo/allreduce.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/types.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>

#include "common/reduce.h"

namespace sdl {
namespace {

std::chrono::milliseconds Ms(double s) {
  return std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
}

// Gloo dislikes null buffers even for zero elements.
char kEmpty[8];

// Small allreduces (negotiation bit vectors, scalars, small gradients) pay
// for latency, not bandwidth: they run in as few sequential exchange rounds as
// possible. One allgather plus a local reduction takes n-1 rounds (Gloo's ring
// allgather); recursive doubling takes log2(n) rounds (two more when n is not
// a power of two) and receives log2(n) messages instead of n-1. Whichever has
// fewer rounds runs: the allgather on 2 and 3 ranks, doubling from 4 on. The
// negotiation's bit vector crosses every rank every cycle, so on many hosts
// this is the difference between a cycle growing linearly with the job and
// growing with its logarithm (docs/benchmarks.md, "Cost at scale").
constexpr size_t kGatherReduceBytes = 64 * 1024;  // gathered bytes (allgather form)
constexpr size_t kDoublingBytes = 64 * 1024;      // per-rank bytes (doubling form)

// Larger allreduces run as a ring (reduce-scatter, then allgather) written on
// Gloo's send/recv buffers. Each step's block moves in chunks of about this
// many bytes (a block under twice this size moves whole), so a chunk is
// reduced while the next ones are still on the wire. Every message costs a
// wake-up of the receiving thread: on the loopback of a 2-core machine,
// 2 ranks, 256 KiB chunks took 4.0-4.7 ms for a 3.2 MB allreduce against
// 3.3-3.4 ms whole, and 62 ms against 44-46 ms with 1 MiB chunks at 64 MiB
// (docs/benchmarks.md).
constexpr size_t kRingChunkBytes = 1024 * 1024;

// Slot prefixes for our own point-to-point exchanges (Gloo's collectives use
// 0x01-0x08; the tag keeps successive operations apart).
constexpr uint8_t kRingSlotPrefix = 0x53;
constexpr uint8_t kDoublingSlotPrefix = 0x54;
constexpr uint8_t kGatherSlotPrefix = 0x55;

// Exchange rounds of recursive doubling on n ranks: log2 of the largest power
// of two <= n, plus a fold and an unfold round for the ranks beyond it.
int DoublingRounds(int n) {
  int p2 = 1, rounds = 0;
  while (p2 * 2 <= n) p2 *= 2, ++rounds;
  return rounds + (p2 < n ? 2 : 0);
}

}  // namespace

std::shared_ptr<gloo::transport::Device> MakeGlooDevice(const std::string& iface,
                                                         const std::string& hostname) {
  gloo::transport::tcp::attr attr;
  if (!iface.empty()) {
    attr.iface = iface;
  } else if (!hostname.empty()) {
    attr.hostname = hostname;
  } else {
    char buf[256] = {0};
    gethostname(buf, sizeof buf - 1);
    attr.hostname = buf;
  }
  try {
    return gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string("cannot create the Gloo TCP device (") +
                    (iface.empty() ? "host " + attr.hostname : "interface " + iface) +
                    "): " + e.what() + "; set SDL_GLOO_IFACE to a usable interface");
  }
}

GlooComm::GlooComm(std::shared_ptr<gloo::transport::Device> device,
                   gloo::rendezvous::Store& store, int rank, int size,
                   std::vector<int> global_ranks, double timeout_s, double start_timeout_s)
    : rank_(rank), size_(size), global_ranks_(std::move(global_ranks)) {
  auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
  ctx->setTimeout(Ms(start_timeout_s));
  try {
    ctx->connectFullMesh(store, device);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(ErrorCode::kPeerFailure,
                std::string("Gloo could not connect all ranks: ") + e.what());
  }
  ctx->setTimeout(Ms(timeout_s));
  ctx_ = ctx;
}

GlooComm::~GlooComm() = default;

void GlooComm::Rethrow(const char* what, const std::exception& e) {
  throw Error(ErrorCode::kPeerFailure,
              std::string("Gloo ") + what + " failed on rank " +
                  std::to_string(global_ranks_[rank_]) +
                  " (a peer died, hung past SDL_TIMEOUT, or the network broke): " + e.what());
}

void GlooComm::Allreduce(void* buf, size_t count, DataType dt, ReduceOp op) {
  if (count == 0) return;
  const size_t bytes = count * DataTypeSize(dt);
  if (bytes <= kDoublingBytes && DoublingRounds(size_) < size_ - 1) {
    DoublingAllreduce(static_cast<char*>(buf), count, dt, op);
    return;
  }
  if (bytes * size_ <= kGatherReduceBytes) {
    GatherReduce(buf, count, bytes, dt, op);
    return;
  }
  if (size_ > 1 && count >= static_cast<size_t>(size_)) {
    RingAllreduce(static_cast<char*>(buf), count, dt, op);
    return;
  }
  gloo::AllreduceOptions opts(ctx_);
  switch (DataTypeSize(dt)) {
    case 1: opts.setOutput(static_cast<uint8_t*>(buf), count); break;
    case 2: opts.setOutput(static_cast<uint16_t*>(buf), count); break;
    case 4: opts.setOutput(static_cast<uint32_t*>(buf), count); break;
    default: opts.setOutput(static_cast<uint64_t*>(buf), count); break;
  }
  opts.setReduceFunction([dt, op](void* o, const void* a, const void* b, size_t n) {
    Reduce(o, a, b, n, dt, op);
  });
  opts.setTag(tag_++);
  try {
    gloo::allreduce(opts);
  } catch (const gloo::Exception& e) {
    Rethrow("allreduce", e);
  }
}

void GlooComm::GatherReduce(void* buf, size_t count, size_t bytes, DataType dt, ReduceOp op) {
  gather_.resize(bytes * size_);
  gloo::AllgatherOptions opts(ctx_);
  opts.setInput(static_cast<uint8_t*>(buf), bytes);
  opts.setOutput(gather_.data(), gather_.size());
  opts.setTag(tag_++);
  try {
    gloo::allgather(opts);
  } catch (const gloo::Exception& e) {
    Rethrow("allreduce", e);
  }
  // Every rank reduces in rank order, so every rank ends with the same bits.
  std::memcpy(buf, gather_.data(), bytes);
  for (int q = 1; q < size_; ++q) Reduce(buf, buf, gather_.data() + q * bytes, count, dt, op);
}

void GlooComm::DoublingAllreduce(char* buf, size_t count, DataType dt, ReduceOp op) {
  const size_t bytes = count * DataTypeSize(dt);
  const int n = size_;
  int p2 = 1;
  while (p2 * 2 <= n) p2 *= 2;
  doubling_tmp_.resize(bytes);
  const auto timeout = ctx_->getTimeout();
  try {
    auto data = ctx_->createUnboundBuffer(buf, bytes);
    auto tmp = ctx_->createUnboundBuffer(doubling_tmp_.data(), bytes);
    // Both partners of an exchange compute lower-rank value op higher-rank
    // value, so they hold the same bits afterwards; by induction every rank
    // ends with the same bits (the operations are commutative, the explicit
    // order keeps that true without relying on it).
    auto combine = [&](int peer) {
      if (rank_ < peer) Reduce(buf, buf, doubling_tmp_.data(), count, dt, op);
      else Reduce(buf, doubling_tmp_.data(), buf, count, dt, op);
    };
    auto exchange = [&](int peer) {
      const uint64_t slot = gloo::Slot::build(kDoublingSlotPrefix, tag_++);
      tmp->recv(peer, slot, 0, bytes);
      data->send(peer, slot, 0, bytes);
      tmp->waitRecv(timeout);
      data->waitSend(timeout);  // buf is overwritten next: the send must be out
      combine(peer);
    };
    // Fold: rank p2 + i hands its value to rank i, which reduces it in.
    const uint64_t fold = gloo::Slot::build(kDoublingSlotPrefix, tag_++);
    if (rank_ >= p2) {
      data->send(rank_ - p2, fold, 0, bytes);
      data->waitSend(timeout);
    } else if (rank_ + p2 < n) {
      tmp->recv(rank_ + p2, fold, 0, bytes);
      tmp->waitRecv(timeout);
      combine(rank_ + p2);
    }
    // Doubling among the first p2 ranks: partners differ in one bit per round.
    // Every rank takes the same tags (the folded ones skip the rounds' slots),
    // so that the next operation's slots agree on every rank.
    for (int mask = 1; mask < p2; mask <<= 1) {
      if (rank_ < p2) exchange(rank_ ^ mask);
      else ++tag_;
    }
    // Unfold: the folded ranks receive the result.
    const uint64_t unfold = gloo::Slot::build(kDoublingSlotPrefix, tag_++);
    if (rank_ >= p2) {
      data->recv(rank_ - p2, unfold, 0, bytes);
      data->waitRecv(timeout);
    } else if (rank_ + p2 < n) {
      data->send(rank_ + p2, unfold, 0, bytes);
      data->waitSend(timeout);
    }
  } catch (const gloo::Exception& e) {
    Rethrow("allreduce", e);
  }
}

void GlooComm::RingAllreduce(char* buf, size_t count, DataType dt, ReduceOp op) {
  const size_t es = DataTypeSize(dt);
  const int n = size_;
  const int right = (rank_ + 1) % n, left = (rank_ + n - 1) % n;
  // Block q: elements [first[q], first[q + 1]).
  std::vector<size_t> first(n + 1);
  for (int q = 0; q <= n; ++q) first[q] = count * static_cast<size_t>(q) / n;
  size_t max_block = 0;
  for (int q = 0; q < n; ++q) max_block = std::max(max_block, first[q + 1] - first[q]);
  ring_tmp_.resize(max_block * es);
  // Elements per chunk of a block of len elements; the sender and the receiver
  // of a block compute it from the same length, so their messages match.
  auto chunk_of = [es](size_t len) {
    const size_t chunks = std::max<size_t>(len * es / kRingChunkBytes, 1);
    return std::max<size_t>((len + chunks - 1) / chunks, 1);
  };
  const auto timeout = ctx_->getTimeout();
  try {
    auto data = ctx_->createUnboundBuffer(buf, count * es);
    auto tmp = ctx_->createUnboundBuffer(ring_tmp_.data(), ring_tmp_.size());
    // One step: send block `out` right while block `in` comes from the left,
    // chunk by chunk; reduce_in: received chunks go to tmp and are reduced
    // into buf, else they land in buf directly.
    auto step = [&](int out, int in, bool reduce_in) {
      const uint64_t slot = gloo::Slot::build(kRingSlotPrefix, tag_++);
      const size_t in_len = first[in + 1] - first[in], out_len = first[out + 1] - first[out];
      const size_t in_chunk = chunk_of(in_len), out_chunk = chunk_of(out_len);
      size_t recvs = 0, sends = 0;
      for (size_t off = 0; off < in_len; off += in_chunk, ++recvs) {
        const size_t len = std::min(in_chunk, in_len - off);
        if (reduce_in) tmp->recv(left, slot, off * es, len * es);
        else data->recv(left, slot, (first[in] + off) * es, len * es);
      }
      for (size_t off = 0; off < out_len; off += out_chunk, ++sends)
        data->send(right, slot, (first[out] + off) * es, std::min(out_chunk, out_len - off) * es);
      for (size_t i = 0; i < recvs; ++i) {
        if (reduce_in) {
          tmp->waitRecv(timeout);
          const size_t off = i * in_chunk, len = std::min(in_chunk, in_len - off);
          char* dst = buf + (first[in] + off) * es;
          Reduce(dst, ring_tmp_.data() + off * es, dst, len, dt, op);
        } else {
          data->waitRecv(timeout);
        }
      }
      for (size_t i = 0; i < sends; ++i) data->waitSend(timeout);
    };
    // Reduce-scatter: after n-1 steps this rank holds block (rank+1) % n fully reduced.
    for (int s = 0; s < n - 1; ++s) step((rank_ - s + n) % n, (rank_ - s - 1 + 2 * n) % n, true);
    // Allgather: pass the reduced blocks around the ring.
    for (int s = 0; s < n - 1; ++s) step((rank_ + 1 - s + n) % n, (rank_ - s + n) % n, false);
  } catch (const gloo::Exception& e) {
    Rethrow("allreduce", e);
  }
}

void GlooComm::Allgatherv(const void* in, void* out, const std::vector<size_t>& bytes) {
  size_t total = 0;
  for (size_t b : bytes) total += b;
  if (total == 0) return;
  gloo::AllgathervOptions opts(ctx_);
  opts.setInput(const_cast<uint8_t*>(static_cast<const uint8_t*>(in ? in : kEmpty)),
                bytes[rank_]);
  opts.setOutput(static_cast<uint8_t*>(out), bytes);
  opts.setTag(tag_++);
  try {
    gloo::allgatherv(opts);
  } catch (const gloo::Exception& e) {
    Rethrow("allgather", e);
  }
}

// Every other member sends its size and its message to root at once (two
// messages on their own slots, both posted before waiting); root receives the
// sizes from everyone in parallel, then the messages. One exchange round
// instead of the ring allgather's size - 1 sequential steps (twice: sizes,
// then messages), and each member moves only its own bytes.
std::vector<std::string> GlooComm::GatherBytes(const std::string& mine, int root) {
  const auto timeout = ctx_->getTimeout();
  const uint64_t size_slot = gloo::Slot::build(kGatherSlotPrefix, tag_++);
  const uint64_t data_slot = gloo::Slot::build(kGatherSlotPrefix, tag_++);
  std::vector<std::string> out;
  try {
    if (rank_ != root) {
      uint64_t my_size = mine.size();
      auto head = ctx_->createUnboundBuffer(&my_size, sizeof my_size);
      head->send(root, size_slot);
      std::unique_ptr<gloo::transport::UnboundBuffer> body;
      if (my_size) {
        body = ctx_->createUnboundBuffer(const_cast<char*>(mine.data()), my_size);
        body->send(root, data_slot);
      }
      head->waitSend(timeout);
      if (body) body->waitSend(timeout);
      return out;
    }
    std::vector<uint64_t> sizes(size_, 0);
    auto heads = ctx_->createUnboundBuffer(sizes.data(), sizes.size() * sizeof(uint64_t));
    for (int q = 0; q < size_; ++q)
      if (q != rank_) heads->recv(q, size_slot, q * sizeof(uint64_t), sizeof(uint64_t));
    for (int k = 1; k < size_; ++k) heads->waitRecv(timeout);
    out.resize(size_);
    std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> bodies;
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) {
        out[q] = mine;
      } else if (sizes[q]) {
        out[q].resize(sizes[q]);
        bodies.push_back(ctx_->createUnboundBuffer(out[q].data(), sizes[q]));
        bodies.back()->recv(q, data_slot);
      }
    }
    for (auto& b : bodies) b->waitRecv(timeout);
  } catch (const gloo::Exception& e) {
    Rethrow("gather", e);
  }
  return out;
}

void GlooComm::Broadcast(void* buf, size_t bytes, int root) {
  if (bytes == 0) return;
  gloo::BroadcastOptions opts(ctx_);
  opts.setOutput(static_cast<uint8_t*>(buf), bytes);
  opts.setRoot(root);
  opts.setTag(tag_++);
  try {
    gloo::broadcast(opts);
  } catch (const gloo::Exception& e) {
    Rethrow("broadcast", e);
  }
}

void GlooComm::Alltoallv(const void* in, void* out, const std::vector<size_t>& matrix) {
  size_t total = 0;
  for (size_t b : matrix) total += b;
  if (total == 0) return;
  std::vector<int64_t> send(size_), recv(size_);
  size_t send_total = 0, recv_total = 0;
  for (int q = 0; q < size_; ++q) {
    send[q] = static_cast<int64_t>(matrix[rank_ * size_ + q]);
    recv[q] = static_cast<int64_t>(matrix[q * size_ + rank_]);
    send_total += send[q];
    recv_total += recv[q];
  }
  gloo::AlltoallvOptions opts(ctx_);
  opts.setInput(const_cast<uint8_t*>(static_cast<const uint8_t*>(send_total ? in : kEmpty)), send);
  opts.setOutput(static_cast<uint8_t*>(recv_total ? out : kEmpty), recv);
  opts.setTag(tag_++);
  try {
    gloo::alltoallv(opts);
  } catch (const gloo::Exception& e) {
    Rethrow("alltoall", e);
  }
}

void GlooComm::Barrier() {
  gloo::BarrierOptions opts(ctx_);
  opts.setTag(tag_++);
  try {
    gloo::barrier(opts);
  } catch (const gloo::Exception& e) {
    Rethrow("barrier", e);
  }
}

}  // namespace sdl
