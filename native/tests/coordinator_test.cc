// Rank 0's half of negotiation without peers: validation and its error
// messages (device mismatch included), fusion determinism, and the response
// cache's invariants.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/coordinator.h"
#include "core/fusion.h"
#include "core/process_set.h"
#include "core/response_cache.h"

namespace sdl {
namespace {

Request Allreduce(const std::string& name, std::vector<int64_t> shape, Device d = Device{},
                  DataType dt = DataType::kFloat32) {
  Request r;
  r.op = OpType::kAllreduce;
  r.dtype = dt;
  r.name = name;
  r.shape = std::move(shape);
  r.device = d;
  return r;
}

// Feeds one request per member and returns what the coordinator decides.
std::vector<Response> Negotiate(ProcessSet& ps, const std::vector<Request>& per_member,
                                int64_t threshold = 0) {
  for (int m = 0; m < ps.size(); ++m) CoordinatorAdd(ps, m, {per_member[m]}, false);
  std::vector<std::string> warnings;
  return CoordinatorReady(ps, threshold, {}, 0, &warnings);
}

const Device kCuda0{DeviceType::kCUDA, 0}, kCuda1{DeviceType::kCUDA, 1};

TEST(Validation, MatchingRequestsGiveOneCacheableResponse) {
  ProcessSet ps(0, {0, 1, 2}, 0, 8);
  auto out = Negotiate(ps, {Allreduce("w", {2, 3}), Allreduce("w", {2, 3}), Allreduce("w", {2, 3})});
  ASSERT_EQ(out.size(), 1u);
  EXPECT_TRUE(out[0].error.empty()) << out[0].error;
  EXPECT_TRUE(out[0].cacheable);
  EXPECT_EQ(out[0].device, DeviceType::kCPU);
  EXPECT_TRUE(ps.coord.Empty());
}

TEST(Validation, NameWaitsForEveryMember) {
  ProcessSet ps(0, {0, 1}, 0, 8);
  CoordinatorAdd(ps, 0, {Allreduce("w", {4})}, false);
  std::vector<std::string> warnings;
  EXPECT_TRUE(CoordinatorReady(ps, 0, {}, 0, &warnings).empty());
  CoordinatorAdd(ps, 1, {Allreduce("w", {4})}, false);
  EXPECT_EQ(CoordinatorReady(ps, 0, {}, 0, &warnings).size(), 1u);
}

TEST(Validation, ShapeMismatchNamesTensorRanksAndShapes) {
  ProcessSet ps(0, {0, 1, 2}, 0, 8);
  auto out = Negotiate(ps, {Allreduce("w", {2, 3}), Allreduce("w", {3}), Allreduce("w", {2, 3})});
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].error_code, ErrorCode::kMismatch);
  EXPECT_EQ(out[0].error,
            "Mismatched allreduce shapes for tensor 'w': ranks [0, 2] have [2, 3]; rank 1 has [3]");
}

TEST(Validation, DtypeMismatch) {
  ProcessSet ps(0, {0, 1}, 0, 8);
  auto out = Negotiate(ps, {Allreduce("w", {2}), Allreduce("w", {2}, Device{}, DataType::kInt32)});
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].error,
            "Mismatched allreduce data types for tensor 'w': rank 0 has float32; rank 1 has int32");
}

TEST(Validation, DeviceMismatchNamesEveryRanksDevice) {
  // Global ranks 4, 5, 6 (a process set): messages name global ranks.
  ProcessSet ps(1, {4, 5, 6}, 0, 8);
  auto out = Negotiate(ps, {Allreduce("grad", {8}), Allreduce("grad", {8}, kCuda1),
                            Allreduce("grad", {8}, kCuda0)});
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].error_code, ErrorCode::kMismatch);
  EXPECT_EQ(out[0].error,
            "Mismatched allreduce devices for tensor 'grad': rank 4 has cpu; rank 6 has cuda:0; "
            "rank 5 has cuda:1");
}

TEST(Validation, DeviceCheckedBeforeDtype) {
  ProcessSet ps(0, {0, 1}, 0, 8);
  auto out = Negotiate(ps, {Allreduce("w", {2}, kCuda0),
                            Allreduce("w", {2}, Device{}, DataType::kInt32)});
  ASSERT_EQ(out.size(), 1u);
  EXPECT_NE(out[0].error.find("devices"), std::string::npos) << out[0].error;
}

TEST(Validation, GpuOrdinalsMayDifferAndPinnedHostIsHost) {
  ProcessSet ps(0, {0, 1}, 0, 8);
  auto out = Negotiate(ps, {Allreduce("w", {2}, kCuda0), Allreduce("w", {2}, kCuda1)});
  ASSERT_EQ(out.size(), 1u);
  EXPECT_TRUE(out[0].error.empty()) << out[0].error;
  EXPECT_EQ(out[0].device, DeviceType::kCUDA);
  out = Negotiate(ps, {Allreduce("h", {2}), Allreduce("h", {2}, Device{DeviceType::kCUDAHost, 0})});
  ASSERT_EQ(out.size(), 1u);
  EXPECT_TRUE(out[0].error.empty()) << out[0].error;
  EXPECT_EQ(out[0].device, DeviceType::kCPU);
}

TEST(Validation, BroadcastRootMismatchNamesGlobalRoots) {
  ProcessSet ps(0, {0, 1}, 0, 8);
  Request a = Allreduce("b", {2}), b = a;
  a.op = b.op = OpType::kBroadcast;
  b.root = 1;
  auto out = Negotiate(ps, {a, b});
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].error,
            "Mismatched broadcast root ranks for tensor 'b': rank 0 has root 0; rank 1 has root 1");
}

Response Ready(const std::string& name, int64_t elements, DeviceType dev = DeviceType::kCPU,
               DataType dt = DataType::kFloat32) {
  Response r;
  r.op = OpType::kAllreduce;
  r.dtype = dt;
  r.device = dev;
  r.names = {name};
  r.shapes = {{elements}};
  return r;
}

std::vector<std::vector<std::string>> Names(const std::vector<Response>& rs) {
  std::vector<std::vector<std::string>> out;
  for (const Response& r : rs) out.push_back(r.names);
  return out;
}

TEST(Fusion, SameInputsGiveSameLayoutAndOrder) {
  std::vector<Response> in;
  for (int i = 0; i < 40; ++i)
    in.push_back(Ready("t" + std::to_string(i), 1 + (i * 37) % 300,
                       i % 5 == 0 ? DeviceType::kCUDA : DeviceType::kCPU,
                       i % 7 == 0 ? DataType::kFloat64 : DataType::kFloat32));
  const int64_t threshold = 2048;
  auto a = FuseResponses(in, threshold);
  auto b = FuseResponses(in, threshold);
  EXPECT_EQ(Names(a), Names(b));
  EXPECT_LT(a.size(), in.size());
  // Every fused response holds one kind and fits the threshold (unless a single tensor
  // exceeds it); within one, tensors keep their first-ready order.
  size_t seen = 0;
  for (const Response& r : a) {
    seen += r.names.size();
    if (r.names.size() > 1) {
      EXPECT_LE(ResponseBytes(r), threshold);
    }
    for (size_t k = 1; k < r.names.size(); ++k)
      EXPECT_LT(std::stoi(r.names[k - 1].substr(1)), std::stoi(r.names[k].substr(1)));
    for (const std::string& n : r.names) {
      int i = std::stoi(n.substr(1));
      EXPECT_EQ(in[i].device, r.device) << n;
      EXPECT_EQ(in[i].dtype, r.dtype) << n;
    }
  }
  EXPECT_EQ(seen, in.size());
}

TEST(Fusion, DevicesAreNeverFusedTogether) {
  auto out = FuseResponses({Ready("a", 4), Ready("b", 4, DeviceType::kCUDA), Ready("c", 4),
                            Ready("d", 4, DeviceType::kCUDA)},
                           1 << 20);
  EXPECT_EQ(Names(out), (std::vector<std::vector<std::string>>{{"a", "c"}, {"b", "d"}}));
}

TEST(Fusion, ZeroThresholdDisablesFusion) {
  auto out = FuseResponses({Ready("a", 4), Ready("b", 4)}, 0);
  EXPECT_EQ(out.size(), 2u);
}

TEST(Fusion, CoordinatorFusesReadyNamesInArrivalOrder) {
  ProcessSet ps(0, {0, 1}, 0, 8);
  for (int m : {1, 0})
    CoordinatorAdd(ps, m, {Allreduce("x", {4}), Allreduce("y", {4}), Allreduce("z", {4}, kCuda0)},
                   false);
  std::vector<std::string> warnings;
  auto out = CoordinatorReady(ps, 1 << 20, {}, 0, &warnings);
  EXPECT_EQ(Names(out), (std::vector<std::vector<std::string>>{{"x", "y"}, {"z"}}));
}

TEST(Fusion, MergeGroupsJoinsMembersByGroupDtypeAndDevice) {
  auto member = [](const std::string& name, const std::string& group, int64_t n,
                   DataType dt = DataType::kFloat32, DeviceType dev = DeviceType::kCPU) {
    Response r = Ready(name, n, dev, dt);
    r.group = group;
    return r;
  };
  Response broadcast = Ready("bc", 3);
  broadcast.op = OpType::kBroadcast;
  broadcast.group = "g";  // only allreduce groups merge
  std::vector<Response> in = {member("g.0", "g", 1),
                              Ready("single", 2),
                              member("h.0", "h", 3),
                              member("g.1", "g", 4),
                              member("g.2", "g", 5, DataType::kFloat64),
                              member("g.3", "g", 6, DataType::kFloat32, DeviceType::kCUDA),
                              broadcast,
                              member("h.1", "h", 7),
                              member("g.4", "g", 8)};
  std::vector<Response> out = MergeGroups(in);
  EXPECT_EQ(Names(out), (std::vector<std::vector<std::string>>{
                            {"g.0", "g.1", "g.4"}, {"single"}, {"h.0", "h.1"}, {"g.2"}, {"g.3"},
                            {"bc"}}));
  EXPECT_EQ(out[0].shapes, (std::vector<std::vector<int64_t>>{{1}, {4}, {8}}));
  EXPECT_EQ(out[2].shapes, (std::vector<std::vector<int64_t>>{{3}, {7}}));
  EXPECT_EQ(out[3].dtype, DataType::kFloat64);
  EXPECT_EQ(out[4].device, DeviceType::kCUDA);
}

TEST(ResponseCache, MembersFedTheSameUpdatesHoldTheSameSlots) {
  // The invariant behind cache bits: equal update sequences give equal slots.
  ResponseCache a(4), b(4);
  std::vector<Request> reqs;
  for (int i = 0; i < 7; ++i) reqs.push_back(Allreduce("n" + std::to_string(i), {i + 1}));
  for (ResponseCache* c : {&a, &b}) {
    for (int i = 0; i < 5; ++i) c->Put(reqs[i], Ready(reqs[i].name, i + 1));
    c->Touch(c->Lookup(reqs[2]));
    for (int i = 5; i < 7; ++i) c->Put(reqs[i], Ready(reqs[i].name, i + 1));
  }
  for (const Request& r : reqs) EXPECT_EQ(a.Lookup(r), b.Lookup(r)) << r.name;
  // Capacity 4: LRU evicted n0 (5th put), then n1 and n3 (n2 was touched).
  EXPECT_EQ(a.Lookup(reqs[0]), -1);
  EXPECT_EQ(a.Lookup(reqs[1]), -1);
  EXPECT_EQ(a.Lookup(reqs[3]), -1);
  EXPECT_GE(a.Lookup(reqs[2]), 0);
  EXPECT_GE(a.Lookup(reqs[4]), 0);
  EXPECT_GE(a.Lookup(reqs[6]), 0);
}

TEST(ResponseCache, HitNeedsTheSameSignatureIncludingDevice) {
  ResponseCache c(4);
  Request r = Allreduce("w", {3}, kCuda0);
  c.Put(r, Ready("w", 3, DeviceType::kCUDA));
  int slot = c.Lookup(r);
  ASSERT_GE(slot, 0);
  EXPECT_EQ(c.response(slot).names, std::vector<std::string>{"w"});
  Request moved = r;
  moved.device = kCuda1;
  EXPECT_EQ(c.Lookup(moved), -1);
  Request reshaped = r;
  reshaped.shape = {4};
  EXPECT_EQ(c.Lookup(reshaped), -1);
  // Put under the same name replaces in place; Erase frees the slot.
  c.Put(moved, Ready("w", 3, DeviceType::kCUDA));
  EXPECT_EQ(c.Lookup(moved), slot);
  c.Erase("w");
  EXPECT_EQ(c.Lookup(moved), -1);
}

TEST(ResponseCache, ZeroCapacityCachesNothing) {
  ResponseCache c(0);
  Request r = Allreduce("w", {3});
  c.Put(r, Ready("w", 3));
  EXPECT_EQ(c.Lookup(r), -1);
}

}  // namespace
}  // namespace sdl
