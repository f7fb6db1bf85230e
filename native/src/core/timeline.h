// The timeline: a Chrome-trace JSON file (Perfetto, chrome://tracing) of what
// rank 0's core does with every tensor (docs/observability.md, "Timeline").
//
// Only rank 0 records: its coordinator sees every rank's readiness. One row
// (thread) per tensor name; on it, from the core's threads:
//   NEGOTIATE_<OP>  first request seen by the coordinator -> ready everywhere,
//                   with an instant "rank N ready" tick per member as its
//                   request arrives (a response-cache hit has no ticks: no
//                   rank reports anything; the span then starts at rank 0's
//                   intake and carries args.cached);
//   QUEUE           ready -> this response's execution starts;
//   <OP>            the execution, with the inner phases the operations layer
//                   knows nested in it (MEMCPY_IN_FUSION_BUFFER, the transport
//                   operation named after the backend, MEMCPY_OUT_FUSION_BUFFER);
// and, when asked, a CYCLE_START instant per negotiation cycle.
//
// Off the critical path: producers (the thread running a cycle, which holds
// the cycle lock, and callers' threads) only push small records into a
// bounded lock-free queue and never wait; when it is full the record is
// dropped and counted. One writer thread drains the queue every few
// milliseconds, pairs the records into spans and appends them to the file.
//
// The file is valid JSON after every write: it always ends with "]". Each
// batch is one pwrite that starts on that "]" and ends with a new one, so a
// reader (or a job killed by SIGKILL) sees either the previous complete array
// or the new one; only a reader racing a single write call can see a torn
// tail, and a retry reads a whole file.
//
// Start/Stop may be called at any time from any thread (Python's
// start_timeline/stop_timeline); records carry the session they were made in,
// so a record produced just before a Stop never lands in the next file.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/message.h"
#include "common/types.h"

namespace sdl {

struct Response;

class Timeline {
 public:
  // capacity: records the queue holds (rounded up to a power of two, >= 2).
  explicit Timeline(size_t capacity = 65536);
  ~Timeline();
  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;

  // Opens (truncates) path and starts the writer; stops a running session
  // first. Throws sdl::Error when the file cannot be created.
  void Start(const std::string& path, bool mark_cycles);
  // Drains what is queued, writes the drop count and closes. Idempotent.
  void Stop();

  // The hot check every hook makes first (one relaxed load).
  bool on() const { return on_.load(std::memory_order_relaxed); }
  bool mark_cycles() const { return mark_cycles_.load(std::memory_order_relaxed); }
  int64_t dropped() const { return dropped_.load(); }
  int64_t written() const { return written_.load(); }
  std::string path();

  // Producer side; every call returns at once (drops when the queue is full).
  // Times are steady-clock seconds. ps: process set id (rows of other sets
  // than the global one are labelled with it).
  void Tick(int32_t ps, const std::string& name, int32_t rank, double t);
  // The response r is ready on this rank at t (from the cache or after the
  // coordinator's broadcast); since: rank 0's intake time of its first name,
  // where a cache hit's NEGOTIATE starts.
  void Ready(int32_t ps, const Response& r, double since, double t, bool cached);
  // Execution of r starts (Begin) and ends (End, the outer span named after
  // the operation; transport names the set's transport). Between them,
  // Phase adds inner spans to every name of r. Called by the thread running
  // the cycle (one at a time).
  void Begin(int32_t ps, const Response& r, double t);
  void Phase(const std::string& phase, double t0, double t1);
  void End(const std::string& transport, double t);
  void Cycle(double t);

  enum class Kind : uint8_t { kTick, kReady, kSpan, kOuter, kCycle };
  struct Record {
    Kind kind = Kind::kTick;
    bool cached = false;
    OpType op = OpType::kAllreduce;
    int32_t ps = 0;
    int32_t rank = 0;
    uint32_t session = 0;
    double t0 = 0, t1 = 0;
    std::string name;  // tick: the tensor; span/outer: the phase; outer: transport in args
    std::shared_ptr<const std::vector<std::string>> names;  // ready/span/outer: the response's
  };

 private:
  struct Cell {
    std::atomic<size_t> seq{0};
    Record rec;
  };
  // A record of the response Begin started (its set, op and names).
  Record Current(Kind kind, double t0, double t1, const std::string& name) const;
  bool Push(Record&& rec);
  bool Pop(Record* rec);
  void WriterLoop();

  // Vyukov's bounded multi-producer queue (one consumer here): each cell's
  // seq says whether it is free for the producer at that position or filled
  // for the consumer; a full queue fails the push instead of waiting.
  std::vector<Cell> cells_;
  size_t mask_;
  std::atomic<size_t> head_{0};  // next position to fill
  std::atomic<size_t> tail_{0};  // next position to drain

  std::atomic<bool> on_{false}, mark_cycles_{false};
  std::atomic<uint32_t> session_{0};
  std::atomic<int64_t> dropped_{0}, written_{0};
  std::mutex control_mu_;  // Start/Stop
  std::string path_;
  std::atomic<bool> stop_writer_{false};
  std::thread writer_;
  int fd_ = -1;
  int64_t end_ = 0;  // offset of the file's closing "]" (writer thread)
  double t0_ = 0;  // steady-clock seconds of the session's start (ts 0)

  // The response being executed (Begin..End; cycle thread only).
  int32_t cur_ps_ = 0;
  OpType cur_op_ = OpType::kAllreduce;
  double cur_start_ = 0;
  std::shared_ptr<const std::vector<std::string>> cur_names_;
};

// Steady-clock seconds, the clock every timeline record uses.
double TimelineNow();

}  // namespace sdl
