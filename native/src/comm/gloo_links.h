// The Gloo communicator's own connections (gloo_comm.cc is their only user):
// the ring's two links with the thread that writes to the right neighbour, and
// the peer links of the latency-bound exchanges. Both are 2-member Gloo
// contexts in synchronous mode: a message is the data alone, and the thread
// that waits reads it from the socket itself.
#pragma once

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/buffer.h>
#include <gloo/transport/device.h>
#include <gloo/transport/pair.h>

#include "common/types.h"

namespace sdl {

inline std::chrono::milliseconds Ms(double s) {
  return std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
}

// The peer links' slots. A link is one connection carrying both directions,
// and a tcp::Buffer's destructor unregisters its slot on the pair whatever
// the buffer was for, so the two directions use different slots: a message to
// a link's lower-ranked member goes to slot 1 (AgreeBits) or 2 (data), one to
// the higher-ranked member to slot 3 or 4. A member registers only the slots
// it receives on and sends only to the other two.
constexpr int kLinkAgreeSlot = 1;
constexpr int kLinkDataSlot = 2;
constexpr int kLinkSlotsUp = 2;  // added for messages to the higher-ranked member

// The ring's transport. Gloo's unbound buffers (gloo_comm.cc's other collectives)
// cost three messages per data message (receive-ready notice, send-ready
// notice, data), and the device's I/O thread reads every one and then wakes
// the waiting thread. The ring instead runs over one 2-member Gloo context per
// link (rank k to rank k + 1: member 0 sends, member 1 receives) in Gloo's
// synchronous mode: a message is the data alone, written into the buffer the
// receiver registered for its slot, and the receiving thread reads it from the
// socket itself. A blocking write could deadlock the ring (every rank writing
// a block larger than the socket buffers while nobody reads), so writes run on
// a thread of their own while the calling thread reads: each link's socket
// carries one direction only, and both ends always make progress. On the
// loopback of a 2-core machine a 3.2 MB allreduce on 2 ranks took 1.0-1.4 ms
// this way against 2.8-3.8 ms over unbound buffers (docs/benchmarks.md).
class RingLinks {
 public:
  RingLinks(std::shared_ptr<gloo::transport::Device> device,
            gloo::rendezvous::Store& store, int rank, int n, double timeout_s) {
    const int left = (rank + n - 1) % n;
    // Both members of a link must connect it at the same time. Links are
    // connected in phases (even links, odd links, then the last one when n is
    // odd): a rank is in at most one link per phase, so every phase's links
    // connect at once and no rank waits on a chain of others.
    auto phase = [n](int k) { return n % 2 == 1 && k == n - 1 ? 2 : k % 2; };
    for (int p = 0; p < 3; ++p) {
      if (phase(rank) == p) out_ = Connect(device, store, rank, 0, timeout_s);
      if (phase(left) == p) in_ = Connect(device, store, left, 1, timeout_s);
    }
    sender_ = std::thread([this] {
      pthread_setname_np(pthread_self(), "sdl_ring_send");
      SendLoop();
    });
  }

  ~RingLinks() {
    {
      std::lock_guard<std::mutex> lock(m_);
      stop_ = true;
    }
    job_cv_.notify_one();
    sender_.join();
  }

  gloo::transport::Pair& out() { return *out_->getPair(1); }
  gloo::transport::Pair& in() { return *in_->getPair(0); }

  // Runs job (writes to the right neighbour) on the sender thread.
  void StartSends(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(m_);
      job_ = std::move(job);
      sent_ = 0;
    }
    job_cv_.notify_one();
  }

  // Called by a send job: the first `n` of its messages are written.
  void Sent(size_t n) {
    {
      std::lock_guard<std::mutex> lock(m_);
      sent_ = n;
    }
    done_cv_.notify_one();
  }

  // Waits until the job started last has written `n` messages (Sent) or has
  // ended; false when it ended before (its error is FinishSends' to report).
  bool WaitSent(size_t n) {
    std::unique_lock<std::mutex> lock(m_);
    done_cv_.wait(lock, [&] { return sent_ >= n || (!job_ && !busy_); });
    return sent_ >= n;
  }

  // Waits until the sends started last are written; rethrows their error.
  void FinishSends() {
    std::unique_lock<std::mutex> lock(m_);
    done_cv_.wait(lock, [&] { return !job_ && !busy_; });
    if (error_) {
      auto e = error_;
      error_ = nullptr;
      std::rethrow_exception(e);
    }
  }

  // Runs receive (this thread's reads) while the sends started last go out,
  // then waits for them. The sends read the caller's buffers, so they end
  // before an exception from receive leaves (which wins over theirs).
  template <class Receive>
  void ReceiveWhileSending(Receive&& receive) {
    try {
      receive();
    } catch (...) {
      try {
        FinishSends();
      } catch (...) {
      }
      throw;
    }
    FinishSends();
  }

 private:
  static std::shared_ptr<gloo::rendezvous::Context> Connect(
      std::shared_ptr<gloo::transport::Device> device, gloo::rendezvous::Store& store,
      int link, int member, double timeout_s) {
    gloo::rendezvous::PrefixStore prefixed("sdl_ring_link_" + std::to_string(link), store);
    auto ctx = std::make_shared<gloo::rendezvous::Context>(member, 2);
    // Also the sockets' send and receive timeouts (synchronous mode).
    ctx->setTimeout(Ms(timeout_s));
    ctx->connectFullMesh(prefixed, device);
    ctx->getPair(1 - member)->setSync(true, false);
    return ctx;
  }

  void SendLoop() {
    std::unique_lock<std::mutex> lock(m_);
    for (;;) {
      job_cv_.wait(lock, [&] { return stop_ || job_; });
      if (stop_) return;
      auto job = std::move(job_);
      job_ = nullptr;
      busy_ = true;
      lock.unlock();
      std::exception_ptr error;
      try {
        job();
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      busy_ = false;
      error_ = error;
      done_cv_.notify_one();
    }
  }

  std::shared_ptr<gloo::rendezvous::Context> out_, in_;
  std::mutex m_;
  std::condition_variable job_cv_, done_cv_;
  std::function<void()> job_;
  bool busy_ = false, stop_ = false;
  size_t sent_ = 0;  // messages the current job reported written (Sent)
  std::exception_ptr error_;
  std::thread sender_;
};

// Latency-bound exchanges: the negotiation's AND (AgreeBits) and allreduces of
// up to 64 KiB. Over Gloo's unbound buffers each message went through the
// device's I/O thread, which read it and then woke the waiting thread, and a
// send waited for the receiver's notice unless its receive had been posted
// ahead: on the loopback of a 2-core machine a 4 KiB allreduce between 2
// processes took about 500 us (p90 4 ms), Open MPI's 50 us (docs/benchmarks.md).
// Here every partner of this member's exchanges has a link of its own, a
// 2-member Gloo context in synchronous mode: the calling thread writes its
// message into the socket and reads the partner's from it, one wake-up per
// message. Messages are at most 64 KiB and Gloo sizes the socket's send buffer
// to the message, so a write does not wait for the partner to read (both
// partners of an exchange write first, then read). Every member runs the same
// collectives in the same order, so the message a member waits for is always
// the next one on its link.
class PeerLinks {
 public:
  static constexpr size_t kDataBytes = 64 * 1024;  // the largest data message

  // Connects a link to each of peers (this member's partners in the
  // latency-bound algorithms). Links are connected in the order of their
  // (lower, higher) member pair, the same on every member, so no member waits
  // on one that waits for it.
  PeerLinks(std::shared_ptr<gloo::transport::Device> device, gloo::rendezvous::Store& store,
            int rank, std::vector<int> peers, double timeout_s)
      : rank_(rank) {
    std::sort(peers.begin(), peers.end());
    const std::vector<char> hello(kDataBytes, 0);
    for (int q : peers) {
      auto link = std::make_unique<Link>();
      const int lo = std::min(rank, q), hi = std::max(rank, q);
      gloo::rendezvous::PrefixStore prefixed(
          "sdl_peer_link_" + std::to_string(lo) + "_" + std::to_string(hi), store);
      const int member = rank == lo ? 0 : 1;
      link->ctx = std::make_shared<gloo::rendezvous::Context>(member, 2);
      link->ctx->setTimeout(Ms(timeout_s));  // also the sockets' (synchronous mode)
      link->ctx->connectFullMesh(prefixed, device);
      link->pair = link->ctx->getPair(1 - member).get();
      link->pair->setSync(true, false);
      link->recv_slots = rank > q ? kLinkSlotsUp : 0;  // messages to this member
      link->send_slots = q > rank ? kLinkSlotsUp : 0;  // messages to the peer
      link->data_in.resize(kDataBytes);
      link->data_recv = link->pair->createRecvBuffer(kLinkDataSlot + link->recv_slots,
                                                     link->data_in.data(), kDataBytes);
      links_.emplace(q, std::move(link));
      // Gloo sizes a socket's send buffer to the largest message sent on it so
      // far, and the kernel then stops tuning it. Left at a 4 KiB message's
      // size, the buffer could not take the next message while the previous
      // one waited for its acknowledgement, which the partner, stuck in the
      // same write, delays by up to 40 ms: 5-10% of 4 KiB allreduces on 2
      // ranks took 40 ms. One message of the largest size each way first.
      SendData(q, hello.data(), kDataBytes);
      RecvData(q);
    }
  }

  // Registers the receive buffers of AgreeBits' messages, `words` words each.
  void PlanAgree(size_t words) {
    for (auto& [q, link] : links_) {
      link->agree_in.assign(words, 0);
      link->agree_out.assign(words, 0);
      link->agree_recv = link->pair->createRecvBuffer(kLinkAgreeSlot + link->recv_slots,
                                                      link->agree_in.data(), words * 8);
      link->agree_send = link->pair->createSendBuffer(kLinkAgreeSlot + link->send_slots,
                                                      link->agree_out.data(), words * 8);
    }
  }

  void SendAgree(int peer, const uint64_t* bits) {
    Link& l = at(peer);
    std::memcpy(l.agree_out.data(), bits, l.agree_out.size() * 8);
    l.agree_send->send(0, l.agree_out.size() * 8, 0);
    l.agree_send->waitSend();
  }

  // Peer's next AgreeBits message.
  const uint64_t* RecvAgree(int peer) {
    Link& l = at(peer);
    l.agree_recv->waitRecv();
    return l.agree_in.data();
  }

  // Writes bytes (<= kDataBytes) from p to peer; p may change once it returns.
  void SendData(int peer, const void* p, size_t bytes) {
    Link& l = at(peer);
    // A send buffer of its own per call (p differs): its slot is the peer's, so
    // its destructor unregisters nothing of this member's.
    auto out = l.pair->createSendBuffer(kLinkDataSlot + l.send_slots, const_cast<void*>(p),
                                        bytes);
    out->send(0, bytes, 0);
    out->waitSend();
  }

  // Peer's next data message (valid until the next one from the same peer).
  const char* RecvData(int peer) {
    Link& l = at(peer);
    l.data_recv->waitRecv();
    return l.data_in.data();
  }

 private:
  struct Link {
    std::shared_ptr<gloo::rendezvous::Context> ctx;
    gloo::transport::Pair* pair = nullptr;
    int recv_slots = 0, send_slots = 0;
    std::vector<char> data_in;
    std::vector<uint64_t> agree_in, agree_out;
    // After ctx and the vectors: the buffers go first.
    std::unique_ptr<gloo::transport::Buffer> data_recv, agree_recv, agree_send;
  };

  Link& at(int peer) {
    auto it = links_.find(peer);
    if (it == links_.end())
      throw Error(ErrorCode::kInvalidArgument, "internal error: no peer link from rank " +
                                                   std::to_string(rank_) + " to " +
                                                   std::to_string(peer));
    return *it->second;
  }

  int rank_;
  std::map<int, std::unique_ptr<Link>> links_;
};

}  // namespace sdl
