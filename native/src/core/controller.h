// The controller: the negotiation protocol, written once for every transport.
//
// Per cycle and per process set, every member runs Controller::Cycle:
//  a) every member ANDs a bit vector over the set's communicator: one bit per
//     response-cache slot whose tensor it has ready, plus inverted flags (needs
//     full negotiation, shutdown, coordinator has pending names, joined) and
//     the fusion threshold (a tunable knob; ANDed too, so every member fuses
//     with the same value even while a set_knob call reaches ranks at
//     different cycles). Slots set on every member run at once from the cache: no
//     further messages;
//  b) if any flag asks for it, every member sends the requests it has not sent
//     yet to the coordinator (member 0), one gather of encoded request lists
//     (only the coordinator reads them: it receives n - 1 lists, the others
//     send one each, instead of every member receiving every list);
//  c) the coordinator adds them to its table; a name is ready when every member
//     asked for it (joined members count as ready for allreduce);
//  d) ready names are validated across members (op, device, dtype, shape,
//     root, ...) into responses, or error responses naming the ranks and what
//     differed; grouped allreduces wait for their whole group, and compatible
//     allreduces are fused up to the fusion threshold (core/coordinator.h);
//  e) the coordinator broadcasts the response list and every member executes it
//     in order, so collectives run in the same order everywhere.
// The world set's AND also carries the autotuned parameters (core/autotune.h):
// rank 0's proposal, all-ones from the others, in force on every rank from
// the next cycle on (applied()); other sets use the same applied values.
// When the AND shows that some member asked to stop, the members exchange who
// did (one allgather, only then) and the cycle reports the stop; the controller
// keeps those ranks so that errors on the other ranks can name them.
//
// Transports provide only the primitives this needs (Comm::Allreduce with
// kBitAnd, GatherBytes, BroadcastBytes, and AllgatherBytes for the stop);
// the executor runs the responses.
#pragma once

#include <atomic>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/message.h"
#include "core/autotune.h"
#include "core/counters.h"
#include "core/process_set.h"
#include "core/timeline.h"

namespace sdl {

class Controller {
 public:
  // Runs one response on this rank; from_cache: it came from step a).
  using ExecuteFn = std::function<void(ProcessSet& ps, const Response& r, bool from_cache)>;
  using LogFn = std::function<void(int level, const std::string& msg)>;

  Controller(Counters& counters, ExecuteFn execute, LogFn log)
      : counters_(counters), execute_(std::move(execute)), log_(std::move(log)) {}

  // One negotiation cycle of one set on this member (steps a-e). world: the
  // global set, the only one that carries shutdown. Returns true when the
  // members agreed to stop (then nothing was executed).
  bool Cycle(ProcessSet& ps, const Config& cfg, bool world, bool shutdown_requested);

  // Host name per global rank, for the stall inspector's messages (set at init).
  void set_hosts(std::vector<std::string> hosts) { hosts_ = std::move(hosts); }
  const std::vector<std::string>& hosts() const { return hosts_; }

  // Global ranks that asked to stop in the cycle that stopped (empty before).
  const std::vector<int32_t>& stopping_ranks() const { return stopping_ranks_; }

  // Rank 0's timeline: readiness ticks and ready responses (core/timeline.h).
  void set_timeline(Timeline* t) { timeline_ = t; }

  // Autotune (core/autotune.h). set_proposal: what this rank sends as rank 0
  // of the world set (ignored on the others; serial 0: not tuning). applied():
  // the params in force for the next cycle, identical on every rank (serial 0:
  // each rank's own knobs). Cycle thread only, except the copies below.
  void set_proposal(const TunedParams& p) { proposal_ = p; }
  const TunedParams& applied() const { return applied_; }
  // The cycle time in force (ms), or fallback when not tuning; any thread.
  double cycle_time_ms(double fallback) const {
    const double v = tuned_cycle_ms_.load(std::memory_order_relaxed);
    return v >= 0 ? v : fallback;
  }
  // Any thread: the applied params, world cycles run so far, and every change
  // of applied params with the world cycle from which it was in force.
  struct TunedHistory {
    TunedParams applied;
    int64_t world_cycles = 0;
    std::vector<std::pair<int64_t, TunedParams>> changes;
  };
  TunedHistory tuned_history();

 private:
  void RunCached(ProcessSet& ps, const std::vector<uint64_t>& bits, size_t head, int64_t threshold);
  void Negotiate(ProcessSet& ps, const Config& cfg, int64_t threshold);
  void Apply(const TunedParams& next);
  void TimelineReady(ProcessSet& ps, const std::vector<Response>& responses, bool cached);

  Counters& counters_;
  ExecuteFn execute_;
  LogFn log_;
  std::vector<int32_t> stopping_ranks_;
  Timeline* timeline_ = nullptr;
  std::vector<std::string> hosts_;
  TunedParams proposal_, applied_;
  std::atomic<double> tuned_cycle_ms_{-1.0};
  std::atomic<int64_t> world_cycles_{0};  // world cycles run (read by tuned_history())
  std::mutex history_mu_;  // guards the copies tuned_history() reads
  TunedParams applied_copy_;
  std::vector<std::pair<int64_t, TunedParams>> changes_;
};

}  // namespace sdl
