// GlooComm's latency-bound allreduces over the peer links (members as threads
// of one process): one direct round on 2, 3 and 5 members, recursive doubling
// with and without a fold on 4, 6, 7 and 8; sizes from one element to the
// 64 KiB limit, in place and out of place, interleaved with the ring, a
// broadcast and the negotiation's AND on the same communicator. Every member
// must end with the same bits as every other (checked through an allgather)
// and with the exact sum of small integers. And a member that leaves while
// its partners wait for it fails them promptly instead of at the timeout.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "run_ranks.h"

namespace sdl {
namespace {

class GlooSmall : public ::testing::TestWithParam<int> {};

TEST_P(GlooSmall, EveryMemberHoldsTheSameExactSum) {
  const int n = GetParam();
  // Elements: 1, odd, and 16384 float32 = 64 KiB (the largest message of the
  // doubling path, and of the exchange on 2 members; on 3 and 5 members the
  // exchange ends at 64 KiB received, so the larger sizes there take the ring,
  // which runs in between anyway).
  const size_t counts[] = {1, 7, 1000, 5461, 16384, 3, 300000, 2};
  RunGlooMembers(n, [&](int r, GlooComm& comm) {
    int call = 0;
    for (size_t count : counts) {
      for (int out_of_place = 0; out_of_place < 2; ++out_of_place, ++call) {
        std::vector<float> in(count), out(count, -1.0f);
        for (size_t i = 0; i < count; ++i)
          in[i] = static_cast<float>((i % 13) * (r + 1) + call);
        if (out_of_place) {
          comm.AllreduceInto(in.data(), out.data(), count, DataType::kFloat32, ReduceOp::kSum);
        } else {
          comm.Allreduce(in.data(), count, DataType::kFloat32, ReduceOp::kSum);
          out = in;
        }
        size_t wrong = 0;
        for (size_t i = 0; i < count; ++i)
          wrong += out[i] != static_cast<float>((i % 13) * (n * (n + 1) / 2) + call * n);
        EXPECT_EQ(wrong, 0u) << "member " << r << " call " << call << " (" << count << ")";
        // Values whose sum rounds: every member must still hold the same bits.
        std::vector<float> odd(count);
        for (size_t i = 0; i < count; ++i) odd[i] = 0.1f * static_cast<float>(r + 1) + 1e-7f * i;
        comm.Allreduce(odd.data(), count, DataType::kFloat32, ReduceOp::kSum);
        const size_t bytes = std::min<size_t>(count, 64) * sizeof(float);
        std::vector<char> all(bytes * n);
        comm.Allgatherv(odd.data(), all.data(), std::vector<size_t>(n, bytes));
        for (int q = 1; q < n; ++q)
          EXPECT_EQ(std::memcmp(all.data(), all.data() + q * bytes, bytes), 0)
              << "members 0 and " << q << " differ after call " << call << " (" << count << ")";
        uint64_t bits[2] = {~(uint64_t{1} << r), ~uint64_t{0} << (call % 7)};
        comm.AgreeBits(bits, 2);
        uint64_t want0 = ~uint64_t{0};
        for (int q = 0; q < n; ++q) want0 &= ~(uint64_t{1} << q);
        EXPECT_EQ(bits[0], want0) << "member " << r;
        EXPECT_EQ(bits[1], ~uint64_t{0} << (call % 7)) << "member " << r;
        int32_t root_value = r == call % n ? 7000 + call : -1;
        comm.Broadcast(&root_value, sizeof root_value, call % n);
        EXPECT_EQ(root_value, 7000 + call) << "member " << r;
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Members, GlooSmall, ::testing::Values(2, 3, 4, 5, 6, 7, 8));

// Member n - 1 takes part in one small allreduce, then leaves (its
// communicator goes away, closing its links). The others' next small
// allreduce fails with a peer failure within a few seconds (the timeout is
// 60 s): a closed link ends the wait at once, and every member depends on
// the leaver directly or through a partner that failed.
class GlooSmallLeaver : public ::testing::TestWithParam<int> {};

TEST_P(GlooSmallLeaver, PartnersFailPromptly) {
  const int n = GetParam();
  auto store = std::make_shared<gloo::rendezvous::HashStore>();
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      std::vector<int> ranks(n);
      for (int q = 0; q < n; ++q) ranks[q] = q;
      auto comm = std::make_unique<GlooComm>(MakeGlooDevice("", "127.0.0.1"), *store, r, n,
                                             ranks, 60, 60);
      std::vector<float> x(100, 1.0f);
      comm->Allreduce(x.data(), x.size(), DataType::kFloat32, ReduceOp::kSum);
      EXPECT_EQ(x[99], static_cast<float>(n));
      if (r == n - 1) return;  // leaves: comm's destructor closes its links
      const auto start = std::chrono::steady_clock::now();
      bool failed = false;
      try {
        comm->Allreduce(x.data(), x.size(), DataType::kFloat32, ReduceOp::kSum);
      } catch (const Error& e) {
        failed = e.code == ErrorCode::kPeerFailure;
      }
      const double waited =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      EXPECT_TRUE(failed) << "member " << r << " did not fail with a peer failure";
      EXPECT_LT(waited, 10.0) << "member " << r << " waited for the leaver";
      // Leaving now closes this member's links too, which is how the failure
      // reaches members that depend on the leaver only through it.
    });
  }
  for (auto& t : threads) t.join();
}

INSTANTIATE_TEST_SUITE_P(Members, GlooSmallLeaver, ::testing::Values(2, 3, 4, 6));

}  // namespace
}  // namespace sdl
