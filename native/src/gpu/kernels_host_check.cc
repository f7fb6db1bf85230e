// TEST ONLY, not part of the extension: runs the body of the batched copy
// kernels (kernels.cu) on the CPU, every block and thread in turn, and compares
// with the CPU transports' Scale (common/reduce.cc). Built and run by
// tests/unit/test_cuda_build.py with the host C++ compiler and the CUDA
// headers, so the chunking, 16-byte vector, tail, in-place and multi-launch
// logic is executed even where no GPU exists (tests/gpu runs it on a GPU).
// Prints "N passed, M failed" and exits non-zero on a failure.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "common/reduce.h"
#include "gpu/kernels.cu"  // the device code, compiled here as host code
#include "gpu/kernels.h"

// kernels.cc refers to the embedded fatbin; nothing is loaded here.
extern "C" __attribute__((visibility("hidden"))) const unsigned char sdl_kernels_fatbin_start[1] =
    {0};

namespace {

using sdl::DataType;
using sdl::gpu::BatchParams;
using sdl::gpu::CopySpan;

int g_passed = 0, g_failed = 0;

template <typename T, bool kScale>
void Emulate(const std::vector<BatchParams>& plans, unsigned grid_cap) {
  for (const BatchParams& p : plans) {
    const unsigned grid = sdl::gpu::GridFor(p, grid_cap);
    for (unsigned b = 0; b < grid; ++b)
      for (unsigned t = 0; t < static_cast<unsigned>(sdl::gpu::kBatchThreads); ++t)
        sdl_kernels::BatchedCopy<T, kScale>(p, b, grid, t);
  }
}

template <typename T>
void RunScaled(const std::vector<CopySpan>& spans, double scale, int64_t divisor,
               unsigned grid_cap) {
  Emulate<T, true>(sdl::gpu::PlanBatches(spans, sizeof(T), scale, divisor), grid_cap);
}

// What BatchedScaledCopy launches, run on the host instead.
void Run(const std::vector<CopySpan>& spans, DataType dt, double scale, int64_t divisor,
         unsigned grid_cap) {
  if (sdl::IsFloating(dt) && divisor != 1) {
    scale /= static_cast<double>(divisor);
    divisor = 1;
  }
  if (scale == 1.0 && divisor == 1) {  // the plain copy kernel, counts in bytes
    std::vector<CopySpan> bytes;
    for (const auto& s : spans) bytes.push_back({s.src, s.dst, s.count * sdl::DataTypeSize(dt)});
    Emulate<uint8_t, false>(sdl::gpu::PlanBatches(bytes, 1, 1.0), grid_cap);
    return;
  }
  switch (dt) {
    case DataType::kUInt8: return RunScaled<uint8_t>(spans, scale, divisor, grid_cap);
    case DataType::kInt8: return RunScaled<int8_t>(spans, scale, divisor, grid_cap);
    case DataType::kInt16: return RunScaled<int16_t>(spans, scale, divisor, grid_cap);
    case DataType::kUInt16: return RunScaled<uint16_t>(spans, scale, divisor, grid_cap);
    case DataType::kInt32: return RunScaled<int32_t>(spans, scale, divisor, grid_cap);
    case DataType::kInt64: return RunScaled<int64_t>(spans, scale, divisor, grid_cap);
    case DataType::kUInt64: return RunScaled<uint64_t>(spans, scale, divisor, grid_cap);
    case DataType::kFloat16: return RunScaled<__half>(spans, scale, divisor, grid_cap);
    case DataType::kBFloat16: return RunScaled<__nv_bfloat16>(spans, scale, divisor, grid_cap);
    case DataType::kFloat32: return RunScaled<float>(spans, scale, divisor, grid_cap);
    case DataType::kFloat64: return RunScaled<double>(spans, scale, divisor, grid_cap);
    case DataType::kBool: std::abort();  // refused by CheckScaleSupported
  }
}

// Values whose scaled results stay in range for the integer types.
void Fill(void* p, size_t n, DataType dt, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(-40.0, 40.0);
  for (size_t i = 0; i < n; ++i) {
    double v = u(rng);
    switch (dt) {
      case DataType::kUInt8: static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(v + 40); break;
      case DataType::kInt8: static_cast<int8_t*>(p)[i] = static_cast<int8_t>(v); break;
      case DataType::kInt16: static_cast<int16_t*>(p)[i] = static_cast<int16_t>(v * 20); break;
      case DataType::kUInt16: static_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(v * 20 + 800); break;
      case DataType::kInt32: static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v * 1e4); break;
      case DataType::kInt64: static_cast<int64_t*>(p)[i] = static_cast<int64_t>(v * 1e9); break;
      case DataType::kUInt64: static_cast<uint64_t*>(p)[i] = static_cast<uint64_t>(v * 1e9 + 5e10); break;
      case DataType::kFloat16: static_cast<uint16_t*>(p)[i] = sdl::FloatToHalf(static_cast<float>(v)); break;
      case DataType::kBFloat16: static_cast<uint16_t*>(p)[i] = sdl::FloatToBFloat16(static_cast<float>(v)); break;
      case DataType::kFloat32: static_cast<float*>(p)[i] = static_cast<float>(v); break;
      case DataType::kFloat64: static_cast<double*>(p)[i] = v; break;
      case DataType::kBool: static_cast<uint8_t*>(p)[i] = v > 0; break;
    }
  }
}

// The operations layer's host scaling: integers divided exactly by divisor
// (64-bit), then every type multiplied by factor as the CPU transports do.
void Reference(std::string* ref, size_t n, DataType dt, double scale, int64_t divisor) {
  void* p = &(*ref)[0];
  auto div = [&](auto* v) {
    using T = std::remove_pointer_t<decltype(v)>;
    for (size_t i = 0; i < n; ++i) {
      if (std::is_signed<T>::value)
        v[i] = static_cast<T>(static_cast<int64_t>(v[i]) / divisor);
      else
        v[i] = static_cast<T>(static_cast<uint64_t>(v[i]) / static_cast<uint64_t>(divisor));
    }
  };
  if (divisor != 1) {
    switch (dt) {
      case DataType::kUInt8: div(static_cast<uint8_t*>(p)); break;
      case DataType::kInt8: div(static_cast<int8_t*>(p)); break;
      case DataType::kInt16: div(static_cast<int16_t*>(p)); break;
      case DataType::kUInt16: div(static_cast<uint16_t*>(p)); break;
      case DataType::kInt32: div(static_cast<int32_t*>(p)); break;
      case DataType::kInt64: div(static_cast<int64_t*>(p)); break;
      case DataType::kUInt64: div(static_cast<uint64_t*>(p)); break;
      default: scale /= static_cast<double>(divisor); break;  // floats: folded
    }
  }
  if (scale != 1.0) sdl::Scale(p, n, dt, scale);
}

// One case: `sizes` spans of `dt`; src starts `misalign` elements into its
// (16-byte aligned) allocation; in place when `in_place`; every third span has
// no source (zeros) when `zeros`.
void Case(DataType dt, const std::vector<size_t>& sizes, double scale, int64_t divisor,
          size_t misalign, bool in_place, bool zeros, unsigned grid_cap, std::mt19937_64& rng) {
  const size_t es = sdl::DataTypeSize(dt);
  std::vector<std::vector<uint64_t>> src_mem, dst_mem;  // uint64_t: 8-aligned; +16 B slack
  std::vector<std::string> want;
  std::vector<CopySpan> spans;
  for (size_t n : sizes) {
    src_mem.emplace_back((n + misalign) * es / 8 + 4);
    dst_mem.emplace_back(n * es / 8 + 4);
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    // Align both to 16 bytes inside their allocations, then apply the misalignment.
    auto align16 = [](void* p) {
      return reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(p) + 15) & ~uintptr_t(15));
    };
    char* src = align16(src_mem[i].data()) + misalign * es;
    char* dst = in_place ? src : align16(dst_mem[i].data());
    Fill(src, sizes[i], dt, rng);
    const bool zero = zeros && i % 3 == 0;
    if (zero && !in_place) Fill(dst, sizes[i], dt, rng);  // garbage the kernel must overwrite
    std::string ref = zero ? std::string(sizes[i] * es, '\0') : std::string(src, sizes[i] * es);
    if (!zero) Reference(&ref, sizes[i], dt, scale, divisor);
    want.push_back(ref);
    spans.push_back({zero ? nullptr : src, dst, sizes[i]});
  }
  Run(spans, dt, scale, divisor, grid_cap);
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (std::memcmp(spans[i].dst, want[i].data(), want[i].size()) == 0) {
      ++g_passed;
      continue;
    }
    ++g_failed;
    size_t first = 0;
    while (first < want[i].size() &&
           static_cast<const char*>(spans[i].dst)[first] == want[i][first]) ++first;
    std::printf("FAIL %s n=%zu scale=%g divisor=%lld misalign=%zu in_place=%d zeros=%d "
                "grid_cap=%u: byte %zu differs\n",
                sdl::DataTypeName(dt), sizes[i], scale, static_cast<long long>(divisor),
                misalign, in_place, zeros, grid_cap, first);
  }
}

}  // namespace

int main() {
  std::mt19937_64 rng(12);
  const std::vector<size_t> odd = {1, 3, 7, 8, 9, 15, 17, 1023, 4097, 8191, 16387, 65537, 300001};
  std::vector<size_t> many;  // more spans than one launch holds (128)
  for (int i = 0; i < 300; ++i) many.push_back(static_cast<size_t>((i * 37) % 700 + 1));
  const DataType all[] = {DataType::kUInt8, DataType::kInt8, DataType::kUInt16, DataType::kInt16,
                          DataType::kInt32,
                          DataType::kInt64, DataType::kUInt64, DataType::kFloat16,
                          DataType::kBFloat16, DataType::kFloat32, DataType::kFloat64};
  for (DataType dt : all) {
    for (double scale : {1.0, 0.5, 3.0}) {
      Case(dt, odd, scale, 1, 0, false, false, 1u << 20, rng);  // aligned: vector path
      Case(dt, odd, scale, 1, 1, false, false, 3, rng);         // misaligned: element path
      Case(dt, odd, scale, 1, 0, true, false, 7, rng);          // in place
      Case(dt, many, scale, 1, 0, false, false, 5, rng);        // several launches
    }
    // Average's exact division by the rank count (300: wider than int8/uint8).
    for (int64_t divisor : {3, 7, 300}) {
      Case(dt, odd, 1.0, divisor, 0, false, false, 1u << 20, rng);
      Case(dt, odd, 0.5, divisor, 1, true, false, 4, rng);
    }
    Case(dt, odd, 1.0, 1, 0, false, true, 6, rng);  // no source: zeros (plain kernel)
    Case(dt, odd, 2.0, 3, 0, false, true, 6, rng);  // no source: zeros (scaled kernel)
  }
  Case(DataType::kBool, odd, 1.0, 1, 1, false, false, 2, rng);  // bool: plain copy only
  Case(DataType::kBool, odd, 1.0, 1, 0, false, true, 2, rng);
  std::printf("kernel emulation: %d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
