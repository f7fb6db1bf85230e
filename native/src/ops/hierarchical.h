// Hierarchical allreduce for device tensors (SDL_HIERARCHICAL_ALLREDUCE):
//   1. reduce-scatter among the members on one host (device collectives: NCCL),
//      so local rank l holds shard l of its host's reduction;
//   2. allreduce of that shard across hosts, among the members with the same
//      local rank, over the CPU transport (the shard staged through host memory);
//   3. allgather of the shards among the members on the host (NCCL).
// Each host's data crosses the network once in total (split over its local
// ranks) instead of once per rank, and the intra-host steps run over NVLink/PCIe.
//
// The orchestration (HierarchicalAllreduce) is written against two small
// interfaces and DeviceMemory, so the C++ tests run this very code with several
// threads, a fake device over host memory and shared-memory communicators
// (native/tests/hierarchical_test.cc); the NCCL backend supplies the real ones.
//
// Which ops: every reduction the flat path has (Sum, Min, Max, Product;
// Average arrives as Sum and the operations layer divides), since each is
// elementwise, associative and commutative. The flat path is used instead
// when the hosts of a process set hold different numbers of its members (the
// shards would not line up), see MakeHostLayout.
//
// Determinism: every member of a cross-host group reduces the same pieces in
// host order, so the ranks of a group end bit-identical; the intra-host steps
// are NCCL's (its reduce-scatter is deterministic for a fixed communicator).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "common/status.h"
#include "common/types.h"
#include "ops/device_memory.h"

namespace sdl {

// Where every member of a process set sits: members indexed as in the set.
struct HostLayout {
  std::vector<int> host;         // per member: index of its host (order of first appearance)
  std::vector<int> local;        // per member: its index among its host's members
  int me = 0;                    // this member's index in the set
  int hosts = 1;                 // number of hosts
  int local_size = 1;            // members per host (the same on every host)
  int local_rank() const { return local[me]; }
  int host_index() const { return host[me]; }
  // Set indices of the members with local rank l, in host order.
  std::vector<int> Group(int l) const;
};

// Builds the layout from each member's host identity. Returns false (use the
// flat path) when the hosts hold different numbers of members. Every member
// passes the same identities, so every member gets the same answer.
bool MakeHostLayout(const std::vector<std::string>& host_of_member, int me, HostLayout* out);

// The per-host communicators' ids: every member of the set calls it (one
// allgather over comm, the set's CPU communicator); on each host's first member
// (local rank 0) *id holds the id it made, and every member leaves with its own
// host's first member's id in *id. Throws sdl::Error as comm does.
void ExchangeHostIds(Comm& comm, const HostLayout& layout, std::string* id);

// count elements split into `parts` shards: the first count % parts shards
// hold one element more (shards may be empty when count < parts).
std::vector<size_t> ShardCounts(size_t count, int parts);

// Device collectives among the members on one host (NCCL's per-host
// communicator in production). Both may queue work on the device instead of
// finishing it, as long as later DeviceMemory copies on the device are
// ordered after it (the NCCL implementation brackets its stream with the core's).
class IntraHost {
 public:
  virtual ~IntraHost() = default;
  // out (counts[local rank] elements) = this member's shard of the reduction
  // of every local member's in (sum(counts) elements).
  virtual Status Reducescatter(const void* in, void* out, const std::vector<size_t>& counts,
                               DataType dt, ReduceOp op) = 0;
  // out = every local member's in (counts[l] elements each) back to back.
  virtual Status Allgather(const void* in, void* out, const std::vector<size_t>& counts,
                           DataType dt) = 0;
};

// The CPU transport among the members with the same local rank (one per host).
class AcrossHosts {
 public:
  virtual ~AcrossHosts() = default;
  // In place over host memory holding this member's shard
  // (shard_counts[local rank] elements): the reduction over its group. Every
  // member of the process set calls it once per hierarchical allreduce, with
  // the same shard_counts (every local rank's shard size).
  virtual Status Allreduce(void* host, const std::vector<size_t>& shard_counts, DataType dt,
                           ReduceOp op) = 0;
};

// AcrossHosts over the process set's own CPU communicator (every member): one
// Alltoallv in which each member sends its shard to the other members of its
// group only, then each reduces the hosts' shards in host order. No further
// communicators are needed; each member sends (hosts - 1) shards, as a direct
// allreduce among the group would (a ring across many hosts would send less:
// not done).
class CommAcrossHosts : public AcrossHosts {
 public:
  // comm: the set's communicator (members ranked as in the layout); both not owned.
  CommAcrossHosts(Comm* comm, const HostLayout* layout) : comm_(comm), layout_(layout) {}
  Status Allreduce(void* host, const std::vector<size_t>& shard_counts, DataType dt,
                   ReduceOp op) override;

 private:
  Comm* comm_;
  const HostLayout* layout_;
  std::vector<char> send_, recv_;
};

// Scratch a hierarchical allreduce reuses: the shard on the device and its
// host staging copy (DeviceMemory::AllocStaging: pinned for CUDA), grown on demand.
class HierarchicalScratch {
 public:
  explicit HierarchicalScratch(DeviceMemory* memory) : memory_(memory) {}
  ~HierarchicalScratch();
  HierarchicalScratch(const HierarchicalScratch&) = delete;
  HierarchicalScratch& operator=(const HierarchicalScratch&) = delete;
  Status Reserve(Device d, size_t bytes, void** device_shard, void** host_shard);

 private:
  void Release();
  DeviceMemory* memory_;
  Device device_;
  void* device_shard_ = nullptr;
  void* host_shard_ = nullptr;
  size_t capacity_ = 0;
};

// out (count elements, on device d) = the reduction of every member's in; in
// == out is in place. Collective over every member of the layout's set; each
// passes the same count, dt and op. across.Allreduce is skipped when there is
// one host, the intra-host steps still run (the 1-GPU check exercises them).
Status HierarchicalAllreduce(const HostLayout& layout, IntraHost& local, AcrossHosts& across,
                             DeviceMemory& memory, HierarchicalScratch& scratch, Device d,
                             const void* in, void* out, size_t count, DataType dt, ReduceOp op);

}  // namespace sdl
