// The operations layer with fake backends and a fake device: backend choice in
// priority order, the refusal of tensors no backend serves, and host staging
// (device -> host -> CPU transport -> device) with pack/unpack and scaling.
//
// The fake device is host memory that the fake DeviceMemory hands out and
// tracks, so the tests can check that the CPU transport only ever sees host
// staging buffers and that each fused response crosses "the bus" once each way.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <set>
#include <vector>

#include "comm/comm.h"
#include "fake_backend.h"
#include "ops/host_backends.h"
#include "ops/operations.h"

namespace sdl {
namespace {

const Device kGpu{DeviceType::kCUDA, 1};

class FakeDeviceMemory : public DeviceMemory {
 public:
  DeviceType type() const override { return DeviceType::kCUDA; }
  Status Alloc(Device d, size_t bytes, void** p) override {
    EXPECT_EQ(d, kGpu);
    *p = std::malloc(bytes ? bytes : 1);
    live.insert(static_cast<char*>(*p));
    sizes[static_cast<char*>(*p)] = bytes;
    return Status::OK();
  }
  void Free(Device d, void* p) override {
    live.erase(static_cast<char*>(p));
    std::free(p);
  }
  Status CopyToHost(Device d, void* host, const void* src, size_t bytes) override {
    EXPECT_TRUE(OnDevice(src));
    EXPECT_FALSE(OnDevice(host));
    ++to_host;
    std::memcpy(host, src, bytes);
    return Status::OK();
  }
  Status CopyFromHost(Device d, void* dst, const void* host, size_t bytes) override {
    EXPECT_TRUE(OnDevice(dst));
    EXPECT_FALSE(OnDevice(host));
    ++from_host;
    std::memcpy(dst, host, bytes);
    return Status::OK();
  }
  Status BatchedCopy(Device d, const CopyEntry* e, int n, DataType dt, const Scaling& s) override {
    ++batches;
    for (int i = 0; i < n; ++i) {
      EXPECT_TRUE(!e[i].src || OnDevice(e[i].src));
      EXPECT_TRUE(OnDevice(e[i].dst));
    }
    return host_.BatchedCopy(Device{}, e, n, dt, s);
  }
  // A mark is the stream's "clock" (how much work it had queued) when it was made.
  struct Mark : ReadyMark {
    uintptr_t stream = 0;
    int clock = 0;
  };
  Status MarkReady(Device d, uintptr_t stream, std::shared_ptr<const ReadyMark>* out) override {
    auto m = std::make_shared<Mark>();
    m->stream = stream;
    m->clock = clock[stream];
    *out = m;
    return Status::OK();
  }
  Status WaitForStream(Device d, uintptr_t stream, const ReadyMark* mark) override {
    waited.push_back(stream);
    if (mark) {
      EXPECT_EQ(static_cast<const Mark*>(mark)->stream, stream);
    }
    // Without a mark: what the stream has queued now.
    waited_clock.push_back(mark ? static_cast<const Mark*>(mark)->clock : clock[stream]);
    return Status::OK();
  }
  Status SignalStream(Device d, uintptr_t stream) override {
    signalled.push_back(stream);
    return Status::OK();
  }
  // True when p lies in memory this fake device handed out.
  bool OnDevice(const void* p) const {
    const char* c = static_cast<const char*>(p);
    for (char* base : live)
      if (c >= base && c < base + std::max<size_t>(sizes.at(base), 1)) return true;
    return false;
  }
  template <typename T> T* New(std::vector<T> values) {
    void* p = nullptr;
    Alloc(kGpu, values.size() * sizeof(T), &p);
    std::memcpy(p, values.data(), values.size() * sizeof(T));
    return static_cast<T*>(p);
  }

  std::set<char*> live;
  std::map<char*, size_t> sizes;
  int to_host = 0, from_host = 0, batches = 0;
  std::vector<uintptr_t> waited, signalled;
  std::map<uintptr_t, int> clock;  // per framework stream: work queued so far
  std::vector<int> waited_clock;   // per wait: the clock waited for

 private:
  HostMemory host_;
};

// Rank 0 of two whose peer (a "twin") always contributes what rank 0 does:
// Sum doubles, Allgather repeats. Records that it only ever sees host memory.
class TwinComm : public Comm {
 public:
  explicit TwinComm(const FakeDeviceMemory* dev) : dev_(dev) {}
  int rank() const override { return 0; }
  int size() const override { return 2; }
  const char* kind() const override { return "twin"; }
  void Allreduce(void* buf, size_t count, DataType dt, ReduceOp op) override {
    Check(buf);
    ++calls;
    EXPECT_TRUE(op == ReduceOp::kSum) << "Average reaches a transport as Sum";
    if (dt == DataType::kFloat32)
      for (size_t i = 0; i < count; ++i) static_cast<float*>(buf)[i] *= 2;
    if (dt == DataType::kInt32)
      for (size_t i = 0; i < count; ++i) static_cast<int32_t*>(buf)[i] *= 2;
  }
  void Allgatherv(const void* in, void* out, const std::vector<size_t>& bytes) override {
    Check(in);
    Check(out);
    ++calls;
    std::memcpy(out, in, bytes[0]);
    std::memcpy(static_cast<char*>(out) + bytes[0], in, bytes[1]);
  }
  void Broadcast(void* buf, size_t, int) override {
    Check(buf);
    ++calls;
  }
  void Alltoallv(const void*, void*, const std::vector<size_t>&) override { ++calls; }
  void Barrier() override {}
  int calls = 0;

 private:
  void Check(const void* p) { EXPECT_FALSE(dev_ && dev_->OnDevice(p)) << "transport saw device memory"; }
  const FakeDeviceMemory* dev_;
};

// A backend that serves one device type while `usable` says so, and counts calls.
class FakeBackend : public NoOpBackend {
 public:
  const char* key() const override { return "fake"; }
  FakeBackend(const char* name, DeviceType type, const bool* usable)
      : name_(name), type_(type), usable_(usable) {}
  const char* name() const override { return name_; }
  bool Enabled(const Response& r, Device d) const override { return *usable_ && d.type == type_; }
  Status Allreduce(const OpContext&, const void*, void*, size_t, DataType, ReduceOp) override {
    ++calls;
    return Status::OK();
  }
  int calls = 0;

 private:
  const char* name_;
  DeviceType type_;
  const bool* usable_;
};

Response AllreduceResponse(std::vector<std::string> names, std::vector<std::vector<int64_t>> shapes,
                           DeviceType dev, DataType dt = DataType::kFloat32) {
  Response r;
  r.op = OpType::kAllreduce;
  r.dtype = dt;
  r.device = dev;
  r.names = std::move(names);
  r.shapes = std::move(shapes);
  return r;
}

Entry MakeEntry(const std::string& name, std::vector<int64_t> shape, Device d, const void* in,
                void* out, uintptr_t stream = 0, DataType dt = DataType::kFloat32) {
  Entry e;
  e.req.name = name;
  e.req.shape = std::move(shape);
  e.req.device = d;
  e.req.dtype = dt;
  e.in = in;
  e.out = out;
  e.stream = stream;
  return e;
}

TEST(BackendChoice, FixedPriorityOrderWhateverTheRegistrationOrder) {
  Operations ops;
  bool usable = true;
  ops.AddDeviceMemory(std::make_unique<FakeDeviceMemory>());
  ops.AddBackend(kPriorityDevice, std::make_unique<FakeBackend>("fake nccl", DeviceType::kCUDA, &usable));
  EXPECT_EQ(ops.BackendNames(),
            (std::vector<std::string>{"fake nccl", "host-staged transport", "host transport"}));
  Response cuda = AllreduceResponse({"w"}, {{4}}, DeviceType::kCUDA);
  Response cpu = AllreduceResponse({"w"}, {{4}}, DeviceType::kCPU);
  EXPECT_STREQ(ops.Choose(cuda, kGpu)->name(), "fake nccl");
  EXPECT_STREQ(ops.Choose(cpu, Device{})->name(), "host transport");
  EXPECT_STREQ(ops.Choose(cpu, Device{DeviceType::kCUDAHost, 0})->name(), "host transport");
  usable = false;  // e.g. NCCL built but no usable GPU: CUDA tensors fall back to staging
  EXPECT_STREQ(ops.Choose(cuda, kGpu)->name(), "host-staged transport");
}

TEST(BackendChoice, EqualPrioritiesKeepRegistrationOrder) {
  Operations ops;
  bool yes = true;
  ops.AddBackend(kPriorityDevice, std::make_unique<FakeBackend>("first", DeviceType::kCUDA, &yes));
  ops.AddBackend(kPriorityDevice, std::make_unique<FakeBackend>("second", DeviceType::kCUDA, &yes));
  EXPECT_STREQ(ops.Choose(AllreduceResponse({"w"}, {{1}}, DeviceType::kCUDA), kGpu)->name(), "first");
}

TEST(BackendChoice, CudaTensorWithoutBackendIsRefusedAtEnqueue) {
  Operations ops;
  Request req;
  req.op = OpType::kAllgather;
  req.name = "emb";
  req.shape = {2};
  req.device = kGpu;
  try {
    ops.CheckServable(req);
    FAIL() << "a CUDA tensor with no CUDA backend was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code, ErrorCode::kInvalidArgument);
    std::string msg = e.what();
    EXPECT_NE(msg.find("allgather of 'emb' is a cuda:1 tensor"), std::string::npos) << msg;
    EXPECT_NE(msg.find("no backend"), std::string::npos) << msg;
    EXPECT_NE(msg.find("host transport"), std::string::npos) << msg;
  }
  req.device = Device{};
  EXPECT_NO_THROW(ops.CheckServable(req));
  req.device = kGpu;
  req.op = OpType::kBarrier;  // no tensor: any backend question is moot
  EXPECT_NO_THROW(ops.CheckServable(req));
  ops.AddDeviceMemory(std::make_unique<FakeDeviceMemory>());
  req.op = OpType::kAllgather;
  EXPECT_NO_THROW(ops.CheckServable(req));  // host staging serves it now
}

TEST(BackendChoice, DeviceBackendRunsCudaResponses) {
  Operations ops;
  bool yes = true;
  auto fake = std::make_unique<FakeBackend>("fake nccl", DeviceType::kCUDA, &yes);
  FakeBackend* nccl = fake.get();
  ops.AddBackend(kPriorityDevice, std::move(fake));
  auto mem = std::make_unique<FakeDeviceMemory>();
  FakeDeviceMemory* dev = mem.get();
  ops.AddDeviceMemory(std::move(mem));
  ProcessSet ps(0, {0, 1}, 0, 4);
  ps.comm = std::make_unique<TwinComm>(dev);
  float* x = dev->New<float>({1, 2});
  Entry e = MakeEntry("w", {2}, kGpu, x, x);
  ASSERT_TRUE(ops.Allreduce(ps, AllreduceResponse({"w"}, {{2}}, DeviceType::kCUDA), {&e}).ok());
  EXPECT_EQ(nccl->calls, 1);
  EXPECT_EQ(static_cast<TwinComm&>(*ps.comm).calls, 0);
  EXPECT_EQ(dev->to_host, 0);
  // counters() shows which backend ran it (what tests/gpu checks NCCL by).
  std::map<std::string, int64_t> counts = ops.Counters();
  EXPECT_EQ(counts["backend.fake"], 1);
  EXPECT_EQ(counts.count("backend.host"), 0u);
  dev->Free(kGpu, x);
}

class Staging : public ::testing::Test {
 protected:
  void SetUp() override {
    auto mem = std::make_unique<FakeDeviceMemory>();
    dev = mem.get();
    ops.AddDeviceMemory(std::move(mem));
    ps.comm = std::make_unique<TwinComm>(dev);
  }
  TwinComm& comm() { return static_cast<TwinComm&>(*ps.comm); }

  Operations ops;
  FakeDeviceMemory* dev = nullptr;
  ProcessSet ps{0, {0, 1}, 0, 4};
};

TEST_F(Staging, FusedAllreducePacksOnDeviceAndCrossesOnceEachWay) {
  float* a = dev->New<float>({1, 2, 3});
  float* b = dev->New<float>({10});
  float* c_in = dev->New<float>({-1, 4});
  float* c_out = dev->New<float>({0, 0});
  Entry ea = MakeEntry("a", {3}, kGpu, a, a, 7);
  Entry eb = MakeEntry("b", {1}, kGpu, b, b, 9);
  Entry ec = MakeEntry("c", {2}, kGpu, c_in, c_out, 7);
  Response r = AllreduceResponse({"a", "b", "c"}, {{3}, {1}, {2}}, DeviceType::kCUDA);
  r.reduce = ReduceOp::kAverage;
  r.prescale = 3.0;
  r.postscale = 0.5;
  ASSERT_TRUE(ops.Allreduce(ps, r, {&ea, &eb, &ec}).ok());
  // average over 2 identical ranks of x*3, then * 0.5 -> 1.5 x
  EXPECT_EQ(std::vector<float>(a, a + 3), (std::vector<float>{1.5f, 3, 4.5f}));
  EXPECT_EQ(b[0], 15.0f);
  EXPECT_EQ(std::vector<float>(c_out, c_out + 2), (std::vector<float>{-1.5f, 6}));
  EXPECT_EQ(std::vector<float>(c_in, c_in + 2), (std::vector<float>{-1, 4})) << "input changed";
  EXPECT_EQ(dev->batches, 2);    // one pack, one unpack
  EXPECT_EQ(dev->to_host, 1);    // the fused buffer, once each way
  EXPECT_EQ(dev->from_host, 1);
  EXPECT_EQ(comm().calls, 1);
  EXPECT_EQ(dev->waited, (std::vector<uintptr_t>{7, 9}));  // each producer stream once
  EXPECT_EQ(dev->signalled, (std::vector<uintptr_t>{7, 9}));
  auto keys = ops.FusionKeys();
  ASSERT_EQ(keys.size(), 1u);
  EXPECT_EQ(std::get<0>(keys[0]), kGpu);
  EXPECT_EQ(std::get<1>(keys[0]), DataType::kFloat32);
  EXPECT_EQ(std::get<2>(keys[0]), 0);
  for (float* p : {a, b, c_in, c_out}) dev->Free(kGpu, p);
}

// The core waits for what each framework stream had queued when the tensor
// was enqueued (its mark), once per stream, for the entry enqueued last there;
// the marks are dropped once waited for, so their events can be reused.
TEST_F(Staging, InputsWaitForTheLastMarkOfEachStreamAndDropTheMarks) {
  float* x = dev->New<float>({1, 2, 3, 4});
  std::vector<Entry> es;
  const uintptr_t streams[] = {7, 9, 7, 7};
  for (int i = 0; i < 4; ++i) {
    es.push_back(MakeEntry("t" + std::to_string(i), {1}, kGpu, x + i, x + i, streams[i]));
    es.back().seq = 10 + i;
    dev->clock[streams[i]] += 1;  // the tensor's producer
    ASSERT_TRUE(ops.MarkReady(kGpu, streams[i], &es.back().ready).ok());
  }
  ASSERT_NE(es[0].ready, nullptr);
  dev->clock[7] += 5;  // the framework queues more before the collective runs
  dev->clock[9] += 5;
  // Listed out of enqueue order: the last mark on 7 is t3's (clock 3), on 9 t1's (1).
  Response r = AllreduceResponse({"t2", "t3", "t0", "t1"}, {{1}, {1}, {1}, {1}},
                                 DeviceType::kCUDA);
  ASSERT_TRUE(ops.Allreduce(ps, r, {&es[2], &es[3], &es[0], &es[1]}).ok());
  EXPECT_EQ(dev->waited, (std::vector<uintptr_t>{7, 9}));
  EXPECT_EQ(dev->waited_clock, (std::vector<int>{3, 1}));
  for (const Entry& e : es) EXPECT_EQ(e.ready, nullptr) << e.req.name;
  std::shared_ptr<const ReadyMark> host;
  ASSERT_TRUE(ops.MarkReady(Device{}, 7, &host).ok());
  EXPECT_EQ(host, nullptr) << "host tensors have nothing to wait for";
  dev->Free(kGpu, x);
}

TEST_F(Staging, AMemoryIsNeverReplaced) {
  EXPECT_THROW(ops.AddDeviceMemory(std::make_unique<FakeDeviceMemory>()), Error);
}

TEST_F(Staging, FusionBuffersAreKeptPerDeviceDtypeAndSetAndFreedWithTheSet) {
  float* f = dev->New<float>({1, 2});
  Entry e1 = MakeEntry("x", {1}, kGpu, f, f), e2 = MakeEntry("y", {1}, kGpu, f + 1, f + 1);
  ASSERT_TRUE(ops.Allreduce(ps, AllreduceResponse({"x", "y"}, {{1}, {1}}, DeviceType::kCUDA),
                            {&e1, &e2}).ok());
  std::vector<float> host = {1, 2};
  Entry h1 = MakeEntry("x", {1}, Device{}, &host[0], &host[0]);
  Entry h2 = MakeEntry("y", {1}, Device{}, &host[1], &host[1]);
  ASSERT_TRUE(ops.Allreduce(ps, AllreduceResponse({"x", "y"}, {{1}, {1}}, DeviceType::kCPU),
                            {&h1, &h2}).ok());
  EXPECT_EQ(host, (std::vector<float>{2, 4}));
  EXPECT_EQ(ops.FusionKeys().size(), 2u);
  const size_t before = dev->live.size();
  ops.ReleaseSet(0);
  EXPECT_TRUE(ops.FusionKeys().empty());
  EXPECT_EQ(dev->live.size(), before - 1);  // the device fusion buffer went back
  dev->Free(kGpu, f);
}

TEST_F(Staging, JoinedRankContributesZerosOnTheDevice) {
  float* x = dev->New<float>({5});
  Entry e = MakeEntry("x", {1}, kGpu, x, x);
  // "j" was never enqueued here (this rank joined): zeros go in, nothing comes out.
  Response r = AllreduceResponse({"j", "x"}, {{3}, {1}}, DeviceType::kCUDA);
  ASSERT_TRUE(ops.Allreduce(ps, r, {nullptr, &e}).ok());
  EXPECT_EQ(x[0], 10.0f);
  dev->Free(kGpu, x);
}

TEST_F(Staging, IntegerAverageDividesExactly) {
  int32_t* x = dev->New<int32_t>({7, -7, 3});
  Entry e = MakeEntry("i", {3}, kGpu, x, x, 0, DataType::kInt32);
  Response r = AllreduceResponse({"i"}, {{3}}, DeviceType::kCUDA, DataType::kInt32);
  r.reduce = ReduceOp::kAverage;
  ASSERT_TRUE(ops.Allreduce(ps, r, {&e}).ok());
  EXPECT_EQ(std::vector<int32_t>(x, x + 3), (std::vector<int32_t>{7, -7, 3}));
  dev->Free(kGpu, x);
}

// The divisor is the rank count, which need not fit a narrow element type.
TEST(HostScaling, IntegerDivisorWiderThanTheElementType) {
  Scaling s;
  s.divisor = 256;
  uint8_t u[2] = {255, 0};
  ApplyScaling(u, 2, DataType::kUInt8, s);  // was a division by (uint8_t)256 == 0
  EXPECT_EQ(u[0], 0);
  s.divisor = 128;
  int8_t i[3] = {-128, 127, -127};
  ApplyScaling(i, 3, DataType::kInt8, s);  // (int8_t)128 == -128 flipped the sign
  EXPECT_EQ(i[0], -1);
  EXPECT_EQ(i[1], 0);
  EXPECT_EQ(i[2], 0);
  s.divisor = 3;
  int64_t w[2] = {-7, 7};
  ApplyScaling(w, 2, DataType::kInt64, s);
  EXPECT_EQ(w[0], -2);
  EXPECT_EQ(w[1], 2);
}

TEST_F(Staging, AllgatherOutputLivesOnTheDevice) {
  float* x = dev->New<float>({1, 2, 3, 4});
  Entry e = MakeEntry("g", {2, 2}, kGpu, x, nullptr);
  Response r = AllreduceResponse({"g"}, {{2, 2}}, DeviceType::kCUDA);
  r.op = OpType::kAllgather;
  r.first_dims = {2, 2};
  Result res;
  ASSERT_TRUE(ops.Allgather(ps, r, e, &res).ok());
  ASSERT_EQ(res.outputs.size(), 1u);
  const Buffer& out = *res.outputs[0];
  EXPECT_EQ(out.device, kGpu);
  EXPECT_EQ(out.shape, (std::vector<int64_t>{4, 2}));
  EXPECT_TRUE(dev->OnDevice(out.data.get()));
  const float* o = reinterpret_cast<const float*>(out.data.get());
  EXPECT_EQ(std::vector<float>(o, o + 8), (std::vector<float>{1, 2, 3, 4, 1, 2, 3, 4}));
  const size_t live = dev->live.size();
  res.outputs.clear();  // the caller dropped the tensor: device memory goes back
  EXPECT_EQ(dev->live.size(), live - 1);
  dev->Free(kGpu, x);
}

TEST_F(Staging, BroadcastRootCopiesItsInputToItsOutput) {
  float* in = dev->New<float>({3, 4});
  float* out = dev->New<float>({0, 0});
  Entry e = MakeEntry("b", {2}, kGpu, in, out);
  Response r = AllreduceResponse({"b"}, {{2}}, DeviceType::kCUDA);
  r.op = OpType::kBroadcast;
  r.root = 0;
  ASSERT_TRUE(ops.Broadcast(ps, r, e).ok());
  EXPECT_EQ(std::vector<float>(out, out + 2), (std::vector<float>{3, 4}));
  EXPECT_EQ(comm().calls, 1);
  dev->Free(kGpu, in);
  dev->Free(kGpu, out);
}

TEST_F(Staging, ReducescatterScalesACopyAndKeepsTheInput) {
  float* x = dev->New<float>({1, 2, 3, 4, 5, 6});
  Entry e = MakeEntry("rs", {3, 2}, kGpu, x, nullptr);
  Response r = AllreduceResponse({"rs"}, {{3, 2}}, DeviceType::kCUDA);
  r.op = OpType::kReducescatter;
  r.prescale = 10;
  Result res;
  ASSERT_TRUE(ops.Reducescatter(ps, r, e, &res).ok());
  const Buffer& out = *res.outputs[0];
  EXPECT_EQ(out.shape, (std::vector<int64_t>{2, 2}));  // rank 0 of 2 gets rows 0-1 of 3
  const float* o = reinterpret_cast<const float*>(out.data.get());
  EXPECT_EQ(std::vector<float>(o, o + 4), (std::vector<float>{20, 40, 60, 80}));
  EXPECT_EQ(std::vector<float>(x, x + 6), (std::vector<float>{1, 2, 3, 4, 5, 6}));
  dev->Free(kGpu, x);
}

TEST(DeviceOutputs, OutliveTheOperationsLayer) {
  std::shared_ptr<Buffer> kept;
  FakeDeviceMemory* dev = nullptr;
  {
    Operations ops;
    auto mem = std::make_unique<FakeDeviceMemory>();
    dev = mem.get();
    ops.AddDeviceMemory(std::move(mem));
    ProcessSet ps(0, {0, 1}, 0, 4);
    ps.comm = std::make_unique<TwinComm>(dev);
    float* x = dev->New<float>({1, 2});
    Entry e = MakeEntry("g", {2}, kGpu, x, nullptr);
    Response r = AllreduceResponse({"g"}, {{2}}, DeviceType::kCUDA);
    r.op = OpType::kAllgather;
    r.first_dims = {2, 2};
    Result res;
    ASSERT_TRUE(ops.Allgather(ps, r, e, &res).ok());
    kept = res.outputs[0];
    dev->Free(kGpu, x);
  }
  // The runtime (and its operations layer) is gone; the caller still holds the tensor.
  EXPECT_EQ(dev->live.size(), 1u);
  const float* o = reinterpret_cast<const float*>(kept->data.get());
  EXPECT_EQ(std::vector<float>(o, o + 4), (std::vector<float>{1, 2, 1, 2}));
  kept.reset();  // frees through the device memory, which it kept alive until now
}

TEST(HostPath, HostTensorsNeverTouchDeviceMemory) {
  Operations ops;
  auto mem = std::make_unique<FakeDeviceMemory>();
  FakeDeviceMemory* dev = mem.get();
  ops.AddDeviceMemory(std::move(mem));
  ProcessSet ps(0, {0, 1}, 0, 4);
  ps.comm = std::make_unique<TwinComm>(dev);
  std::vector<float> x = {1, 2}, y = {3};
  Entry ex = MakeEntry("x", {2}, Device{}, x.data(), x.data());
  Entry ey = MakeEntry("y", {1}, Device{}, y.data(), y.data());
  Response r = AllreduceResponse({"x", "y"}, {{2}, {1}}, DeviceType::kCPU);
  r.postscale = 0.25;
  ASSERT_TRUE(ops.Allreduce(ps, r, {&ex, &ey}).ok());
  EXPECT_EQ(x, (std::vector<float>{0.5f, 1}));
  EXPECT_EQ(y, (std::vector<float>{1.5f}));
  EXPECT_EQ(dev->batches + dev->to_host + dev->from_host, 0);
  EXPECT_TRUE(dev->waited.empty());
}

}  // namespace
}  // namespace sdl
