// Comm::AllreduceSpans on shared memory (members as threads of one process):
// reducing tensors where they lie gives the bits of packing them back to back,
// Allreduce of the packed buffer and unpacking, whatever the span boundaries,
// chunking (small staging halves force rounds) and member count.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "comm/shm_comm.h"

namespace sdl {
namespace {

// Element counts of the spans: odd sizes, empty ones, one longer than a round.
const std::vector<size_t> kCounts = {1, 0, 37, 1000, 3, 0, 5000, 129, 2};

template <typename T>
std::vector<std::vector<T>> Inputs(int rank) {
  std::mt19937 rng(1234 + rank);
  std::uniform_real_distribution<double> dist(-100.0, 100.0);
  std::vector<std::vector<T>> out;
  for (size_t n : kCounts) {
    std::vector<T> v(n);
    for (T& x : v) x = static_cast<T>(dist(rng));  // float: sums depend on their order
    out.push_back(std::move(v));
  }
  return out;
}

template <typename T>
void Check(DataType dt, ReduceOp op, int n) {
  const std::string name = "/sdl-span-test-" + std::to_string(::getpid()) + "-" +
                           std::to_string(static_cast<int>(dt)) + "-" +
                           std::to_string(static_cast<int>(op)) + "-" + std::to_string(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      std::vector<int> ranks(n);
      for (int q = 0; q < n; ++q) ranks[q] = q;
      // 8 KiB slots: 4 KiB staging halves, so the 6000-odd elements take rounds.
      ShmComm comm(name, r, n, ranks, 8192, 20, 20);
      std::vector<std::vector<T>> spans_data = Inputs<T>(r);
      std::vector<T> packed;
      for (const auto& v : spans_data) packed.insert(packed.end(), v.begin(), v.end());
      std::vector<Comm::Span> spans;
      for (auto& v : spans_data)
        spans.push_back(Comm::Span{reinterpret_cast<char*>(v.data()), v.size() * sizeof(T)});
      ASSERT_TRUE(comm.AllreduceSpans(spans, packed.size(), dt, op));
      comm.Allreduce(packed.data(), packed.size(), dt, op);
      size_t at = 0;
      for (size_t i = 0; i < spans_data.size(); ++i) {
        const auto& v = spans_data[i];
        ASSERT_EQ(0, v.empty() ? 0 : std::memcmp(v.data(), packed.data() + at, v.size() * sizeof(T)))
            << "member " << r << " of " << n << ": span " << i << " differs from the packed result";
        at += v.size();
      }
    });
  }
  for (auto& t : threads) t.join();
}

TEST(ShmAllreduceSpans, SameBitsAsPackedAllreduce) {
  for (int n : {2, 3}) {
    Check<float>(DataType::kFloat32, ReduceOp::kSum, n);
    Check<double>(DataType::kFloat64, ReduceOp::kMax, n);
    Check<int32_t>(DataType::kInt32, ReduceOp::kSum, n);
  }
}

}  // namespace
}  // namespace sdl
