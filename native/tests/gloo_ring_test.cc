// GlooComm::Allreduce on its ring path (members as threads of one process):
// blocks that move whole and blocks split into chunks, uneven blocks, and
// several calls in a row, against the exact sum (small integers in float32).
#include <gtest/gtest.h>

#include <tuple>
#include <vector>

#include "run_ranks.h"

namespace sdl {
namespace {

class GlooRing : public ::testing::TestWithParam<std::tuple<int, size_t>> {};

TEST_P(GlooRing, SumMatchesOnEveryMember) {
  const int n = std::get<0>(GetParam());
  const size_t count = std::get<1>(GetParam());
  RunGlooMembers(n, [&](int r, GlooComm& comm) {
    std::vector<float> buf(count);
    for (int call = 0; call < 2; ++call) {
      // Member r holds (i % 97) * (r + 1) + call: the sum is exact in float32.
      for (size_t i = 0; i < count; ++i) buf[i] = static_cast<float>((i % 97) * (r + 1) + call);
      comm.Allreduce(buf.data(), count, DataType::kFloat32, ReduceOp::kSum);
      size_t wrong = 0, first = count;
      for (size_t i = 0; i < count; ++i) {
        const float want = static_cast<float>((i % 97) * (n * (n + 1) / 2) + call * n);
        if (buf[i] != want && wrong++ == 0) first = i;
      }
      EXPECT_EQ(wrong, 0u) << "member " << r << " call " << call << ": first wrong element "
                           << first << " of " << count;
    }
  });
}

// Ring calls of changing sizes (blocks whole and chunked) with small
// allreduces (other algorithms) and a broadcast in between: each call's
// messages meet their receives, whatever came before.
class GlooRingSequence : public ::testing::TestWithParam<int> {};

TEST_P(GlooRingSequence, ChangingSizesAndOtherCollectivesBetween) {
  const int n = GetParam();
  const size_t counts[] = {819200, 40000, 2359299, 2359299, 100, 786437, 819200};
  RunGlooMembers(n, [&](int r, GlooComm& comm) {
    int call = 0;
    for (size_t count : counts) {
      std::vector<float> buf(count);
      for (size_t i = 0; i < count; ++i) buf[i] = static_cast<float>((i % 89) * (r + 1) + call);
      comm.Allreduce(buf.data(), count, DataType::kFloat32, ReduceOp::kSum);
      size_t wrong = 0;
      for (size_t i = 0; i < count; ++i)
        wrong += buf[i] != static_cast<float>((i % 89) * (n * (n + 1) / 2) + call * n);
      EXPECT_EQ(wrong, 0u) << "member " << r << " call " << call << " (" << count << " elements)";
      int32_t root_value = r == call % n ? 1000 + call : -1;
      comm.Broadcast(&root_value, sizeof root_value, call % n);
      EXPECT_EQ(root_value, 1000 + call) << "member " << r;
      ++call;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Members, GlooRingSequence, ::testing::Values(2, 3, 4));

// Members: 2-6 (from 4 on, the reduce-scatter reuses its two scratch regions).
// Element counts: just above the small-message paths; 3.2 MB and 3 MiB + 20
// bytes (uneven blocks of 1-1.6 MB, which move whole); 9 MiB + 12 bytes
// (blocks of 3-4.5 MiB, which move in chunks of about 1 MiB).
INSTANTIATE_TEST_SUITE_P(Sizes, GlooRing,
                         ::testing::Combine(::testing::Values(2, 3, 4, 6),
                                            ::testing::Values(size_t{40000}, size_t{819200},
                                                              size_t{786437}, size_t{2359299})));

}  // namespace
}  // namespace sdl
