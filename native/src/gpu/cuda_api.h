// The CUDA runtime, loaded at run time (see dynlib.h): a table of the entry
// points spark_dl uses, resolved once per process. Compiled only when the build
// found the CUDA toolkit's headers (SDL_HAVE_CUDA); the headers give the types,
// the symbols come from whichever libcudart.so.13/.12 the host has.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "gpu/dynlib.h"
#include "gpu/status.h"

namespace sdl {
namespace gpu {

struct CudaApi {
  DynLib lib;
  int runtime_version = 0;  // cudaRuntimeGetVersion: 13000 for 13.0

  decltype(&::cudaGetErrorName) GetErrorName = nullptr;
  decltype(&::cudaGetErrorString) GetErrorString = nullptr;
  decltype(&::cudaGetLastError) GetLastError = nullptr;
  decltype(&::cudaRuntimeGetVersion) RuntimeGetVersion = nullptr;
  decltype(&::cudaDriverGetVersion) DriverGetVersion = nullptr;
  decltype(&::cudaGetDeviceCount) GetDeviceCount = nullptr;
  decltype(&::cudaGetDevice) GetDevice = nullptr;
  decltype(&::cudaSetDevice) SetDevice = nullptr;
  decltype(&::cudaDeviceGetAttribute) DeviceGetAttribute = nullptr;
  decltype(&::cudaPointerGetAttributes) PointerGetAttributes = nullptr;
  decltype(&::cudaStreamCreateWithPriority) StreamCreateWithPriority = nullptr;
  decltype(&::cudaStreamDestroy) StreamDestroy = nullptr;
  decltype(&::cudaStreamSynchronize) StreamSynchronize = nullptr;
  decltype(&::cudaStreamWaitEvent) StreamWaitEvent = nullptr;
  decltype(&::cudaEventCreateWithFlags) EventCreateWithFlags = nullptr;
  decltype(&::cudaEventDestroy) EventDestroy = nullptr;
  decltype(&::cudaEventRecord) EventRecord = nullptr;
  decltype(&::cudaEventQuery) EventQuery = nullptr;
  decltype(&::cudaEventSynchronize) EventSynchronize = nullptr;
  // Spelled out where cuda_runtime.h (included by nccl.h) adds C++ template
  // overloads, which decltype cannot pick from.
  cudaError_t (*Malloc)(void**, size_t) = nullptr;
  decltype(&::cudaFree) Free = nullptr;
  cudaError_t (*MallocHost)(void**, size_t) = nullptr;
  cudaError_t (*HostAlloc)(void**, size_t, unsigned int) = nullptr;  // pinned staging
  decltype(&::cudaFreeHost) FreeHost = nullptr;
  decltype(&::cudaMemcpyAsync) MemcpyAsync = nullptr;
  decltype(&::cudaMemsetAsync) MemsetAsync = nullptr;
  cudaError_t (*LaunchKernel)(const void*, dim3, dim3, void**, size_t, cudaStream_t) = nullptr;
  // Library management (CUDA 12.0+): the kernels are an embedded fatbin loaded
  // with these, so the extension needs no statically linked runtime.
  decltype(&::cudaLibraryLoadData) LibraryLoadData = nullptr;
  decltype(&::cudaLibraryGetKernel) LibraryGetKernel = nullptr;

  // From the CUDA driver (libcuda.so.1), optional: whether a device's primary
  // context is active, so DeviceGuard can tell a device a thread really used
  // from the 0 that cudaGetDevice reports on a thread that never chose one.
  // The driver's CUresult and CUdevice are plain integers (0: success).
  int (*DriverDeviceGet)(int* device, int ordinal) = nullptr;            // cuDeviceGet
  int (*DriverPrimaryCtxGetState)(int device, unsigned int* flags, int* active) = nullptr;

  // Whether `device`'s primary context is active; true when the driver cannot
  // say (the symbols are missing or the call fails).
  bool HasPrimaryContext(int device) const;

  // "what failed: cudaErrorX (description)" for a failed call.
  std::string Describe(cudaError_t err, const char* what) const;
  // OK for cudaSuccess, else Status::Failure with Describe(). Clears the
  // runtime's last-error slot so a later unrelated call does not see it.
  Status Check(cudaError_t err, const char* what) const;
};

// The process's CUDA runtime, loaded on first call (thread-safe). nullptr when
// no libcudart.so.13/.12 of version 12.0 or later could be loaded; then *error
// (when given) says what was searched and what to install.
const CudaApi* Cuda(std::string* error = nullptr);

// Whether CUDA can run here: the runtime loaded and at least one device.
struct CudaAvailability {
  bool usable = false;
  std::string reason;   // why not, when !usable ("" when usable)
  std::string library;  // the libcudart file in use ("" when none loaded)
  int runtime_version = 0;
  int driver_version = 0;  // 0: no driver
  int device_count = 0;
};
// Queried once per process (device visibility does not change under a running
// process: CUDA_VISIBLE_DEVICES is read by the driver at its initialization).
const CudaAvailability& QueryCuda();

// Makes `device` current for the scope and restores the previous one: the
// background thread may serve tensors on several devices, and the framework's
// threads must not see their current device changed. The previous device is
// restored only when its primary context is active: on a thread that never
// chose a device cudaGetDevice says 0, and setting 0 back would create a
// context on GPU 0 (cudaSetDevice initializes it since CUDA 12) in every rank
// of a host, hundreds of MiB each, and fail on exclusive-process GPUs.
class DeviceGuard {
 public:
  DeviceGuard(const CudaApi* api, int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  const Status& status() const { return status_; }

 private:
  const CudaApi* api_;
  int previous_ = -1;
  Status status_;
};

}  // namespace gpu
}  // namespace sdl
