// Who runs a rank's negotiation cycles: the background thread, or a caller
// that waits (inline cycles).
//
// A cycle (Controller::Cycle of the global set, then of every other set this
// rank belongs to) is collective: every rank runs the same sequence of
// cycles, each one matched by one cycle on every peer. The protocol does not
// care which thread runs a cycle, only that a rank's cycles never overlap:
// cycle_mu_ makes them strictly sequential whoever runs them.
//
// Why callers run cycles: handing a step's collectives to the background
// thread costs two wake-ups (it wakes to run the cycle; it wakes the caller
// when the handle completes). On a host with fewer cores than busy threads
// each wake-up waits for a scheduling slot, and for a step of small fused
// tensors those waits cost more than the collective itself. So a caller
// that waits on an unfinished handle (WaitRange) takes the cycle lock when
// it is free and runs cycles until its handles are done, with no pacing
// between them (each cycle blocks in the transport until the peers join it,
// so this is no busy loop). Callers that find the lock taken sleep on their
// handles and are kicked (HandleTable::Kick) whenever it comes free.
//
// While callers run cycles the background thread stands down: a cycle of its
// own would only add a cycle every peer has to match. It still runs the
// cycles nobody waits for: async operations no caller waits on yet, idle
// heartbeats (how a rank notices its peers' shutdown), join, and shutdown.
// The last caller to leave wakes it when work is left.
//
// Endings: a cycle that agrees to stop or throws, on whichever thread, records
// that under cycle_mu_ (ended_); no cycle runs afterwards, and the background
// thread leaves its loop and fails what is left, as it always did.
#include <algorithm>
#include <chrono>

#include "core/runtime.h"

namespace sdl {
namespace {

// How long the background thread, woken by new work, leaves a caller to come
// and run the cycle itself (WaitForWork). Long enough for a caller to get from
// its enqueue to its wait through a few Python frames on a busy core; short
// against a training step.
constexpr double kInlineGraceMs = 0.2;

double SteadySeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

void Runtime::Intake(ProcessSet& ps) {
  std::lock_guard<std::mutex> lk(ps.mu);
  if (ps.incoming.empty()) return;
  const double now = SteadySeconds();
  while (!ps.incoming.empty()) {
    Entry e = std::move(ps.incoming.front());
    ps.incoming.pop_front();
    if (e.req.op == OpType::kJoin) {
      ps.joined = true;
      ps.join_handle = e.handle;
      continue;
    }
    e.since = now;
    e.seq = ps.next_seq++;
    e.flight_id = recorder_.Enqueued(ps.id, e.req, now);
    std::string name = e.req.name;
    ps.pending.insert_or_assign(std::move(name), std::move(e));
  }
}

void Runtime::WakeBackground(bool notify) {
  {
    std::lock_guard<std::mutex> lk(wake_mu_);
    work_ = true;
    // In its grace wait the thread looks at the work when the grace ends; a
    // wake-up now would only cost a context switch (on a busy host, the core
    // a peer rank needs). Shutdown is always delivered.
    notify = notify && (!grace_ || shutdown_requested_.load());
  }
  if (notify) wake_cv_.notify_one();
}

Runtime::Wake Runtime::WaitForWork(bool busy, bool everywhere) {
  Config cfg = config();
  cfg.cycle_time_ms = controller_.cycle_time_ms(cfg.cycle_time_ms);  // autotune's, when tuning
  // While tensors wait for slower ranks, cycle more often: their arrival is
  // only seen through negotiation. A rank with nothing to do that belongs to
  // every set sleeps longer: any operation, anywhere, needs its own enqueue
  // (which wakes it), and peers with work block in the cycle until it comes.
  // A rank outside some set keeps the short cycle: that set's members may
  // have work that waits on this rank's world cycles.
  double wait_ms = cfg.cycle_time_ms;
  if (busy) {
    wait_ms = std::min(cfg.cycle_time_ms, 0.1);
  } else if (everywhere) {
    wait_ms = std::max(cfg.cycle_time_ms, std::min(cfg.idle_cycle_ms, cfg.timeout_s * 250.0));
  }
  auto standing_down = [this] {
    return inline_waiters_.load() > 0 && !shutdown_requested_.load() && !ended_.load();
  };
  std::unique_lock<std::mutex> lk(wake_mu_);
  if (standing_down()) {
    // Callers run the cycles (and take in new work); sleep until the last one
    // leaves with work left (it sets work_), checking now and then.
    work_ = false;
    wake_cv_.wait_for(lk, std::chrono::duration<double, std::milli>(std::max(wait_ms, 10.0)),
                      [&] { return work_ || !standing_down(); });
    return Wake::kNone;
  }
  const bool woken = wake_cv_.wait_for(lk, std::chrono::duration<double, std::milli>(wait_ms),
                                      [this] { return work_; });
  work_ = false;
  if (woken && inline_ok_ && cfg.inline_cycles && !shutdown_requested_.load()) {
    // New work: the caller that enqueued it usually waits for it a moment
    // later and then runs the cycle itself. Give it kInlineGraceMs to get
    // there before taking the cycle: otherwise this thread, scheduled on the
    // other core while the caller is still in Python, wins the cycle lock and
    // the caller sleeps through the hand-off inline cycles exist to avoid.
    // Operations nobody waits on start that much later. Enqueues during the
    // grace do not wake this thread again (see WakeBackground).
    grace_ = true;
    wake_cv_.wait_for(lk, std::chrono::duration<double, std::milli>(kInlineGraceMs),
                      [&] { return standing_down() || shutdown_requested_.load(); });
    grace_ = false;
  }
  if (standing_down()) return Wake::kNone;
  return woken ? Wake::kWork : Wake::kTimer;
}

void Runtime::RunCycleLocked() {
  ErrorCode code = ErrorCode::kShutdown;
  std::string message;
  try {
    // Asynchronous device errors (NCCL) of work queued in earlier cycles end the
    // runtime like a failed cycle, on whichever thread runs the cycles.
    ThrowIfError(ops_.Poll());
    if (timeline_ && timeline_->on() && timeline_->mark_cycles()) timeline_->Cycle(TimelineNow());
    recorder_.CycleStarted();
    std::shared_ptr<ProcessSet> world = FindSet(0);
    Intake(*world);
    if (controller_.Cycle(*world, config(), true, shutdown_requested_.load())) {
      const std::vector<int32_t>& asked = controller_.stopping_ranks();
      if (std::find(asked.begin(), asked.end(), opts_.topo.rank) == asked.end()) {
        std::lock_guard<std::mutex> lk(status_mu_);
        stopped_by_peers_ = asked;
      }
      ended_ = true;
      end_code_ = ErrorCode::kShutdown;
      end_message_ = kShutDownMessage;
      return;
    }
    if (tuner_) {
      // Rank 0 scores the sample and picks what it proposes next cycle.
      tuner_->AfterCycle(controller_.applied(), counters_.bytes.load(), SteadySeconds());
      controller_.set_proposal(tuner_->proposal());
    }
    std::vector<std::shared_ptr<ProcessSet>> sets;
    {
      std::lock_guard<std::mutex> lk(sets_mu_);
      for (auto& [id, ps] : active_)
        if (id != 0 && ps->member()) sets.push_back(ps);
    }
    for (auto& ps : sets) {
      Intake(*ps);
      controller_.Cycle(*ps, config(), false, false);
    }
    NotePaceLocked();
    return;
  } catch (const Error& e) {
    code = e.code == ErrorCode::kOk ? ErrorCode::kPeerFailure : e.code;
    message = e.what();
  } catch (const std::exception& e) {
    code = ErrorCode::kPeerFailure;
    message = std::string("background thread failed: ") + e.what();
  }
  // The coordinator names where the ranks parted ways (its table knows, even of a dead peer).
  if (const std::string d = DivergenceLocked(); !d.empty() && message.rfind("Stalled", 0) != 0)
    message += "; the ranks parted ways at " + d;
  failed_.store(true);
  ended_ = true;
  end_code_ = code;
  end_message_ = message;
}

bool Runtime::HasWorkLocked() {
  std::lock_guard<std::mutex> lk(sets_mu_);
  for (auto& [id, ps] : active_) {
    if (!ps->member()) continue;
    if (!ps->pending.empty() || ps->joined) return true;
    std::lock_guard<std::mutex> plk(ps->mu);
    if (!ps->incoming.empty()) return true;
  }
  return false;
}

void Runtime::LeaveInline() {
  // Decrement first, then look for work: an enqueue that saw a waiter (and so
  // did not wake the background thread) queued its work before reading the
  // count, so either it sees zero and wakes the thread, or this check sees
  // the work (both are sequentially consistent).
  if (inline_waiters_.fetch_sub(1) != 1) return;
  std::unique_lock<std::mutex> lk(cycle_mu_, std::try_to_lock);
  // A thread holding the lock runs cycles and looks again when it leaves, or
  // is the background thread itself; either way waking costs only a check.
  const bool wake = !lk.owns_lock() || (!ended_ && HasWorkLocked());
  if (lk.owns_lock()) ReleaseCycleLock(lk, 0);
  if (wake) WakeBackground(true);
}

void Runtime::ReleaseCycleLock(std::unique_lock<std::mutex>& lk, int mine) {
  // Unlock first, then count: a caller counts itself before it tries the lock
  // and reads the kick counter before that, so when its try failed because we
  // still held the lock, it is counted here and our kick wakes its sleep.
  lk.unlock();
  if (inline_waiters_.load() > mine) handles_.Kick();
}

bool Runtime::WaitRange(int64_t first, int64_t n, double timeout_s) {
  // A zero timeout is a poll: it never blocks in a cycle.
  if (timeout_s == 0 || !inline_ok_ || !config().inline_cycles)
    return handles_.WaitRange(first, n, timeout_s);
  const auto start = std::chrono::steady_clock::now();
  auto left_s = [&] {
    if (timeout_s < 0) return -1.0;
    double left = timeout_s -
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return std::max(left, 0.0);
  };
  inline_waiters_.fetch_add(1);
  struct Leave {
    Runtime* rt;
    ~Leave() { rt->LeaveInline(); }
  } leave{this};
  while (true) {
    // Read before trying the lock: a kick after this wakes the sleep below.
    const uint64_t kick = handles_.kicks();
    if (handles_.WaitRange(first, n, 0.0)) return true;
    bool ran = false, ended = false, progress = false;
    {
      std::unique_lock<std::mutex> lk(cycle_mu_, std::try_to_lock);
      if (lk.owns_lock()) {
        if (!ended_) {
          const int64_t finished = counters_.tensors.load();
          RunCycleLocked();
          progress = counters_.tensors.load() != finished;
          counters_.inline_cycles++;
          ran = true;
          ended = ended_;
        }
        ReleaseCycleLock(lk, 1);  // other waiters (not this one) retry now
      }
    }
    if (ran) {
      // After an ending the background thread fails what is left.
      if (ended) WakeBackground(true);
      if (timeout_s >= 0 && left_s() <= 0) return handles_.WaitRange(first, n, 0.0);
      // A cycle that finished nothing (the peers have not submitted these
      // tensors yet) is not repeated at once: the next one waits as long as
      // the background thread's busy pacing, so that two ranks whose callers
      // both wait do not run empty cycles back to back and starve the cores.
      // The first cycle of a wait is never delayed.
      if (!progress && !ended) {
        double pace_s = std::min(controller_.cycle_time_ms(config().cycle_time_ms), 0.1) / 1000.0;
        if (timeout_s >= 0) pace_s = std::min(pace_s, left_s());
        if (handles_.WaitRange(first, n, pace_s)) return true;
      }
      continue;
    }
    // Another thread runs a cycle (or the runtime ended): sleep until the
    // handles are done, the lock comes free, or the timeout.
    double left = left_s();
    if (timeout_s >= 0 && left <= 0) return handles_.WaitRange(first, n, 0.0);
    if (handles_.WaitRange(first, n, left, &kick)) return true;
  }
}

void Runtime::NotePaceLocked() {
  bool busy = false, everywhere = true;
  std::lock_guard<std::mutex> lk(sets_mu_);
  for (auto& [id, ps] : active_) {
    busy |= !ps->pending.empty() || ps->joined;
    everywhere &= ps->member();
  }
  busy_.store(busy);
  everywhere_.store(everywhere);
}

void Runtime::Loop() {
  {
    // Released like every other hold of the lock: a caller that waits right
    // after init() may have found it taken here, and sleeps until kicked.
    std::unique_lock<std::mutex> lk(cycle_mu_);
    NotePaceLocked();
    ReleaseCycleLock(lk, 0);
  }
  while (true) {
    const Wake wake = WaitForWork(busy_.load(), everywhere_.load());
    if (wake == Wake::kNone) continue;
    std::unique_lock<std::mutex> lk(cycle_mu_);
    // Woken for work that is gone: a caller came (during the grace, or before
    // this thread was even scheduled), ran the cycles itself and left with
    // nothing pending. A cycle now would be an empty one that every peer has
    // to match; a peer whose caller runs it with new work finds nothing
    // finished and paces before its next cycle (tens of microseconds on every
    // small collective). Timed cycles (heartbeats, busy pacing) and shutdown
    // run.
    const bool stale = wake == Wake::kWork && !shutdown_requested_.load() && !HasWorkLocked();
    if (!ended_ && !stale) RunCycleLocked();
    const bool ended = ended_;
    ReleaseCycleLock(lk, 0);  // callers that wait for the lock retry now
    if (ended) break;
  }
  // ended_ is set: no cycle runs any more, so the cycle-side state is ours.
  const ErrorCode code = end_code_;
  const std::string message = end_message_;
  if (failed_.load()) Log(0, message);
  if (failed_.load()) DumpFlightRecorder("the runtime failed: " + message);
  {
    std::lock_guard<std::mutex> lk(status_mu_);
    stop_code_ = code;
    stop_message_ = message;
    stopped_.store(true);
  }
  std::vector<std::shared_ptr<ProcessSet>> sets;
  {
    std::lock_guard<std::mutex> lk(sets_mu_);
    for (auto& [id, ps] : active_) sets.push_back(ps);
    for (auto& [id, ps] : staged_) sets.push_back(ps);
  }
  // Closing the communicators makes peers blocked on us fail at once instead
  // of waiting for their timeout; after a failure the device backends' too
  // (NCCL's are aborted: a finalize would wait for peers that are gone).
  if (failed_.load()) ops_.Abort(message);
  for (auto& ps : sets) ps->comm.reset();
  // Pending and newly enqueued operations fail naming themselves (and, when
  // peers shut down first, those peers); anything left (join) gets the plain message.
  for (auto& ps : sets) {
    std::vector<std::pair<std::string, OpType>> names;
    for (auto& [name, e] : ps->pending) names.emplace_back(name, e.req.op);
    for (auto& [name, op] : names) {
      Result res;
      res.code = code;
      {
        std::lock_guard<std::mutex> lk(status_mu_);
        res.message = StopMessageLocked(op, name);
      }
      Finish(*ps, name, std::move(res));
    }
    std::lock_guard<std::mutex> lk(ps->mu);
    for (Entry& e : ps->incoming) {
      Result res;
      res.code = code;
      {
        std::lock_guard<std::mutex> slk(status_mu_);
        res.message = StopMessageLocked(e.req.op, e.req.name);
      }
      handles_.Complete(e.handle, std::move(res));
    }
    ps->incoming.clear();
    ps->inflight.clear();
  }
  handles_.FailAll(code, message);
}

}  // namespace sdl
