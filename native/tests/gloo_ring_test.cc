// GlooComm::Allreduce on its ring path (members as threads of one process):
// blocks that move whole and blocks split into chunks, uneven blocks, and
// several calls in a row, against the exact sum (small integers in float32).
#include <gtest/gtest.h>

#include <csignal>

#include <chrono>
#include <cstring>
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

// Out of place on the ring's path: out receives the sum, in keeps its values,
// and the bits are those of the in-place call.
class GlooRingInto : public ::testing::TestWithParam<std::tuple<int, size_t>> {};

TEST_P(GlooRingInto, MatchesInPlaceAndLeavesTheInputAlone) {
  const int n = std::get<0>(GetParam());
  const size_t count = std::get<1>(GetParam());
  RunGlooMembers(n, [&](int r, GlooComm& comm) {
    // Values with fractions, so that the order of the additions shows in the bits.
    std::vector<float> in(count), out(count, -1.0f), inplace(count);
    for (size_t i = 0; i < count; ++i) in[i] = static_cast<float>((i % 89) * (r + 1)) / 7.0f;
    inplace = in;
    const std::vector<float> before = in;
    comm.AllreduceInto(in.data(), out.data(), count, DataType::kFloat32, ReduceOp::kSum);
    comm.Allreduce(inplace.data(), count, DataType::kFloat32, ReduceOp::kSum);
    EXPECT_EQ(in, before) << "member " << r << ": the input changed";
    size_t wrong = 0;
    for (size_t i = 0; i < count; ++i) wrong += std::memcmp(&out[i], &inplace[i], sizeof(float)) != 0;
    EXPECT_EQ(wrong, 0u) << "member " << r << ": out of place differs from in place";
  });
}

INSTANTIATE_TEST_SUITE_P(Sizes, GlooRingInto,
                         ::testing::Combine(::testing::Values(2, 3, 4),
                                            ::testing::Values(size_t{40000}, size_t{2359299})));

// Large calls back to back with nothing between them: blocks far larger than
// the sockets' buffers (a write blocks until the neighbour reads), and a
// neighbour starting its next call while this member still reads the last.
class GlooRingBackToBack : public ::testing::TestWithParam<int> {};

TEST_P(GlooRingBackToBack, LargeCallsWithNothingBetween) {
  const int n = GetParam();
  const size_t count = 6 * 1024 * 1024 + 7;  // 24 MiB and 28 bytes
  RunGlooMembers(n, [&](int r, GlooComm& comm) {
    std::vector<float> buf(count);
    for (int call = 0; call < 3; ++call) {
      for (size_t i = 0; i < count; ++i) buf[i] = static_cast<float>((i % 89) * (r + 1) + call);
      comm.Allreduce(buf.data(), count, DataType::kFloat32, ReduceOp::kSum);
      size_t wrong = 0;
      for (size_t i = 0; i < count; ++i)
        wrong += buf[i] != static_cast<float>((i % 89) * (n * (n + 1) / 2) + call * n);
      EXPECT_EQ(wrong, 0u) << "member " << r << " call " << call;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Members, GlooRingBackToBack, ::testing::Values(2, 3));

// A member that leaves (its communicator destroyed, its sockets closed) fails
// the others' ring calls with a peer-failure error long before the timeout
// (60 s here): on the member reading from it and on the one writing to it
// (3 members), and on 2 members, whose calls take the one-exchange form.
class GlooRingFailure : public ::testing::TestWithParam<int> {};

TEST_P(GlooRingFailure, LeavingMemberFailsTheOthersQuickly) {
  std::signal(SIGPIPE, SIG_IGN);  // as in Python, which ignores it
  const int n = GetParam();
  RunGlooMembers(n, [&](int r, GlooComm& comm) {
    comm.Barrier();  // every member is connected: the last one leaves mid-job
    if (r == n - 1) return;
    std::vector<float> buf(1 << 20, 1.0f);
    const auto start = std::chrono::steady_clock::now();
    try {
      for (int call = 0; call < 100; ++call)
        comm.Allreduce(buf.data(), buf.size(), DataType::kFloat32, ReduceOp::kSum);
      ADD_FAILURE() << "member " << r << ": no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.code, ErrorCode::kPeerFailure) << e.what();
    }
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(took, 10.0) << "member " << r;
  });
}

INSTANTIATE_TEST_SUITE_P(Members, GlooRingFailure, ::testing::Values(2, 3));

// Members: 2-6.
// Element counts: just above the small-message paths; 3.2 MB and 3 MiB + 20
// bytes (uneven blocks of 1-1.6 MB, which move whole); 9 MiB + 12 bytes
// (blocks of 3-4.5 MiB, which move in chunks of about 1 MiB).
INSTANTIATE_TEST_SUITE_P(Sizes, GlooRing,
                         ::testing::Combine(::testing::Values(2, 3, 4, 6),
                                            ::testing::Values(size_t{40000}, size_t{819200},
                                                              size_t{786437}, size_t{2359299})));

}  // namespace
}  // namespace sdl
