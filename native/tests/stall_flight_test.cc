// The stall inspector's decisions on the coordinator's table (warnings grouped
// and bounded, the stall shutdown, the divergence report) and the flight
// recorder's ring, without peers.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

#include "core/coordinator.h"
#include "core/flight_recorder.h"
#include "core/process_set.h"

namespace sdl {
namespace {

Request Allreduce(const std::string& name) {
  Request r;
  r.op = OpType::kAllreduce;
  r.name = name;
  r.shape = {4};
  return r;
}

// Makes every pending name look `s` seconds older.
void Age(ProcessSet& ps, double s) {
  for (auto& [name, p] : ps.coord.table) p.first_seen -= s;
}

TEST(StallInspector, OneWarningPerCheckGroupedByMissingRanksWithHosts) {
  ProcessSet ps(0, {0, 1, 2}, 0, 8);
  const std::vector<std::string> hosts = {"h0", "h1", "h2"};
  CoordinatorAdd(ps, 0, {Allreduce("a"), Allreduce("b"), Allreduce("c")}, false);
  CoordinatorAdd(ps, 1, {Allreduce("a"), Allreduce("b")}, false);
  StallOptions stall;
  stall.check_s = 5;
  stall.hosts = &hosts;
  std::vector<std::string> warnings;
  EXPECT_TRUE(CoordinatorReady(ps, 0, stall, 0, &warnings).empty());
  EXPECT_TRUE(warnings.empty());  // not yet waited 5 s
  Age(ps, 6);
  CoordinatorReady(ps, 0, stall, 0, &warnings);
  ASSERT_EQ(warnings.size(), 1u);
  const std::string& w = warnings[0];
  EXPECT_NE(w.find("3 tensors of process set 0"), std::string::npos) << w;
  EXPECT_NE(w.find("missing rank 2 (host h2): allreduce 'a' (submitted by ranks [0, 1]"),
            std::string::npos) << w;
  EXPECT_NE(w.find("allreduce 'b'"), std::string::npos) << w;
  EXPECT_NE(w.find("missing ranks [1, 2] (hosts h1, h2): allreduce 'c'"), std::string::npos) << w;
  // The next check period, not the next cycle, repeats it.
  CoordinatorReady(ps, 0, stall, 0, &warnings);
  EXPECT_EQ(warnings.size(), 1u);
}

TEST(StallInspector, WarningStaysBoundedForManyNames) {
  ProcessSet ps(0, {0, 1}, 0, 8);
  std::vector<Request> reqs;
  for (int i = 0; i < 500; ++i) reqs.push_back(Allreduce("grad." + std::to_string(i)));
  CoordinatorAdd(ps, 0, reqs, false);
  Age(ps, 10);
  StallOptions stall;
  stall.check_s = 1;
  std::vector<std::string> warnings;
  CoordinatorReady(ps, 0, stall, 0, &warnings);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_LT(warnings[0].size(), 1200u) << warnings[0];
  EXPECT_NE(warnings[0].find("and 492 more"), std::string::npos) << warnings[0];
}

TEST(StallInspector, ShutdownTimeGivesOnePeerFailureResponse) {
  ProcessSet ps(0, {0, 1}, 0, 8);
  const std::vector<std::string> hosts = {"h0", "h1"};
  CoordinatorAdd(ps, 0, {Allreduce("x")}, false);
  StallOptions stall;
  stall.check_s = 1;
  stall.shutdown_s = 3;
  stall.hosts = &hosts;
  std::vector<std::string> warnings;
  Age(ps, 2);
  EXPECT_TRUE(CoordinatorReady(ps, 0, stall, 0, &warnings).empty());
  Age(ps, 2);
  auto out = CoordinatorReady(ps, 0, stall, 0, &warnings);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].error_code, ErrorCode::kPeerFailure);
  EXPECT_NE(out[0].error.find("SDL_STALL_SHUTDOWN_TIME"), std::string::npos) << out[0].error;
  EXPECT_NE(out[0].error.find("missing rank 1 (host h1): allreduce 'x'"), std::string::npos)
      << out[0].error;
}

TEST(StallInspector, DivergenceNamesOldestWaitingNameAndMissingRanks) {
  ProcessSet ps(0, {0, 1, 2}, 0, 8);
  const std::vector<std::string> hosts = {"h0", "h1", "h2"};
  std::vector<std::string> warnings;
  CoordinatorReady(ps, 0, {}, 0, &warnings);  // sizes the joined table
  EXPECT_EQ(CoordinatorDivergence(ps, &hosts), "");
  CoordinatorAdd(ps, 0, {Allreduce("first"), Allreduce("second")}, false);
  CoordinatorAdd(ps, 2, {Allreduce("first")}, false);
  const std::string d = CoordinatorDivergence(ps, &hosts);
  EXPECT_NE(d.find("allreduce 'first' on process set 0, submitted by ranks [0, 2] (hosts h0, h2), "
                   "not by rank 1 (host h1)"),
            std::string::npos) << d;
  EXPECT_NE(d.find("1 later name wait"), std::string::npos) << d;
}

double Steady() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Runs one collective through the hooks as the runtime does: taken in (the
// id goes into the set's pending entry), negotiated and started, done.
void RunOne(FlightRecorder& fr, ProcessSet& ps, const std::string& name, bool cached,
            bool finish = true) {
  Entry e;
  e.req = Allreduce(name);
  e.flight_id = fr.Enqueued(ps.id, e.req, Steady());
  const uint64_t id = e.flight_id;
  ps.pending[name] = std::move(e);
  if (!finish) return;
  fr.CycleStarted();
  Response resp;
  resp.names = {name};
  fr.Started(ps, resp, cached);
  fr.Done(id, ErrorCode::kOk);
  ps.pending.erase(name);
}

TEST(FlightRecorder, RingKeepsLastNWithTimesInOrder) {
  FlightRecorder fr(4);
  ProcessSet ps(0, {0, 1}, 0, 8);
  for (int i = 0; i < 6; ++i) RunOne(fr, ps, "t" + std::to_string(i), i % 2 == 1);
  RunOne(fr, ps, "open", false, false);
  auto recs = fr.Snapshot();
  ASSERT_EQ(recs.size(), 4u);
  EXPECT_EQ(recs[0].name, "t3");
  EXPECT_EQ(recs[0].id, 4u);
  EXPECT_EQ(recs[3].name, "open");
  EXPECT_EQ(recs[3].done, 0);
  for (int i = 0; i < 3; ++i) {
    EXPECT_GT(recs[i].enqueued, 0);
    EXPECT_LE(recs[i].enqueued, recs[i].negotiated);
    EXPECT_LE(recs[i].negotiated, recs[i].started);
    EXPECT_LE(recs[i].started, recs[i].done);
  }
  EXPECT_TRUE(recs[0].from_cache);
  const std::string text = fr.Text(3, "h3", "test", 2);
  EXPECT_NE(text.find("flight recorder of rank 3 (host h3), test: last 2 of 4"), std::string::npos)
      << text;
  EXPECT_NE(text.find("allreduce 'open' set 0 float32 [4]: WAITING"), std::string::npos) << text;
  EXPECT_EQ(text.find("'t4'"), std::string::npos) << text;  // only the last 2: t5, open
  const std::string json = fr.Json(3, "h\"3", "why");
  EXPECT_NE(json.find("\"host\": \"h\\\"3\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"state\": \"waiting\""), std::string::npos) << json;
}

TEST(FlightRecorder, OffCostsNothingAndRecordsNothing) {
  FlightRecorder fr(0);
  ProcessSet ps(0, {0, 1}, 0, 8);
  RunOne(fr, ps, "x", false);
  EXPECT_TRUE(fr.Snapshot().empty());
}

TEST(FlightRecorder, RecordOverwrittenWhileOpenIsNotResurrected) {
  FlightRecorder fr(2);
  const uint64_t a = fr.Enqueued(0, Allreduce("a"), Steady());
  fr.Enqueued(0, Allreduce("b"), Steady());
  fr.Enqueued(0, Allreduce("c"), Steady());  // overwrites 'a' while it is open
  fr.Done(a, ErrorCode::kOk);
  auto recs = fr.Snapshot();
  ASSERT_EQ(recs.size(), 2u);
  EXPECT_EQ(recs[0].name, "b");
  EXPECT_EQ(recs[1].name, "c");
  EXPECT_EQ(recs[1].done, 0);
}

}  // namespace
}  // namespace sdl
