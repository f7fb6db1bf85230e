// Hierarchical allreduce (ops/hierarchical.h) without a GPU: the orchestration
// the NCCL backend runs, with several members as threads, a fake device over
// host memory, shared-memory communicators standing in for the per-host NCCL
// communicator (IntraHost), and the production CommAcrossHosts over the whole
// set's communicator (shared memory, or Gloo TCP on the loopback). Results are checked against a
// plain sum/min/max/product over the members' inputs, on every member, for
// sizes that do not divide by the local size.
#include <gtest/gtest.h>

#include <gloo/rendezvous/hash_store.h>
#include <gloo/rendezvous/prefix_store.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include "comm/gloo_comm.h"
#include "comm/shm_comm.h"
#include "ops/hierarchical.h"

namespace sdl {
namespace {

const Device kGpu{DeviceType::kCUDA, 0};

// Host memory that plays a device: it remembers what it handed out, so the
// test can check which steps touch "device" memory and which host memory.
class FakeDevice : public DeviceMemory {
 public:
  DeviceType type() const override { return DeviceType::kCUDA; }
  Status Alloc(Device d, size_t bytes, void** p) override {
    *p = std::malloc(bytes ? bytes : 1);
    std::lock_guard<std::mutex> lk(mu_);
    live_[static_cast<char*>(*p)] = bytes ? bytes : 1;
    return Status::OK();
  }
  void Free(Device d, void* p) override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      live_.erase(static_cast<char*>(p));
    }
    std::free(p);
  }
  Status CopyToHost(Device d, void* host, const void* src, size_t bytes) override {
    EXPECT_TRUE(OnDevice(src));
    EXPECT_FALSE(OnDevice(host));
    ++to_host;
    if (bytes) std::memcpy(host, src, bytes);
    return Status::OK();
  }
  Status CopyFromHost(Device d, void* dst, const void* host, size_t bytes) override {
    EXPECT_TRUE(OnDevice(dst));
    EXPECT_FALSE(OnDevice(host));
    ++from_host;
    if (bytes) std::memcpy(dst, host, bytes);
    return Status::OK();
  }
  Status BatchedCopy(Device d, const CopyEntry* e, int n, DataType dt, const Scaling& s) override {
    return HostMemory().BatchedCopy(Device{}, e, n, dt, s);
  }
  Status StagingFence(Device d) override {
    ++fences;
    return Status::OK();
  }
  bool OnDevice(const void* p) const {
    std::lock_guard<std::mutex> lk(mu_);
    const char* c = static_cast<const char*>(p);
    for (auto& [base, size] : live_)
      if (c >= base && c < base + size) return true;
    return false;
  }
  std::atomic<int> to_host{0}, from_host{0}, fences{0};

 private:
  mutable std::mutex mu_;
  std::map<char*, size_t> live_;
};

// IntraHost over a shared-memory communicator among the members of one host,
// checking that it is handed device memory only (NCCL's contract).
class ShmIntraHost : public IntraHost {
 public:
  ShmIntraHost(Comm* comm, const FakeDevice* dev) : comm_(comm), dev_(dev) {}
  Status Reducescatter(const void* in, void* out, const std::vector<size_t>& counts, DataType dt,
                       ReduceOp op) override {
    EXPECT_TRUE(dev_->OnDevice(in));
    EXPECT_TRUE(dev_->OnDevice(out));
    comm_->Reducescatter(in, out, counts, dt, op);
    ++calls;
    return Status::OK();
  }
  Status Allgather(const void* in, void* out, const std::vector<size_t>& counts,
                   DataType dt) override {
    EXPECT_TRUE(dev_->OnDevice(in));
    EXPECT_TRUE(dev_->OnDevice(out));
    std::vector<size_t> bytes;
    for (size_t c : counts) bytes.push_back(c * DataTypeSize(dt));
    comm_->Allgatherv(in, out, bytes);
    ++calls;
    return Status::OK();
  }
  int calls = 0;

 private:
  Comm* comm_;
  const FakeDevice* dev_;
};

std::unique_ptr<Comm> Shm(const std::string& name, int rank, int size) {
  if (size == 1) return std::make_unique<SelfComm>();
  std::vector<int> ranks(size);
  for (int i = 0; i < size; ++i) ranks[i] = i;
  return std::make_unique<ShmComm>(name, rank, size, ranks, 1 << 16, 30.0, 30.0);
}

// The set's communicator over Gloo TCP on the loopback, as between hosts.
std::unique_ptr<Comm> Gloo(gloo::rendezvous::Store& store, const std::string& tag, int rank,
                           int size) {
  if (size == 1) return std::make_unique<SelfComm>();
  static std::shared_ptr<gloo::transport::Device> device = MakeGlooDevice("", "127.0.0.1");
  gloo::rendezvous::PrefixStore prefixed(tag, store);
  std::vector<int> ranks(size);
  for (int i = 0; i < size; ++i) ranks[i] = i;
  return std::make_unique<GlooComm>(device, prefixed, rank, size, ranks, 30.0, 30.0);
}

std::string UniqueName(const std::string& tag) {
  static std::atomic<int> n{0};
  return "/sdl_hier_test_" + std::to_string(getpid()) + "_" + tag + "_" + std::to_string(n++);
}

// Member m's input element i, chosen so every op's exact result is small and
// representable in every tested type (Product: factors in {-1, 1, 2}).
double Input(ReduceOp op, int m, size_t i) {
  if (op == ReduceOp::kProduct) {
    const int k = static_cast<int>((m + i) % 3);
    return k == 0 ? 2 : (k == 1 ? 1 : -1);
  }
  return static_cast<double>(static_cast<int>((m * 13 + i * 7) % 23) - 11);
}

double Expected(ReduceOp op, int members, size_t i) {
  double acc = Input(op, 0, i);
  for (int m = 1; m < members; ++m) {
    const double x = Input(op, m, i);
    switch (op) {
      case ReduceOp::kSum: acc += x; break;
      case ReduceOp::kProduct: acc *= x; break;
      case ReduceOp::kMin: acc = std::min(acc, x); break;
      case ReduceOp::kMax: acc = std::max(acc, x); break;
      default: ADD_FAILURE() << "untested op";
    }
  }
  return acc;
}

template <typename T>
void Fill(void* p, ReduceOp op, int m, size_t n) {
  for (size_t i = 0; i < n; ++i) static_cast<T*>(p)[i] = static_cast<T>(Input(op, m, i));
}

template <typename T>
double Get(const void* p, size_t i) {
  return static_cast<double>(static_cast<const T*>(p)[i]);
}

void FillAs(DataType dt, void* p, ReduceOp op, int m, size_t n) {
  switch (dt) {
    case DataType::kFloat32: return Fill<float>(p, op, m, n);
    case DataType::kFloat64: return Fill<double>(p, op, m, n);
    case DataType::kInt32: return Fill<int32_t>(p, op, m, n);
    case DataType::kInt64: return Fill<int64_t>(p, op, m, n);
    default: FAIL() << "untested dtype";
  }
}

double GetAs(DataType dt, const void* p, size_t i) {
  switch (dt) {
    case DataType::kFloat32: return Get<float>(p, i);
    case DataType::kFloat64: return Get<double>(p, i);
    case DataType::kInt32: return Get<int32_t>(p, i);
    case DataType::kInt64: return Get<int64_t>(p, i);
    default: return 0;
  }
}

struct Case {
  DataType dt;
  ReduceOp op;
  size_t count;
  bool in_place;
};

std::vector<Case> AllCases() {
  std::vector<Case> cases;
  for (DataType dt : {DataType::kFloat32, DataType::kFloat64, DataType::kInt32, DataType::kInt64})
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kProduct})
      for (size_t count : {size_t{0}, size_t{1}, size_t{3}, size_t{1001}})
        cases.push_back(Case{dt, op, count, count % 2 == 1});
  cases.push_back(Case{DataType::kFloat32, ReduceOp::kSum, 100003, false});
  return cases;
}

// Runs every case on members whose hosts are `hosts` (one thread each) and
// checks each member's result against the plain reduction; returns each
// member's device copy counters through *to_host.
void RunLayout(const std::vector<std::string>& hosts, int* to_host_per_member = nullptr,
               bool gloo_across = false) {
  const int n = static_cast<int>(hosts.size());
  std::vector<HostLayout> layouts(n);
  for (int m = 0; m < n; ++m) ASSERT_TRUE(MakeHostLayout(hosts, m, &layouts[m]));
  const std::string flat_name = UniqueName("flat");
  gloo::rendezvous::HashStore store;
  std::vector<std::string> local_names;
  for (int h = 0; h < layouts[0].hosts; ++h)
    local_names.push_back(UniqueName("h" + std::to_string(h)));
  const std::vector<Case> cases = AllCases();
  // results[case][member]: the output bytes, to compare members bit for bit.
  std::vector<std::vector<std::vector<char>>> results(cases.size(),
                                                      std::vector<std::vector<char>>(n));
  std::vector<int> to_host(n, 0);
  std::vector<std::thread> threads;
  for (int m = 0; m < n; ++m) {
    threads.emplace_back([&, m] {
      const HostLayout& L = layouts[m];
      std::unique_ptr<Comm> flat =
          gloo_across ? Gloo(store, flat_name, m, n) : Shm(flat_name, m, n);
      std::unique_ptr<Comm> local = Shm(local_names[L.host_index()], L.local_rank(), L.local_size);
      FakeDevice dev;
      ShmIntraHost intra(local.get(), &dev);
      CommAcrossHosts across(flat.get(), &L);
      {
        HierarchicalScratch scratch(&dev);
        for (size_t c = 0; c < cases.size(); ++c) {
          const Case& k = cases[c];
          const size_t bytes = k.count * DataTypeSize(k.dt);
          void *in = nullptr, *out = nullptr;
          dev.Alloc(kGpu, bytes, &in);
          if (k.in_place) out = in;
          else dev.Alloc(kGpu, bytes, &out);
          FillAs(k.dt, in, k.op, m, k.count);
          Status s = HierarchicalAllreduce(L, intra, across, dev, scratch, kGpu, in, out, k.count,
                                           k.dt, k.op);
          EXPECT_TRUE(s.ok()) << s.message;
          results[c][m].assign(static_cast<char*>(out), static_cast<char*>(out) + bytes);
          dev.Free(kGpu, in);
          if (!k.in_place) dev.Free(kGpu, out);
        }
      }
      to_host[m] = dev.to_host;
      EXPECT_EQ(dev.to_host.load(), dev.from_host.load());
    });
  }
  for (std::thread& t : threads) t.join();
  for (size_t c = 0; c < cases.size(); ++c) {
    const Case& k = cases[c];
    for (int m = 0; m < n; ++m) {
      ASSERT_EQ(results[c][m], results[c][0])
          << "member " << m << " differs from member 0 (dtype " << DataTypeName(k.dt)
          << ", op " << static_cast<int>(k.op) << ", count " << k.count << ")";
    }
    for (size_t i = 0; i < k.count; ++i) {
      ASSERT_EQ(GetAs(k.dt, results[c][0].data(), i), Expected(k.op, n, i))
          << "element " << i << " of " << k.count << " (dtype " << DataTypeName(k.dt) << ", op "
          << static_cast<int>(k.op) << ")";
    }
  }
  if (to_host_per_member)
    for (int m = 0; m < n; ++m) to_host_per_member[m] = to_host[m];
}

TEST(HostLayout, GroupsMembersByHostInOrderOfFirstAppearance) {
  HostLayout L;
  ASSERT_TRUE(MakeHostLayout({"a", "b", "b", "a"}, 2, &L));
  EXPECT_EQ(L.hosts, 2);
  EXPECT_EQ(L.local_size, 2);
  EXPECT_EQ(L.host, (std::vector<int>{0, 1, 1, 0}));
  EXPECT_EQ(L.local, (std::vector<int>{0, 0, 1, 1}));
  EXPECT_EQ(L.local_rank(), 1);
  EXPECT_EQ(L.host_index(), 1);
  // Local rank 1's group, in host order: member 3 (host a), then member 2 (host b).
  EXPECT_EQ(L.Group(1), (std::vector<int>{3, 2}));
}

TEST(HostLayout, UnequalHostsTakeTheFlatPath) {
  HostLayout L;
  EXPECT_FALSE(MakeHostLayout({"a", "a", "b"}, 0, &L));
  EXPECT_TRUE(MakeHostLayout({"a"}, 0, &L));
  EXPECT_EQ(L.hosts, 1);
  EXPECT_EQ(L.local_size, 1);
}

TEST(HostLayout, ShardsOfOddSizesCoverEveryElementOnce) {
  EXPECT_EQ(ShardCounts(7, 2), (std::vector<size_t>{4, 3}));
  EXPECT_EQ(ShardCounts(1, 3), (std::vector<size_t>{1, 0, 0}));
  EXPECT_EQ(ShardCounts(0, 2), (std::vector<size_t>{0, 0}));
  EXPECT_EQ(ShardCounts(9, 3), (std::vector<size_t>{3, 3, 3}));
}

TEST(HostIds, EveryMemberGetsItsHostsFirstMembersId) {
  const std::vector<std::string> hosts = {"a", "b", "b", "a", "c", "c"};
  const int n = static_cast<int>(hosts.size());
  const std::string name = UniqueName("ids");
  std::vector<std::string> got(n);
  std::vector<std::thread> threads;
  for (int m = 0; m < n; ++m) {
    threads.emplace_back([&, m] {
      HostLayout L;
      ASSERT_TRUE(MakeHostLayout(hosts, m, &L));
      std::unique_ptr<Comm> flat = Shm(name, m, n);
      // Only local rank 0 made an id (NCCL's ncclGetUniqueId); the others pass nothing.
      std::string id = L.local_rank() == 0 ? "id-of-member-" + std::to_string(m) : "";
      ExchangeHostIds(*flat, L, &id);
      got[m] = id;
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(got, (std::vector<std::string>{"id-of-member-0", "id-of-member-1", "id-of-member-1",
                                           "id-of-member-0", "id-of-member-4",
                                           "id-of-member-4"}));
}

// The brief's case: 2 hosts x 2 local ranks, the members of a host not next to
// each other in the set (so host order and set order differ within a group).
TEST(HierarchicalAllreduce, TwoHostsTimesTwoLocalRanksMatchThePlainReduction) {
  int to_host[4] = {0, 0, 0, 0};
  RunLayout({"hostA", "hostB", "hostB", "hostA"}, to_host);
  // One staging round trip per allreduce and member (the shard only).
  for (int m = 0; m < 4; ++m) EXPECT_EQ(to_host[m], static_cast<int>(AllCases().size()));
}

// The same with the set's communicator over Gloo, as between real hosts.
TEST(HierarchicalAllreduce, TwoHostsTimesTwoLocalRanksOverGloo) {
  RunLayout({"hostA", "hostA", "hostB", "hostB"}, nullptr, true);
}

TEST(HierarchicalAllreduce, ThreeHostsOfOneRankUseOnlyTheCrossHostStep) {
  RunLayout({"a", "b", "c"});
}

TEST(HierarchicalAllreduce, OneHostNeverStagesThroughHostMemory) {
  int to_host[3] = {1, 1, 1};
  RunLayout({"a", "a", "a"}, to_host);
  for (int m = 0; m < 3; ++m) EXPECT_EQ(to_host[m], 0);
}

// The 1-GPU check's shape: a set of one member on one host.
TEST(HierarchicalAllreduce, DegenerateOneRankHost) {
  int to_host[1] = {1};
  RunLayout({"a"}, to_host);
  EXPECT_EQ(to_host[0], 0);
}

}  // namespace
}  // namespace sdl
