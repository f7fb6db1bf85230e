// The timeline's writer without peers: every record pushed is either written
// or counted as dropped (never waited for), the file is one JSON array after
// every write, and records of a stopped session never reach the next file.
#include <gtest/gtest.h>

#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/message.h"
#include "core/timeline.h"

namespace sdl {
namespace {

std::string Slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

std::string TempPath(const char* tag) {
  return ::testing::TempDir() + "/sdl_timeline_" + tag + "_" + std::to_string(getpid()) + ".json";
}

size_t Count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// Pushes one negotiated, executed response per step from several threads.
void Produce(Timeline& tl, int threads, int steps) {
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t)
    ts.emplace_back([&tl, t, steps] {
      Response r;
      r.names = {"t" + std::to_string(t)};
      for (int s = 0; s < steps; ++s) {
        const double now = TimelineNow();
        tl.Tick(0, r.names[0], t, now);
        tl.Ready(0, r, now, now, false);
      }
    });
  for (auto& t : ts) t.join();
}

TEST(Timeline, EveryRecordIsWrittenOrCountedAndTheFileStaysAnArray) {
  const std::string path = TempPath("count");
  Timeline tl(4);  // tiny: most pushes find it full
  tl.Start(path, false);
  std::string first = Slurp(path);
  ASSERT_EQ(first.front(), '[');
  ASSERT_EQ(first.back(), ']');
  Produce(tl, 4, 2000);
  tl.Stop();
  const std::string text = Slurp(path);
  EXPECT_EQ(text.front(), '[');
  EXPECT_EQ(text.back(), ']');
  EXPECT_GT(tl.dropped(), 0);
  EXPECT_EQ(tl.written() + tl.dropped(), 4 * 2000 * 2);
  // Written ticks and spans are in the file; the stats name the total dropped.
  EXPECT_EQ(Count(text, "\"ph\":\"i\"") + Count(text, "\"name\":\"NEGOTIATE_ALLREDUCE\""),
            static_cast<size_t>(tl.written()));
  EXPECT_NE(text.find("\"dropped\":" + std::to_string(tl.dropped()) + ","), std::string::npos);
  unlink(path.c_str());
}

TEST(Timeline, NothingIsDroppedWhenTheQueueKeepsUp) {
  const std::string path = TempPath("keep");
  Timeline tl(1 << 16);
  tl.Start(path, true);
  Produce(tl, 2, 100);
  tl.Cycle(TimelineNow());
  tl.Stop();
  EXPECT_EQ(tl.dropped(), 0);
  EXPECT_EQ(tl.written(), 2 * 100 * 2 + 1);
  EXPECT_EQ(Count(Slurp(path), "CYCLE_START"), 1u);
  unlink(path.c_str());
}

TEST(Timeline, RecordsOfAStoppedSessionStayOutOfTheNext) {
  const std::string a = TempPath("a"), b = TempPath("b");
  Timeline tl(64);
  tl.Start(a, false);
  tl.Stop();
  tl.Tick(0, "stale", 1, TimelineNow());  // a producer that saw on() just before Stop
  tl.Start(b, false);
  tl.Tick(0, "fresh", 1, TimelineNow());
  tl.Stop();
  const std::string text = Slurp(b);
  EXPECT_EQ(text.find("stale"), std::string::npos);
  EXPECT_NE(text.find("fresh"), std::string::npos);
  unlink(a.c_str());
  unlink(b.c_str());
}

TEST(Timeline, AnUnwritablePathThrows) {
  Timeline tl(8);
  EXPECT_THROW(tl.Start("/nonexistent-dir/x.json", false), Error);
  EXPECT_FALSE(tl.on());
}

}  // namespace
}  // namespace sdl
