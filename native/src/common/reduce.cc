#include "common/reduce.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

namespace sdl {

float HalfToFloat(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or nan
    return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0));
  }
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (abs < 0x38800000u) {  // subnormal or zero in half
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);
    uint32_t e = abs >> 23;
    uint32_t m = (abs & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - e;  // 113 - e + 13
    uint32_t half_m = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1);
    uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half_m & 1))) ++half_m;
    return static_cast<uint16_t>(sign | half_m);
  }
  uint32_t h = ((abs >> 13) - ((127 - 15) << 10));
  uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1))) ++h;  // round to nearest even
  return static_cast<uint16_t>(sign | h);
}

float BFloat16ToFloat(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t FloatToBFloat16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // nan
  uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>((x + rounding) >> 16);
}

namespace {

template <typename T, typename F>
void Apply(void* out, const void* a, const void* b, size_t n, F f) {
  T* o = static_cast<T*>(out);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) o[i] = f(x[i], y[i]);
}

template <typename T>
void ReduceTyped(void* out, const void* a, const void* b, size_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::kAverage:
    case ReduceOp::kSum: return Apply<T>(out, a, b, n, [](T x, T y) { return T(x + y); });
    case ReduceOp::kProduct: return Apply<T>(out, a, b, n, [](T x, T y) { return T(x * y); });
    case ReduceOp::kMin: return Apply<T>(out, a, b, n, [](T x, T y) { return std::min(x, y); });
    case ReduceOp::kMax: return Apply<T>(out, a, b, n, [](T x, T y) { return std::max(x, y); });
    case ReduceOp::kBitAnd: break;
  }
  throw Error(ErrorCode::kInvalidArgument, "unsupported reduction");
}

#if defined(__x86_64__)
// float16 conversions with the F16C instructions (8 lanes at a time), used
// when the CPU has them; the portable loop below is several times slower.
__attribute__((target("avx,f16c"))) void HalfToFloatF16C(const uint16_t* in, float* out,
                                                          size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  for (; i < n; ++i) out[i] = HalfToFloat(in[i]);
}
__attribute__((target("avx,f16c"))) void FloatToHalfF16C(const float* in, uint16_t* out,
                                                          size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) out[i] = FloatToHalf(in[i]);
}
bool HasF16C() {
  static const bool has = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
  return has;
}
#endif

void ToFloatBlock(const uint16_t* in, float* out, size_t n, bool bf16) {
#if defined(__x86_64__)
  if (!bf16 && HasF16C()) return HalfToFloatF16C(in, out, n);
#endif
  for (size_t i = 0; i < n; ++i) out[i] = bf16 ? BFloat16ToFloat(in[i]) : HalfToFloat(in[i]);
}

void FromFloatBlock(const float* in, uint16_t* out, size_t n, bool bf16) {
#if defined(__x86_64__)
  if (!bf16 && HasF16C()) return FloatToHalfF16C(in, out, n);
#endif
  for (size_t i = 0; i < n; ++i) out[i] = bf16 ? FloatToBFloat16(in[i]) : FloatToHalf(in[i]);
}

template <bool kBF16>
void Reduce16(void* out, const void* a, const void* b, size_t n, ReduceOp op) {
  uint16_t* o = static_cast<uint16_t*>(out);
  const uint16_t* x = static_cast<const uint16_t*>(a);
  const uint16_t* y = static_cast<const uint16_t*>(b);
  // Convert through float in blocks so the loops vectorise.
  constexpr size_t kBlock = 256;
  float fx[kBlock], fy[kBlock];
  for (size_t base = 0; base < n; base += kBlock) {
    size_t m = std::min(kBlock, n - base);
    ToFloatBlock(x + base, fx, m, kBF16);
    ToFloatBlock(y + base, fy, m, kBF16);
    ReduceTyped<float>(fx, fx, fy, m, op);
    FromFloatBlock(fx, o + base, m, kBF16);
  }
}

}  // namespace

void CheckReduceSupported(DataType dt, ReduceOp op) {
  if (op == ReduceOp::kBitAnd && dt != DataType::kUInt64)
    throw Error(ErrorCode::kInvalidArgument, "BitAnd is internal to uint64 bit vectors");
  if (dt == DataType::kBool && (op == ReduceOp::kSum || op == ReduceOp::kAverage))
    throw Error(ErrorCode::kInvalidArgument,
                std::string("reduce op ") + ReduceOpName(op) +
                    " is not defined for bool tensors; use Max (logical or) or Min/Product "
                    "(logical and)");
}

void Reduce(void* out, const void* a, const void* b, size_t n, DataType dt, ReduceOp op) {
  switch (dt) {
    case DataType::kUInt8: return ReduceTyped<uint8_t>(out, a, b, n, op);
    case DataType::kInt8: return ReduceTyped<int8_t>(out, a, b, n, op);
    case DataType::kInt16: return ReduceTyped<int16_t>(out, a, b, n, op);
    case DataType::kUInt16: return ReduceTyped<uint16_t>(out, a, b, n, op);
    case DataType::kInt32: return ReduceTyped<int32_t>(out, a, b, n, op);
    case DataType::kInt64: return ReduceTyped<int64_t>(out, a, b, n, op);
    case DataType::kFloat32: return ReduceTyped<float>(out, a, b, n, op);
    case DataType::kFloat64: return ReduceTyped<double>(out, a, b, n, op);
    case DataType::kFloat16: return Reduce16<false>(out, a, b, n, op);
    case DataType::kBFloat16: return Reduce16<true>(out, a, b, n, op);
    case DataType::kBool: {
      CheckReduceSupported(dt, op);
      bool is_or = op == ReduceOp::kMax;
      return Apply<uint8_t>(out, a, b, n, [is_or](uint8_t x, uint8_t y) {
        return static_cast<uint8_t>(is_or ? (x || y) : (x && y));
      });
    }
    case DataType::kUInt64:
      if (op == ReduceOp::kBitAnd)
        return Apply<uint64_t>(out, a, b, n, [](uint64_t x, uint64_t y) { return x & y; });
      return ReduceTyped<uint64_t>(out, a, b, n, op);
  }
}

namespace {
template <typename T>
void ScaleInt(void* buf, size_t n, double f) {
  T* p = static_cast<T*>(buf);
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<T>(std::trunc(static_cast<double>(p[i]) * f));
}
}  // namespace

void Scale(void* buf, size_t n, DataType dt, double factor) {
  if (factor == 1.0) return;
  switch (dt) {
    case DataType::kFloat32: {
      float* p = static_cast<float*>(buf);
      float f = static_cast<float>(factor);
      for (size_t i = 0; i < n; ++i) p[i] *= f;
      return;
    }
    case DataType::kFloat64: {
      double* p = static_cast<double*>(buf);
      for (size_t i = 0; i < n; ++i) p[i] *= factor;
      return;
    }
    case DataType::kFloat16:
    case DataType::kBFloat16: {
      const bool bf16 = dt == DataType::kBFloat16;
      uint16_t* p = static_cast<uint16_t*>(buf);
      float block[256];
      for (size_t base = 0; base < n; base += 256) {
        size_t m = std::min<size_t>(256, n - base);
        ToFloatBlock(p + base, block, m, bf16);
        for (size_t i = 0; i < m; ++i) block[i] = static_cast<float>(block[i] * factor);
        FromFloatBlock(block, p + base, m, bf16);
      }
      return;
    }
    case DataType::kUInt8: return ScaleInt<uint8_t>(buf, n, factor);
    case DataType::kInt8: return ScaleInt<int8_t>(buf, n, factor);
    case DataType::kInt16: return ScaleInt<int16_t>(buf, n, factor);
    case DataType::kUInt16: return ScaleInt<uint16_t>(buf, n, factor);
    case DataType::kInt32: return ScaleInt<int32_t>(buf, n, factor);
    case DataType::kInt64: return ScaleInt<int64_t>(buf, n, factor);
    case DataType::kUInt64: return ScaleInt<uint64_t>(buf, n, factor);
    case DataType::kBool:
      throw Error(ErrorCode::kInvalidArgument, "bool tensors cannot be scaled");
  }
}

}  // namespace sdl
