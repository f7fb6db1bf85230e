#include "gpu/kernels.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <string>

#include "gpu/build_config.h"  // generated: SDL_CUDA_ARCH_STRING
// The fatbin nvcc built from kernels.cu, placed in the extension by the
// generated kernels_fatbin.cc (an .incbin). Hidden: not part of the exported surface.
extern "C" __attribute__((visibility("hidden"))) const unsigned char sdl_kernels_fatbin_start[];

namespace sdl {
namespace gpu {
namespace {

constexpr int kNumDataTypes = static_cast<int>(DataType::kUInt64) + 1;

// The kernel of each dtype in kernels.cu (nullptr: not scalable).
const char* ScaledKernelName(DataType dt) {
  switch (dt) {
    case DataType::kUInt8: return "sdl_scaled_copy_u8";
    case DataType::kInt8: return "sdl_scaled_copy_i8";
    case DataType::kInt16: return "sdl_scaled_copy_i16";
    case DataType::kUInt16: return "sdl_scaled_copy_u16";
    case DataType::kInt32: return "sdl_scaled_copy_i32";
    case DataType::kInt64: return "sdl_scaled_copy_i64";
    case DataType::kUInt64: return "sdl_scaled_copy_u64";
    case DataType::kFloat16: return "sdl_scaled_copy_f16";
    case DataType::kBFloat16: return "sdl_scaled_copy_bf16";
    case DataType::kFloat32: return "sdl_scaled_copy_f32";
    case DataType::kFloat64: return "sdl_scaled_copy_f64";
    case DataType::kBool: return nullptr;
  }
  return nullptr;
}

struct KernelTable {
  Status status;
  const CudaApi* api = nullptr;
  cudaKernel_t copy = nullptr;
  cudaKernel_t scaled[kNumDataTypes] = {};
};

// Loaded once per process: a cudaLibrary_t is context-independent, so one load
// serves every device (each device gets its module on first launch there).
const KernelTable& Kernels() {
  static const KernelTable table = [] {
    KernelTable t;
    std::string error;
    t.api = Cuda(&error);
    if (!t.api) {
      t.status = Status::Failure(error);
      return t;
    }
    cudaLibrary_t lib = nullptr;
    t.status = t.api->Check(t.api->LibraryLoadData(&lib, sdl_kernels_fatbin_start, nullptr,
                                                   nullptr, 0, nullptr, nullptr, 0),
                            "loading spark_dl's CUDA kernels (cudaLibraryLoadData; built for "
                            SDL_CUDA_ARCH_STRING ")");
    if (!t.status.ok()) return t;
    auto get = [&](const char* name, cudaKernel_t* out) {
      if (!t.status.ok()) return;
      std::string what = std::string("cudaLibraryGetKernel(") + name + ")";
      t.status = t.api->Check(t.api->LibraryGetKernel(out, lib, name), what.c_str());
    };
    get("sdl_batched_copy", &t.copy);
    for (int i = 0; i < kNumDataTypes; ++i) {
      const char* name = ScaledKernelName(static_cast<DataType>(i));
      if (name) get(name, &t.scaled[i]);
    }
    return t;
  }();
  return table;
}

// The blocks of kBatchThreads threads that can be resident on `device` at once.
unsigned MaxResidentBlocks(const CudaApi* api, int device) {
  static std::mutex mu;
  static std::map<int, unsigned> cache;
  std::lock_guard<std::mutex> lk(mu);
  auto it = cache.find(device);
  if (it != cache.end()) return it->second;
  int sms = 0, threads_per_sm = 0;
  if (api->DeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      api->DeviceGetAttribute(&threads_per_sm, cudaDevAttrMaxThreadsPerMultiProcessor,
                              device) != cudaSuccess) {
    api->GetLastError();
    sms = 32;  // a modest grid still covers every chunk (blocks loop)
    threads_per_sm = 1024;
  }
  unsigned blocks = static_cast<unsigned>(sms) *
                    static_cast<unsigned>(std::max(1, threads_per_sm / kBatchThreads));
  cache[device] = blocks;
  return blocks;
}

Status Launch(const KernelTable& k, cudaKernel_t kernel, const std::vector<BatchParams>& plans,
              cudaStream_t stream) {
  int device = 0;
  SDL_GPU_RETURN_IF_ERROR(k.api->Check(k.api->GetDevice(&device), "cudaGetDevice"));
  const unsigned max_blocks = MaxResidentBlocks(k.api, device);
  for (const BatchParams& p : plans) {
    // cudaLaunchKernel copies the parameter block at the call: `p` need not
    // outlive the launch.
    void* args[] = {const_cast<BatchParams*>(&p)};
    cudaError_t err = k.api->LaunchKernel(reinterpret_cast<const void*>(kernel),
                                          dim3(GridFor(p, max_blocks)), dim3(kBatchThreads),
                                          args, 0, stream);
    if (err != cudaSuccess) {
      std::string what = "launching spark_dl's batched copy kernel on device " +
                         std::to_string(device) + " (built for " SDL_CUDA_ARCH_STRING ")";
      return k.api->Check(err, what.c_str());
    }
  }
  return Status::OK();
}

}  // namespace

Status CheckScaleSupported(DataType dt, double scale, int64_t divisor) {
  if (divisor < 1)
    return Status::Invalid("scale divisor " + std::to_string(divisor) + " is not positive");
  if (scale == 1.0 && divisor == 1) return Status::OK();
  if (!ScaledKernelName(dt))
    return Status::Invalid(std::string(DataTypeName(dt)) +
                           " tensors cannot be scaled (prescale/postscale or Average)");
  return Status::OK();
}

std::vector<BatchParams> PlanBatches(const std::vector<CopySpan>& spans, size_t elem_size,
                                     double scale, int64_t divisor) {
  std::vector<BatchParams> plans;
  const uint32_t chunk_elems = kBatchChunkBytes / static_cast<uint32_t>(elem_size);
  BatchParams* cur = nullptr;
  for (const CopySpan& s : spans) {
    if (s.count == 0) continue;
    if (!cur || cur->num_entries == kBatchMaxEntries) {
      plans.emplace_back();
      cur = &plans.back();
      cur->num_entries = 0;
      cur->chunk_elems = chunk_elems;
      cur->scale = scale;
      cur->divisor = divisor;
      cur->chunk_begin[0] = 0;
    }
    const int e = cur->num_entries++;
    cur->entries[e] = BatchEntry{s.src, s.dst, static_cast<uint64_t>(s.count)};
    const uint64_t chunks = (static_cast<uint64_t>(s.count) + chunk_elems - 1) / chunk_elems;
    cur->chunk_begin[e + 1] = cur->chunk_begin[e] + static_cast<uint32_t>(chunks);
  }
  return plans;
}

unsigned GridFor(const BatchParams& p, unsigned max_resident_blocks) {
  const uint32_t chunks = p.chunk_begin[p.num_entries];
  return std::max(1u, std::min<unsigned>(chunks, std::max(1u, max_resident_blocks)));
}

Status LoadKernels() { return Kernels().status; }

const char* KernelArchitectures() { return SDL_CUDA_ARCH_STRING; }

Status BatchedScaledCopy(const std::vector<CopySpan>& spans, DataType dt, double scale,
                         cudaStream_t stream, int64_t divisor) {
  SDL_GPU_RETURN_IF_ERROR(CheckScaleSupported(dt, scale, divisor));
  if (IsFloating(dt) && divisor != 1) {  // floats multiply once per element
    scale /= static_cast<double>(divisor);
    divisor = 1;
  }
  const size_t elem = DataTypeSize(dt);
  const bool plain = scale == 1.0 && divisor == 1;
  // A chunk's element count must fit the 32-bit chunk prefix sums: 2^32 chunks
  // of 16 KiB is 64 TiB, so only absurd sizes are refused.
  uint64_t total_chunks = 0;
  std::vector<CopySpan> work;
  work.reserve(spans.size());
  for (size_t i = 0; i < spans.size(); ++i) {
    const CopySpan& s = spans[i];
    if (s.count == 0) continue;
    if (!s.dst)
      return Status::Invalid("batched copy entry " + std::to_string(i) +
                             " has a null destination");
    const size_t n = plain ? s.count * elem : s.count;
    total_chunks += (n * (plain ? 1 : elem) + kBatchChunkBytes - 1) / kBatchChunkBytes;
    work.push_back(CopySpan{s.src, s.dst, n});
  }
  if (work.empty()) return Status::OK();
  if (total_chunks > 0xffffffffull)
    return Status::Invalid("batched copy of more than 64 TiB in one call");
  const KernelTable& k = Kernels();
  SDL_GPU_RETURN_IF_ERROR(k.status);
  const cudaKernel_t kernel = plain ? k.copy : k.scaled[static_cast<int>(dt)];
  return Launch(k, kernel, PlanBatches(work, plain ? 1 : elem, scale, divisor), stream);
}

Status ScaleInPlace(void* buf, size_t count, DataType dt, double scale, cudaStream_t stream,
                    int64_t divisor) {
  if ((scale == 1.0 && divisor == 1) || count == 0) return Status::OK();
  return BatchedScaledCopy({CopySpan{buf, buf, count}}, dt, scale, stream, divisor);
}

}  // namespace gpu
}  // namespace sdl
