#include "core/autotune.h"

#include <algorithm>
#include <cmath>
#include <sstream>

namespace sdl {
namespace {

constexpr uint64_t kCache = 1, kHier = 2, kTuneHier = 4, kDone = 8;

// Search ranges (log scale): fusion 64 KiB .. 256 MiB, cycle time 0.01 .. 10 ms
// (below 0.1 ms it paces busy cycles too, core/loop.cc).
constexpr double kFusionLog2Lo = 16, kFusionLog2Span = 12;
constexpr double kCycleLog10Lo = -2, kCycleLog10Span = 3;

std::string Fmt(double v) {
  std::ostringstream s;
  s.precision(6);
  s << v;
  return s.str();
}

}  // namespace

void EncodeTuned(const TunedParams& p, uint64_t* w) {
  w[0] = p.serial;
  w[1] = static_cast<uint64_t>(std::max<int64_t>(p.fusion_threshold, 0));
  w[2] = static_cast<uint64_t>(std::llround(std::max(p.cycle_time_ms, 0.0) * 1000.0));
  w[3] = (p.response_cache ? kCache : 0) | (p.hierarchical ? kHier : 0) |
         (p.tune_hierarchical ? kTuneHier : 0) | (p.done ? kDone : 0);
}

TunedParams DecodeTuned(const uint64_t* w) {
  TunedParams p;
  p.serial = w[0];
  p.fusion_threshold = static_cast<int64_t>(w[1]);
  p.cycle_time_ms = static_cast<double>(w[2]) / 1000.0;
  p.response_cache = w[3] & kCache;
  p.hierarchical = w[3] & kHier;
  p.tune_hierarchical = w[3] & kTuneHier;
  p.done = w[3] & kDone;
  return p;
}

Autotuner::Autotuner(AutotuneOptions opts, LogFn log)
    : opts_(std::move(opts)),
      log_(std::move(log)),
      bo_(2 + (opts_.tune_cache ? 1 : 0) + (opts_.tune_hierarchical ? 1 : 0), opts_.noise) {
  opts_.warmup_samples = std::max(opts_.warmup_samples, 0);
  opts_.steps_per_sample = std::max(opts_.steps_per_sample, 1);
  opts_.max_samples = std::max(opts_.max_samples, 1);
  // The start goes through the wire format too, so that the values rank 0
  // scores are exactly those every rank applies.
  uint64_t w[kTunedWords];
  TunedParams start = opts_.start;
  start.serial = 1;
  start.tune_hierarchical = opts_.tune_hierarchical;
  if (!opts_.tune_cache) start.response_cache = false;
  start.done = false;
  EncodeTuned(start, w);
  proposal_ = DecodeTuned(w);
  opts_.start = proposal_;
  if (!opts_.log_path.empty()) {
    csv_ = std::fopen(opts_.log_path.c_str(), "w");
    if (!csv_) {
      log_(0, "autotune: cannot write " + opts_.log_path + "; tuning without a log");
    } else {
      std::fputs("sample,warmup,fusion_threshold_bytes,cycle_time_ms,response_cache,"
                 "hierarchical_allreduce,score_bytes_per_s,best_so_far\n", csv_);
      std::fflush(csv_);
    }
  }
  std::string what = "autotune: tuning fusion_threshold, cycle_time_ms";
  if (opts_.tune_cache) what += ", response cache on/off";
  what += opts_.tune_hierarchical
              ? ", hierarchical allreduce"
              : "; hierarchical allreduce not tuned (the job's ranks are on one host, or no host "
                "holds several of them)";
  what += "; hierarchical allgather not tuned (the core has no hierarchical allgather); " +
          std::to_string(opts_.warmup_samples) + " warm-up + " +
          std::to_string(opts_.max_samples) + " samples of " +
          std::to_string(opts_.steps_per_sample) + " working cycles";
  log_(0, what);
}

Autotuner::~Autotuner() {
  if (csv_) std::fclose(csv_);
}

std::vector<double> Autotuner::ToUnit(const TunedParams& p) const {
  auto clamp01 = [](double v) { return std::min(std::max(v, 0.0), 1.0); };
  std::vector<double> x;
  x.push_back(clamp01((std::log2(std::max<double>(p.fusion_threshold, 1)) - kFusionLog2Lo) /
                      kFusionLog2Span));
  x.push_back(clamp01((std::log10(std::max(p.cycle_time_ms, 1e-3)) - kCycleLog10Lo) /
                      kCycleLog10Span));
  if (opts_.tune_cache) x.push_back(p.response_cache ? 1 : 0);
  if (opts_.tune_hierarchical) x.push_back(p.hierarchical ? 1 : 0);
  return x;
}

TunedParams Autotuner::FromUnit(const std::vector<double>& x) const {
  TunedParams p = opts_.start;
  const double bytes = std::exp2(kFusionLog2Lo + kFusionLog2Span * x[0]);
  p.fusion_threshold = std::llround(bytes / 1024.0) * 1024;  // whole KiB
  const double ms = std::pow(10.0, kCycleLog10Lo + kCycleLog10Span * x[1]);
  p.cycle_time_ms = std::round(ms * 100.0) / 100.0;  // 10 us steps
  size_t i = 2;
  if (opts_.tune_cache) p.response_cache = x[i++] >= 0.5;
  if (opts_.tune_hierarchical) p.hierarchical = x[i++] >= 0.5;
  uint64_t w[kTunedWords];
  EncodeTuned(p, w);
  return DecodeTuned(w);
}

void Autotuner::AfterCycle(const TunedParams& next, int64_t bytes, double now) {
  if (proposal_.done) return;
  if (!started_) {
    // The proposal is in force from the next cycle on: the sample starts now.
    if (next.serial != proposal_.serial) return;
    started_ = true;
    t0_ = now;
    b0_ = last_bytes_ = bytes;
    work_cycles_ = 0;
    return;
  }
  if (bytes == last_bytes_) return;  // an idle or negotiation-only cycle
  last_bytes_ = bytes;
  if (++work_cycles_ < opts_.steps_per_sample) return;
  const double span = std::max(now - t0_, 1e-9);
  Finish(static_cast<double>(bytes - b0_) / span);
}

void Autotuner::Finish(double score) {
  started_ = false;
  const bool warmup = samples_ < opts_.warmup_samples;
  const std::string index = std::to_string(samples_);
  samples_++;
  TunedParams next = proposal_;
  if (warmup) {
    WriteRow(index, proposal_, score, true, false);
  } else {
    bo_.Add(ToUnit(proposal_), score);
    scored_.push_back(proposal_);
    scores_.push_back(score);
    const int best = bo_.BestIndex();
    WriteRow(index, proposal_, score, false, best == static_cast<int>(scored_.size()) - 1);
    if (static_cast<int>(scored_.size()) >= opts_.max_samples) {
      // Done: the best scored sample's values, for the rest of the run.
      next = scored_[best];
      next.done = true;
      WriteRow("chosen", next, scores_[best], false, true);
      log_(0, "autotune: chose fusion_threshold=" + std::to_string(next.fusion_threshold) +
                  " cycle_time_ms=" + Fmt(next.cycle_time_ms) +
                  " response_cache=" + std::to_string(next.response_cache) +
                  (opts_.tune_hierarchical ? " hierarchical_allreduce=" +
                                                 std::to_string(next.hierarchical)
                                           : std::string()) +
                  " (" + Fmt(scores_[best]) + " B/s; the knobs' values: " + Fmt(scores_[0]) +
                  " B/s)");
    } else {
      next = FromUnit(bo_.Next());
    }
  }
  next.serial = proposal_.serial + 1;
  proposal_ = next;
}

void Autotuner::WriteRow(const std::string& sample, const TunedParams& p, double score,
                         bool warmup, bool best) {
  if (!csv_) return;
  std::string row = sample + "," + (warmup ? "1" : "0") + "," + std::to_string(p.fusion_threshold) +
                    "," + Fmt(p.cycle_time_ms) + "," + (p.response_cache ? "1" : "0") + "," +
                    (opts_.tune_hierarchical ? (p.hierarchical ? "1" : "0") : "") + "," +
                    Fmt(score) + "," + (best ? "1" : "0") + "\n";
  std::fputs(row.c_str(), csv_);
  std::fflush(csv_);
}

}  // namespace sdl
