#include "core/handles.h"

#include <sys/mman.h>

#include <chrono>
#include <cstring>
#include <new>
#include <utility>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels return EINVAL
#endif

namespace sdl {
namespace {

constexpr size_t kPooledMin = size_t{1} << 20;  // smaller outputs come from the heap
constexpr size_t kHugePage = size_t{2} << 20;
constexpr size_t kIdleCap = size_t{256} << 20;  // idle bytes the pool keeps at most
constexpr double kIdleSeconds = 30.0;           // idle buffers older than this are unmapped

double Seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct IdleBuffer {
  char* p;
  size_t capacity;
  double since;
};

// Released pooled buffers, oldest first. Leaked on purpose: tensors may be
// released after static destructors ran (at interpreter exit).
struct OutputPool {
  std::mutex mu;
  std::vector<IdleBuffer> idle;
  size_t idle_bytes = 0;
};

OutputPool& Pool() {
  static OutputPool* pool = new OutputPool;
  return *pool;
}

// Removes (under the pool's lock) buffers idle too long or beyond the cap;
// returns them for unmapping outside the lock.
std::vector<IdleBuffer> TrimLocked(OutputPool& pool, double now) {
  std::vector<IdleBuffer> drop;
  size_t keep = 0;
  while (keep < pool.idle.size() &&
         (pool.idle_bytes > kIdleCap || now - pool.idle[keep].since > kIdleSeconds)) {
    pool.idle_bytes -= pool.idle[keep].capacity;
    drop.push_back(pool.idle[keep]);
    ++keep;
  }
  pool.idle.erase(pool.idle.begin(), pool.idle.begin() + static_cast<std::ptrdiff_t>(keep));
  return drop;
}

void Unmap(const std::vector<IdleBuffer>& drop) {
  for (const IdleBuffer& b : drop) munmap(b.p, b.capacity);
}

// A fresh capacity-byte mapping, 2 MiB aligned so that transparent huge pages
// can back it, with every page faulted in now rather than inside a collective.
char* MapFresh(size_t capacity) {
  size_t span = capacity + kHugePage;
  void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) throw std::bad_alloc();
  uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  uintptr_t aligned = (start + kHugePage - 1) / kHugePage * kHugePage;
  if (aligned > start) munmap(raw, aligned - start);
  size_t tail = start + span - (aligned + capacity);
  if (tail) munmap(reinterpret_cast<void*>(aligned + capacity), tail);
  char* p = reinterpret_cast<char*>(aligned);
#ifdef MADV_HUGEPAGE
  madvise(p, capacity, MADV_HUGEPAGE);
#endif
  if (madvise(p, capacity, MADV_POPULATE_WRITE) != 0) {
    for (size_t off = 0; off < capacity; off += 4096) static_cast<volatile char*>(p)[off] = 0;
  }
  return p;
}

char* AcquireOutput(size_t bytes, size_t* capacity) {
  if (bytes < kPooledMin) {
    *capacity = 0;
    return new char[bytes];
  }
  const size_t want = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  OutputPool& pool = Pool();
  std::vector<IdleBuffer> drop;
  char* found = nullptr;
  {
    std::lock_guard<std::mutex> lk(pool.mu);
    // The most recently released buffer that fits without wasting more than a quarter.
    for (size_t i = pool.idle.size(); i-- > 0;) {
      const IdleBuffer& b = pool.idle[i];
      if (b.capacity >= want && b.capacity <= want + want / 4) {
        found = b.p;
        *capacity = b.capacity;
        pool.idle_bytes -= b.capacity;
        pool.idle.erase(pool.idle.begin() + static_cast<std::ptrdiff_t>(i));
        break;
      }
    }
    drop = TrimLocked(pool, Seconds());
  }
  Unmap(drop);
  if (found) return found;
  *capacity = want;
  return MapFresh(want);
}

}  // namespace

void OutputDeleter::operator()(char* p) const {
  if (!p) return;
  if (release) {
    release(p);
    return;
  }
  if (capacity == 0) {
    delete[] p;
    return;
  }
  OutputPool& pool = Pool();
  std::vector<IdleBuffer> drop;
  {
    std::lock_guard<std::mutex> lk(pool.mu);
    double now = Seconds();
    pool.idle.push_back({p, capacity, now});
    pool.idle_bytes += capacity;
    drop = TrimLocked(pool, now);
  }
  Unmap(drop);
}

Buffer::Buffer(Device d, char* p, size_t n, std::function<void(char*)> release)
    : data(p, OutputDeleter{0, std::move(release)}), bytes(n), device(d) {}

Buffer::Buffer(size_t n) : bytes(n) {
  if (!n) return;
  size_t capacity = 0;
  char* p = AcquireOutput(n, &capacity);
  data = std::unique_ptr<char[], OutputDeleter>(p, OutputDeleter{capacity});
}

int64_t HandleTable::CreateRange(int64_t n) {
  std::lock_guard<std::mutex> lk(mu_);
  const int64_t first = next_;
  next_ += n;
  for (int64_t h = first; h < next_; ++h) states_[h];
  return first;
}

void HandleTable::Complete(int64_t h, Result r) {
  bool wake = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = states_.find(h);
    if (it == states_.end() || it->second.done) return;
    it->second.done = true;
    it->second.result = std::move(r);
    wake = it->second.waited;
  }
  if (wake) cv_.notify_all();
}

bool HandleTable::Poll(int64_t h) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = states_.find(h);
  if (it == states_.end())
    throw Error(ErrorCode::kInvalidArgument, "unknown handle " + std::to_string(h));
  return it->second.done;
}

uint64_t HandleTable::kicks() {
  std::lock_guard<std::mutex> lk(mu_);
  return kicks_;
}

void HandleTable::Kick() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    ++kicks_;
  }
  cv_.notify_all();
}

bool HandleTable::WaitRange(int64_t first, int64_t n, double timeout_s, const uint64_t* kick) {
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(timeout_s < 0 ? 0 : timeout_s));
  std::unique_lock<std::mutex> lk(mu_);
  // Sleeps on the first unfinished handle until it is done, then moves on:
  // handles finish roughly in order, so this sleeps about once per collective.
  for (int64_t h = first; h < first + n; ++h) {
    auto it = states_.find(h);
    if (it == states_.end())
      throw Error(ErrorCode::kInvalidArgument, "unknown handle " + std::to_string(h));
    if (it->second.done) continue;
    if (kick && kicks_ != *kick) return false;
    // A zero timeout is a poll. It must not reach the condition variable: a
    // timed wait whose deadline has just passed still sleeps for the thread's
    // timer slack (50 us by default) before the kernel reports the timeout,
    // and Runtime::WaitRange polls like this before every inline cycle.
    if (timeout_s == 0) return false;
    it->second.waited = true;
    // Looked up again at every wake-up: another thread may have taken it meanwhile.
    auto done = [&] {
      auto found = states_.find(h);
      if (found == states_.end())
        throw Error(ErrorCode::kInvalidArgument, "unknown handle " + std::to_string(h));
      return found->second.done || (kick && kicks_ != *kick);
    };
    if (timeout_s < 0) {
      cv_.wait(lk, done);
    } else if (!cv_.wait_until(lk, deadline, done)) {
      return false;
    }
    if (!states_.find(h)->second.done) return false;  // kicked
  }
  return true;
}

Result HandleTable::Take(int64_t h) {
  std::vector<Result> r = TakeRange(h, 1);
  return std::move(r[0]);
}

std::vector<Result> HandleTable::TakeRange(int64_t first, int64_t n) {
  std::lock_guard<std::mutex> lk(mu_);
  for (int64_t h = first; h < first + n; ++h) {
    auto it = states_.find(h);
    if (it == states_.end())
      throw Error(ErrorCode::kInvalidArgument, "unknown handle " + std::to_string(h));
    if (!it->second.done)
      throw Error(ErrorCode::kInvalidArgument, "handle " + std::to_string(h) + " is not finished");
  }
  std::vector<Result> out;
  out.reserve(static_cast<size_t>(n));
  for (int64_t h = first; h < first + n; ++h) {
    auto it = states_.find(h);
    out.push_back(std::move(it->second.result));
    states_.erase(it);
  }
  return out;
}

void HandleTable::FailAll(ErrorCode code, const std::string& msg) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& [h, s] : states_) {
      if (s.done) continue;
      s.done = true;
      s.result.code = code;
      s.result.message = msg;
    }
  }
  cv_.notify_all();
}

}  // namespace sdl
