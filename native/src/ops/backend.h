// A collective backend: one way of running a negotiated response's data
// movement (NCCL on the GPU, the process set's CPU transport, or the CPU
// transport staged through host memory for device tensors).
//
// The operations layer (ops/operations.h) picks one backend per response, the
// first enabled one in a fixed priority order (kPriority* below), and does
// everything around the collective itself: fusion buffers per (device, dtype,
// process set), pack/unpack with prescale/postscale through the device's
// DeviceMemory, stream hooks, and output allocation. A backend therefore only
// moves bytes that already sit in memory of the response's device:
//  - every pointer it gets lives on ctx.device (host memory for host
//    tensors, device memory for CUDA tensors) and stays valid for the call;
//  - it runs in order on the background thread; it may queue work on the
//    device's stream instead of finishing it (the layer's SignalStream hook and
//    any later CopyToHost are ordered after it) — host transports finish it;
//  - Average never reaches it (the layer reduces Average as Sum and divides);
//  - failures come back as a Status or as sdl::Error from a transport; either
//    ends the runtime like a transport failure (every pending op fails).
// Contract on Enabled: every member must give the same answer for one response
// (the response is identical everywhere; the device's memory kind too), so the
// answer may depend on the build and on what the host can do only when every
// host can do the same (a GPU backend checks that at init). Enabled is also
// called at enqueue on the caller's thread (Operations::CheckServable), so it
// may read only state fixed before the background thread started.
//
// Adding a backend: implement this interface in src/ops/ (or src/gpu/ for
// CUDA sources) and register it in Runtime's constructor with
// Operations::AddBackend(priority, backend); see docs/core.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "common/message.h"
#include "common/status.h"
#include "common/types.h"

namespace sdl {

struct ProcessSet;

// Fixed priority order: lower runs first when enabled.
constexpr int kPriorityDevice = 0;   // device-native collectives (NCCL) for CUDA tensors
constexpr int kPriorityStaged = 10;  // CUDA tensors through host memory and the CPU transport
constexpr int kPriorityHost = 20;    // the set's CPU transport (shm, Gloo, MPI) for host tensors

struct OpContext {
  ProcessSet& ps;            // the process set (its communicator, rank, size)
  const Response& response;  // the negotiated response being run
  Device device;             // this rank's device for the response's tensors
};

class OpBackend {
 public:
  virtual ~OpBackend() = default;
  virtual const char* name() const = 0;
  // True when this backend runs response r for tensors on device d.
  virtual bool Enabled(const Response& r, Device d) const = 0;

  // out (count elements) receives the reduction of every member's in; in == out
  // is in place.
  virtual Status Allreduce(const OpContext& ctx, const void* in, void* out, size_t count,
                           DataType dt, ReduceOp op) = 0;
  // In place over host spans taken as one buffer of count elements (see
  // Comm::AllreduceSpans): a fused allreduce without packing. *done false: no
  // such path here (then on no member), the caller packs.
  virtual Status AllreduceSpans(const OpContext& ctx, const std::vector<Comm::Span>& spans,
                                size_t count, DataType dt, ReduceOp op, bool* done) {
    *done = false;
    return Status::OK();
  }
  // Member r contributes bytes[r] bytes; out receives them concatenated in member order.
  virtual Status Allgatherv(const OpContext& ctx, const void* in, void* out,
                            const std::vector<size_t>& bytes) = 0;
  // root: index of the root in the process set.
  virtual Status Broadcast(const OpContext& ctx, void* buf, size_t bytes, int root) = 0;
  // matrix[src * size + dst]: bytes src sends to dst.
  virtual Status Alltoallv(const OpContext& ctx, const void* in, void* out,
                           const std::vector<size_t>& matrix) = 0;
  // out (counts[rank] elements) receives this member's slice of the reduction.
  virtual Status Reducescatter(const OpContext& ctx, const void* in, void* out,
                               const std::vector<size_t>& counts, DataType dt, ReduceOp op) = 0;
  // A process set was removed: drop what the backend keeps for it (NCCL
  // communicators). Background thread.
  virtual void ReleaseSet(int32_t ps_id) {}
  // Once per cycle of the background thread, before it runs responses: a
  // bounded, non-blocking health check of work a backend queued and returned
  // from (NCCL reports errors of queued collectives asynchronously). A failure
  // ends the runtime like a transport failure: every in-flight and later
  // handle fails with the message.
  virtual Status Poll() { return Status::OK(); }
  // The runtime failed (a peer or a transport): end what the backend may still
  // wait on, so that neither this rank's teardown nor its peers block on it
  // (NCCL: abort the communicators instead of finalizing them). Background thread.
  virtual void Abort(const std::string& why) {}

  // Counter key of this backend (counters()["backend.<key>"]: responses it ran).
  virtual const char* key() const = 0;
  // Adds this backend's own counters (e.g. which of its paths ran) to *out.
  virtual void AddCounters(std::map<std::string, int64_t>* out) const {}
};

}  // namespace sdl
