// Inline cycles (core/loop.cc): callers that wait run their rank's negotiation
// cycles themselves; the background thread runs the rest. Runtimes as threads
// of one process over an in-memory store, over shared memory and Gloo TCP.
#include <gtest/gtest.h>

#include <gloo/rendezvous/hash_store.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/runtime.h"
#include "run_ranks.h"

namespace sdl {
namespace {

void RunRanks(int n, const std::string& transport, bool inline_cycles,
              const std::function<void(int, Runtime&)>& body) {
  RunRanks(n, transport, body, [&](Config& c) { c.inline_cycles = inline_cycles; });
}

Request Allreduce(const std::string& name, int64_t n) {
  Request r;
  r.op = OpType::kAllreduce;
  r.name = name;
  r.shape = {n};
  return r;
}

double Seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

class Inline : public ::testing::TestWithParam<std::string> {};

// One batch per step waited on at once: the waiting thread runs the cycles.
TEST_P(Inline, WaitingCallerRunsTheCycles) {
  for (bool on : {true, false}) {
    RunRanks(2, GetParam(), on, [&](int rank, Runtime& rt) {
      for (int step = 0; step < 20; ++step) {
        std::vector<std::vector<float>> xs(8, std::vector<float>(100, float(rank + step)));
        std::vector<Runtime::Submission> subs(xs.size());
        for (size_t i = 0; i < xs.size(); ++i) {
          subs[i].req = Allreduce("g" + std::to_string(i), 100);
          subs[i].in = subs[i].out = xs[i].data();
        }
        int64_t first = rt.EnqueueMany(0, std::move(subs));
        ASSERT_TRUE(rt.WaitRange(first, 8, 30)) << "inline " << on << ", step " << step << ", rank " << rank;
        for (const Result& res : rt.handles().TakeRange(first, 8))
          ASSERT_EQ(res.code, ErrorCode::kOk) << res.message;
        for (auto& x : xs) ASSERT_EQ(x, std::vector<float>(100, float(1 + 2 * step)));
      }
      if (on)
        EXPECT_GT(rt.counters().inline_cycles.load(), 0);
      else
        EXPECT_EQ(rt.counters().inline_cycles.load(), 0);
    });
  }
}

// Several threads of each rank wait at once, each on its own tensors: one
// runs cycles, the others sleep until their handles finish or the lock frees.
TEST_P(Inline, ManyThreadsWaitAtOnce) {
  RunRanks(2, GetParam(), true, [&](int rank, Runtime& rt) {
    const int kThreads = 4, kOps = 15;
    std::vector<std::thread> ts;
    std::atomic<int> ok{0};
    for (int t = 0; t < kThreads; ++t) {
      ts.emplace_back([&, t] {
        for (int i = 0; i < kOps; ++i) {
          std::vector<float> x(10 + t, float(rank * 10 + t));
          std::string name = "t" + std::to_string(t) + "." + std::to_string(i);
          int64_t h = rt.Enqueue(0, Allreduce(name, 10 + t), x.data(), x.data());
          if (!rt.WaitRange(h, 1, 30)) return;
          Result res = rt.handles().Take(h);
          if (res.code == ErrorCode::kOk && x == std::vector<float>(10 + t, float(10 + 2 * t))) ok++;
        }
      });
    }
    for (auto& th : ts) th.join();
    EXPECT_EQ(ok.load(), kThreads * kOps);
  });
}

// Rank 1 never waits (it polls): its background thread runs its cycles,
// matching the cycles rank 0's waiting caller runs.
TEST_P(Inline, RankThatNeverWaitsIsServedByTheBackgroundThread) {
  RunRanks(2, GetParam(), true, [&](int rank, Runtime& rt) {
    for (int step = 0; step < 10; ++step) {
      std::vector<float> x(64, float(rank + 1));
      int64_t h = rt.Enqueue(0, Allreduce("a", 64), x.data(), x.data());
      if (rank == 0) {
        ASSERT_TRUE(rt.WaitRange(h, 1, 30));
      } else {
        const double deadline = Seconds() + 30;
        while (!rt.handles().Poll(h) && Seconds() < deadline)
          std::this_thread::sleep_for(std::chrono::microseconds(200));
        ASSERT_TRUE(rt.handles().Poll(h));
      }
      Result res = rt.handles().Take(h);
      ASSERT_EQ(res.code, ErrorCode::kOk) << res.message;
      ASSERT_EQ(x, std::vector<float>(64, 3.0f));
    }
    if (rank == 1) {
      EXPECT_EQ(rt.counters().inline_cycles.load(), 0);
    }
  });
}

// Rank 0's caller sits in an inline cycle waiting for a tensor rank 1 never
// submits; rank 0 shuts down meanwhile. The wait ends with the shutdown
// error in bounded time, on both ranks.
TEST_P(Inline, ShutdownWhileACallerRunsACycle) {
  std::atomic<bool> shutting{false};
  RunRanks(2, GetParam(), true, [&](int rank, Runtime& rt) {
    float x[4] = {1, 2, 3, 4};
    if (rank == 1) {
      // Its background thread keeps running idle cycles (matching rank 0's)
      // until rank 0's shutdown stops both.
      while (!shutting.load()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      return;
    }
    int64_t h = rt.Enqueue(0, Allreduce("never", 4), x, x);
    Result res;
    bool done = false;
    std::thread waiter([&] {
      done = rt.WaitRange(h, 1, 30);
      if (done) res = rt.handles().Take(h);
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    EXPECT_GT(rt.counters().inline_cycles.load(), 0);  // the waiter was running cycles
    const double start = Seconds();
    shutting.store(true);
    rt.Shutdown();
    waiter.join();
    EXPECT_LT(Seconds() - start, 10.0);
    ASSERT_TRUE(done);
    EXPECT_EQ(res.code, ErrorCode::kShutdown);
    // Its own shutdown, or rank 1's when that reached the same cycle first.
    EXPECT_TRUE(res.message == Runtime::kShutDownMessage ||
                res.message.find("'never' on rank 0 cannot run") != std::string::npos)
        << res.message;
  });
}

// A wait with a timeout returns false in bounded time when the peer never
// submits the tensor, and the runtime keeps working.
TEST_P(Inline, WaitTimesOutWhileRunningCycles) {
  RunRanks(2, GetParam(), true, [&](int rank, Runtime& rt) {
    std::vector<float> x(4, float(rank));
    if (rank == 0) {
      int64_t h = rt.Enqueue(0, Allreduce("late", 4), x.data(), x.data());
      const double start = Seconds();
      EXPECT_FALSE(rt.WaitRange(h, 1, 0.3));
      EXPECT_LT(Seconds() - start, 5.0);
      ASSERT_TRUE(rt.WaitRange(h, 1, 30));
      EXPECT_EQ(rt.handles().Take(h).code, ErrorCode::kOk);
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(800));
      int64_t h = rt.Enqueue(0, Allreduce("late", 4), x.data(), x.data());
      ASSERT_TRUE(rt.WaitRange(h, 1, 30));
      EXPECT_EQ(rt.handles().Take(h).code, ErrorCode::kOk);
    }
    EXPECT_EQ(x, std::vector<float>(4, 1.0f));
  });
}

INSTANTIATE_TEST_SUITE_P(Transports, Inline, ::testing::Values("shm", "gloo"));

}  // namespace
}  // namespace sdl
