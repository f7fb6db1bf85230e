// The operations layer: between the executor and the backends.
//
// It owns what every backend shares, so that a backend only moves bytes:
//  - the backend registry: per response, the first enabled backend in the
//    fixed priority order of ops/backend.h (NCCL for CUDA tensors when built
//    and usable; else CUDA tensors staged through host memory over the CPU
//    transport; host tensors over the CPU transport: shm, Gloo or MPI);
//  - device memories: HostMemory always, one DeviceMemory per device type a
//    GPU build registers (which also enables host staging for that type);
//  - fusion buffers, one per (device, dtype, process set), grown on demand,
//    freed when the set is removed or the runtime ends;
//  - pack/unpack with prescale/postscale (Average = Sum then divide) through
//    DeviceMemory::BatchedCopy, the per-response stream hooks, and outputs the
//    core allocates on the tensor's device.
// Everything but CheckServable and MarkReady runs on the background thread
// only; backends and memories are registered before that thread starts.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "core/handles.h"
#include "core/process_set.h"
#include "ops/backend.h"
#include "ops/device_memory.h"

namespace sdl { class Timeline; }

namespace sdl {

class Operations {
 public:
  // Starts with host memory and the host transport backend.
  Operations();
  ~Operations();
  Operations(const Operations&) = delete;
  Operations& operator=(const Operations&) = delete;

  // Adds a backend at a priority (kPriority*; equal priorities keep the order
  // of registration).
  void AddBackend(int priority, std::unique_ptr<OpBackend> backend);
  // Registers the memory of a device type (not kCPU) and, after every
  // device-native backend, the host-staged backend for it.
  void AddDeviceMemory(std::unique_ptr<DeviceMemory> memory);

  // The backend that runs r for tensors on d, or nullptr.
  OpBackend* Choose(const Response& r, Device d) const;
  // Throws Error(kInvalidArgument) naming the operation, the tensor and its
  // device when no backend of this build can run req (called at enqueue, on
  // the caller's thread, so the refusal comes before any peer waits).
  void CheckServable(const Request& req) const;
  // What stream has queued now on d (DeviceMemory::MarkReady): the point a
  // device tensor's collective waits for. Null for host tensors. Any thread
  // (the caller's, at enqueue).
  Status MarkReady(Device d, uintptr_t stream, std::shared_ptr<const ReadyMark>* out) const;
  // Registered backends, in priority order (for logs and tests).
  std::vector<std::string> BackendNames() const;

  // The data collectives of one response on this rank. entries[i] is this
  // rank's entry for r.names[i], null where this rank joined (allreduce
  // contributes zeros then). Each returns the first failed Status (no
  // backend, allocation, device hook, or the backend's own).
  Status Allreduce(ProcessSet& ps, const Response& r, const std::vector<Entry*>& entries);
  Status Allgather(ProcessSet& ps, const Response& r, Entry& e, Result* res);
  Status Broadcast(ProcessSet& ps, const Response& r, Entry& e);
  Status Alltoall(ProcessSet& ps, const Response& r, Entry& e, Result* res);
  Status Reducescatter(ProcessSet& ps, const Response& r, Entry& e, Result* res);

  // Every backend's Poll (OpBackend::Poll); the first failure. Background thread.
  Status Poll();
  // Every backend's Abort (OpBackend::Abort): the runtime failed. Background thread.
  void Abort(const std::string& why);
  // "backend.<key>": responses each backend ran (a fused allreduce counts once),
  // plus the backends' own counters. Any thread.
  std::map<std::string, int64_t> Counters() const;

  // Frees the fusion buffers of a process set (removed, or the runtime ends).
  void ReleaseSet(int32_t ps_id);
  // Fusion buffers held now, as (device, dtype, set) keys (for tests).
  std::vector<std::tuple<Device, DataType, int32_t>> FusionKeys() const;
  // Rank 0's timeline (core/timeline.h): allreduce reports its inner phases.
  void set_timeline(Timeline* t) { timeline_ = t; }

 private:
  Timeline* timeline_ = nullptr;
  struct Registered {
    int priority;
    std::unique_ptr<OpBackend> backend;
  };
  struct FusionBuffer {
    void* data = nullptr;
    size_t capacity = 0;
  };
  using FusionKey = std::tuple<Device, DataType, int32_t>;

  DeviceMemory* MemoryFor(Device d) const;
  // The device of a response's tensors on this rank (see the .cc on joined ranks).
  Device DeviceFor(const Response& r, const std::vector<Entry*>& entries);
  // The backend and memory for r on d, counted as a run of that backend.
  Status Select(const Response& r, Device d, OpBackend** backend, DeviceMemory** memory);
  Status Fusion(Device d, DataType dt, int32_t ps_id, size_t bytes, void** p);
  Status AllocateOutput(Device d, DataType dt, std::vector<int64_t> shape,
                        std::shared_ptr<Buffer>* out);
  Status WaitInputs(DeviceMemory* m, Device d, const std::vector<Entry*>& entries);
  Status SignalOutputs(DeviceMemory* m, Device d, const std::vector<Entry*>& entries);
  Status AllreduceInPlace(OpBackend* b, DeviceMemory* m, const OpContext& ctx,
                          const std::vector<Entry*>& entries, const Scaling& post, bool* done);

  std::vector<Registered> backends_;  // sorted by priority
  mutable std::mutex counts_mu_;
  std::map<const OpBackend*, int64_t> runs_;  // responses run, by backend (Select)
  OpBackend* host_backend_ = nullptr;
  HostMemory host_memory_;
  // Shared: device outputs handed to the caller keep their memory alive (a
  // tensor may outlive the runtime).
  std::map<DeviceType, std::shared_ptr<DeviceMemory>> memories_;
  std::map<FusionKey, FusionBuffer> fusion_;
  std::map<DeviceType, int32_t> last_ordinal_;  // per type: the device of the last entry seen
};

}  // namespace sdl
