#include "comm/shm_comm.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <new>
#include <thread>

#include "common/reduce.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace sdl {
namespace {

// memcpy with streaming (non-temporal) stores: the destination lines are not
// read first and do not evict the staging slots. For results written to
// caller memory that this rank will not read again within the collective.
// The caller's next Sync() publishes the data (after the sfence here).
void StreamCopy(char* dst, const char* src, size_t n) {
#if defined(__SSE2__)
  if (n >= 4096) {
    size_t head = (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16;
    std::memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    for (; n >= 64; n -= 64, dst += 64, src += 64) {
      __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
      __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
      __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32));
      __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 48), d);
    }
    std::memcpy(dst, src, n);
    _mm_sfence();
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

constexpr uint64_t kMagic = 0x53444c53484d3031ull;  // "SDLSHM01"
constexpr size_t kAlign = 64;

struct Header {
  std::atomic<uint64_t> magic;
  std::atomic<uint32_t> attached;
  uint32_t size;
  uint64_t slot_bytes;
};

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Shared (not process-private) futexes: the word lives in a segment mapped by
// several processes.
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, double seconds) {
  struct timespec ts;
  ts.tv_sec = static_cast<time_t>(seconds);
  ts.tv_nsec = static_cast<long>((seconds - static_cast<double>(ts.tv_sec)) * 1e9);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void FutexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

size_t RoundUp(size_t n, size_t a) { return (n + a - 1) / a * a; }

// True when pid has exited: gone, or a zombie its parent has not reaped yet
// (kill(pid, 0) still succeeds for those).
bool ProcessExited(pid_t pid) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0) return errno == ESRCH;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  FILE* f = std::fopen(path, "r");
  if (!f) return false;
  char buf[512];
  size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* close_paren = std::strrchr(buf, ')');  // comm may contain spaces
  return close_paren && close_paren[1] == ' ' && (close_paren[2] == 'Z' || close_paren[2] == 'X');
}

}  // namespace

// One cache line per rank. A waiting peer spins briefly, then sleeps on the
// futex word `seq` (the low 32 bits of step, bumped on failure too) after
// counting itself in `waiters`, so the owner only pays for a wake-up system
// call when somebody actually sleeps.
struct alignas(kAlign) ShmComm::Control {
  std::atomic<uint64_t> step;
  std::atomic<int32_t> pid;
  std::atomic<uint32_t> failed;
  std::atomic<uint32_t> seq;
  std::atomic<uint32_t> waiters;
};

ShmComm::ShmComm(const std::string& name, int rank, int size, std::vector<int> global_ranks,
                 size_t slot_bytes, double timeout_s, double start_timeout_s)
    : rank_(rank), size_(size), global_ranks_(std::move(global_ranks)),
      timeout_s_(timeout_s), name_(name) {
  slot_bytes_ = RoundUp(std::max<size_t>(slot_bytes, 2 * 4096), 2 * kAlign);
  half_bytes_ = slot_bytes_ / 2;
  header_bytes_ = RoundUp(sizeof(Header), kAlign) + kAlign * size_;
  header_bytes_ = RoundUp(header_bytes_, 4096);
  total_bytes_ = header_bytes_ + slot_bytes_ * size_;

  double deadline = Now() + start_timeout_s;
  int fd = -1;
  if (rank_ == 0) {
    fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0)
      throw Error(ErrorCode::kPeerFailure,
                  "shm_open(" + name_ + ") failed: " + std::strerror(errno));
    if (ftruncate(fd, static_cast<off_t>(total_bytes_)) != 0) {
      int e = errno;
      close(fd);
      shm_unlink(name_.c_str());
      throw Error(ErrorCode::kPeerFailure, "cannot size shared memory segment " + name_ + " (" +
                                               std::to_string(total_bytes_) + " bytes): " +
                                               std::strerror(e) + "; is /dev/shm too small?");
    }
  } else {
    while (true) {
      fd = shm_open(name_.c_str(), O_RDWR, 0600);
      struct stat st;
      if (fd >= 0 && fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) == total_bytes_) break;
      if (fd >= 0) close(fd);
      if (Now() > deadline)
        throw Error(ErrorCode::kPeerFailure,
                    "timed out waiting for rank " + std::to_string(global_ranks_[0]) +
                        " to create shared memory segment " + name_);
      std::this_thread::sleep_for(std::chrono::microseconds(500));
    }
  }
  void* p = mmap(nullptr, total_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    if (rank_ == 0) shm_unlink(name_.c_str());
    throw Error(ErrorCode::kPeerFailure, "mmap of " + name_ + " failed: " + std::strerror(errno));
  }
  base_ = static_cast<char*>(p);
  auto* hdr = reinterpret_cast<Header*>(base_);
  if (rank_ == 0) {
    new (hdr) Header();
    hdr->size = static_cast<uint32_t>(size_);
    hdr->slot_bytes = slot_bytes_;
    hdr->attached.store(0);
    for (int r = 0; r < size_; ++r) {
      Control* c = new (ctl(r)) Control();
      c->step.store(0);
      c->pid.store(0);
      c->failed.store(0);
      c->seq.store(0);
      c->waiters.store(0);
    }
    hdr->magic.store(kMagic, std::memory_order_release);
  } else {
    while (hdr->magic.load(std::memory_order_acquire) != kMagic) {
      if (Now() > deadline) {
        munmap(base_, total_bytes_);
        base_ = nullptr;
        throw Error(ErrorCode::kPeerFailure, "shared memory segment " + name_ + " never initialised");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  ctl(rank_)->pid.store(static_cast<int32_t>(getpid()));
  hdr->attached.fetch_add(1);
  while (hdr->attached.load(std::memory_order_acquire) < static_cast<uint32_t>(size_)) {
    if (Now() > deadline) {
      if (rank_ == 0) shm_unlink(name_.c_str());
      throw Error(ErrorCode::kPeerFailure, "timed out waiting for all " + std::to_string(size_) +
                                               " local ranks to attach to " + name_);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (rank_ == 0) shm_unlink(name_.c_str());
}

ShmComm::~ShmComm() {
  if (!base_) return;
  // Peers still waiting on this rank (it failed on another transport, or shut
  // down) learn it at once instead of at their timeout.
  uint32_t none = 0;
  ctl(rank_)->failed.compare_exchange_strong(none, 2);
  Publish();
  munmap(base_, total_bytes_);
}

ShmComm::Control* ShmComm::ctl(int r) const {
  return reinterpret_cast<Control*>(base_ + RoundUp(sizeof(Header), kAlign) + kAlign * r);
}

char* ShmComm::half(int r, uint64_t round) const {
  return base_ + header_bytes_ + slot_bytes_ * r + (round % 2) * half_bytes_;
}

void ShmComm::Publish() {
  Control* me = ctl(rank_);
  me->seq.fetch_add(1);
  if (me->waiters.load() != 0) FutexWakeAll(&me->seq);
}

void ShmComm::Fail(const std::string& msg) {
  if (base_) {
    ctl(rank_)->failed.store(1, std::memory_order_release);
    Publish();
  }
  throw Error(ErrorCode::kPeerFailure, msg);
}

void ShmComm::WaitFor(int peer, uint64_t step) {
  Control* c = ctl(peer);
  for (int i = 0; i < 2000; ++i) {
    if (c->step.load(std::memory_order_acquire) >= step) return;
    CpuRelax();
  }
  double start = Now();
  double deadline = start + timeout_s_;
  double next_check = start;
  bool counted = false;
  struct Uncount {  // leave the waiter count as found, also when Fail throws
    std::atomic<uint32_t>* waiters;
    bool* counted;
    ~Uncount() {
      if (*counted) waiters->fetch_sub(1);
    }
  } uncount{&c->waiters, &counted};
  while (true) {
    // Read seq before step: a publish after this read changes seq, so the
    // futex wait below returns at once instead of missing it.
    uint32_t seq = c->seq.load();
    if (c->step.load() >= step) {
      AdaptYield(Now() - start);
      return;
    }
    if (uint32_t f = c->failed.load(std::memory_order_acquire))
      Fail("rank " + std::to_string(global_ranks_[peer]) +
           (f == 1 ? " failed during a collective (its transport raised an error)"
                   : " stopped taking part in collectives (it shut down or failed)"));
    double now = Now();
    if (now >= next_check) {
      next_check = now + 0.01;
      pid_t pid = c->pid.load();
      if (ProcessExited(pid))
        Fail("rank " + std::to_string(global_ranks_[peer]) + " (pid " + std::to_string(pid) +
             ") exited while rank " + std::to_string(global_ranks_[rank_]) +
             " waited for it in a collective");
      if (now > deadline)
        Fail("rank " + std::to_string(global_ranks_[peer]) + " did not take part in a collective for " +
             std::to_string(static_cast<int>(timeout_s_)) + " s (SDL_TIMEOUT); it is hung or stopped");
    }
    // Yield for a while (cheap when the peer is about to arrive), then sleep
    // on the peer's futex so a waiting rank leaves its core to the
    // framework's compute threads; the peer's next step wakes it.
    if (now - start < yield_s_) {
      sched_yield();
      continue;
    }
    if (!counted) {
      c->waiters.fetch_add(1);
      counted = true;
      continue;  // re-read seq and step after announcing ourselves
    }
    FutexWait(&c->seq, seq, std::min(0.01, std::max(next_check - now, 0.0001)));
  }
}

// The yield window adapts to how long peers keep this rank waiting. Back-to-back
// small collectives meet within tens of microseconds: a longer window saves
// the futex sleep and wake-up on every call (11 us against 26 us per 4 KiB
// allreduce on 2 busy cores). During training a peer is usually computing for
// milliseconds: there yielding only burns CPU the training threads need
// (5-10% slower steps with a fixed 200 us window), so the window shrinks.
void ShmComm::AdaptYield(double waited_s) {
  constexpr double kMin = 0.00002, kMax = 0.0002;
  if (waited_s <= yield_s_) yield_s_ = std::min(kMax, yield_s_ * 2);  // met while yielding
  else if (waited_s > 0.001) yield_s_ = std::max(kMin, yield_s_ / 2);  // peer was far away
}

void ShmComm::Sync() {
  ++step_;
  ctl(rank_)->step.store(step_, std::memory_order_release);
  Publish();
  for (int q = 0; q < size_; ++q)
    if (q != rank_) WaitFor(q, step_);
}

void ShmComm::Barrier() { Sync(); }

void ShmComm::Allreduce(void* buf, size_t count, DataType dt, ReduceOp op) {
  AllreduceInto(buf, buf, count, dt, op);
}

// Out of place, in needs no copy first: it is staged for the peers straight
// from in, the first reduction of this rank's part reads in, and the results
// reach out through streaming stores (out is usually not in cache; a plain
// store would read every line first, a third more memory traffic than in
// place). Every operand and the order of the reductions are the same as in
// place, so the bits are too.
void ShmComm::AllreduceInto(const void* in, void* out, size_t count, DataType dt, ReduceOp op) {
  if (count == 0) return;
  const size_t es = DataTypeSize(dt);
  if (size_ == 1) {
    if (in != out) std::memcpy(out, in, count * es);
    return;
  }
  const size_t chunk = std::max<size_t>(half_bytes_ / es / size_, 1) * size_;  // elements
  const char* src = static_cast<const char*>(in);
  char* data = static_cast<char*>(out);
  const bool in_place = src == data;
  for (size_t off = 0; off < count; off += chunk) {
    size_t n = std::min(chunk, count - off);
    const char* mine_in = src + off * es;
    char* mine = data + off * es;
    auto lo = [&](int q) { return n * q / size_ * es; };
    auto len = [&](int q) { return n * (q + 1) / size_ * es - n * q / size_ * es; };
    char* stage = half(rank_, round_);
    // Peers need my contribution to the parts they own.
    for (int q = 0; q < size_; ++q)
      if (q != rank_ && len(q)) std::memcpy(stage + lo(q), mine_in + lo(q), len(q));
    Sync();
    // Each part has one owner that reduces it, so every rank ends with identical bits.
    size_t my_lo = lo(rank_), my_len = len(rank_), my_n = my_len / es;
    if (my_len) {
      // In place the part is reduced in the caller's buffer and staged; out of
      // place it is reduced in this rank's (cached) staging slot, which peers
      // do not read at my_lo in this round, and streamed to out.
      char* acc_out = in_place ? mine + my_lo : stage + my_lo;
      const char* acc = mine_in + my_lo;  // the partial result: my input until the first step
      for (int q = 0; q < size_; ++q) {
        if (q == rank_) continue;
        const char* theirs = half(q, round_) + my_lo;
        if (q < rank_) Reduce(acc_out, theirs, acc, my_n, dt, op);
        else Reduce(acc_out, acc, theirs, my_n, dt, op);
        acc = acc_out;
      }
      if (in_place) std::memcpy(stage + my_lo, mine + my_lo, my_len);
      else StreamCopy(mine + my_lo, stage + my_lo, my_len);
    }
    Sync();
    for (int q = 0; q < size_; ++q) {
      if (q == rank_ || !len(q)) continue;
      if (in_place) std::memcpy(mine + lo(q), half(q, round_) + lo(q), len(q));
      else StreamCopy(mine + lo(q), half(q, round_) + lo(q), len(q));
    }
    ++round_;
  }
}

namespace {

// Byte ranges of a list of spans seen as one buffer laid back to back.
class SpanView {
 public:
  explicit SpanView(const std::vector<Comm::Span>& spans) : spans_(spans) {
    starts_.reserve(spans.size());
    size_t at = 0;
    for (const Comm::Span& s : spans) {
      starts_.push_back(at);
      at += s.bytes;
    }
  }
  // Calls fn(piece, offset from lo, bytes) for the pieces of [lo, lo + len).
  template <typename Fn>
  void ForEach(size_t lo, size_t len, Fn&& fn) const {
    size_t i = std::upper_bound(starts_.begin(), starts_.end(), lo) - starts_.begin() - 1;
    size_t done = 0;
    while (done < len) {
      const size_t in_span = lo + done - starts_[i];
      const size_t n = std::min(spans_[i].bytes - in_span, len - done);
      if (n) fn(spans_[i].data + in_span, done, n);
      done += n;
      ++i;
    }
  }

 private:
  const std::vector<Comm::Span>& spans_;
  std::vector<size_t> starts_;
};

}  // namespace

// AllreduceInto's in-place algorithm over a SpanView: the same chunks, owners
// and order of reductions, so the bits are those of the packed buffer's.
bool ShmComm::AllreduceSpans(const std::vector<Span>& spans, size_t count, DataType dt,
                             ReduceOp op) {
  if (count == 0 || size_ == 1) return true;
  const size_t es = DataTypeSize(dt);
  const SpanView view(spans);
  const size_t chunk = std::max<size_t>(half_bytes_ / es / size_, 1) * size_;  // elements
  for (size_t off = 0; off < count; off += chunk) {
    const size_t n = std::min(chunk, count - off);
    const size_t base = off * es;
    auto lo = [&](int q) { return n * q / size_ * es; };
    auto len = [&](int q) { return n * (q + 1) / size_ * es - n * q / size_ * es; };
    char* stage = half(rank_, round_);
    for (int q = 0; q < size_; ++q) {
      if (q == rank_ || !len(q)) continue;
      view.ForEach(base + lo(q), len(q), [&](char* p, size_t at, size_t bytes) {
        std::memcpy(stage + lo(q) + at, p, bytes);
      });
    }
    Sync();
    const size_t my_lo = lo(rank_), my_len = len(rank_);
    if (my_len) {
      view.ForEach(base + my_lo, my_len, [&](char* p, size_t at, size_t bytes) {
        for (int q = 0; q < size_; ++q) {
          if (q == rank_) continue;
          const char* theirs = half(q, round_) + my_lo + at;
          if (q < rank_) Reduce(p, theirs, p, bytes / es, dt, op);
          else Reduce(p, p, theirs, bytes / es, dt, op);
        }
        std::memcpy(stage + my_lo + at, p, bytes);
      });
    }
    Sync();
    for (int q = 0; q < size_; ++q) {
      if (q == rank_ || !len(q)) continue;
      const char* theirs = half(q, round_) + lo(q);
      view.ForEach(base + lo(q), len(q), [&](char* p, size_t at, size_t bytes) {
        std::memcpy(p, theirs + at, bytes);
      });
    }
    ++round_;
  }
  return true;
}

void ShmComm::Allgatherv(const void* in, void* out, const std::vector<size_t>& bytes) {
  size_t max_bytes = *std::max_element(bytes.begin(), bytes.end());
  std::vector<size_t> displ(size_, 0);
  for (int q = 1; q < size_; ++q) displ[q] = displ[q - 1] + bytes[q - 1];
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  if (bytes[rank_] && src != dst + displ[rank_])
    std::memmove(dst + displ[rank_], src, bytes[rank_]);
  for (size_t off = 0; off < max_bytes; off += half_bytes_) {
    auto piece = [&](int q) { return bytes[q] > off ? std::min(half_bytes_, bytes[q] - off) : 0; };
    if (piece(rank_)) std::memcpy(half(rank_, round_), src + off, piece(rank_));
    Sync();
    for (int q = 0; q < size_; ++q)
      if (q != rank_ && piece(q)) std::memcpy(dst + displ[q] + off, half(q, round_), piece(q));
    ++round_;
  }
}

// One round when every message fits a staging half (negotiation's lists do):
// each member stages its size and message, and after the sync root copies
// them out. Every member reads the others' size words (shared memory, a few
// loads) so that all agree on how many more rounds longer messages need.
// Staging halves alternate by round and every round syncs all members, so a
// half is never rewritten before root has read it (as in Allgatherv).
std::vector<std::string> ShmComm::GatherBytes(const std::string& mine, int root) {
  constexpr size_t kHead = sizeof(uint64_t);
  const size_t first = half_bytes_ - kHead;  // message bytes staged in the first round
  const uint64_t my_size = mine.size();
  char* stage = half(rank_, round_);
  std::memcpy(stage, &my_size, kHead);
  if (rank_ != root && my_size) std::memcpy(stage + kHead, mine.data(), std::min<size_t>(first, my_size));
  Sync();
  std::vector<size_t> sizes(size_);
  for (int q = 0; q < size_; ++q) {
    uint64_t s = 0;
    std::memcpy(&s, half(q, round_), kHead);
    sizes[q] = s;
  }
  std::vector<std::string> out;
  if (rank_ == root) {
    out.resize(size_);
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) {
        out[q] = mine;
        continue;
      }
      out[q].resize(sizes[q]);
      if (sizes[q]) std::memcpy(out[q].data(), half(q, round_) + kHead, std::min(first, sizes[q]));
    }
  }
  ++round_;
  const size_t longest = *std::max_element(sizes.begin(), sizes.end());
  for (size_t off = first; off < longest; off += half_bytes_) {
    auto piece = [&](int q) { return sizes[q] > off ? std::min(half_bytes_, sizes[q] - off) : 0; };
    if (rank_ != root && piece(rank_)) std::memcpy(half(rank_, round_), mine.data() + off, piece(rank_));
    Sync();
    if (rank_ == root)
      for (int q = 0; q < size_; ++q)
        if (q != rank_ && piece(q)) std::memcpy(out[q].data() + off, half(q, round_), piece(q));
    ++round_;
  }
  return out;
}

void ShmComm::Broadcast(void* buf, size_t bytes, int root) {
  char* data = static_cast<char*>(buf);
  for (size_t off = 0; off < bytes; off += half_bytes_) {
    size_t n = std::min(half_bytes_, bytes - off);
    if (rank_ == root) std::memcpy(half(root, round_), data + off, n);
    Sync();
    if (rank_ != root) std::memcpy(data + off, half(root, round_), n);
    ++round_;
  }
}

void ShmComm::Alltoallv(const void* in, void* out, const std::vector<size_t>& matrix) {
  const size_t per = std::max<size_t>(half_bytes_ / size_ / kAlign, 1) * kAlign;
  size_t max_piece = *std::max_element(matrix.begin(), matrix.end());
  std::vector<size_t> send_displ(size_, 0), recv_displ(size_, 0);
  for (int q = 1; q < size_; ++q) {
    send_displ[q] = send_displ[q - 1] + matrix[rank_ * size_ + q - 1];
    recv_displ[q] = recv_displ[q - 1] + matrix[(q - 1) * size_ + rank_];
  }
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  size_t self = matrix[rank_ * size_ + rank_];
  if (self) std::memmove(dst + recv_displ[rank_], src + send_displ[rank_], self);
  for (size_t off = 0; off < max_piece; off += per) {
    auto piece = [&](int from, int to) {
      size_t b = matrix[from * size_ + to];
      return b > off ? std::min(per, b - off) : 0;
    };
    char* stage = half(rank_, round_);
    for (int q = 0; q < size_; ++q)
      if (q != rank_ && piece(rank_, q))
        std::memcpy(stage + q * per, src + send_displ[q] + off, piece(rank_, q));
    Sync();
    for (int q = 0; q < size_; ++q)
      if (q != rank_ && piece(q, rank_))
        std::memcpy(dst + recv_displ[q] + off, half(q, round_) + rank_ * per, piece(q, rank_));
    ++round_;
  }
}

}  // namespace sdl
