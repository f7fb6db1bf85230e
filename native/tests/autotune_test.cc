// Autotune without peers: the Gaussian process and expected improvement
// (core/bayes_opt.h), the parameter words every rank decodes identically, and
// rank 0's sample state machine (core/autotune.h). Agreement across ranks is
// checked by tests/parallel/test_autotune.py.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "core/autotune.h"
#include "core/bayes_opt.h"

namespace sdl {
namespace {

TEST(GaussianProcess, FitsKnownPointsAndIsUnsureFarAway) {
  GaussianProcess gp(0.3, 1e-6);
  std::vector<std::vector<double>> xs{{0.0}, {0.25}, {0.5}, {0.75}, {1.0}};
  std::vector<double> ys;
  for (auto& x : xs) ys.push_back(100 + 50 * std::sin(3 * x[0]));
  gp.Fit(xs, ys);
  for (size_t i = 0; i < xs.size(); ++i) {
    double m, s;
    gp.Predict(xs[i], &m, &s);
    EXPECT_NEAR(m, ys[i], 1e-3 * std::fabs(ys[i])) << i;
    EXPECT_LT(s, 0.1) << i;  // about sqrt(noise) of the scores' spread (~20)
  }
  // Between samples: close to the smooth function, with some uncertainty.
  double m, s;
  gp.Predict({0.375}, &m, &s);
  EXPECT_NEAR(m, 100 + 50 * std::sin(3 * 0.375), 2.0);
  // Far outside: back to the prior (the scores' mean), uncertain.
  double mf, sf;
  gp.Predict({5.0}, &mf, &sf);
  double mean = 0;
  for (double y : ys) mean += y / ys.size();
  EXPECT_NEAR(mf, mean, 1e-6);
  EXPECT_GT(sf, s);
}

TEST(GaussianProcess, NoiseSmoothsDuplicates) {
  // Two different scores at the same point: the noise term keeps K invertible
  // and the mean lands between them.
  GaussianProcess gp(0.3, 0.5);
  gp.Fit({{0.5}, {0.5}}, {10.0, 20.0});
  double m, s;
  gp.Predict({0.5}, &m, &s);
  EXPECT_GT(m, 10.0);
  EXPECT_LT(m, 20.0);
}

TEST(ExpectedImprovement, Basics) {
  // No uncertainty: the plain gain, never negative.
  EXPECT_DOUBLE_EQ(ExpectedImprovement(5, 0, 3, 0), 2);
  EXPECT_DOUBLE_EQ(ExpectedImprovement(1, 0, 3, 0), 0);
  // Uncertainty adds value; more of it adds more.
  EXPECT_GT(ExpectedImprovement(3, 1, 3, 0), 0);
  EXPECT_GT(ExpectedImprovement(3, 2, 3, 0), ExpectedImprovement(3, 1, 3, 0));
  EXPECT_GT(ExpectedImprovement(4, 1, 3, 0), ExpectedImprovement(3, 1, 3, 0));
}

TEST(BayesOpt, PicksTheObviousOptimumOfA1DToy) {
  // f peaks at 0.8; after samples around it, EI proposes a point near 0.8.
  auto f = [](double x) { return 10 - 40 * (x - 0.8) * (x - 0.8); };
  BayesOpt bo(1, 1e-4);
  for (double x : {0.0, 0.2, 0.4, 0.6, 0.7, 0.9, 1.0}) bo.Add({x}, f(x));
  std::vector<double> next = bo.Next();
  ASSERT_EQ(next.size(), 1u);
  EXPECT_NEAR(next[0], 0.8, 0.06);
  EXPECT_EQ(bo.BestIndex(), 4);  // 0.7 and 0.9 tie; the first wins
}

TEST(BayesOpt, ConvergesOnA2DToyWithinAFewSamples) {
  auto f = [](const std::vector<double>& x) {
    return -((x[0] - 0.3) * (x[0] - 0.3) + (x[1] - 0.7) * (x[1] - 0.7));
  };
  BayesOpt bo(2, 1e-3);
  std::vector<std::vector<double>> tried{{0.5, 0.5}};
  bo.Add(tried[0], f(tried[0]));
  for (int i = 0; i < 15; ++i) {
    tried.push_back(bo.Next());
    bo.Add(tried.back(), f(tried.back()));
  }
  // The best sample lies within 0.15 of the optimum (the start is 0.28 away).
  EXPECT_GT(f(tried[bo.BestIndex()]), -0.15 * 0.15);
}

TEST(TunedParams, WordsRoundTripAndAllOnesIsTheIdentityOfAnd) {
  TunedParams p;
  p.serial = 7;
  p.fusion_threshold = 64 << 20;
  p.cycle_time_ms = 2.5;
  p.response_cache = false;
  p.hierarchical = true;
  p.tune_hierarchical = true;
  uint64_t w[kTunedWords], ones[kTunedWords];
  EncodeTuned(p, w);
  for (size_t i = 0; i < kTunedWords; ++i) ones[i] = ~uint64_t{0} & w[i];  // rank 0 AND others
  EXPECT_EQ(DecodeTuned(ones), p);
  TunedParams off;
  off.serial = 0;
  EncodeTuned(off, w);
  EXPECT_EQ(DecodeTuned(w).serial, 0u);
}

// Drives the tuner as Runtime does: each "cycle" applies what rank 0 proposed
// in the previous one and finishes `bytes` of work.
struct Drive {
  Autotuner& t;
  TunedParams applied;
  int64_t bytes = 0;
  double now = 0;
  int cycles = 0;
  void Cycle(int64_t work, double secs) {
    TunedParams next = t.proposal();  // what the AND of this cycle carries
    now += secs;
    bytes += work;
    applied = next;
    t.AfterCycle(applied, bytes, now);
    cycles++;
  }
};

// A CSV row from its third field on (the values and the score).
std::string AfterWarmup(const std::string& row) { return row.substr(row.find(',', row.find(',') + 1)); }

TEST(Autotuner, WarmupSamplesThenMaxSamplesThenChoosesTheBestAndStops) {
  const std::string path = ::testing::TempDir() + "autotune_test.csv";
  AutotuneOptions o;
  o.warmup_samples = 2;
  o.steps_per_sample = 3;
  o.max_samples = 5;
  o.noise = 0.1;
  o.log_path = path;
  o.start.fusion_threshold = 128 << 20;
  o.start.cycle_time_ms = 1.0;
  std::vector<std::string> logs;
  Autotuner t(o, [&](int, const std::string& m) { logs.push_back(m); });
  EXPECT_EQ(t.proposal().serial, 1u);
  EXPECT_EQ(t.proposal().fusion_threshold, 128 << 20);
  Drive d{t, {}};
  // The time a cycle takes depends on the fusion threshold: larger is faster
  // here, so the tuner should keep a large one.
  for (int i = 0; i < 1000 && !t.done(); ++i) {
    const double secs = 1e-3 * (1 + 100.0 / (1 + d.applied.fusion_threshold / 65536.0));
    d.Cycle(i % 2 ? 1000 : 0, secs);  // every other cycle idle: not counted
  }
  ASSERT_TRUE(t.done());
  const TunedParams chosen = t.proposal();
  EXPECT_EQ(chosen.serial, 1u + 2 + 5);  // one serial per sample, then the choice
  // CSV: header, 2 warm-up rows, 5 scored rows, the chosen row.
  std::ifstream f(path);
  std::vector<std::string> lines;
  for (std::string l; std::getline(f, l);) lines.push_back(l);
  ASSERT_EQ(lines.size(), 1u + 2 + 5 + 1);
  EXPECT_EQ(lines[0].rfind("sample,warmup,", 0), 0u);
  EXPECT_EQ(lines[1].rfind("0,1,", 0), 0u);
  EXPECT_EQ(lines[3].rfind("2,0,", 0), 0u);
  EXPECT_EQ(lines.back().rfind("chosen,0," + std::to_string(chosen.fusion_threshold) + ",", 0), 0u);
  // The chosen row repeats the best scored row's values and score.
  double best = -1;
  std::string best_tail;
  for (size_t i = 3; i < 8; ++i) {
    double score = std::stod(lines[i].substr(lines[i].rfind(',', lines[i].size() - 3) + 1));
    if (score > best) {
      best = score;
      best_tail = AfterWarmup(lines[i]);
    }
  }
  EXPECT_EQ(AfterWarmup(lines.back()), best_tail);
  // Done means done: nothing changes afterwards.
  for (int i = 0; i < 50; ++i) d.Cycle(1000, 1e-3);
  EXPECT_EQ(t.proposal(), chosen);
  EXPECT_FALSE(logs.empty());
  std::remove(path.c_str());
}

TEST(Autotuner, UnitMappingStaysInRange) {
  AutotuneOptions o;
  o.tune_cache = true;
  o.tune_hierarchical = true;
  Autotuner t(o, [](int, const std::string&) {});
  TunedParams lo = t.FromUnit({0, 0, 0, 0}), hi = t.FromUnit({1, 1, 1, 1});
  EXPECT_EQ(lo.fusion_threshold, 64 << 10);
  EXPECT_EQ(hi.fusion_threshold, 256 << 20);
  EXPECT_NEAR(lo.cycle_time_ms, 0.01, 1e-9);
  EXPECT_NEAR(hi.cycle_time_ms, 10.0, 1e-9);
  EXPECT_FALSE(lo.response_cache);
  EXPECT_TRUE(hi.hierarchical);
  std::vector<double> x = t.ToUnit(hi);
  EXPECT_NEAR(x[0], 1, 1e-6);
  EXPECT_NEAR(x[1], 1, 1e-6);
}

}  // namespace
}  // namespace sdl
