#include "gpu/nccl_comm.h"

#include <chrono>
#include <cstring>
#include <numeric>
#include <thread>

#include "gpu/kernels.h"

namespace sdl {
namespace gpu {
namespace {

using Clock = std::chrono::steady_clock;

// Polls a non-blocking communicator until its state leaves ncclInProgress or
// the deadline passes (then *timed_out). Short sleeps after a spin: creation
// takes milliseconds to seconds, a collective's enqueue microseconds.
ncclResult_t PollAsync(const NcclApi* nccl, ncclComm_t comm, Clock::time_point deadline,
                       bool* timed_out) {
  *timed_out = false;
  for (int spins = 0;; ++spins) {
    ncclResult_t state = ncclInProgress;
    ncclResult_t r = nccl->CommGetAsyncError(comm, &state);
    if (r != ncclSuccess) return r;
    if (state != ncclInProgress) return state;
    if (Clock::now() > deadline) {
      *timed_out = true;
      return ncclInProgress;
    }
    if (spins > 100) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

Clock::time_point Deadline(double timeout_s) {
  return Clock::now() + std::chrono::microseconds(static_cast<int64_t>(timeout_s * 1e6));
}

Status CheckCounts(const std::vector<size_t>& counts, int size, const char* op,
                   const char* what) {
  if (static_cast<int>(counts.size()) != size)
    return Status::Invalid(std::string(op) + ": " + what + " has " +
                           std::to_string(counts.size()) + " entries for " +
                           std::to_string(size) + " ranks");
  return Status::OK();
}

const char* Ptr(const void* base, size_t elements, size_t elem_size) {
  return static_cast<const char*>(base) + elements * elem_size;
}

}  // namespace

Status NcclCommunicator::Create(int device, int rank, int size,
                                const BroadcastFromRoot& broadcast, const NcclOptions& options,
                                std::unique_ptr<NcclCommunicator>* out) {
  if (size < 1 || rank < 0 || rank >= size)
    return Status::Invalid("NCCL communicator: rank " + std::to_string(rank) +
                           " is not in a set of " + std::to_string(size));
  std::string error;
  const NcclApi* nccl = Nccl(&error);
  if (!nccl) return Status::Failure(error);
  const CudaApi* cuda = Cuda(&error);
  if (!cuda) return Status::Failure(error);

  std::unique_ptr<NcclCommunicator> c(new NcclCommunicator());
  c->nccl_ = nccl;
  c->cuda_ = cuda;
  c->device_ = device;
  c->rank_ = rank;
  c->size_ = size;
  c->options_ = options;

  DeviceGuard guard(cuda, device);
  SDL_GPU_RETURN_IF_ERROR(guard.status());
  SDL_GPU_RETURN_IF_ERROR(Stream::Create(device, options.stream_priority, &c->stream_));
  SDL_GPU_RETURN_IF_ERROR(Event::Create(device, &c->stream_event_));

  // Rank 0 makes the id; the controller carries it to the others.
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  std::string id_bytes;
  if (rank == 0) {
    ncclResult_t r = nccl->GetUniqueId(&id);
    if (r != ncclSuccess) return Status::Failure(nccl->Describe(r, "ncclGetUniqueId"));
    id_bytes.assign(reinterpret_cast<const char*>(&id), sizeof(id));
  }
  SDL_GPU_RETURN_IF_ERROR(broadcast(&id_bytes));
  if (id_bytes.size() != sizeof(id))
    return Status::Failure("NCCL unique id from rank 0 has " + std::to_string(id_bytes.size()) +
                           " bytes, expected " + std::to_string(sizeof(id)));
  std::memcpy(&id, id_bytes.data(), sizeof(id));

  // Non-blocking: creation can be bounded (and aborted), unlike ncclCommInitRank,
  // which waits forever for a rank that never joins.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclResult_t r = nccl->CommInitRankConfig(&comm, size, id, rank, &config);
  if (r == ncclInProgress) {
    bool timed_out = false;
    r = PollAsync(nccl, comm, Deadline(options.timeout_s), &timed_out);
    if (timed_out) {
      nccl->CommAbort(comm);
      return Status::Failure("creating the NCCL communicator (rank " + std::to_string(rank) +
                             " of " + std::to_string(size) + ", device " +
                             std::to_string(device) + ") timed out after " +
                             std::to_string(options.timeout_s) +
                             " s: a rank of the set did not join");
    }
  }
  if (r != ncclSuccess) {
    Status s = Status::Failure(nccl->Describe(r, "ncclCommInitRankConfig", comm) + " (rank " +
                               std::to_string(rank) + " of " + std::to_string(size) +
                               ", device " + std::to_string(device) + ")");
    if (comm) nccl->CommAbort(comm);
    return s;
  }
  c->comm_ = comm;
  *out = std::move(c);
  return Status::OK();
}

NcclCommunicator::~NcclCommunicator() {
  if (!comm_) return;
  DeviceGuard guard(cuda_, device_);
  if (failure_.ok()) {
    // Finalize flushes the operations still queued, then destroy frees the
    // resources; both bounded, else abort.
    ncclResult_t r = nccl_->CommFinalize(comm_);
    if (r == ncclInProgress) {
      bool timed_out = false;
      r = PollAsync(nccl_, comm_, Deadline(options_.timeout_s), &timed_out);
    }
    if (r == ncclSuccess) {
      nccl_->CommDestroy(comm_);
      return;
    }
  }
  nccl_->CommAbort(comm_);
}

Status NcclCommunicator::Usable() const {
  if (!failure_.ok())
    return Status::Failure("the NCCL communicator failed earlier: " + failure_.message());
  return Status::OK();
}

Status NcclCommunicator::Finish(ncclResult_t r, const char* what) {
  if (r == ncclInProgress) {
    bool timed_out = false;
    r = PollAsync(nccl_, comm_, Deadline(options_.timeout_s), &timed_out);
    if (timed_out)
      return Fail(std::string(what) + " did not complete within " +
                  std::to_string(options_.timeout_s) + " s");
  }
  if (r == ncclSuccess) return Status::OK();
  std::string msg = nccl_->Describe(r, what, comm_) + " (rank " + std::to_string(rank_) +
                    " of " + std::to_string(size_) + ", device " + std::to_string(device_) +
                    ")";
  if (r == ncclInvalidArgument || r == ncclInvalidUsage) return Status::Invalid(msg);
  return Fail(msg);  // NCCL's communicator is unusable after a system or remote error
}

Status NcclCommunicator::Fail(const std::string& msg) {
  if (group_depth_ > 0) {
    if (failed_in_group_.empty()) failed_in_group_ = msg;
    return Status::Failure(msg);
  }
  Abort(msg);
  return failure_;
}

Status NcclCommunicator::WaitFor(cudaEvent_t input_ready) {
  SDL_GPU_RETURN_IF_ERROR(Usable());
  return cuda_->Check(cuda_->StreamWaitEvent(stream_.get(), input_ready, 0),
                      "cudaStreamWaitEvent");
}

Status NcclCommunicator::WaitForStream(cudaStream_t framework_stream) {
  SDL_GPU_RETURN_IF_ERROR(Usable());
  DeviceGuard guard(cuda_, device_);
  SDL_GPU_RETURN_IF_ERROR(guard.status());
  SDL_GPU_RETURN_IF_ERROR(stream_event_.Record(framework_stream));
  return stream_event_.MakeStreamWait(stream_.get());
}

Status NcclCommunicator::RecordDone(const Event& done) {
  SDL_GPU_RETURN_IF_ERROR(Usable());
  DeviceGuard guard(cuda_, device_);
  SDL_GPU_RETURN_IF_ERROR(guard.status());
  return done.Record(stream_.get());
}

Status NcclCommunicator::Allreduce(const void* send, void* recv, size_t count, DataType dt,
                                   ReduceOp op) {
  SDL_GPU_RETURN_IF_ERROR(Usable());
  ncclDataType_t type;
  ncclRedOp_t nop = ncclSum;
  SDL_GPU_RETURN_IF_ERROR(NcclReduceType(dt, op, &type));
  if (op != ReduceOp::kAverage) SDL_GPU_RETURN_IF_ERROR(NcclReduceOp(op, &nop));
  if (count == 0) return Status::OK();
  DeviceGuard guard(cuda_, device_);
  SDL_GPU_RETURN_IF_ERROR(guard.status());
  SDL_GPU_RETURN_IF_ERROR(
      Finish(nccl_->AllReduce(send, recv, count, type, nop, comm_, stream_.get()),
             "ncclAllReduce"));
  if (op == ReduceOp::kAverage) return ScaleInPlace(recv, count, dt, 1.0, stream_.get(), size_);
  return Status::OK();
}

Status NcclCommunicator::Allgather(const void* send, void* recv,
                                   const std::vector<size_t>& counts, DataType dt) {
  SDL_GPU_RETURN_IF_ERROR(Usable());
  SDL_GPU_RETURN_IF_ERROR(CheckCounts(counts, size_, "allgather", "counts"));
  const size_t es = DataTypeSize(dt);
  DeviceGuard guard(cuda_, device_);
  SDL_GPU_RETURN_IF_ERROR(guard.status());
  bool equal = true;
  for (size_t c : counts) equal = equal && c == counts[0];
  if (equal) {
    if (counts[0] == 0) return Status::OK();
    return Finish(nccl_->AllGather(send, recv, counts[0] * es, ncclUint8, comm_, stream_.get()),
                  "ncclAllGather");
  }
  // Ragged: rank r broadcasts its block into its place in everyone's recv.
  // Counts are the same on every rank (negotiated), so every rank skips the
  // same empty blocks.
  SDL_GPU_RETURN_IF_ERROR(GroupStart());
  Status status;
  size_t offset = 0;
  for (int r = 0; r < size_ && status.ok(); ++r) {
    void* dst = const_cast<char*>(Ptr(recv, offset, es));
    if (counts[r] > 0)
      status = Finish(nccl_->Broadcast(r == rank_ ? send : dst, dst, counts[r] * es, ncclUint8,
                                       r, comm_, stream_.get()),
                      "ncclBroadcast (ragged allgather)");
    offset += counts[r];
  }
  Status end = GroupEnd();
  return status.ok() ? end : status;
}

Status NcclCommunicator::Broadcast(void* buf, size_t count, DataType dt, int root) {
  SDL_GPU_RETURN_IF_ERROR(Usable());
  if (root < 0 || root >= size_)
    return Status::Invalid("broadcast root " + std::to_string(root) + " is not in a set of " +
                           std::to_string(size_));
  if (count == 0) return Status::OK();
  DeviceGuard guard(cuda_, device_);
  SDL_GPU_RETURN_IF_ERROR(guard.status());
  return Finish(nccl_->Broadcast(buf, buf, count * DataTypeSize(dt), ncclUint8, root, comm_,
                                 stream_.get()),
                "ncclBroadcast");
}

Status NcclCommunicator::Alltoall(const void* send, const std::vector<size_t>& send_counts,
                                  void* recv, const std::vector<size_t>& recv_counts,
                                  DataType dt) {
  SDL_GPU_RETURN_IF_ERROR(Usable());
  SDL_GPU_RETURN_IF_ERROR(CheckCounts(send_counts, size_, "alltoall", "send_counts"));
  SDL_GPU_RETURN_IF_ERROR(CheckCounts(recv_counts, size_, "alltoall", "recv_counts"));
  const size_t es = DataTypeSize(dt);
  DeviceGuard guard(cuda_, device_);
  SDL_GPU_RETURN_IF_ERROR(guard.status());
  SDL_GPU_RETURN_IF_ERROR(GroupStart());
  Status status;
  size_t soff = 0, roff = 0;
  for (int p = 0; p < size_ && status.ok(); ++p) {
    // recv_counts[p] here equals send_counts[rank] on p (negotiated), so both
    // sides skip the same empty transfers.
    if (send_counts[p] > 0)
      status = Finish(nccl_->Send(Ptr(send, soff, es), send_counts[p] * es, ncclUint8, p, comm_,
                                  stream_.get()),
                      "ncclSend (alltoall)");
    if (status.ok() && recv_counts[p] > 0)
      status = Finish(nccl_->Recv(const_cast<char*>(Ptr(recv, roff, es)), recv_counts[p] * es,
                                  ncclUint8, p, comm_, stream_.get()),
                      "ncclRecv (alltoall)");
    soff += send_counts[p];
    roff += recv_counts[p];
  }
  Status end = GroupEnd();
  return status.ok() ? end : status;
}

Status NcclCommunicator::Reducescatter(const void* send, void* recv,
                                       const std::vector<size_t>& counts, DataType dt,
                                       ReduceOp op) {
  SDL_GPU_RETURN_IF_ERROR(Usable());
  SDL_GPU_RETURN_IF_ERROR(CheckCounts(counts, size_, "reducescatter", "counts"));
  ncclDataType_t type;
  ncclRedOp_t nop = ncclSum;
  SDL_GPU_RETURN_IF_ERROR(NcclReduceType(dt, op, &type));
  if (op != ReduceOp::kAverage) SDL_GPU_RETURN_IF_ERROR(NcclReduceOp(op, &nop));
  const size_t es = DataTypeSize(dt);
  DeviceGuard guard(cuda_, device_);
  SDL_GPU_RETURN_IF_ERROR(guard.status());
  bool equal = true;
  for (size_t c : counts) equal = equal && c == counts[0];
  if (equal) {
    if (counts[0] > 0)
      SDL_GPU_RETURN_IF_ERROR(Finish(nccl_->ReduceScatter(send, recv, counts[0], type, nop,
                                                          comm_, stream_.get()),
                                     "ncclReduceScatter"));
  } else {
    // Ragged: one reduce per block, rooted at the rank that keeps it.
    SDL_GPU_RETURN_IF_ERROR(GroupStart());
    Status status;
    size_t offset = 0;
    for (int r = 0; r < size_ && status.ok(); ++r) {
      if (counts[r] > 0)
        status = Finish(nccl_->Reduce(Ptr(send, offset, es), recv, counts[r], type, nop, r,
                                      comm_, stream_.get()),
                        "ncclReduce (ragged reducescatter)");
      offset += counts[r];
    }
    Status end = GroupEnd();
    SDL_GPU_RETURN_IF_ERROR(status);
    SDL_GPU_RETURN_IF_ERROR(end);
  }
  if (op == ReduceOp::kAverage)
    return ScaleInPlace(recv, counts[rank_], dt, 1.0, stream_.get(), size_);
  return Status::OK();
}

Status NcclCommunicator::GroupStart() {
  SDL_GPU_RETURN_IF_ERROR(Usable());
  SDL_GPU_RETURN_IF_ERROR(Finish(nccl_->GroupStart(), "ncclGroupStart"));
  ++group_depth_;
  return Status::OK();
}

Status NcclCommunicator::GroupEnd() {
  if (group_depth_ == 0) return Status::Invalid("ncclGroupEnd without ncclGroupStart");
  --group_depth_;
  // Always end the group NCCL opened, even after a failure inside it, so the
  // thread's group state does not leak into the next operation.
  DeviceGuard guard(cuda_, device_);
  Status end = Finish(nccl_->GroupEnd(), "ncclGroupEnd");
  if (group_depth_ == 0 && !failed_in_group_.empty()) {
    std::string why;
    why.swap(failed_in_group_);
    Abort(why);  // no-op when the group's end failed (and aborted) too
    if (end.ok()) end = failure_;
  }
  return end;
}

Status NcclCommunicator::CheckAsyncError() {
  SDL_GPU_RETURN_IF_ERROR(Usable());
  ncclResult_t state = ncclSuccess;
  ncclResult_t r = nccl_->CommGetAsyncError(comm_, &state);
  if (r != ncclSuccess) return Finish(r, "ncclCommGetAsyncError");
  if (state != ncclSuccess && state != ncclInProgress) return Finish(state, "NCCL (async)");
  return Status::OK();
}

void NcclCommunicator::Abort(const std::string& why) {
  if (!failure_.ok()) return;
  failure_ = Status::Failure(why);
  if (comm_) {
    DeviceGuard guard(cuda_, device_);
    nccl_->CommAbort(comm_);
    comm_ = nullptr;
  }
}

// --- NcclCommunicators ---------------------------------------------------------------

Status NcclCommunicators::Get(int32_t process_set_id, int device, int rank, int size,
                              const BroadcastFromRoot& broadcast, NcclCommunicator** out) {
  std::lock_guard<std::mutex> lk(mu_);
  auto key = std::make_pair(process_set_id, device);
  auto it = comms_.find(key);
  // A failed communicator stays: its ranks cannot agree to rebuild it without
  // the controller, so every later operation reports the first failure.
  if (it == comms_.end()) {
    std::unique_ptr<NcclCommunicator> c;
    SDL_GPU_RETURN_IF_ERROR(NcclCommunicator::Create(device, rank, size, broadcast, options_, &c));
    it = comms_.emplace(key, std::move(c)).first;
  }
  if (it->second->rank() != rank || it->second->size() != size)
    return Status::Invalid("process set " + std::to_string(process_set_id) +
                           " changed its membership on device " + std::to_string(device) +
                           " (rank " + std::to_string(rank) + " of " + std::to_string(size) +
                           ", the communicator has rank " + std::to_string(it->second->rank()) +
                           " of " + std::to_string(it->second->size()) + ")");
  *out = it->second.get();
  return Status::OK();
}

void NcclCommunicators::Erase(int32_t process_set_id) {
  std::lock_guard<std::mutex> lk(mu_);
  for (auto it = comms_.begin(); it != comms_.end();)
    it = it->first.first == process_set_id ? comms_.erase(it) : std::next(it);
}

void NcclCommunicators::AbortAll(const std::string& why) {
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& kv : comms_) kv.second->Abort(why);
}

Status NcclCommunicators::CheckAsyncErrors(const char* label) {
  std::string failure;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& [key, comm] : comms_) {
      if (comm->failed()) continue;  // already reported by the call that failed
      Status s = comm->CheckAsyncError();
      if (s.ok()) continue;
      failure = std::string("asynchronous NCCL error on the ") + label +
                " communicator of process set " + std::to_string(key.first) + ", cuda:" +
                std::to_string(key.second) + " (rank " + std::to_string(comm->rank()) + " of " +
                std::to_string(comm->size()) +
                "): " + s.message() +
                ". A peer failed or the device faulted; every pending operation fails and "
                "the communicators are aborted";
      break;
    }
  }
  if (failure.empty()) return Status::OK();
  AbortAll(failure);
  return Status::Failure(failure);
}

}  // namespace gpu
}  // namespace sdl
