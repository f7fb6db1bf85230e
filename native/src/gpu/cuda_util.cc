#include "gpu/cuda_util.h"

#include <utility>

namespace sdl {
namespace gpu {
namespace {

Status Api(const CudaApi** api) {
  std::string error;
  *api = Cuda(&error);
  if (!*api) return Status::Failure(error);
  return Status::OK();
}

}  // namespace

// --- Stream ---------------------------------------------------------------------------

Stream::~Stream() {
  if (stream_) {
    DeviceGuard g(api_, device_);
    api_->StreamDestroy(stream_);  // returns at once; queued work still completes
  }
}

Stream& Stream::operator=(Stream&& o) noexcept {
  std::swap(api_, o.api_);
  std::swap(stream_, o.stream_);
  std::swap(device_, o.device_);
  return *this;
}

Status Stream::Create(int device, int priority, Stream* out) {
  const CudaApi* api;
  SDL_GPU_RETURN_IF_ERROR(Api(&api));
  DeviceGuard g(api, device);
  SDL_GPU_RETURN_IF_ERROR(g.status());
  cudaStream_t s = nullptr;
  SDL_GPU_RETURN_IF_ERROR(api->Check(
      api->StreamCreateWithPriority(&s, cudaStreamNonBlocking, priority), "cudaStreamCreate"));
  Stream created;
  created.api_ = api;
  created.stream_ = s;
  created.device_ = device;
  *out = std::move(created);
  return Status::OK();
}

Status Stream::Synchronize() const {
  return api_->Check(api_->StreamSynchronize(stream_), "cudaStreamSynchronize");
}

// --- Event ----------------------------------------------------------------------------

Event::~Event() {
  if (event_) {
    DeviceGuard g(api_, device_);
    api_->EventDestroy(event_);
  }
}

Event& Event::operator=(Event&& o) noexcept {
  std::swap(api_, o.api_);
  std::swap(event_, o.event_);
  std::swap(device_, o.device_);
  return *this;
}

Status Event::Create(int device, Event* out) {
  const CudaApi* api;
  SDL_GPU_RETURN_IF_ERROR(Api(&api));
  DeviceGuard g(api, device);
  SDL_GPU_RETURN_IF_ERROR(g.status());
  cudaEvent_t e = nullptr;
  SDL_GPU_RETURN_IF_ERROR(
      api->Check(api->EventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate"));
  Event created;
  created.api_ = api;
  created.event_ = e;
  created.device_ = device;
  *out = std::move(created);
  return Status::OK();
}

Status Event::Record(cudaStream_t stream) const {
  return api_->Check(api_->EventRecord(event_, stream), "cudaEventRecord");
}

Status Event::MakeStreamWait(cudaStream_t stream) const {
  return api_->Check(api_->StreamWaitEvent(stream, event_, 0), "cudaStreamWaitEvent");
}

Status Event::Query(bool* done) const {
  cudaError_t err = api_->EventQuery(event_);
  if (err == cudaErrorNotReady) {
    *done = false;
    return Status::OK();
  }
  *done = true;
  return api_->Check(err, "cudaEventQuery");
}

Status Event::Synchronize() const {
  return api_->Check(api_->EventSynchronize(event_), "cudaEventSynchronize");
}

// --- DeviceBuffer ---------------------------------------------------------------------

DeviceBuffer::~DeviceBuffer() { Release(); }

void DeviceBuffer::Release() {
  if (data_) {
    DeviceGuard g(api_, device_);
    api_->Free(data_);
  }
  data_ = nullptr;
  capacity_ = 0;
}

Status DeviceBuffer::Reserve(int device, size_t bytes) {
  if (data_ && device_ == device && capacity_ >= bytes) return Status::OK();
  if (!api_) SDL_GPU_RETURN_IF_ERROR(Api(&api_));
  Release();
  device_ = device;
  if (bytes == 0) return Status::OK();
  DeviceGuard g(api_, device);
  SDL_GPU_RETURN_IF_ERROR(g.status());
  void* p = nullptr;
  cudaError_t err = api_->Malloc(&p, bytes);
  if (err != cudaSuccess) {
    std::string what = "cudaMalloc of " + std::to_string(bytes) + " bytes on device " +
                       std::to_string(device);
    return api_->Check(err, what.c_str());
  }
  data_ = p;
  capacity_ = bytes;
  return Status::OK();
}

// --- PinnedBuffer ---------------------------------------------------------------------

PinnedBuffer::~PinnedBuffer() { Release(); }

void PinnedBuffer::Release() {
  if (data_) api_->FreeHost(data_);
  data_ = nullptr;
  capacity_ = 0;
}

Status PinnedBuffer::Reserve(size_t bytes) {
  if (data_ && capacity_ >= bytes) return Status::OK();
  if (!api_) SDL_GPU_RETURN_IF_ERROR(Api(&api_));
  Release();
  if (bytes == 0) return Status::OK();
  void* p = nullptr;
  std::string what = "cudaMallocHost of " + std::to_string(bytes) + " bytes";
  SDL_GPU_RETURN_IF_ERROR(api_->Check(api_->MallocHost(&p, bytes), what.c_str()));
  data_ = p;
  capacity_ = bytes;
  return Status::OK();
}

// --- free functions -------------------------------------------------------------------

Status CopyAsync(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return Status::OK();
  const CudaApi* api;
  SDL_GPU_RETURN_IF_ERROR(Api(&api));
  return api->Check(api->MemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream),
                    "cudaMemcpyAsync");
}

Status PointerDevice(const void* ptr, int* device) {
  const CudaApi* api;
  SDL_GPU_RETURN_IF_ERROR(Api(&api));
  cudaPointerAttributes attr{};
  SDL_GPU_RETURN_IF_ERROR(
      api->Check(api->PointerGetAttributes(&attr, ptr), "cudaPointerGetAttributes"));
  *device = (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged)
                ? attr.device
                : -1;
  return Status::OK();
}

}  // namespace gpu
}  // namespace sdl
