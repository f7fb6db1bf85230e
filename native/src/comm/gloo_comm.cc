#include "comm/gloo_comm.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>

#include <gloo/allgather.h>
#include <gloo/allgatherv.h>
#include <gloo/allreduce.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/types.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/buffer.h>
#include <gloo/transport/pair.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include "comm/gloo_links.h"
#include "common/reduce.h"

namespace sdl {
namespace {

// Gloo dislikes null buffers even for zero elements.
char kEmpty[8];

// Small allreduces (negotiation bit vectors, scalars, small gradients) pay
// for latency, not bandwidth: they run in as few sequential exchange rounds as
// possible, over the peer links (PeerLinks). Sending to every other rank at
// once and reducing locally takes one round but receives n-1 messages;
// recursive doubling takes log2(n) rounds (two more when n is not a power of
// two) and receives one message per round. The exchange runs where doubling
// would take as many rounds as it receives messages (2, 3 and 5 ranks), doubling
// otherwise. The negotiation's bit vector crosses every rank every cycle, so
// on many hosts this is the difference between a cycle growing linearly with
// the job and growing with its logarithm (docs/benchmarks.md, "Cost at
// scale"). On 2 ranks the exchange moves as many bytes as the ring's two
// steps, in one round, so it takes every allreduce up to kDoublingBytes there.
constexpr size_t kGatherReduceBytes = 64 * 1024;  // received bytes (exchange form)
constexpr size_t kDoublingBytes = PeerLinks::kDataBytes;  // per-rank bytes (doubling form)

// Larger allreduces run as a ring (reduce-scatter, then allgather). Each
// step's block moves in chunks of about this many bytes (a block under twice
// this size moves whole), so a chunk is reduced while the next ones are still
// on the wire; every message costs the receiver a wake-up, so chunks stay
// large (docs/benchmarks.md: 256 KiB chunks were slower than whole 1.6 MB
// blocks on 2 ranks, 1 MiB faster than both at 64 MiB).
constexpr size_t kRingChunkBytes = 1024 * 1024;
// The ring's messages address one of two buffers on the receiving end of a
// link: the received block that reduce-scatter reduces, or the result itself
// (allgather).
constexpr int kRingScratchSlot = 1;
constexpr int kRingResultSlot = 2;

// Slot prefix for GatherBytes' point-to-point messages (Gloo's collectives use
// 0x01-0x08; the tag keeps successive operations apart).
constexpr uint8_t kGatherSlotPrefix = 0x55;

// The largest power of two <= n (recursive doubling runs among that many
// ranks; the others fold into them), and its log2 in *log2.
int PowerOfTwoBelow(int n, int* log2) {
  int p2 = 1, k = 0;
  while (p2 * 2 <= n) p2 *= 2, ++k;
  if (log2) *log2 = k;
  return p2;
}

// Exchange rounds of recursive doubling on n ranks: log2 of the largest power
// of two <= n, plus a fold and an unfold round for the ranks beyond it.
int DoublingRounds(int n) {
  int rounds = 0;
  const int p2 = PowerOfTwoBelow(n, &rounds);
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
  if (size_ > 1) {
    try {
      ring_ = std::make_unique<RingLinks>(device, store, rank_, size_, timeout_s);
    } catch (const std::exception& e) {
      throw Error(ErrorCode::kPeerFailure,
                  std::string("Gloo could not connect the ring's links: ") + e.what());
    }
    try {
      // The AND's partners are those of every latency-bound exchange.
      PlanAgreement();
      std::vector<int> peers;
      for (const AgreeStep& st : agree_steps_)
        if (std::find(peers.begin(), peers.end(), st.peer) == peers.end()) peers.push_back(st.peer);
      links_ = std::make_unique<PeerLinks>(device, store, rank_, peers, timeout_s);
    } catch (const std::exception& e) {
      throw Error(ErrorCode::kPeerFailure,
                  std::string("Gloo could not connect the peer links: ") + e.what());
    }
  }
}

GlooComm::~GlooComm() = default;

void GlooComm::Rethrow(const char* what, const std::exception& e) {
  throw Error(ErrorCode::kPeerFailure,
              std::string("Gloo ") + what + " failed on rank " +
                  std::to_string(global_ranks_[rank_]) +
                  " (a peer died, hung past SDL_TIMEOUT, or the network broke): " + e.what());
}

GlooComm::Path GlooComm::AllreducePath(size_t count, DataType dt) const {
  const size_t bytes = count * DataTypeSize(dt);
  if (bytes <= kDoublingBytes && DoublingRounds(size_) < size_ - 1) return Path::kDoubling;
  if (bytes * size_ <= kGatherReduceBytes || (size_ == 2 && bytes <= kDoublingBytes))
    return Path::kGather;
  if (size_ > 1 && count >= static_cast<size_t>(size_)) return Path::kRing;
  return Path::kGloo;
}

void GlooComm::Allreduce(void* buf, size_t count, DataType dt, ReduceOp op) {
  if (count == 0) return;
  switch (AllreducePath(count, dt)) {
    case Path::kDoubling:
      DoublingAllreduce(static_cast<char*>(buf), count, dt, op);
      return;
    case Path::kGather:
      GatherReduce(buf, count, count * DataTypeSize(dt), dt, op);
      return;
    case Path::kRing:
      LargeAllreduce(static_cast<char*>(buf), static_cast<char*>(buf), count, dt, op);
      return;
    case Path::kGloo:
      break;
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

void GlooComm::AllreduceInto(const void* in, void* out, size_t count, DataType dt,
                             ReduceOp op) {
  if (count > 0 && in != out && AllreducePath(count, dt) == Path::kRing) {
    LargeAllreduce(static_cast<const char*>(in), static_cast<char*>(out), count, dt, op);
    return;
  }
  Comm::AllreduceInto(in, out, count, dt, op);
}

void GlooComm::LargeAllreduce(const char* src, char* buf, size_t count, DataType dt,
                              ReduceOp op) {
  if (size_ == 2) ExchangeAllreduce(src, buf, count, dt, op);
  else RingAllreduce(src, buf, count, dt, op);
}

void GlooComm::GatherReduce(void* buf, size_t count, size_t bytes, DataType dt, ReduceOp op) {
  // One round: every member's values to every other over the peer links.
  // Every member reduces in rank order, so every member ends with the same bits.
  std::vector<const char*> from(size_);
  try {
    for (int q = 0; q < size_; ++q)
      if (q != rank_) links_->SendData(q, buf, bytes);
    for (int q = 0; q < size_; ++q)
      if (q != rank_) from[q] = links_->RecvData(q);
  } catch (const gloo::Exception& e) {
    Rethrow("allreduce", e);
  }
  if (rank_ != 0) {  // buf starts as rank 0's values; this rank's go aside
    gather_.assign(static_cast<const uint8_t*>(buf), static_cast<const uint8_t*>(buf) + bytes);
    from[rank_] = reinterpret_cast<const char*>(gather_.data());
    std::memcpy(buf, from[0], bytes);
  }
  for (int q = 1; q < size_; ++q) Reduce(buf, buf, from[q], count, dt, op);
}

void GlooComm::DoublingAllreduce(char* buf, size_t count, DataType dt, ReduceOp op) {
  const size_t bytes = count * DataTypeSize(dt);
  const int n = size_;
  const int p2 = PowerOfTwoBelow(n, nullptr);
  // Both partners of an exchange compute lower-rank value op higher-rank
  // value, so they hold the same bits afterwards; by induction every rank
  // ends with the same bits (the operations are commutative, the explicit
  // order keeps that true without relying on it).
  auto combine = [&](int peer, const char* theirs) {
    if (rank_ < peer) Reduce(buf, buf, theirs, count, dt, op);
    else Reduce(buf, theirs, buf, count, dt, op);
  };
  try {
    if (rank_ >= p2) {
      // Folded: hand this rank's values to rank - p2, then receive the result.
      links_->SendData(rank_ - p2, buf, bytes);
      std::memcpy(buf, links_->RecvData(rank_ - p2), bytes);
      return;
    }
    if (rank_ + p2 < n) combine(rank_ + p2, links_->RecvData(rank_ + p2));
    // Doubling among the first p2 ranks: partners differ in one bit per round.
    // A send has left buf once it returns (the write is synchronous).
    for (int mask = 1; mask < p2; mask <<= 1) {
      const int peer = rank_ ^ mask;
      links_->SendData(peer, buf, bytes);
      combine(peer, links_->RecvData(peer));
    }
    if (rank_ + p2 < n) links_->SendData(rank_ + p2, buf, bytes);
  } catch (const gloo::Exception& e) {
    Rethrow("allreduce", e);
  }
}

// The negotiation cycle's AND (AgreeBits), over the peer links. On 2, 3 and 5
// ranks every member sends its bits to every other at once (one round); from
// 4 on (but 5), recursive doubling (log2 rounds, and a fold and an unfold when
// the size is not a power of two). AND is exact and commutative: every order
// gives the same bits.
void GlooComm::PlanAgreement() {
  const int n = size_, r = rank_;
  if (DoublingRounds(n) >= n - 1) {
    for (int q = 0; q < n; ++q)
      if (q != r) agree_steps_.push_back({q, 0, true, true});
  } else {
    int rounds = 0;
    const int p2 = PowerOfTwoBelow(n, &rounds);
    if (r >= p2) {
      agree_steps_.push_back({r - p2, 0, true, false});           // fold into r - p2
      agree_steps_.push_back({r - p2, rounds + 1, false, true});  // the result back
    } else {
      if (r + p2 < n) agree_steps_.push_back({r + p2, 0, false, true});
      for (int k = 0; k < rounds; ++k) agree_steps_.push_back({r ^ (1 << k), 1 + k, true, true});
      if (r + p2 < n) agree_steps_.push_back({r + p2, rounds + 1, true, false});
    }
  }
}

void GlooComm::AgreeBits(uint64_t* bits, size_t words) {
  if (size_ == 1 || words == 0) return;
  if (agree_words_ == 0) {  // the first call: the links' buffers for its size
    agree_words_ = words;
    links_->PlanAgree(words);
  }
  if (words != agree_words_)
    throw Error(ErrorCode::kMismatch, "negotiation bit vector changed size: " +
                                          std::to_string(agree_words_) + " -> " +
                                          std::to_string(words) + " words");
  try {
    // Steps of one phase: every send goes out (this rank's bits so far), then
    // every receive is folded in.
    for (size_t i = 0; i < agree_steps_.size();) {
      size_t end = i;
      while (end < agree_steps_.size() && agree_steps_[end].phase == agree_steps_[i].phase) ++end;
      for (size_t k = i; k < end; ++k)
        if (agree_steps_[k].send) links_->SendAgree(agree_steps_[k].peer, bits);
      for (size_t k = i; k < end; ++k) {
        if (!agree_steps_[k].recv) continue;
        const uint64_t* theirs = links_->RecvAgree(agree_steps_[k].peer);
        for (size_t w = 0; w < words; ++w) bits[w] &= theirs[w];
      }
      i = end;
    }
  } catch (const gloo::Exception& e) {
    Rethrow("negotiation", e);
  }
}

// On 2 ranks an allreduce is one exchange over the ring's links: each rank
// sends its whole buffer to the other (the sender thread) while it reads the
// other's, chunk by chunk, and reduces each chunk in rank order. Each way that
// moves as many bytes as the ring's reduce-scatter and allgather steps
// together, in one step instead of two: one hand-off to the sender and one
// wait for the slower rank fewer. Every chunk lands at the start of tmp (a
// message lands only when this thread reads it), so tmp is one chunk. In
// place, a chunk of buf is overwritten only once the sender has written it.
void GlooComm::ExchangeAllreduce(const char* src, char* buf, size_t count, DataType dt,
                                 ReduceOp op) {
  const size_t es = DataTypeSize(dt);
  const size_t chunk = std::max<size_t>(kRingChunkBytes / es, 1);
  const size_t chunks = (count + chunk - 1) / chunk;
  ring_tmp_.resize(std::min(count, chunk) * es);
  RingLinks& links = *ring_;
  try {
    auto mine = links.out().createSendBuffer(kRingScratchSlot, const_cast<char*>(src), count * es);
    auto tmp = links.in().createRecvBuffer(kRingScratchSlot, ring_tmp_.data(), ring_tmp_.size());
    gloo::transport::Buffer* send = mine.get();
    links.StartSends([=, &links] {
      for (size_t c = 0; c < chunks; ++c) {
        const size_t at = c * chunk;
        send->send(at * es, std::min(chunk, count - at) * es, 0);
        send->waitSend();
        links.Sent(c + 1);
      }
    });
    links.ReceiveWhileSending([&] {
      for (size_t c = 0; c < chunks; ++c) {
        const size_t at = c * chunk, len = std::min(chunk, count - at);
        tmp->waitRecv();
        // The sender reads src: in place, wait until this chunk is out. A
        // sender that failed ends the wait; FinishSends reports it.
        if (src == buf && !links.WaitSent(c + 1)) return;
        const char* own = src + at * es;
        if (rank_ == 0) Reduce(buf + at * es, own, ring_tmp_.data(), len, dt, op);
        else Reduce(buf + at * es, ring_tmp_.data(), own, len, dt, op);
      }
    });
  } catch (const std::exception& e) {
    Rethrow("allreduce", e);
  }
}

void GlooComm::RingAllreduce(const char* src, char* buf, size_t count, DataType dt, ReduceOp op) {
  const size_t es = DataTypeSize(dt);
  const int n = size_;
  // Block q: elements [first[q], first[q + 1]).
  std::vector<size_t> first(n + 1);
  for (int q = 0; q <= n; ++q) first[q] = count * static_cast<size_t>(q) / n;
  size_t max_block = 0;
  for (int q = 0; q < n; ++q) max_block = std::max(max_block, first[q + 1] - first[q]);
  // Step s sends block out[s] right while block in[s] comes from the left:
  // reduce-scatter (n - 1 steps; after them this rank holds block (rank + 1)
  // % n fully reduced), then allgather (n - 1 steps passing the reduced
  // blocks around).
  const int steps = 2 * (n - 1);
  std::vector<int> out(steps), in(steps);
  for (int s = 0; s < n - 1; ++s) {
    out[s] = (rank_ - s + n) % n;
    in[s] = (rank_ - s - 1 + 2 * n) % n;
    out[n - 1 + s] = (rank_ + 1 - s + n) % n;
    in[n - 1 + s] = (rank_ - s + n) % n;
  }
  // Out of place (src != buf), this rank's own values are read from src: the
  // first step sends its block from there, and each reduce-scatter step
  // reduces the received block with src's into buf. Every block of buf is
  // written once before it is read (reduced in one reduce-scatter step, or
  // received in allgather), so the result is bit for bit the in-place one's.
  // A reduce-scatter message lands in tmp at its offset within the block; an
  // allgather message lands in the result at its own place. Messages land only
  // when this thread reads them (synchronous mode), in the order sent, so one
  // block of tmp serves every step, and a message the left neighbour sends
  // early (its next step, or its next call) waits in the socket.
  ring_tmp_.resize(max_block * es);
  // Elements per chunk of a block of len elements; the sender and the receiver
  // of a block compute it from the same length, so their messages match.
  auto chunk_of = [es](size_t len) {
    const size_t chunks = std::max<size_t>(len * es / kRingChunkBytes, 1);
    return std::max<size_t>((len + chunks - 1) / chunks, 1);
  };
  auto len_of = [&](int block) { return first[block + 1] - first[block]; };
  RingLinks& links = *ring_;
  const size_t bytes = count * es;
  try {
    auto first_to_tmp = links.out().createSendBuffer(kRingScratchSlot, const_cast<char*>(src), bytes);
    auto to_tmp = links.out().createSendBuffer(kRingScratchSlot, buf, bytes);
    auto to_result = links.out().createSendBuffer(kRingResultSlot, buf, bytes);
    auto tmp = links.in().createRecvBuffer(kRingScratchSlot, ring_tmp_.data(), ring_tmp_.size());
    auto result = links.in().createRecvBuffer(kRingResultSlot, buf, bytes);
    for (int s = 0; s < steps; ++s) {
      const bool scatter = s < n - 1;
      gloo::transport::Buffer* send =
          s == 0 ? first_to_tmp.get() : scatter ? to_tmp.get() : to_result.get();
      const size_t out_first = first[out[s]], out_len = len_of(out[s]);
      links.StartSends([=] {
        const size_t chunk = chunk_of(out_len);
        for (size_t off = 0; off < out_len; off += chunk) {
          const size_t at = (out_first + off) * es;
          send->send(at, std::min(chunk, out_len - off) * es, scatter ? off * es : at);
          send->waitSend();
        }
      });
      const size_t in_len = len_of(in[s]), in_chunk = chunk_of(in_len);
      char* block = buf + first[in[s]] * es;
      const char* mine = src + first[in[s]] * es;  // this rank's own values of the block
      links.ReceiveWhileSending([&] {
        for (size_t off = 0; off < in_len; off += in_chunk) {
          if (scatter) {
            // A received chunk is reduced while the next ones are on the wire.
            tmp->waitRecv();
            const size_t len = std::min(in_chunk, in_len - off);
            Reduce(block + off * es, ring_tmp_.data() + off * es, mine + off * es, len, dt, op);
          } else {
            result->waitRecv();
          }
        }
      });
    }
  } catch (const std::exception& e) {
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
