#include "ops/cuda_memory.h"

#include <cstdio>
#include <string>
#include <vector>

#include "gpu/kernels.h"

namespace sdl {
namespace {

Status NoCuda() {
  const gpu::CudaAvailability& a = gpu::QueryCuda();
  return Status::Fail(ErrorCode::kInvalidArgument,
                      "a CUDA tensor reached the core, but CUDA is not usable in this process: " +
                          a.reason);
}

}  // namespace

Status CudaMemory::Get(Device d, PerDevice** out) {
  auto it = devices_.find(d.index);
  if (it == devices_.end()) {
    if (!gpu::QueryCuda().usable) return NoCuda();
    auto pd = std::make_unique<PerDevice>();
    // Priority 0: the default; gradients share the device with the backward pass.
    SDL_RETURN_IF_ERROR(FromGpu(gpu::Stream::Create(d.index, 0, &pd->stream)));
    SDL_RETURN_IF_ERROR(FromGpu(gpu::Event::Create(d.index, &pd->event)));
    it = devices_.emplace(d.index, std::move(pd)).first;
  }
  *out = it->second.get();
  return Status::OK();
}

Status CudaMemory::StreamFor(Device d, cudaStream_t* out) {
  PerDevice* pd = nullptr;
  SDL_RETURN_IF_ERROR(Get(d, &pd));
  *out = pd->stream.get();
  return Status::OK();
}

Status CudaMemory::EventFor(Device d, const gpu::Event** out) {
  PerDevice* pd = nullptr;
  SDL_RETURN_IF_ERROR(Get(d, &pd));
  *out = &pd->event;
  return Status::OK();
}

Status CudaMemory::Alloc(Device d, size_t bytes, void** p) {
  *p = nullptr;
  if (bytes == 0) return Status::OK();
  const gpu::CudaApi* api = gpu::Cuda();
  if (!api || !gpu::QueryCuda().usable) return NoCuda();
  gpu::DeviceGuard guard(api, d.index);
  SDL_RETURN_IF_ERROR(FromGpu(guard.status()));
  Status s = FromGpu(api->Check(api->Malloc(p, bytes), "cudaMalloc"));
  if (!s.ok()) {
    *p = nullptr;
    s.message = "allocating " + std::to_string(bytes) + " bytes on " + DeviceName(d) + ": " +
                s.message;
  }
  return s;
}

void CudaMemory::Free(Device d, void* p) {
  if (!p) return;
  const gpu::CudaApi* api = gpu::Cuda();
  if (!api) return;
  gpu::DeviceGuard guard(api, d.index);
  // cudaFree waits for work using p on any stream; a failure here (a device
  // error already reported elsewhere) cannot be acted on.
  (void)api->Check(api->Free(p), "cudaFree");
}

Status CudaMemory::CopyToHost(Device d, void* host, const void* src, size_t bytes) {
  if (!bytes) return Status::OK();
  PerDevice* pd = nullptr;
  SDL_RETURN_IF_ERROR(Get(d, &pd));
  gpu::DeviceGuard guard(gpu::Cuda(), d.index);
  // On the core stream, so the copy follows the pack and the input waits;
  // then the host transport reads `host`: wait for this stream only.
  SDL_RETURN_IF_ERROR(FromGpu(gpu::CopyAsync(host, src, bytes, pd->stream.get())));
  return FromGpu(pd->stream.Synchronize());
}

Status CudaMemory::CopyFromHost(Device d, void* dst, const void* host, size_t bytes) {
  if (!bytes) return Status::OK();
  PerDevice* pd = nullptr;
  SDL_RETURN_IF_ERROR(Get(d, &pd));
  gpu::DeviceGuard guard(gpu::Cuda(), d.index);
  SDL_RETURN_IF_ERROR(FromGpu(gpu::CopyAsync(dst, host, bytes, pd->stream.get())));
  // From a pinned staging buffer the copy is DMA queued on the core stream: the
  // device's later work (unpack, SignalStream) is ordered after it, and the
  // host waits only before it writes into a staging buffer again
  // (StagingFence). Any other host memory may change as soon as we return:
  // wait until it was read.
  if (staging_ && staging_->IsPinned(host, bytes)) {
    staging_pending_[d.index] = true;
    return Status::OK();
  }
  return FromGpu(pd->stream.Synchronize());
}

StagingPool& CudaMemory::Staging() {
  if (!staging_) {
    StagingPool::Pin pin = [](int device, size_t bytes, void** p, std::string* why) {
      const gpu::CudaApi* api = gpu::Cuda(why);
      if (!api || !api->HostAlloc) {
        if (why->empty()) *why = "cudaHostAlloc is not available";
        return false;
      }
      gpu::DeviceGuard guard(api, device);
      // Portable: pinned for every device of the process, not only the current one.
      gpu::Status s = api->Check(api->HostAlloc(p, bytes, cudaHostAllocPortable),
                                 "cudaHostAlloc");
      if (!s.ok()) *why = s.message();
      return s.ok();
    };
    StagingPool::Unpin unpin = [](void* p) {
      if (const gpu::CudaApi* api = gpu::Cuda()) (void)api->FreeHost(p);
    };
    staging_ = std::make_unique<StagingPool>(pin, unpin, [](const std::string& msg) {
      std::fprintf(stderr, "[spark_dl] %s\n", msg.c_str());
    });
  }
  return *staging_;
}

Status CudaMemory::AllocStaging(Device d, size_t bytes, void** p) {
  return Staging().Acquire(d.index, bytes, p);
}

void CudaMemory::FreeStaging(Device d, void* p) {
  if (staging_) staging_->Release(p);
}

Status CudaMemory::StagingFence(Device d) {
  auto it = staging_pending_.find(d.index);
  if (it == staging_pending_.end() || !it->second) return Status::OK();
  PerDevice* pd = nullptr;
  SDL_RETURN_IF_ERROR(Get(d, &pd));
  it->second = false;
  return FromGpu(pd->stream.Synchronize());
}

CudaMemory::~CudaMemory() {
  // Pending copies read pinned buffers: finish them before the pool frees them.
  for (auto& [dev, pd] : devices_) (void)pd->stream.Synchronize();
  staging_.reset();
}

Status CudaMemory::BatchedCopy(Device d, const CopyEntry* entries, int n, DataType dt,
                               const Scaling& s) {
  if (n <= 0) return Status::OK();
  PerDevice* pd = nullptr;
  SDL_RETURN_IF_ERROR(Get(d, &pd));
  std::vector<gpu::CopySpan> spans;
  spans.reserve(n);
  for (int i = 0; i < n; ++i) spans.push_back(gpu::CopySpan{entries[i].src, entries[i].dst,
                                                            entries[i].count});
  gpu::DeviceGuard guard(gpu::Cuda(), d.index);
  SDL_RETURN_IF_ERROR(FromGpu(guard.status()));
  return FromGpu(gpu::BatchedScaledCopy(spans, dt, s.factor, pd->stream.get(), s.divisor));
}

class CudaMemory::CudaMark : public ReadyMark {
 public:
  CudaMark(std::shared_ptr<MarkPool> pool, int device, gpu::Event event)
      : pool_(std::move(pool)), device_(device), event_(std::move(event)) {}
  ~CudaMark() override {
    std::lock_guard<std::mutex> lk(pool_->mu);
    pool_->free[device_].push_back(std::move(event_));
  }
  const gpu::Event& event() const { return event_; }

 private:
  std::shared_ptr<MarkPool> pool_;
  int device_;
  gpu::Event event_;
};

Status CudaMemory::MarkReady(Device d, uintptr_t stream,
                             std::shared_ptr<const ReadyMark>* out) {
  out->reset();
  if (!gpu::QueryCuda().usable) return NoCuda();
  gpu::Event event;
  {
    std::lock_guard<std::mutex> lk(marks_->mu);
    std::vector<gpu::Event>& free = marks_->free[d.index];
    if (!free.empty()) {
      event = std::move(free.back());
      free.pop_back();
    }
  }
  if (!event.get()) SDL_RETURN_IF_ERROR(FromGpu(gpu::Event::Create(d.index, &event)));
  // Recorded with d current: the legacy default stream (1) is the current
  // device's, and the per-thread one (2) is this thread's, the framework's.
  gpu::DeviceGuard guard(gpu::Cuda(), d.index);
  SDL_RETURN_IF_ERROR(FromGpu(guard.status()));
  // A failed record leaves the event unrecorded; it still goes back to the pool.
  auto mark = std::make_shared<CudaMark>(marks_, d.index, std::move(event));
  SDL_RETURN_IF_ERROR(FromGpu(mark->event().Record(FrameworkStream(stream))));
  *out = std::move(mark);
  return Status::OK();
}

Status CudaMemory::WaitForStream(Device d, uintptr_t stream, const ReadyMark* mark) {
  PerDevice* pd = nullptr;
  SDL_RETURN_IF_ERROR(Get(d, &pd));
  gpu::DeviceGuard guard(gpu::Cuda(), d.index);
  SDL_RETURN_IF_ERROR(FromGpu(guard.status()));
  // The mark recorded at enqueue: the tensor's producer and what came before
  // it on the framework's stream, not the work the framework queued since.
  if (mark) return FromGpu(static_cast<const CudaMark*>(mark)->event().MakeStreamWait(pd->stream.get()));
  // Without one, everything queued on the stream up to now.
  SDL_RETURN_IF_ERROR(FromGpu(pd->event.Record(FrameworkStream(stream))));
  return FromGpu(pd->event.MakeStreamWait(pd->stream.get()));
}

Status CudaMemory::SignalStream(Device d, uintptr_t stream) {
  PerDevice* pd = nullptr;
  SDL_RETURN_IF_ERROR(Get(d, &pd));
  gpu::DeviceGuard guard(gpu::Cuda(), d.index);
  SDL_RETURN_IF_ERROR(FromGpu(guard.status()));
  // The outputs (and the reads of the inputs) are queued on the core stream:
  // the framework's later work on its stream runs after them, so the caller may
  // read the result and reuse the input's memory in stream order.
  // The per-thread default stream named here would be this thread's, not the
  // framework's: finish the work on the host instead, before the handle completes.
  if (stream == kPerThreadDefaultStream) return FromGpu(pd->stream.Synchronize());
  SDL_RETURN_IF_ERROR(FromGpu(pd->event.Record(pd->stream.get())));
  return FromGpu(pd->event.MakeStreamWait(FrameworkStream(stream)));
}

}  // namespace sdl
