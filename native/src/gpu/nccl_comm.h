// NCCL communicators and the collectives the operations layer runs on CUDA
// tensors. One NcclCommunicator per (process set, device): it owns its NCCL
// communicator and a CUDA stream; every operation is enqueued on that stream and
// returns at once (no host synchronization), so the caller orders work with events:
//
//   framework stream ──record──> input_ready ──WaitFor──> comm stream:
//       PackFusion (kernels.h) -> Allreduce -> UnpackFusion -> RecordDone(done)
//   done ──MakeStreamWait──> framework stream (the result is ready there), or
//   done.Query() on the background thread to complete the handle.
//
// Contract (as for every collective in the core): all ranks of the set call the
// same operations, with the same counts/dtype/op/root, in the same order; the
// controller's negotiated responses give that order. Counts are elements of the
// given dtype. Allgather/broadcast/alltoall move bytes, so every dtype works.
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/types.h"
#include "gpu/cuda_util.h"
#include "gpu/nccl_api.h"
#include "gpu/status.h"

namespace sdl {
namespace gpu {

struct NcclOptions {
  // Bound on creating a communicator (every rank must join) and on any NCCL call
  // the non-blocking communicator reports as still in progress. Past it the
  // communicator is aborted and the call fails (a peer died or hangs).
  double timeout_s = 300.0;
  // Priority of the communicator's stream (cudaStreamCreateWithPriority: lower
  // is more urgent). Gradients compete with the backward pass; 0 is default.
  int stream_priority = 0;
};

// Exchanges the NCCL unique id: on the set's rank 0 *id_bytes holds the id
// (128 bytes) to send; on every other rank the callback fills it with rank 0's.
// The controller provides it (a broadcast over its transport, bounded in time).
using BroadcastFromRoot = std::function<Status(std::string* id_bytes)>;

class NcclCommunicator {
 public:
  // Collective over the `size` ranks of one process set: each calls Create with
  // its own rank in the set and its device. Blocks until every rank joined or
  // options.timeout_s passed.
  static Status Create(int device, int rank, int size, const BroadcastFromRoot& broadcast,
                       const NcclOptions& options, std::unique_ptr<NcclCommunicator>* out);
  ~NcclCommunicator();
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int device() const { return device_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  cudaStream_t stream() const { return stream_.get(); }

  // --- ordering with the framework ---
  // The communicator's stream waits (on the device) for the work `input_ready`
  // captured. Record it on the framework's stream when the tensor is enqueued
  // (later work on that stream must not be waited for).
  Status WaitFor(cudaEvent_t input_ready);
  // Same for everything submitted to `framework_stream` so far.
  Status WaitForStream(cudaStream_t framework_stream);
  // Records `done` on the communicator's stream: it completes when every
  // operation enqueued so far has.
  Status RecordDone(const Event& done);

  // --- collectives (enqueue on stream() and return) ---
  // recv = reduce over ranks of send; in place when send == recv. Average is a
  // Sum followed by a division by size in place (integers exactly, toward zero,
  // as the CPU operations do); a fused caller reduces with Sum and folds the
  // division into UnpackFusion instead.
  Status Allreduce(const void* send, void* recv, size_t count, DataType dt, ReduceOp op);
  // recv = the ranks' send buffers back to back, rank r's `counts[r]` elements
  // at offset sum(counts[0..r)). Unequal counts (ragged first dimension) run as
  // one broadcast per rank in a group.
  Status Allgather(const void* send, void* recv, const std::vector<size_t>& counts,
                   DataType dt);
  // buf on every rank = buf on `root` (a rank of the set).
  Status Broadcast(void* buf, size_t count, DataType dt, int root);
  // send_counts[p] elements to rank p (at offset sum(send_counts[0..p)) of
  // send), recv_counts[p] from rank p likewise into recv. Send/recv in a group.
  Status Alltoall(const void* send, const std::vector<size_t>& send_counts, void* recv,
                  const std::vector<size_t>& recv_counts, DataType dt);
  // send holds sum(counts) elements; recv gets this rank's block (counts[rank()]
  // elements) reduced over ranks. Unequal counts run as one reduce per rank.
  Status Reducescatter(const void* send, void* recv, const std::vector<size_t>& counts,
                       DataType dt, ReduceOp op);
  // Brackets several collectives into one NCCL launch (grouped ops). Nests.
  Status GroupStart();
  Status GroupEnd();

  // --- failure ---
  // An error NCCL found asynchronously (a peer's connection broke ...). Call
  // while waiting for a done event that takes long.
  Status CheckAsyncError();
  // Aborts the communicator: its pending operations end (their streams are
  // unblocked), every later call fails. Use when a peer failed or a wait timed out.
  void Abort(const std::string& why);
  bool failed() const { return !failure_.ok(); }

 private:
  NcclCommunicator() = default;
  // Turns a call's result into a Status: waits (bounded) while a non-blocking
  // call is in progress; on error marks the communicator failed.
  Status Finish(ncclResult_t r, const char* what);
  // Marks the communicator failed with msg and aborts it; inside an open group
  // the abort waits for the group's end (GroupEnd), since ncclGroupEnd must
  // not meet a communicator that was aborted (and freed) inside the group.
  Status Fail(const std::string& msg);
  Status Usable() const;

  const NcclApi* nccl_ = nullptr;
  const CudaApi* cuda_ = nullptr;
  ncclComm_t comm_ = nullptr;
  int device_ = -1, rank_ = -1, size_ = 0;
  NcclOptions options_;
  Stream stream_;
  Event stream_event_;  // for WaitForStream
  Status failure_;
  int group_depth_ = 0;
  std::string failed_in_group_;  // a failure inside the open group, aborted at its end
};

// The communicators of one runtime, by (process set id, device). Thread-safe.
class NcclCommunicators {
 public:
  explicit NcclCommunicators(NcclOptions options = NcclOptions()) : options_(options) {}

  // The communicator for (process_set_id, device), created on first use.
  // Creation is collective over the set (see NcclCommunicator::Create): every
  // rank of the set must reach its first Get for the pair in the same response.
  Status Get(int32_t process_set_id, int device, int rank, int size,
             const BroadcastFromRoot& broadcast, NcclCommunicator** out);
  // Destroys the communicators of a removed process set.
  void Erase(int32_t process_set_id);
  // Aborts every communicator (a peer failed; shutting down on error).
  void AbortAll(const std::string& why);
  // ncclCommGetAsyncError of every live communicator (non-blocking: the
  // operations layer calls it once per background cycle). On the first error:
  // aborts every communicator here and returns a failure naming the
  // communicator (`label` process set, device, rank of size) and NCCL's error.
  Status CheckAsyncErrors(const char* label);

 private:
  NcclOptions options_;
  std::mutex mu_;
  std::map<std::pair<int32_t, int>, std::unique_ptr<NcclCommunicator>> comms_;
};

}  // namespace gpu
}  // namespace sdl
