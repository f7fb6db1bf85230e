// The flight recorder: each rank's ring of its last N collectives, dumped when
// a job fails, so that the rank (and the collective) where the ranks parted
// ways can be named afterwards.
//
// What a record holds: the operation (name, op, shape, dtype, process set)
// and four times on the steady clock, in seconds since the recorder was made
// (the runtime's init): taken in by the cycle side (Runtime::Intake), the start
// of the negotiation cycle that agreed on it (not before it was taken in: a
// cycle takes new work in after it began), the start of its execution, and
// its completion (with the result's error code). 0 means "not reached": a dump
// shows how far each collective got. wall_base() converts to wall time.
//
// Cost: the hooks run on the thread that runs the cycle (cycle_mu_ held) and
// take an uncontended mutex (the Python accessor and the dump read from other
// threads); records live in a preallocated ring whose slots keep their
// strings' and shapes' memory, and a record is found by its id (kept in the
// operation's Entry), so steady state allocates nothing: tens of ns per
// collective (benchmarks/flight_recorder.py). With capacity 0 every hook
// returns at once.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "common/message.h"
#include "core/process_set.h"

namespace sdl {

struct FlightRecord {
  uint64_t id = 0;          // this rank's sequence number of the collective (from 1)
  int32_t process_set = 0;
  std::string name;
  OpType op = OpType::kAllreduce;
  DataType dtype = DataType::kFloat32;
  std::vector<int64_t> shape;
  double enqueued = 0, negotiated = 0, started = 0, done = 0;  // 0: not reached
  bool from_cache = false;  // negotiated through the response cache
  ErrorCode code = ErrorCode::kOk;  // valid once done != 0
};

class FlightRecorder {
 public:
  explicit FlightRecorder(size_t capacity);

  size_t capacity() const { return ring_.size(); }
  // Wall-clock seconds (Unix epoch) of time 0 of the records.
  double wall_base() const { return wall_base_; }

  // The hooks (cycle thread). Enqueued returns the record's id (0 when off),
  // which the operation's Entry keeps (Entry::flight_id): the later hooks
  // find the record by it, with no lookup of their own. CycleStarted stamps
  // the time later Started calls record as their negotiation time.
  // steady_s: the intake time the caller already read (steady clock, seconds since
  // its epoch), so that this hook reads no clock.
  uint64_t Enqueued(int32_t ps, const Request& req, double steady_s);
  void CycleStarted();
  void Started(const ProcessSet& ps, const Response& r, bool from_cache);
  void Done(uint64_t id, ErrorCode code);

  // The records still in the ring, oldest first.
  std::vector<FlightRecord> Snapshot() const;

  // A dump: a bounded text for the log (the last max_lines records, newest
  // last, under a header naming rank, host, reason) and the full ring as JSON.
  std::string Text(int rank, const std::string& host, const std::string& reason,
                   size_t max_lines) const;
  std::string Json(int rank, const std::string& host, const std::string& reason) const;

  double Now() const;

 private:
  FlightRecord* Find(uint64_t id);  // mu_ held; null once overwritten

  mutable std::mutex mu_;
  std::vector<FlightRecord> ring_;
  uint64_t next_id_ = 1;
  double steady_base_ = 0, wall_base_ = 0, cycle_start_ = 0;
};

// One record as a line: "#12 allreduce 'grad.w' set 0 float32 [2, 3]: taken in 1.204 s, ...".
std::string FlightRecordLine(const FlightRecord& r);

}  // namespace sdl
