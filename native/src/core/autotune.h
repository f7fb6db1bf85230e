// Autotune: rank 0 tunes the fusion threshold, the cycle time, the response
// cache (on/off) and, where it applies, hierarchical allreduce while the job
// trains (knob autotune; docs/observability.md, section Autotune).
//
// Agreement: the parameters in force are a TunedParams that every rank holds
// in its Controller (Controller::applied()). Rank 0 puts its proposal into
// kTunedWords words of the world set's per-cycle AND (Controller::Cycle);
// every other rank puts all-ones there, so the AND hands every rank rank 0's
// words, bit for bit. The agreed words of world cycle c take effect from
// world cycle c + 1 on, on every rank: each rank's cycle c + 1 starts (and
// sets its cache bits, its fusion threshold, its hierarchical path, its
// pacing) from values that are a function of cycle c's AND result alone.
// Ranks run the same sequence of world cycles, so they switch between the
// same two cycles. A serial of 0 means "not tuning": rank 0 sends zeros when
// autotune is off, and then every rank keeps its own knobs, as before.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/bayes_opt.h"

namespace sdl {

struct TunedParams {
  uint64_t serial = 0;            // sample number + 1; 0: autotune off (rank 0 decides)
  int64_t fusion_threshold = 0;   // bytes
  double cycle_time_ms = 1.0;
  bool response_cache = true;
  bool hierarchical = false;       // hierarchical allreduce (CPU), used when tune_hierarchical
  bool tune_hierarchical = false;  // the world set's transport is hierarchical
  bool done = false;               // tuning finished: these are the chosen values
  bool operator==(const TunedParams& o) const {
    return serial == o.serial && fusion_threshold == o.fusion_threshold &&
           cycle_time_ms == o.cycle_time_ms && response_cache == o.response_cache &&
           hierarchical == o.hierarchical && tune_hierarchical == o.tune_hierarchical &&
           done == o.done;
  }
};

constexpr size_t kTunedWords = 4;
// Lossless for what Cycle needs: the cycle time travels in whole microseconds,
// and the decoded value is what every rank (rank 0 included) applies.
void EncodeTuned(const TunedParams& p, uint64_t* words);
TunedParams DecodeTuned(const uint64_t* words);

struct AutotuneOptions {
  int warmup_samples = 3;
  int steps_per_sample = 50;
  int max_samples = 20;
  double noise = 0.8;
  std::string log_path;           // CSV; empty: none
  bool tune_cache = true;         // false when the cache has no capacity
  bool tune_hierarchical = false;
  TunedParams start;              // the knobs' values: warm-up and the first scored sample
};

// Rank 0's tuner. Not thread-safe: the cycle that owns cycle_mu_ calls it.
class Autotuner {
 public:
  using LogFn = std::function<void(int level, const std::string& msg)>;
  Autotuner(AutotuneOptions opts, LogFn log);
  ~Autotuner();

  // What rank 0 sends in the next world cycle.
  const TunedParams& proposal() const { return proposal_; }
  bool done() const { return proposal_.done; }

  // After each world cycle: next = the params agreed for the next cycle,
  // bytes = payload bytes finished so far (Counters::bytes), now = seconds.
  // A sample starts once its params are in force and ends after
  // steps_per_sample cycles that finished work; its score is the bytes
  // finished per second over that span.
  void AfterCycle(const TunedParams& next, int64_t bytes, double now);

  // Unit-cube coordinates of params, and back (exposed for tests).
  std::vector<double> ToUnit(const TunedParams& p) const;
  TunedParams FromUnit(const std::vector<double>& x) const;

 private:
  void Finish(double score);
  void WriteRow(const std::string& sample, const TunedParams& p, double score, bool warmup,
                bool best);

  AutotuneOptions opts_;
  LogFn log_;
  BayesOpt bo_;
  TunedParams proposal_;
  int samples_ = 0;      // finished samples, warm-up included
  bool started_ = false;
  double t0_ = 0;
  int64_t b0_ = 0, last_bytes_ = 0;
  int work_cycles_ = 0;
  std::vector<TunedParams> scored_;  // scored samples, in order (bo_ holds their scores)
  std::vector<double> scores_;
  std::FILE* csv_ = nullptr;
};

}  // namespace sdl
