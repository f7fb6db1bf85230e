// A process set: a group of ranks that runs collectives among themselves,
// with its own communicator, queue, response cache and coordinator state.
// Set 0 is the global set (every rank).
#pragma once

#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "comm/comm.h"
#include "common/message.h"
#include "core/handles.h"
#include "core/response_cache.h"
#include "ops/device_memory.h"

namespace sdl {

// One operation this rank enqueued and has not finished.
struct Entry {
  Request req;
  const void* in = nullptr;  // caller memory (kept alive by the caller until done)
  void* out = nullptr;       // caller memory, or null when the core allocates
  std::shared_ptr<Buffer> output;  // core-allocated out (allreduce), handed back on success
  int64_t handle = 0;
  uintptr_t stream = 0;      // the framework's stream for device tensors (0: default)
  // Device tensors: what stream had queued at enqueue (the tensor's producer),
  // recorded under the set's lock, so on one stream marks follow seq order.
  // Dropped once the core's stream waited for it.
  std::shared_ptr<const ReadyMark> ready;
  bool sent = false;         // already sent to the coordinator
  double since = 0;          // steady-clock seconds when the background thread took it in
  uint64_t seq = 0;          // intake order within its set (requests go out in this order)
  uint64_t flight_id = 0;    // its flight-recorder record (0: none)
};

// What the coordinator (member 0) knows of one name across the set's members.
struct PendingName {
  std::vector<Request> reqs;   // per member (valid where have[i])
  std::vector<bool> have;
  std::vector<double> when;    // per member: steady-clock seconds its request arrived
  int count = 0;
  double first_seen = 0;       // steady-clock seconds when the first request arrived
};

struct Coordinator {
  std::map<std::string, PendingName> table;
  std::vector<std::string> order;  // arrival order of names
  std::vector<bool> joined;
  int last_joined = -1;
  double stall_warned_at = 0;      // steady-clock seconds of the last stall warning
  bool Empty() const { return table.empty(); }
};

struct ProcessSet {
  ProcessSet(int32_t id, std::vector<int32_t> ranks, int32_t my_rank, size_t cache_capacity)
      : id(id), ranks(std::move(ranks)), my_rank(my_rank), cache(cache_capacity) {}

  const int32_t id;
  const std::vector<int32_t> ranks;  // global ranks, ascending
  const int32_t my_rank;             // index in ranks, -1 when not a member
  std::unique_ptr<Comm> comm;
  // comm->kind() when the set was made ("" when not a member): what transport()
  // reports, also after a stop has released comm (another thread may be releasing it).
  std::string transport;

  // Caller side (guarded by mu): new work and names in flight.
  std::mutex mu;
  std::deque<Entry> incoming;
  std::unordered_set<std::string> inflight;

  // Background-thread side.
  std::unordered_map<std::string, Entry> pending;
  uint64_t next_seq = 0;     // Entry::seq of the next one taken in
  ResponseCache cache;
  Coordinator coord;
  bool joined = false;        // this rank called join and waits for the others
  int64_t join_handle = 0;

  bool member() const { return my_rank >= 0; }
  int size() const { return static_cast<int>(ranks.size()); }
};

}  // namespace sdl
