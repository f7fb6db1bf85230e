// The runtime: everything one process needs to run collectives, built at
// init() and torn down at shutdown(). No globals: a test may build several.
//
// Why a background thread: collectives must run in the same order on every
// rank, but framework threads enqueue tensors in whatever order their
// backward pass produces them. Each rank runs a sequence of negotiation
// cycles (one lock, cycle_mu_, keeps them strictly sequential) that agree with
// the other ranks which enqueued tensors are ready everywhere and run them in
// the agreed order. The background thread runs the cycles nobody else runs:
// it wakes as soon as work is enqueued (no fixed sleep in front of small
// collectives) and otherwise runs an idle cycle every idle_cycle_ms
// (cycle_time_ms when some set excludes this rank) so that ranks notice each
// other's shutdown without spending CPU on empty negotiations. A caller that
// waits on an unfinished handle runs the cycles itself instead (WaitRange,
// knob inline_cycles; core/loop.cc explains why and how).
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/config.h"
#include "common/message.h"
#include "core/autotune.h"
#include "core/controller.h"
#include "core/counters.h"
#include "core/flight_recorder.h"
#include "core/handles.h"
#include "core/process_set.h"
#include "core/timeline.h"
#include "ops/operations.h"

namespace gloo {
namespace rendezvous { class Store; }
namespace transport { class Device; }
}  // namespace gloo

namespace sdl {

struct Topology {
  int rank = 0, size = 1;
  int local_rank = 0, local_size = 1;
  int cross_rank = 0, cross_size = 1;
};

struct RuntimeOptions {
  Topology topo;
  std::string hostname;  // address peers use for this rank's Gloo connections
  std::shared_ptr<gloo::rendezvous::Store> store;  // required when size > 1
  int epoch = 0;         // distinguishes successive init()s of one job in the store
  std::vector<std::vector<int32_t>> process_sets;  // extra sets registered at init
  Config config;
  // MPI (config.controller == "mpi"): the topology comes from MPI, not from topo.
  bool use_mpi = false;
  intptr_t mpi_comm_addr = 0;        // address of an MPI_Comm (mpi4py); 0: MPI_COMM_WORLD
  std::vector<int32_t> mpi_ranks;    // init(comm=[ranks]): a subset of MPI_COMM_WORLD
  // Registers more device memories and backends before the background thread
  // starts (C++ tests: a fake device).
  std::function<void(Operations&)> add_ops;
};

class Runtime {
 public:
  static constexpr const char* kShutDownMessage = "spark_dl has been shut down";

  explicit Runtime(RuntimeOptions opts);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  // Agrees with the other ranks to stop (the first rank that asks stops all),
  // fails what is still pending, and joins the background thread. Idempotent.
  void Shutdown();

  // Enqueues one operation on process set ps_id and returns its handle.
  // in/out are caller memory that must stay valid until the handle is done;
  // out == nullptr asks the core to allocate the output (allgather, alltoall,
  // reducescatter; allreduce with core_output). Throws sdl::Error for bad
  // calls (unknown set, duplicate in-flight name, invalid arguments) and after
  // a failure or shutdown.
  // core_output (allreduce, out == nullptr): the core allocates the output
  // from its output pool (see Buffer in handles.h) and returns it as the
  // result's first output. stream: the framework's stream that produced a
  // device tensor (DLPack's stream protocol; 0: the default stream).
  int64_t Enqueue(int32_t ps_id, Request req, const void* in, void* out,
                  bool core_output = false, uintptr_t stream = 0);

  // One operation of a batch: Enqueue's arguments.
  struct Submission {
    Request req;
    const void* in = nullptr;
    void* out = nullptr;
    bool core_output = false;
    uintptr_t stream = 0;  // the framework's stream of a device tensor (see Enqueue)
  };
  // Enqueues a batch on one set, all or nothing (every submission is checked
  // before any is queued), under one lock and with one wake-up of the
  // background thread. Returns the first of subs.size() consecutive handles,
  // in submission order. What a step's gradients need: a per-tensor Enqueue
  // wakes the background thread for each tensor, which then runs cycles on
  // the first few while the caller is still enqueueing the rest.
  int64_t EnqueueMany(int32_t ps_id, std::vector<Submission> subs);

  // Registers a new process set (every rank calls it, in the same order).
  // Members connect before this returns; the set becomes usable on every rank
  // in the same cycle, when the returned handle completes. Returns {id, handle}.
  std::pair<int32_t, int64_t> AddProcessSet(std::vector<int32_t> ranks);
  int64_t RemoveProcessSet(int32_t id);
  std::vector<int32_t> ProcessSetRanks(int32_t id);
  std::vector<int32_t> ProcessSetIds();
  std::string TransportOf(int32_t id);

  // Waits until every handle of [first, first + n) is done (true) or
  // timeout_s (< 0: no limit) passed (false). With inline_cycles on, the
  // caller runs this rank's cycles while it waits, whenever no other thread
  // runs one; a cycle in progress is finished before the timeout is checked,
  // so a wait may overrun it by one cycle: usually by at most a peer's idle
  // heartbeat (idle_cycle_ms; an idle peer's background thread matches the
  // cycle that often), by the transport timeout when a peer hangs. The Python
  // binding waits in 50 ms slices and checks for signals between them, so
  // Ctrl-C lands within that bound too (measured: an alarm during a wait on
  // a peer 3 s late was handled after 0.50 s, with or without inline cycles).
  // Throws when a handle is unknown.
  bool WaitRange(int64_t first, int64_t n, double timeout_s);

  HandleTable& handles() { return handles_; }
  const Topology& topology() const { return opts_.topo; }
  Counters& counters() { return counters_; }
  const Operations& operations() const { return ops_; }
  Config config();
  void SetKnob(const std::string& name, const std::string& value);
  bool failed() const { return failed_.load(); }
  // Starts/stops rank 0's timeline (core/timeline.h) at run time; on other
  // ranks both do nothing and StartTimeline returns false (only rank 0 sees
  // every rank's readiness). Throws when the file cannot be created.
  bool StartTimeline(const std::string& path, bool mark_cycles);
  void StopTimeline();
  Timeline* timeline() { return timeline_.get(); }
  const FlightRecorder& flight_recorder() const { return recorder_; }
  // Autotune's parameters in force on this rank and their history (any thread).
  Controller::TunedHistory autotune_state() { return controller_.tuned_history(); }

 private:
  std::shared_ptr<ProcessSet> MakeProcessSet(int32_t id, std::vector<int32_t> ranks);
  std::unique_ptr<Comm> MakeComm(int32_t id, const std::vector<int32_t>& ranks, int my_rank);
  std::unique_ptr<Comm> MakeShm(const std::string& tag, const std::vector<int32_t>& ranks, int my);
  std::unique_ptr<Comm> MakeNetwork(const std::string& tag, const std::vector<int32_t>& ranks, int my);
  void InitMpi();   // MPI world, topology, host identities and job token
  void InitStore();  // the same through the rendezvous store
  std::shared_ptr<ProcessSet> FindSet(int32_t id);
  // Throws the stop error when the runtime stopped (or is stopping); req, when
  // given, is the operation the caller tried, for the message.
  void CheckUsable(const Request* req = nullptr);
  // Why an operation cannot run once the runtime stopped (status_mu_ held): the
  // failure, this rank's own shutdown, or the peers that shut down first.
  std::string StopMessageLocked(OpType op, const std::string& name) const;
  // Enqueue's argument checks for one submission on ps; allocates a core
  // output when asked (sub.out then points into *output).
  void CheckSubmission(const ProcessSet& ps, Submission& sub, std::shared_ptr<Buffer>* output);
  void Loop();
  // Moves newly enqueued entries of a set to the cycle side.
  void Intake(ProcessSet& ps);
  // Sleeps until work, a timeout or shutdown, and says why it woke: kNone
  // when callers run the cycles inline (the background thread stands down),
  // kTimer for its pacing timer, kWork for new work (or shutdown).
  enum class Wake { kNone, kTimer, kWork };
  Wake WaitForWork(bool busy, bool everywhere);
  // One cycle of every set this rank belongs to (cycle_mu_ held, !ended_).
  // Records the ending (agreed stop or failure) in ended_/end_code_/end_message_.
  void RunCycleLocked();
  // Whether any set has work a cycle must advance (cycle_mu_ held).
  bool HasWorkLocked();
  void WakeBackground(bool notify);
  void LeaveInline();
  // Records (cycle_mu_ held) what paces the background thread's next wait:
  // whether tensors are pending or this rank joined, and whether it belongs
  // to every set (read without the lock by WaitForWork).
  void NotePaceLocked();
  // Unlocks cycle_mu_ and kicks the callers that wait for it (more than
  // `mine`: the caller's own count).
  void ReleaseCycleLock(std::unique_lock<std::mutex>& lk, int mine);
  void Execute(ProcessSet& ps, const Response& r, bool from_cache);
  void Finish(ProcessSet& ps, const std::string& name, Result result);
  void ExecAllreduce(ProcessSet& ps, const Response& r);
  void ExecAllgather(ProcessSet& ps, const Response& r);
  void ExecBroadcast(ProcessSet& ps, const Response& r);
  void ExecAlltoall(ProcessSet& ps, const Response& r);
  void ExecReducescatter(ProcessSet& ps, const Response& r);
  void ExecProcessSetChange(ProcessSet& ps, const Response& r);
  void FailSet(ProcessSet& ps, ErrorCode code, const std::string& msg);
  void Log(int level, const std::string& msg);
  // Dumps this rank's flight recorder (reason: why) to stderr, bounded, and to
  // the knob flight_recorder_dir when set. Any thread.
  void DumpFlightRecorder(const std::string& why);
  // Rank 0 of a set (its coordinator): where the members parted ways, for a
  // failure's message ("" when no set's table shows it; cycle_mu_ held).
  std::string DivergenceLocked();

  RuntimeOptions opts_;
  std::mutex config_mu_;
  Config config_;
  FlightRecorder recorder_;  // before controller_: the hooks run from its callbacks
  HandleTable handles_;
  Counters counters_;
  Controller controller_;
  Operations ops_;  // backends, device memories, fusion buffers (background thread)
  std::string job_token_;
  std::vector<std::string> host_of_rank_;
  std::vector<std::string> host_name_of_rank_;  // what messages print per rank
  std::shared_ptr<gloo::transport::Device> gloo_device_;
  void* mpi_world_ = nullptr;  // MPI_Comm* (kept opaque so this header needs no mpi.h)

  std::mutex sets_mu_;
  std::map<int32_t, std::shared_ptr<ProcessSet>> active_;
  std::map<int32_t, std::shared_ptr<ProcessSet>> staged_;  // added, not yet agreed
  int32_t next_set_id_ = 1;

  // Cycles (see the top of this file). ended_: a cycle agreed to stop or
  // failed; no cycle runs after that and the background thread cleans up.
  std::mutex cycle_mu_;
  std::atomic<bool> ended_{false};  // written under cycle_mu_; read without it to stop standing down
  ErrorCode end_code_ = ErrorCode::kShutdown;
  std::string end_message_;
  bool inline_ok_ = true;                 // false under MPI without THREAD_MULTIPLE
  std::atomic<int> inline_waiters_{0};    // callers inside WaitRange running cycles
  std::atomic<bool> busy_{false}, everywhere_{true};  // see NotePaceLocked

  std::mutex wake_mu_;
  std::condition_variable wake_cv_;
  bool work_ = false;
  bool grace_ = false;  // in WaitForWork's grace wait (under wake_mu_)
  std::atomic<bool> shutdown_requested_{false};
  std::atomic<bool> stopped_{false};
  std::atomic<bool> failed_{false};
  std::mutex status_mu_;
  ErrorCode stop_code_ = ErrorCode::kShutdown;
  std::string stop_message_;
  // Set when the ranks agreed to stop because others asked: the ranks that did.
  std::vector<int32_t> stopped_by_peers_;
  std::thread thread_;
  std::unique_ptr<Timeline> timeline_;  // rank 0 only
  std::unique_ptr<Autotuner> tuner_;    // rank 0 with knob autotune; cycle side only
};

}  // namespace sdl
