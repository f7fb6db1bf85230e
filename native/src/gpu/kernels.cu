// Device code of the batched pack/unpack/scale kernels. nvcc compiles this file
// alone into a fatbin (SASS for the listed architectures plus PTX) that the build
// embeds in the extension; kernels.cc loads it with cudaLibraryLoadData and
// launches the extern "C" kernels below by name. Nothing here is linked against
// the CUDA runtime.
//
// The copy body and the scalers are __host__ __device__ so that
// kernels_host_check.cc can run this same code on the CPU (every block and
// thread in turn) against the CPU transports' Scale: machines without a GPU
// still execute the chunking, vector and tail logic.
//
// Scaling follows the CPU transports (common/reduce.cc, Scale) so a CUDA result
// equals the CPU one: float32 multiplies by the factor rounded to float,
// float64 in double, float16/bfloat16 convert to float, multiply, round to
// nearest even; integers multiply in double and truncate toward zero (as
// Horovod's integer Average does; the cast saturates on the device). bool
// cannot be scaled (the host refuses before launching). Integer Average uses
// the divisor: exact division by the rank count, as the CPU operations do.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "gpu/kernel_params.h"

#if defined(__CUDACC__)
#define SDL_UNROLL _Pragma("unroll")
#else
#define SDL_UNROLL  // the host check (kernels_host_check.cc) runs these loops as written
#endif

namespace sdl_kernels {

using sdl::gpu::BatchParams;

// Integers: divided by the divisor exactly (in 64 bits, so any rank count
// works for narrow types), then multiplied by the factor in double.
template <typename T>
struct Scaler {
  double f;
  int64_t d;
  SDL_HOST_DEVICE Scaler(double s, int64_t divisor) : f(s), d(divisor) {}
  SDL_HOST_DEVICE T operator()(T x) const {
    if (d != 1) {
      if (static_cast<T>(-1) < static_cast<T>(0))
        x = static_cast<T>(static_cast<int64_t>(x) / d);
      else
        x = static_cast<T>(static_cast<uint64_t>(x) / static_cast<uint64_t>(d));
    }
    return f == 1.0 ? x : static_cast<T>(static_cast<double>(x) * f);
  }
};

template <>
struct Scaler<float> {
  float f;
  SDL_HOST_DEVICE Scaler(double s, int64_t) : f(static_cast<float>(s)) {}
  SDL_HOST_DEVICE float operator()(float x) const { return x * f; }
};

template <>
struct Scaler<double> {
  double f;
  SDL_HOST_DEVICE Scaler(double s, int64_t) : f(s) {}
  SDL_HOST_DEVICE double operator()(double x) const { return x * f; }
};

template <>
struct Scaler<__half> {
  float f;
  SDL_HOST_DEVICE Scaler(double s, int64_t) : f(static_cast<float>(s)) {}
  SDL_HOST_DEVICE __half operator()(__half x) const {
    return __float2half_rn(__half2float(x) * f);
  }
};

template <>
struct Scaler<__nv_bfloat16> {
  float f;
  SDL_HOST_DEVICE Scaler(double s, int64_t) : f(static_cast<float>(s)) {}
  SDL_HOST_DEVICE __nv_bfloat16 operator()(__nv_bfloat16 x) const {
    return __float2bfloat16_rn(__bfloat162float(x) * f);
  }
};

// dst[i] = scale(src[i]) (or a plain copy) over the chunks of the batch that
// thread `thread` of block `block` (of `grid` blocks of kBatchThreads) owns.
// src may equal dst (scale in place): each element is read and written by the
// same thread, so there is no hazard.
template <typename T, bool kScale>
SDL_HOST_DEVICE inline void BatchedCopy(const BatchParams& p, uint32_t block, uint32_t grid,
                                        uint32_t thread) {
  constexpr int kVec = 16 / sizeof(T);  // elements per 16-byte vector
  static_assert(kVec * sizeof(T) == 16, "element size must divide 16");
  // A standard chunk (kBatchChunkBytes) is exactly kVecPerThread vectors per
  // thread of a kBatchThreads block (the host launches blocks of that size).
  constexpr int kVecPerThread = sdl::gpu::kBatchChunkBytes / (16 * sdl::gpu::kBatchThreads);
  static_assert(kVecPerThread * 16 * sdl::gpu::kBatchThreads == sdl::gpu::kBatchChunkBytes,
                "a chunk must be whole vectors per thread");
  using sdl::gpu::kBatchThreads;
  const Scaler<T> scale(p.scale, p.divisor);
  const uint32_t total = p.chunk_begin[p.num_entries];
  for (uint32_t c = block; c < total; c += grid) {
    int e;
    uint64_t begin, end;
    sdl::gpu::ChunkRange(p, c, &e, &begin, &end);
    const T* src = static_cast<const T*>(p.entries[e].src);
    T* dst = static_cast<T*>(p.entries[e].dst);
    if (src == nullptr) {  // zeros; 0 scaled is 0
      for (uint64_t i = begin + thread; i < end; i += kBatchThreads) dst[i] = T();
      continue;
    }
    const bool aligned =
        ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0;
    uint64_t scalar_from = begin;
    if (aligned) {
      // begin is a multiple of kVec (chunk_elems is); the partial vector at the
      // end of an entry is left to the scalar loop. Each thread loads all its
      // vectors of the segment before storing any: several loads in flight per
      // thread instead of one round trip each (the compiler may not reorder
      // them itself, since src may alias dst).
      const uint4* s4 = reinterpret_cast<const uint4*>(src);
      uint4* d4 = reinterpret_cast<uint4*>(dst);
      const uint64_t vbegin = begin / kVec, vend = end / kVec;
      constexpr uint64_t kSegment = static_cast<uint64_t>(kVecPerThread) * kBatchThreads;
      for (uint64_t seg = vbegin; seg < vend; seg += kSegment) {  // once for a standard chunk
        uint4 v[kVecPerThread];
SDL_UNROLL
        for (int k = 0; k < kVecPerThread; ++k) {
          const uint64_t i = seg + thread + static_cast<uint64_t>(k) * kBatchThreads;
          if (i < vend) v[k] = s4[i];
        }
SDL_UNROLL
        for (int k = 0; k < kVecPerThread; ++k) {
          const uint64_t i = seg + thread + static_cast<uint64_t>(k) * kBatchThreads;
          if (i < vend) {
            if (kScale) {
              T* t = reinterpret_cast<T*>(&v[k]);
SDL_UNROLL
              for (int j = 0; j < kVec; ++j) t[j] = scale(t[j]);
            }
            d4[i] = v[k];
          }
        }
      }
      scalar_from = vend * kVec;
    }
    for (uint64_t i = scalar_from + thread; i < end; i += kBatchThreads)
      dst[i] = kScale ? scale(src[i]) : src[i];
  }
}

}  // namespace sdl_kernels

#if defined(__CUDACC__)
// __grid_constant__: the 4 KiB block stays in the constant bank; without it the
// dynamic indexing into entries[] would copy it to every thread's local memory.
#define SDL_SCALED_COPY_KERNEL(suffix, T)                                         \
  extern "C" __global__ void __launch_bounds__(sdl::gpu::kBatchThreads)          \
      sdl_scaled_copy_##suffix(const __grid_constant__ sdl::gpu::BatchParams p) { \
    sdl_kernels::BatchedCopy<T, true>(p, blockIdx.x, gridDim.x, threadIdx.x);     \
  }

SDL_SCALED_COPY_KERNEL(u8, uint8_t)
SDL_SCALED_COPY_KERNEL(i8, int8_t)
SDL_SCALED_COPY_KERNEL(i16, int16_t)
SDL_SCALED_COPY_KERNEL(u16, uint16_t)
SDL_SCALED_COPY_KERNEL(i32, int32_t)
SDL_SCALED_COPY_KERNEL(i64, int64_t)
SDL_SCALED_COPY_KERNEL(u64, uint64_t)
SDL_SCALED_COPY_KERNEL(f16, __half)
SDL_SCALED_COPY_KERNEL(bf16, __nv_bfloat16)
SDL_SCALED_COPY_KERNEL(f32, float)
SDL_SCALED_COPY_KERNEL(f64, double)

// Unscaled pack/unpack of any dtype: counts are in bytes.
extern "C" __global__ void __launch_bounds__(sdl::gpu::kBatchThreads)
    sdl_batched_copy(const __grid_constant__ sdl::gpu::BatchParams p) {
  sdl_kernels::BatchedCopy<uint8_t, false>(p, blockIdx.x, gridDim.x, threadIdx.x);
}
#endif  // __CUDACC__
