// Host staging without a GPU: the pinned-buffer pool (ops/staging_pool.h) with fake
// pinning, the host-staged backend's use of it (staging buffers from the device's
// memory, reused across collectives, fenced before the host writes into them), and
// the operations layer's per-cycle Poll of its backends (asynchronous NCCL errors).
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "core/process_set.h"
#include "fake_backend.h"
#include "ops/host_backends.h"
#include "ops/operations.h"
#include "ops/staging_pool.h"

namespace sdl {
namespace {

// Pinning that succeeds `budget` times, then fails like a locked-memory limit.
struct FakePinning {
  int budget = 1000;
  std::set<void*> pinned;
  std::vector<std::string> logs;
  StagingPool Pool() {
    return StagingPool(
        [this](int, size_t bytes, void** p, std::string* why) {
          if (budget-- <= 0) {
            *why = "cudaErrorMemoryAllocation (fake)";
            return false;
          }
          *p = std::malloc(bytes);
          pinned.insert(*p);
          return true;
        },
        [this](void* p) {
          EXPECT_EQ(pinned.erase(p), 1u) << "unpinned a buffer the pool did not pin";
          std::free(p);
        },
        [this](const std::string& m) { logs.push_back(m); });
  }
};

TEST(StagingPool, ReusesBuffersPerDeviceAndSizeClass) {
  FakePinning f;
  {
    StagingPool pool = f.Pool();
    void *a = nullptr, *b = nullptr, *c = nullptr;
    ASSERT_TRUE(pool.Acquire(0, 1000, &a).ok());
    EXPECT_EQ(StagingPool::SizeClass(1000), size_t{64} << 10);
    EXPECT_EQ(StagingPool::SizeClass((size_t{64} << 10) + 1), size_t{128} << 10);
    pool.Release(a);
    ASSERT_TRUE(pool.Acquire(0, 60000, &b).ok());  // same class, same device: reused
    EXPECT_EQ(a, b);
    ASSERT_TRUE(pool.Acquire(1, 1000, &c).ok());   // another device: its own buffer
    EXPECT_NE(c, b);
    void* d = nullptr;
    ASSERT_TRUE(pool.Acquire(0, 1000, &d).ok());   // b is still out: a new one
    EXPECT_NE(d, b);
    EXPECT_EQ(pool.allocated(), 3u);
    EXPECT_EQ(pool.pinned(), 3u);
    EXPECT_TRUE(pool.IsPinned(static_cast<char*>(b) + 10, 1000));
    EXPECT_FALSE(pool.IsPinned(static_cast<char*>(b) + 10, size_t{64} << 10));  // runs past it
    int on_stack = 0;
    EXPECT_FALSE(pool.IsPinned(&on_stack, sizeof(on_stack)));
    EXPECT_TRUE(f.logs.empty());
  }
  EXPECT_TRUE(f.pinned.empty()) << "the pool unpins what it pinned when it goes";
}

TEST(StagingPool, FallsBackToPageableMemoryWithOneLogLine) {
  FakePinning f;
  f.budget = 1;
  StagingPool pool = f.Pool();
  void *a = nullptr, *b = nullptr, *c = nullptr;
  ASSERT_TRUE(pool.Acquire(0, 10, &a).ok());
  ASSERT_TRUE(pool.Acquire(0, 10, &b).ok());
  ASSERT_TRUE(pool.Acquire(0, 10, &c).ok());
  EXPECT_TRUE(pool.IsPinned(a, 10));
  EXPECT_FALSE(pool.IsPinned(b, 10));
  EXPECT_FALSE(pool.IsPinned(c, 10));
  std::memset(b, 1, 10);  // pageable, but usable
  ASSERT_EQ(f.logs.size(), 1u);
  EXPECT_NE(f.logs[0].find("pageable"), std::string::npos) << f.logs[0];
  EXPECT_NE(f.logs[0].find("cudaErrorMemoryAllocation"), std::string::npos) << f.logs[0];
}

// A device over host memory whose staging comes from a StagingPool, like CudaMemory's:
// copies from pinned staging are "queued" (pending until StagingFence).
class PooledDevice : public DeviceMemory {
 public:
  explicit PooledDevice(FakePinning* f) : pool_(f->Pool()) {}
  DeviceType type() const override { return DeviceType::kCUDA; }
  Status Alloc(Device, size_t bytes, void** p) override {
    *p = std::malloc(bytes ? bytes : 1);
    return Status::OK();
  }
  void Free(Device, void* p) override { std::free(p); }
  Status CopyToHost(Device, void* host, const void* src, size_t bytes) override {
    EXPECT_FALSE(pending) << "the host wrote a staging buffer while a copy from it was queued";
    EXPECT_TRUE(pool_.IsPinned(host, bytes));
    std::memcpy(host, src, bytes);
    return Status::OK();
  }
  Status CopyFromHost(Device, void* dst, const void* host, size_t bytes) override {
    EXPECT_TRUE(pool_.IsPinned(host, bytes));
    std::memcpy(dst, host, bytes);
    pending = true;  // as CudaMemory: the DMA may still run after this returns
    return Status::OK();
  }
  Status BatchedCopy(Device, const CopyEntry* e, int n, DataType dt, const Scaling& s) override {
    return HostMemory().BatchedCopy(Device{}, e, n, dt, s);
  }
  Status AllocStaging(Device d, size_t bytes, void** p) override {
    return pool_.Acquire(d.index, bytes, p);
  }
  void FreeStaging(Device, void* p) override { pool_.Release(p); }
  Status StagingFence(Device) override {
    ++fences;
    pending = false;
    return Status::OK();
  }
  StagingPool& pool() { return pool_; }
  bool pending = false;
  int fences = 0;

 private:
  StagingPool pool_;
};

// One member whose "transport" doubles (a peer with the same data), on host memory.
class DoublingComm : public SelfComm {
 public:
  void Allreduce(void* buf, size_t count, DataType dt, ReduceOp op) override {
    for (size_t i = 0; i < count; ++i) static_cast<float*>(buf)[i] *= 2;
  }
};

TEST(HostStaging, UsesPinnedPooledBuffersAndFencesBeforeReusingThem) {
  FakePinning f;
  PooledDevice dev(&f);
  HostTransportBackend host;
  ProcessSet ps{0, {0}, 0, 4};
  ps.comm = std::make_unique<DoublingComm>();
  Response r;
  r.op = OpType::kAllreduce;
  r.dtype = DataType::kFloat32;
  r.names = {"x"};
  const Device gpu{DeviceType::kCUDA, 0};
  {
    HostStagedBackend staged(&dev, &host);
    std::vector<float> x = {1, 2, 3}, y(3);
    for (int round = 0; round < 3; ++round) {
      ASSERT_TRUE(staged.Allreduce(OpContext{ps, r, gpu}, x.data(), y.data(), 3,
                                   DataType::kFloat32, ReduceOp::kSum).ok());
      EXPECT_EQ(y, (std::vector<float>{2, 4, 6}));
    }
    // Each round fenced before writing the buffer the previous round's CopyFromHost read
    // (CopyToHost checks that nothing was pending).
    EXPECT_EQ(dev.fences, 3);
    EXPECT_EQ(dev.pool().allocated(), 1u) << "one staging buffer, reused every round";
  }
  EXPECT_EQ(dev.pool().allocated(), 1u) << "the backend gives its buffers back to the pool";
}

// A backend whose asynchronous health check fails once `broken` is set.
class PollingBackend : public NoOpBackend {
 public:
  const char* key() const override { return "polling"; }
  bool Enabled(const Response&, Device d) const override { return d.type == DeviceType::kCUDA; }
  Status Poll() override {
    ++polls;
    if (!*broken) return Status::OK();
    return Status::Fail(ErrorCode::kPeerFailure,
                        "asynchronous NCCL error on the fake communicator");
  }
  explicit PollingBackend(const bool* b) : broken(b) {}
  const bool* broken;
  int polls = 0;
};

TEST(Poll, ReportsTheFirstBackendFailure) {
  Operations ops;
  bool broken = false;
  auto backend = std::make_unique<PollingBackend>(&broken);
  PollingBackend* b = backend.get();
  ops.AddBackend(kPriorityDevice, std::move(backend));
  EXPECT_TRUE(ops.Poll().ok());
  broken = true;
  Status s = ops.Poll();
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code, ErrorCode::kPeerFailure);
  EXPECT_NE(s.message.find("fake communicator"), std::string::npos);
  EXPECT_EQ(b->polls, 2);
}

}  // namespace
}  // namespace sdl
