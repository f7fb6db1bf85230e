// HierarchicalComm's pipelined allreduce (comm/hierarchical_comm.h) with fake
// communicators in one process: the order of the phases per chunk, that the
// cross-host allreduce of a chunk overlaps the next chunk's local reduction,
// and that a failure on the pipe's thread reaches the caller (no hang, the
// pipe drained before the buffer is given back).
#include <gtest/gtest.h>

#include <atomic>
#include <algorithm>
#include <chrono>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "comm/hierarchical_comm.h"

namespace sdl {
namespace {

// Logs every call as "<who>:<op>:<first element index>" and can add to the
// data so the result shows which phases ran on each element.
class LogComm : public Comm {
 public:
  LogComm(std::string who, std::vector<std::string>* log, std::mutex* mu, float add,
          const float* base)
      : who_(std::move(who)), log_(log), mu_(mu), add_(add), base_(base) {}
  int rank() const override { return 0; }
  int size() const override { return 2; }
  const char* kind() const override { return "log"; }
  void Allreduce(void* buf, size_t count, DataType dt, ReduceOp op) override {
    Note("allreduce", buf);
    if (delay_ms) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    if (fail_at >= 0 && calls++ == fail_at) throw std::runtime_error(who_ + " lost its peer");
    float* f = static_cast<float*>(buf);
    for (size_t i = 0; i < count; ++i) f[i] += add_;
    active--;
  }
  void AllreduceInto(const void* in, void* out, size_t count, DataType dt, ReduceOp op) override {
    if (in != out) std::copy_n(static_cast<const float*>(in), count, static_cast<float*>(out));
    Allreduce(out, count, dt, op);
  }
  void Broadcast(void* buf, size_t bytes, int root) override { Note("broadcast", buf); active--; }
  void Allgatherv(const void*, void*, const std::vector<size_t>&) override {}
  void Alltoallv(const void*, void*, const std::vector<size_t>&) override {}
  void Barrier() override {}

  int delay_ms = 0;
  int fail_at = -1;
  int calls = 0;
  // Calls running now on all LogComms sharing the counter (overlap check).
  static std::atomic<int> active;
  static std::atomic<int> most_active;

 private:
  void Note(const char* op, const void* buf) {
    int now = ++active;
    int seen = most_active.load();
    while (now > seen && !most_active.compare_exchange_weak(seen, now)) {
    }
    std::lock_guard<std::mutex> lk(*mu_);
    log_->push_back(who_ + ":" + op + ":" +
                    std::to_string(static_cast<const float*>(buf) - base_));
  }
  std::string who_;
  std::vector<std::string>* log_;
  std::mutex* mu_;
  float add_;
  const float* base_;
};
std::atomic<int> LogComm::active{0};
std::atomic<int> LogComm::most_active{0};

struct Fixture {
  std::vector<float> data;
  std::vector<std::string> log;
  std::mutex mu;
  LogComm* local = nullptr;
  LogComm* cross = nullptr;
  std::unique_ptr<HierarchicalComm> comm;

  Fixture(size_t n, size_t chunk_bytes, bool leader) : data(n) {
    std::iota(data.begin(), data.end(), 0.0f);
    auto l = std::make_unique<LogComm>("local", &log, &mu, 1000.0f, data.data());
    local = l.get();
    std::unique_ptr<Comm> c;
    if (leader) {
      auto x = std::make_unique<LogComm>("cross", &log, &mu, 1.0e6f, data.data());
      cross = x.get();
      c = std::move(x);
    }
    comm = std::make_unique<HierarchicalComm>(std::move(l), std::move(c),
                                              std::make_unique<SelfComm>(), chunk_bytes);
    LogComm::active = 0;
    LogComm::most_active = 0;
  }
};

TEST(HierarchicalCommTest, SmallBuffersRunThePhasesOnceInOrder) {
  Fixture f(10, 64, true);  // 40 bytes: one chunk
  f.comm->Allreduce(f.data.data(), f.data.size(), DataType::kFloat32, ReduceOp::kSum);
  EXPECT_EQ(f.log, (std::vector<std::string>{"local:allreduce:0", "cross:allreduce:0",
                                              "local:broadcast:0"}));
  EXPECT_FLOAT_EQ(f.data[3], 3.0f + 1000.0f + 1.0e6f);
}

TEST(HierarchicalCommTest, ChunksGoThroughEveryPhaseInTheMembersOrder) {
  // 10 floats in chunks of 4: [0,4) [4,8) [8,10).
  for (bool leader : {true, false}) {
    Fixture f(10, 16, leader);
    f.comm->Allreduce(f.data.data(), f.data.size(), DataType::kFloat32, ReduceOp::kSum);
    std::vector<std::string> local;
    for (const auto& e : f.log)
      if (e.rfind("local:", 0) == 0) local.push_back(e);
    // Every member of a host makes the same shared-memory calls in this order.
    EXPECT_EQ(local, (std::vector<std::string>{"local:allreduce:0", "local:allreduce:4",
                                                "local:broadcast:0", "local:allreduce:8",
                                                "local:broadcast:4", "local:broadcast:8"}))
        << leader;
    for (size_t i = 0; i < f.data.size(); ++i)
      EXPECT_FLOAT_EQ(f.data[i], i + 1000.0f + (leader ? 1.0e6f : 0.0f)) << i;
    if (!leader) continue;
    std::vector<std::string> cross;
    for (const auto& e : f.log)
      if (e.rfind("cross:", 0) == 0) cross.push_back(e);
    EXPECT_EQ(cross, (std::vector<std::string>{"cross:allreduce:0", "cross:allreduce:4",
                                                "cross:allreduce:8"}));
    // A chunk crosses only after the host reduced it, and is broadcast only after.
    auto at = [&](const std::string& e) {
      return std::find(f.log.begin(), f.log.end(), e) - f.log.begin();
    };
    for (int k : {0, 4, 8}) {
      EXPECT_LT(at("local:allreduce:" + std::to_string(k)),
                at("cross:allreduce:" + std::to_string(k)));
      EXPECT_LT(at("cross:allreduce:" + std::to_string(k)),
                at("local:broadcast:" + std::to_string(k)));
    }
  }
}

TEST(HierarchicalCommTest, OutOfPlaceLeavesTheInputAlone) {
  Fixture f(10, 16, true);
  std::vector<float> in(f.data), out(10, -1.0f);
  f.comm->AllreduceInto(in.data(), out.data(), 10, DataType::kFloat32, ReduceOp::kSum);
  EXPECT_EQ(in, f.data);
  for (size_t i = 0; i < 10; ++i) EXPECT_FLOAT_EQ(out[i], i + 1000.0f + 1.0e6f) << i;
}

TEST(HierarchicalCommTest, TheWireOverlapsTheNextChunksLocalReduction) {
  Fixture f(64, 64, true);  // 4 chunks
  f.cross->delay_ms = 30;
  f.local->delay_ms = 30;
  f.comm->Allreduce(f.data.data(), f.data.size(), DataType::kFloat32, ReduceOp::kSum);
  // A cross call ran beside a local one (one after the other, at most one runs at a
  // time). How much time that saves is benchmarks/multihost.py's to say.
  EXPECT_GE(LogComm::most_active.load(), 2);
}

TEST(HierarchicalCommTest, AFailureOnThePipesThreadReachesTheCaller) {
  Fixture f(64, 16, true);  // 16 chunks
  f.cross->fail_at = 2;     // the third chunk's cross allreduce
  f.cross->delay_ms = 2;
  try {
    f.comm->Allreduce(f.data.data(), f.data.size(), DataType::kFloat32, ReduceOp::kSum);
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "cross lost its peer");
  }
  // Chunks after the failed one never crossed (the communicator is unusable), and
  // the pipe is idle: nothing writes to the buffer any more.
  int crossed = 0;
  for (const auto& e : f.log) crossed += e.rfind("cross:", 0) == 0;
  EXPECT_LE(crossed, 4);
  // The next call fails at once with the same error.
  EXPECT_THROW(f.comm->Allreduce(f.data.data(), f.data.size(), DataType::kFloat32,
                                 ReduceOp::kSum),
               std::runtime_error);
}

TEST(HierarchicalCommTest, ALocalFailureDrainsThePipeFirst) {
  Fixture f(64, 16, true);
  f.local->fail_at = 3;  // the fourth chunk's local reduction
  f.cross->delay_ms = 20;
  EXPECT_THROW(f.comm->Allreduce(f.data.data(), f.data.size(), DataType::kFloat32,
                                 ReduceOp::kSum),
               std::runtime_error);
  // Every chunk handed to the pipe had crossed before the error came out.
  std::lock_guard<std::mutex> lk(f.mu);
  int crossed = 0;
  for (const auto& e : f.log) crossed += e.rfind("cross:", 0) == 0;
  EXPECT_EQ(crossed, 3);
}

}  // namespace
}  // namespace sdl
