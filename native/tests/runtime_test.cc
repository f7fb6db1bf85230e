// Several runtimes as threads of one process, meeting through an in-memory
// rendezvous store (gloo's HashStore): the whole path from enqueue through
// negotiation, the operations layer and a real transport to the handles.
#include <gtest/gtest.h>

#include <gloo/rendezvous/hash_store.h>

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/runtime.h"
#include "fake_backend.h"
#include "run_ranks.h"
#ifdef SDL_HAVE_CUDA
#include "gpu/cuda_api.h"
#endif

namespace sdl {
namespace {

Result WaitFor(Runtime& rt, int64_t h) {
  EXPECT_TRUE(rt.handles().Wait(h, 30)) << "handle did not complete";
  return rt.handles().Take(h);
}

Request Req(OpType op, const std::string& name, std::vector<int64_t> shape) {
  Request r;
  r.op = op;
  r.name = name;
  r.shape = std::move(shape);
  return r;
}

class Threads : public ::testing::TestWithParam<std::string> {};

TEST_P(Threads, FusedAllreduceAndAllgatherAcrossRuntimes) {
  const int n = 3;
  RunRanks(n, GetParam(), [&](int rank, Runtime& rt) {
    std::vector<std::vector<float>> xs;
    for (int t = 0; t < 5; ++t) xs.push_back(std::vector<float>(4 + t, float(rank + t)));
    std::vector<int64_t> hs;
    for (int t = 0; t < 5; ++t) {
      Request r = Req(OpType::kAllreduce, "t" + std::to_string(t), {4 + t});
      r.reduce = ReduceOp::kAverage;
      hs.push_back(rt.Enqueue(0, r, xs[t].data(), xs[t].data()));
    }
    for (int t = 0; t < 5; ++t) {
      Result res = WaitFor(rt, hs[t]);
      EXPECT_EQ(res.code, ErrorCode::kOk) << res.message;
      EXPECT_EQ(xs[t], std::vector<float>(4 + t, 1.0f + t));  // mean of rank + t over 0..2
    }
    std::vector<int32_t> mine(rank + 1, rank);
    Request g = Req(OpType::kAllgather, "g", {rank + 1});
    g.dtype = DataType::kInt32;
    Result res = WaitFor(rt, rt.Enqueue(0, g, mine.data(), nullptr));
    ASSERT_EQ(res.code, ErrorCode::kOk) << res.message;
    const int32_t* o = reinterpret_cast<const int32_t*>(res.outputs[0]->data.get());
    EXPECT_EQ(std::vector<int32_t>(o, o + 6), (std::vector<int32_t>{0, 1, 1, 2, 2, 2}));
  });
}

TEST_P(Threads, ShapeMismatchFailsOnEveryRankNamingTheRanks) {
  RunRanks(2, GetParam(), [&](int rank, Runtime& rt) {
    std::vector<float> x(rank + 2, 1.0f);
    Result res = WaitFor(rt, rt.Enqueue(0, Req(OpType::kAllreduce, "w", {rank + 2}), x.data(), x.data()));
    EXPECT_EQ(res.code, ErrorCode::kMismatch);
    EXPECT_EQ(res.message, "Mismatched allreduce shapes for tensor 'w': rank 0 has [2]; rank 1 has [3]");
    // The runtime stays usable after a mismatch.
    std::vector<float> y(2, float(rank));
    res = WaitFor(rt, rt.Enqueue(0, Req(OpType::kAllreduce, "w", {2}), y.data(), y.data()));
    EXPECT_EQ(res.code, ErrorCode::kOk) << res.message;
    EXPECT_EQ(y, std::vector<float>(2, 1.0f));
  });
}

TEST_P(Threads, CudaTensorIsRefusedAtEnqueueWithoutABackend) {
#ifdef SDL_HAVE_CUDA
  // Where CUDA is usable the runtime registers the CUDA backends, which take the tensor.
  if (gpu::QueryCuda().usable) GTEST_SKIP() << "CUDA is usable here";
#endif
  RunRanks(2, GetParam(), [&](int rank, Runtime& rt) {
    float x[2] = {0, 0};
    Request r = Req(OpType::kAllreduce, "gpu", {2});
    r.device = Device{DeviceType::kCUDA, rank};
    try {
      rt.Enqueue(0, r, x, x);
      ADD_FAILURE() << "a CUDA tensor was accepted by a build without a CUDA backend";
    } catch (const Error& e) {
      EXPECT_EQ(e.code, ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("cuda:" + std::to_string(rank)), std::string::npos);
    }
  });
}

// Host memory posing as a CUDA device whose framework streams keep a clock (the
// work queued on them so far): records each ready mark (the clock, and the
// thread that took it) and each wait of the core's stream.
class ClockedDevice : public HostMemory {
 public:
  struct Mark : ReadyMark {
    std::thread::id thread;
    int clock = 0;
  };
  DeviceType type() const override { return DeviceType::kCUDA; }
  Status MarkReady(Device, uintptr_t stream, std::shared_ptr<const ReadyMark>* out) override {
    auto m = std::make_shared<Mark>();
    m->thread = std::this_thread::get_id();
    m->clock = clock.load();
    std::lock_guard<std::mutex> lk(mu);
    marked.push_back(stream);
    *out = m;
    return Status::OK();
  }
  Status WaitForStream(Device, uintptr_t stream, const ReadyMark* mark) override {
    std::lock_guard<std::mutex> lk(mu);
    waits.push_back(mark ? *static_cast<const Mark*>(mark) : Mark{});
    if (!mark) waits.back().clock = clock.load();
    return Status::OK();
  }
  std::atomic<int> clock{0};
  std::mutex mu;
  std::vector<uintptr_t> marked;
  std::vector<Mark> waits;
};

TEST(DeviceStreams, TheCoreWaitsForWhatTheStreamHadQueuedAtEnqueue) {
#ifdef SDL_HAVE_CUDA
  // Where CUDA is usable the runtime registers the real CUDA memory (tests/gpu covers it).
  if (gpu::QueryCuda().usable) GTEST_SKIP() << "CUDA is usable here";
#endif
  ClockedDevice* dev = nullptr;
  RuntimeOptions o;
  o.hostname = "127.0.0.1";
  o.add_ops = [&](Operations& ops) {
    auto m = std::make_unique<ClockedDevice>();
    dev = m.get();
    ops.AddDeviceMemory(std::move(m));
  };
  Runtime rt(std::move(o));
  ASSERT_NE(dev, nullptr);
  std::vector<float> x(6, 1.0f);
  std::vector<Runtime::Submission> subs(3);
  const uintptr_t streams[] = {7, 7, 9};
  for (int i = 0; i < 3; ++i) {
    subs[i].req = Req(OpType::kAllreduce, "g" + std::to_string(i), {2});
    subs[i].req.device = Device{DeviceType::kCUDA, 0};
    subs[i].in = subs[i].out = x.data() + 2 * i;
    subs[i].stream = streams[i];
  }
  dev->clock = 1;  // the gradients' producers
  const int64_t first = rt.EnqueueMany(0, std::move(subs));
  dev->clock = 2;  // the rest of the backward pass, queued after the enqueue
  for (int i = 0; i < 3; ++i) {
    Result res = WaitFor(rt, first + i);
    EXPECT_EQ(res.code, ErrorCode::kOk) << res.message;
  }
  std::lock_guard<std::mutex> lk(dev->mu);
  EXPECT_EQ(dev->marked, (std::vector<uintptr_t>{7, 9})) << "one mark per stream of the batch";
  ASSERT_EQ(dev->waits.size(), 2u) << "one wait per stream of the response";
  for (const ClockedDevice::Mark& w : dev->waits) {
    EXPECT_EQ(w.thread, std::this_thread::get_id()) << "the mark is taken by the enqueuing thread";
    EXPECT_EQ(w.clock, 1) << "the core waited for work queued after the enqueue";
  }
}

// A backend that serves nothing, whose health check fails on demand (as NCCL
// reports a broken collective asynchronously), and which records its aborts.
class FailingBackend : public NoOpBackend {
 public:
  const char* key() const override { return "failing"; }
  Status Poll() override {
    if (fail.load()) return Status::Fail(ErrorCode::kPeerFailure, "device link broke (fake)");
    return Status::OK();
  }
  void Abort(const std::string& why) override {
    std::lock_guard<std::mutex> lk(mu);
    aborts.push_back(why);
  }
  std::atomic<bool> fail{false};
  std::mutex mu;
  std::vector<std::string> aborts;
};

// RunRanks options that give each rank a FailingBackend, kept in backends[rank].
std::function<void(int, RuntimeOptions&)> WithFailingBackends(FailingBackend** backends) {
  return [backends](int rank, RuntimeOptions& o) {
    o.add_ops = [backends, rank](Operations& ops) {
      auto b = std::make_unique<FailingBackend>();
      backends[rank] = b.get();
      ops.AddBackend(kPriorityDevice, std::move(b));
    };
  };
}

// After a failure the runtime aborts its device backends (NCCL's communicators
// would otherwise be finalized, which waits for peers that are gone); a clean
// shutdown does not.
TEST_P(Threads, AFailedRuntimeAbortsItsDeviceBackends) {
  FailingBackend* backends[2] = {nullptr, nullptr};
  RunRanks(
      2, GetParam(),
      [&](int rank, Runtime& rt) {
        float x[1] = {1};
        Result ok = WaitFor(rt, rt.Enqueue(0, Req(OpType::kAllreduce, "before", {1}), x, x));
        EXPECT_EQ(ok.code, ErrorCode::kOk) << ok.message;
        if (rank == 1) backends[1]->fail = true;
        // Both ranks fail: rank 1 on its own check, rank 0 through the peer's end.
        Result res = WaitFor(rt, rt.Enqueue(0, Req(OpType::kAllreduce, "after", {1}), x, x));
        EXPECT_NE(res.code, ErrorCode::kOk) << "rank " << rank;
        if (rank == 1) {
          EXPECT_NE(res.message.find("device link broke (fake)"), std::string::npos) << res.message;
        }
        rt.Shutdown();
        std::lock_guard<std::mutex> lk(backends[rank]->mu);
        ASSERT_EQ(backends[rank]->aborts.size(), 1u) << "rank " << rank;
        if (rank == 1) {
          EXPECT_NE(backends[1]->aborts[0].find("device link broke"), std::string::npos);
        }
      },
      {}, WithFailingBackends(backends));
}

TEST_P(Threads, ACleanShutdownAbortsNothing) {
  FailingBackend* backends[2] = {nullptr, nullptr};
  RunRanks(
      2, GetParam(),
      [&](int rank, Runtime& rt) {
        float x[1] = {1};
        Result ok = WaitFor(rt, rt.Enqueue(0, Req(OpType::kAllreduce, "x", {1}), x, x));
        EXPECT_EQ(ok.code, ErrorCode::kOk) << ok.message;
        rt.Shutdown();
        std::lock_guard<std::mutex> lk(backends[rank]->mu);
        EXPECT_TRUE(backends[rank]->aborts.empty()) << "rank " << rank;
      },
      {}, WithFailingBackends(backends));
}

TEST_P(Threads, CollectiveAfterAPeerShutDownNamesThatPeer) {
  std::atomic<bool> enqueued{false};
  RunRanks(2, GetParam(), [&](int rank, Runtime& rt) {
    float x[2] = {1, 2};
    if (rank == 0) {
      while (!enqueued.load()) std::this_thread::yield();
      rt.Shutdown();  // rank 1 still waits on 'p': the calls did not match
      try {
        rt.Enqueue(0, Req(OpType::kAllreduce, "q", {2}), x, x);
        ADD_FAILURE() << "enqueue after shutdown was accepted";
      } catch (const Error& e) {
        EXPECT_EQ(e.code, ErrorCode::kShutdown);
        EXPECT_STREQ(e.what(), "spark_dl has been shut down");  // its own shutdown
      }
      return;
    }
    int64_t h = rt.Enqueue(0, Req(OpType::kAllreduce, "p", {2}), x, x);
    enqueued.store(true);
    Result res = WaitFor(rt, h);
    EXPECT_EQ(res.code, ErrorCode::kShutdown);
    EXPECT_EQ(res.message,
              "allreduce 'p' on rank 1 cannot run: rank 0 had already shut down; every rank must "
              "make the same collective calls in the same order");
    try {
      Request b = Req(OpType::kBroadcast, "after", {2});
      rt.Enqueue(0, b, x, x);
      ADD_FAILURE() << "enqueue after the peers shut down was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code, ErrorCode::kShutdown);
      EXPECT_STREQ(e.what(),
                   "broadcast 'after' on rank 1 cannot run: rank 0 had already shut down; every "
                   "rank must make the same collective calls in the same order");
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Transports, Threads, ::testing::Values("shm", "gloo"));

}  // namespace
}  // namespace sdl
