// GlooComm::AgreeBits (the negotiation cycle's AND, with each call's receives
// posted when the previous call ends): members as threads of one process, on
// the direct schedule (2, 3 members) and recursive doubling with and without a
// fold (4, 5, 6, 8), interleaved with other collectives on the same
// communicator, against the AND computed here.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "run_ranks.h"

namespace sdl {
namespace {

// Member r's word w in call c: every bit set except one that depends on
// (r, w, c), so the AND clears one bit per member.
uint64_t Word(int r, size_t w, int c) { return ~(uint64_t{1} << ((r * 7 + w * 3 + c) % 64)); }

class GlooAgree : public ::testing::TestWithParam<int> {};

TEST_P(GlooAgree, AndOfEveryMemberOnEveryCall) {
  const int n = GetParam();
  constexpr size_t kWords = 3;
  constexpr int kCalls = 12;
  RunGlooMembers(n, [&](int r, GlooComm& comm) {
    for (int c = 0; c < kCalls; ++c) {
      std::vector<uint64_t> bits(kWords);
      for (size_t w = 0; w < kWords; ++w) bits[w] = Word(r, w, c);
      comm.AgreeBits(bits.data(), kWords);
      for (size_t w = 0; w < kWords; ++w) {
        uint64_t want = ~uint64_t{0};
        for (int q = 0; q < n; ++q) want &= Word(q, w, c);
        EXPECT_EQ(bits[w], want) << "member " << r << " call " << c << " word " << w;
      }
      // Other traffic between cycles (as collectives run between them) must
      // not meet the receives already posted for the next call.
      if (c % 3 == 1) {
        std::vector<float> x(64, 1.0f);
        comm.Allreduce(x.data(), x.size(), DataType::kFloat32, ReduceOp::kSum);
        EXPECT_EQ(x[63], static_cast<float>(n));
        comm.Barrier();
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Members, GlooAgree, ::testing::Values(2, 3, 4, 5, 6, 8));

}  // namespace
}  // namespace sdl
