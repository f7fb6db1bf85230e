#include "gpu/cuda_api.h"

#include <mutex>

namespace sdl {
namespace gpu {
namespace {

template <typename F>
bool Resolve(const DynLib& lib, const char* name, F* out, std::string* missing) {
  *out = reinterpret_cast<F>(lib.Symbol(name));
  if (!*out) *missing += (missing->empty() ? "" : ", ") + std::string(name);
  return *out != nullptr;
}

struct Loaded {
  CudaApi api;
  bool ok = false;
  std::string error;
};

Loaded* Load() {
  static Loaded* loaded = [] {
    auto* l = new Loaded();  // leaked on purpose: the runtime is never unloaded
    LibrarySearch search;
    // The major version this build's headers came from first, then the other one.
    if (CUDART_VERSION >= 13000)
      search.sonames = {"libcudart.so.13", "libcudart.so.12"};
    else
      search.sonames = {"libcudart.so.12", "libcudart.so.13"};
    // nvidia-cuda-runtime wheels: nvidia/cu13/lib (CUDA 13), nvidia/cuda_runtime/lib (12).
    search.subdir_globs = {"nvidia/*/lib"};
    search.fixed_dirs = {"/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib",
                         "/usr/local/cuda/targets/sbsa-linux/lib"};
    std::string error;
    DynLib lib = OpenLibrary("the CUDA runtime", search, &error);
    if (!lib.loaded()) {
      l->error = error + ". Install a CUDA 12/13 runtime (the nvidia-cuda-runtime wheel, which "
                         "PyTorch's CUDA builds bring, or a CUDA toolkit)";
      return l;
    }
    CudaApi& a = l->api;
    a.lib = lib;
    std::string missing;
    Resolve(lib, "cudaGetErrorName", &a.GetErrorName, &missing);
    Resolve(lib, "cudaGetErrorString", &a.GetErrorString, &missing);
    Resolve(lib, "cudaGetLastError", &a.GetLastError, &missing);
    Resolve(lib, "cudaRuntimeGetVersion", &a.RuntimeGetVersion, &missing);
    Resolve(lib, "cudaDriverGetVersion", &a.DriverGetVersion, &missing);
    Resolve(lib, "cudaGetDeviceCount", &a.GetDeviceCount, &missing);
    Resolve(lib, "cudaGetDevice", &a.GetDevice, &missing);
    Resolve(lib, "cudaSetDevice", &a.SetDevice, &missing);
    Resolve(lib, "cudaDeviceGetAttribute", &a.DeviceGetAttribute, &missing);
    Resolve(lib, "cudaPointerGetAttributes", &a.PointerGetAttributes, &missing);
    Resolve(lib, "cudaStreamCreateWithPriority", &a.StreamCreateWithPriority, &missing);
    Resolve(lib, "cudaStreamDestroy", &a.StreamDestroy, &missing);
    Resolve(lib, "cudaStreamSynchronize", &a.StreamSynchronize, &missing);
    Resolve(lib, "cudaStreamWaitEvent", &a.StreamWaitEvent, &missing);
    Resolve(lib, "cudaEventCreateWithFlags", &a.EventCreateWithFlags, &missing);
    Resolve(lib, "cudaEventDestroy", &a.EventDestroy, &missing);
    Resolve(lib, "cudaEventRecord", &a.EventRecord, &missing);
    Resolve(lib, "cudaEventQuery", &a.EventQuery, &missing);
    Resolve(lib, "cudaEventSynchronize", &a.EventSynchronize, &missing);
    Resolve(lib, "cudaMalloc", &a.Malloc, &missing);
    Resolve(lib, "cudaFree", &a.Free, &missing);
    Resolve(lib, "cudaMallocHost", &a.MallocHost, &missing);
    Resolve(lib, "cudaFreeHost", &a.FreeHost, &missing);
    Resolve(lib, "cudaHostAlloc", &a.HostAlloc, &missing);
    Resolve(lib, "cudaMemcpyAsync", &a.MemcpyAsync, &missing);
    Resolve(lib, "cudaMemsetAsync", &a.MemsetAsync, &missing);
    Resolve(lib, "cudaLaunchKernel", &a.LaunchKernel, &missing);
    Resolve(lib, "cudaLibraryLoadData", &a.LibraryLoadData, &missing);
    Resolve(lib, "cudaLibraryGetKernel", &a.LibraryGetKernel, &missing);
    if (!missing.empty()) {
      l->error = "the CUDA runtime " + lib.path + " lacks " + missing +
                 "; spark_dl needs CUDA runtime 12.0 or later";
      return l;
    }
    if (a.RuntimeGetVersion(&a.runtime_version) != cudaSuccess) a.runtime_version = 0;
    // The driver the runtime uses (loaded already, or by the runtime's first call).
    LibrarySearch driver;
    driver.sonames = {"libcuda.so.1"};
    std::string driver_error;
    DynLib drv = OpenLibrary("the CUDA driver", driver, &driver_error);
    if (drv.loaded()) {
      a.DriverDeviceGet = reinterpret_cast<decltype(a.DriverDeviceGet)>(drv.Symbol("cuDeviceGet"));
      a.DriverPrimaryCtxGetState = reinterpret_cast<decltype(a.DriverPrimaryCtxGetState)>(
          drv.Symbol("cuDevicePrimaryCtxGetState"));
    }
    l->ok = true;
    return l;
  }();
  return loaded;
}

}  // namespace

std::string CudaApi::Describe(cudaError_t err, const char* what) const {
  const char* name = GetErrorName ? GetErrorName(err) : nullptr;
  const char* text = GetErrorString ? GetErrorString(err) : nullptr;
  std::string s = std::string(what) + " failed: ";
  s += name ? name : ("CUDA error " + std::to_string(static_cast<int>(err)));
  if (text) s += std::string(" (") + text + ")";
  return s;
}

Status CudaApi::Check(cudaError_t err, const char* what) const {
  if (err == cudaSuccess) return Status::OK();
  if (GetLastError) GetLastError();  // reset the non-sticky error slot
  return Status::Failure(Describe(err, what));
}

const CudaApi* Cuda(std::string* error) {
  Loaded* l = Load();
  if (!l->ok) {
    if (error) *error = l->error;
    return nullptr;
  }
  return &l->api;
}

const CudaAvailability& QueryCuda() {
  static const CudaAvailability info = [] {
    CudaAvailability a;
    std::string error;
    const CudaApi* api = Cuda(&error);
    if (!api) {
      a.reason = error;
      return a;
    }
    a.library = api->lib.path;
    a.runtime_version = api->runtime_version;
    if (api->DriverGetVersion(&a.driver_version) != cudaSuccess) a.driver_version = 0;
    int count = 0;
    cudaError_t err = api->GetDeviceCount(&count);
    if (err != cudaSuccess) {
      a.reason = api->Describe(err, "cudaGetDeviceCount") +
                 (a.driver_version == 0 ? "; no NVIDIA driver is installed on this host" : "");
      api->GetLastError();
      return a;
    }
    a.device_count = count;
    if (count == 0) {
      a.reason = "the CUDA runtime sees no device (check CUDA_VISIBLE_DEVICES and the driver)";
      return a;
    }
    a.usable = true;
    return a;
  }();
  return info;
}

DeviceGuard::DeviceGuard(const CudaApi* api, int device) : api_(api) {
  int current = -1;
  status_ = api_->Check(api_->GetDevice(&current), "cudaGetDevice");
  if (!status_.ok()) return;
  if (current == device) return;
  std::string what = "cudaSetDevice(" + std::to_string(device) + ")";
  status_ = api_->Check(api_->SetDevice(device), what.c_str());
  if (status_.ok()) previous_ = current;
}

bool CudaApi::HasPrimaryContext(int device) const {
  if (!DriverDeviceGet || !DriverPrimaryCtxGetState) return true;
  int dev = 0;
  unsigned int flags = 0;
  int active = 0;
  if (DriverDeviceGet(&dev, device) != 0) return true;
  if (DriverPrimaryCtxGetState(dev, &flags, &active) != 0) return true;
  return active != 0;
}

DeviceGuard::~DeviceGuard() {
  // Without a context there, the thread never used that device: leave this one.
  if (previous_ >= 0 && api_->HasPrimaryContext(previous_)) api_->SetDevice(previous_);
}

}  // namespace gpu
}  // namespace sdl
