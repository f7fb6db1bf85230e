// Element-wise kernels used by every transport: reductions and scaling.
#pragma once

#include <cstddef>

#include "common/types.h"

namespace sdl {

// out[i] = a[i] (op) b[i] for n elements; out may alias a or b.
// Average is reduced as Sum (the caller divides). Throws Error(kInvalidArgument)
// for combinations that make no sense (e.g. Sum of bool).
void Reduce(void* out, const void* a, const void* b, size_t n, DataType dt, ReduceOp op);

// Checks Reduce supports (dt, op) without running it.
void CheckReduceSupported(DataType dt, ReduceOp op);

// buf[i] *= factor (integers: computed in double, truncated toward zero).
void Scale(void* buf, size_t n, DataType dt, double factor);

// IEEE half and bfloat16 conversions.
float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
float BFloat16ToFloat(uint16_t h);
uint16_t FloatToBFloat16(float f);

}  // namespace sdl
