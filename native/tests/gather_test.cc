// Comm::GatherBytes on the real transports (members as threads of one
// process): root gets every member's message in rank order, the others
// nothing; messages longer than a shared-memory staging half span rounds.
#include <gtest/gtest.h>

#include <gloo/rendezvous/hash_store.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/gloo_comm.h"
#include "comm/shm_comm.h"

namespace sdl {
namespace {

std::unique_ptr<Comm> MakeComm(const std::string& kind, const std::string& name, int rank, int n,
                               gloo::rendezvous::Store& store) {
  std::vector<int> ranks(n);
  for (int r = 0; r < n; ++r) ranks[r] = r;
  if (kind == "shm")  // 8 KiB slots: 4 KiB staging halves, so long messages take rounds
    return std::make_unique<ShmComm>(name, rank, n, ranks, 8192, 20, 20);
  return std::make_unique<GlooComm>(MakeGlooDevice("", "127.0.0.1"), store, rank, n, ranks, 20, 20);
}

// Member r's message in call k: its length varies per member and call (some empty).
std::string Message(int r, int k) {
  const size_t len = (r * 7919 + k * 104729) % 3 == 0 ? 0 : (r + 1) * (k * 2500 + 1);
  std::string s(len, '\0');
  for (size_t i = 0; i < len; ++i) s[i] = static_cast<char>('a' + (i + r + k) % 26);
  return s;
}

class Gather : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(Gather, RootGetsEveryMessageInRankOrder) {
  const std::string kind = std::get<0>(GetParam());
  const int n = std::get<1>(GetParam());
  auto store = std::make_shared<gloo::rendezvous::HashStore>();
  const std::string name = "/sdl-gather-test-" + std::to_string(::getpid()) + "-" + kind +
                           std::to_string(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      std::unique_ptr<Comm> comm = MakeComm(kind, name, r, n, *store);
      for (int k = 0; k < 6; ++k) {
        const int root = k % n;
        std::vector<std::string> got = comm->GatherBytes(Message(r, k), root);
        if (r != root) {
          EXPECT_TRUE(got.empty()) << "member " << r << " is not root but got messages";
          continue;
        }
        ASSERT_EQ(got.size(), static_cast<size_t>(n));
        for (int q = 0; q < n; ++q) EXPECT_EQ(got[q], Message(q, k)) << "member " << q << " call " << k;
      }
      // Still in step afterwards: an allgather sees the same on every member.
      std::vector<std::string> all = comm->AllgatherBytes(std::to_string(r));
      for (int q = 0; q < n; ++q) EXPECT_EQ(all[q], std::to_string(q));
    });
  }
  for (auto& t : threads) t.join();
}

INSTANTIATE_TEST_SUITE_P(Transports, Gather,
                         ::testing::Combine(::testing::Values("shm", "gloo"),
                                            ::testing::Values(2, 3, 5)));

}  // namespace
}  // namespace sdl
