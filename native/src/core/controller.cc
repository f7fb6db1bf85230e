#include "core/controller.h"

#include <algorithm>
#include <chrono>

#include "core/coordinator.h"
#include "core/fusion.h"

namespace sdl {
namespace {

constexpr uint64_t kNeedFull = 1, kShutdownFlag = 2, kCoordPending = 4, kJoinedFlag = 8;

// A cached name still waiting after kCachedWaitS goes through full negotiation,
// so that the coordinator sees it: stall warnings and mismatch errors come from
// its table (cache bits alone never show which names the others wait on).
constexpr double kCachedWaitS = 1.0;

double SteadySeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

bool Controller::Cycle(ProcessSet& ps, const Config& cfg, bool world, bool shutdown_requested) {
  // This cycle's tuned params: agreed in the previous world cycle, so the same
  // on every member before any bit below is set (core/autotune.h).
  const TunedParams cur = applied_;
  const bool tuned = cur.serial != 0;
  if (tuned && cur.tune_hierarchical) ps.comm->SetHierarchical(cur.hierarchical);
  // Cache off: no slot bits, every request goes through full negotiation; the
  // cache itself keeps being updated by execution, identically everywhere.
  const bool use_cache = !tuned || cur.response_cache;
  const size_t cap = ps.cache.capacity();
  const size_t head = world ? 2 + kTunedWords : 2;
  const size_t words = head + (cap + 63) / 64;
  std::vector<uint64_t> bits(words, 0);
  uint64_t flags = 0;
  const double now = SteadySeconds();
  for (auto& [name, e] : ps.pending) {
    if (e.sent) continue;
    int slot = use_cache ? ps.cache.Lookup(e.req) : -1;
    if (slot >= 0 && now - e.since < kCachedWaitS) bits[head + slot / 64] |= uint64_t{1} << (slot % 64);
    else flags |= kNeedFull;
  }
  if (world && shutdown_requested) flags |= kShutdownFlag;
  if (ps.my_rank == 0 && !ps.coord.Empty()) flags |= kCoordPending;
  if (ps.joined) flags |= kJoinedFlag;
  bits[0] = ~flags;
  bits[1] = static_cast<uint64_t>(std::max<int64_t>(cfg.fusion_threshold, 0));
  // Rank 0's proposal; all-ones elsewhere, so the AND is rank 0's words.
  if (world) {
    if (ps.my_rank == 0) EncodeTuned(proposal_, &bits[2]);
    else std::fill(bits.begin() + 2, bits.begin() + head, ~uint64_t{0});
  }
  ps.comm->AgreeBits(bits.data(), words);
  flags = ~bits[0];
  // Identical on every member: the AND of every member's knob, or the tuned value.
  const int64_t threshold = tuned ? cur.fusion_threshold : static_cast<int64_t>(bits[1]);
  counters_.cycles++;
  if (flags & kShutdownFlag) {
    // Only now, once: who asked to stop, so that errors on the others can name them.
    std::vector<std::string> asked =
        ps.comm->AllgatherBytes(std::string(1, shutdown_requested ? '1' : '0'));
    stopping_ranks_.clear();
    for (int q = 0; q < ps.size(); ++q)
      if (asked[q] == "1") stopping_ranks_.push_back(ps.ranks[q]);
    return true;
  }

  // a) tensors every member has ready in the cache run now, in slot order.
  RunCached(ps, bits, head, threshold);
  // b)-e) full negotiation through the coordinator.
  if (flags & (kNeedFull | kCoordPending | kJoinedFlag))
    Negotiate(ps, cfg, tuned ? threshold : cfg.fusion_threshold);

  if (world) Apply(DecodeTuned(&bits[2]));
  return false;
}

void Controller::Apply(const TunedParams& next) {
  const int64_t cycle = world_cycles_.fetch_add(1, std::memory_order_relaxed) + 1;
  if (next == applied_) return;  // the usual case: no lock, nothing recorded
  applied_ = next;
  tuned_cycle_ms_.store(next.serial != 0 ? next.cycle_time_ms : -1.0, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lk(history_mu_);
  applied_copy_ = next;
  // In force from world cycle number `cycle` (0-based) on; bounded: rank 0
  // changes the params once per sample, and never after it is done.
  changes_.emplace_back(cycle, next);
}

Controller::TunedHistory Controller::tuned_history() {
  std::lock_guard<std::mutex> lk(history_mu_);
  return TunedHistory{applied_copy_, world_cycles_.load(std::memory_order_relaxed), changes_};
}

void Controller::RunCached(ProcessSet& ps, const std::vector<uint64_t>& bits, size_t head,
                           int64_t threshold) {
  std::vector<int> slots;
  for (size_t w = head; w < bits.size(); ++w)
    for (uint64_t b = bits[w]; b; b &= b - 1)
      slots.push_back(static_cast<int>((w - head) * 64 + __builtin_ctzll(b)));
  if (slots.empty()) return;
  // Hits per group: a cycle holds few groups, so a scan, not a key per member.
  std::vector<std::pair<const std::string*, int>> group_hits;
  auto hits = [&](const std::string& group) -> int& {
    for (auto& [name, n] : group_hits)
      if (*name == group) return n;
    group_hits.emplace_back(&group, 0);
    return group_hits.back().second;
  };
  for (int s : slots)
    if (!ps.cache.request(s).group.empty()) hits(ps.cache.request(s).group)++;
  std::vector<Response> ready;
  std::vector<size_t> groups;
  for (int s : slots) {
    const Request& rq = ps.cache.request(s);
    // A group runs from the cache only when every member of it hit.
    if (!rq.group.empty() && hits(rq.group) < rq.group_size) continue;
    AppendMerged(&ready, &groups, ps.cache.response(s));
    ps.cache.Touch(s);
  }
  std::vector<Response> fused = FuseResponses(std::move(ready), threshold);
  if (timeline_ && timeline_->on()) TimelineReady(ps, fused, true);
  for (const Response& r : fused) {
    counters_.cache_hits += static_cast<int64_t>(r.names.size());
    execute_(ps, r, true);
  }
}

// threshold: what the coordinator fuses up to (its own knob unless tuned).
void Controller::Negotiate(ProcessSet& ps, const Config& cfg, int64_t threshold) {
  counters_.full_negotiations++;
  // Unsent requests, in the order this rank took them in.
  std::vector<Entry*> unsent;
  for (auto& [name, e] : ps.pending)
    if (!e.sent) unsent.push_back(&e);
  std::sort(unsent.begin(), unsent.end(), [](const Entry* a, const Entry* b) { return a->seq < b->seq; });
  std::vector<Request> send;
  send.reserve(unsent.size());
  for (Entry* e : unsent) {
    e->sent = true;
    send.push_back(e->req);
  }
  // Only the coordinator reads the lists: a gather, not an allgather.
  std::vector<std::string> all = ps.comm->GatherBytes(EncodeRequests(send, ps.joined, false), 0);
  std::string out;
  if (ps.my_rank == 0) {
    for (int q = 0; q < ps.size(); ++q) {
      bool joined = false, unused = false;
      std::vector<Request> reqs = DecodeRequests(all[q], &joined, &unused);
      if (timeline_ && timeline_->on())
        for (const Request& rq : reqs) timeline_->Tick(ps.id, rq.name, ps.ranks[q], SteadySeconds());
      CoordinatorAdd(ps, q, std::move(reqs), joined);
    }
    std::vector<std::string> warnings;
    StallOptions stall;
    if (!cfg.stall_check_disable) {
      stall.check_s = cfg.stall_check_s;
      stall.shutdown_s = cfg.stall_shutdown_s;
    }
    stall.hosts = &hosts_;
    std::vector<Response> ready =
        CoordinatorReady(ps, threshold, stall, cfg.timeout_s, &warnings);
    for (const std::string& w : warnings) log_(0, "warning: " + w);
    if (cfg.verbose >= 2) {
      for (const Response& r : ready)
        log_(2, "process set " + std::to_string(ps.id) + ": run " + OpTypeName(r.op) + " of " +
                    std::to_string(r.names.size()) + " tensor(s), first '" + r.names[0] + "'" +
                    (r.error.empty() ? "" : " (error)"));
    }
    out = EncodeResponses(ready);
  }
  ps.comm->BroadcastBytes(&out, 0);
  std::vector<Response> responses = DecodeResponses(out);
  if (timeline_ && timeline_->on()) TimelineReady(ps, responses, false);
  for (const Response& r : responses) {
    counters_.negotiated += static_cast<int64_t>(r.names.size());
    execute_(ps, r, false);
  }
}

void Controller::TimelineReady(ProcessSet& ps, const std::vector<Response>& responses,
                               bool cached) {
  const double now = SteadySeconds();
  for (const Response& r : responses) {
    if (!r.error.empty() || r.names.empty() || r.op > OpType::kBarrier) continue;
    auto it = ps.pending.find(r.names[0]);
    timeline_->Ready(ps.id, r, it == ps.pending.end() ? now : it->second.since, now, cached);
  }
}

}  // namespace sdl
