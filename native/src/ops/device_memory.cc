#include "ops/device_memory.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

#include "common/reduce.h"

namespace sdl {

Scaling PreScaling(double prescale) {
  Scaling s;
  s.factor = prescale;
  return s;
}

Scaling PostScaling(DataType dt, ReduceOp op, double postscale, int size) {
  Scaling s;
  s.factor = postscale;
  if (op == ReduceOp::kAverage) {
    if (IsFloating(dt)) s.factor /= size;
    else s.divisor = size;
  }
  return s;
}

void ApplyScaling(void* buf, size_t n, DataType dt, const Scaling& s) {
  if (s.divisor != 1) {
    switch (dt) {
// In 64 bits (W), as the CUDA kernel does: a divisor (the rank count) need not
// fit the element type (uint8 over 256 ranks, int8 over 128).
#define SDL_DIV(T, W)                                                                     \
  for (size_t i = 0; i < n; ++i) {                                                        \
    T& x = static_cast<T*>(buf)[i];                                                       \
    x = static_cast<T>(static_cast<W>(x) / static_cast<W>(s.divisor));                    \
  }                                                                                       \
  break;
      case DataType::kUInt8: SDL_DIV(uint8_t, uint64_t)
      case DataType::kInt8: SDL_DIV(int8_t, int64_t)
      case DataType::kInt16: SDL_DIV(int16_t, int64_t)
      case DataType::kUInt16: SDL_DIV(uint16_t, uint64_t)
      case DataType::kInt32: SDL_DIV(int32_t, int64_t)
      case DataType::kInt64: SDL_DIV(int64_t, int64_t)
      case DataType::kUInt64: SDL_DIV(uint64_t, uint64_t)
#undef SDL_DIV
      default: break;
    }
  }
  Scale(buf, n, dt, s.factor);
}

Status DeviceMemory::AllocStaging(Device, size_t bytes, void** p) {
  *p = std::malloc(bytes ? bytes : 1);
  if (!*p)
    return Status::Fail(ErrorCode::kPeerFailure,
                        "out of host memory allocating a " + std::to_string(bytes) +
                            "-byte staging buffer");
  return Status::OK();
}

void DeviceMemory::FreeStaging(Device, void* p) { std::free(p); }

Status HostMemory::Alloc(Device, size_t bytes, void** p) {
  *p = std::malloc(bytes ? bytes : 1);
  if (!*p)
    return Status::Fail(ErrorCode::kPeerFailure,
                        "out of host memory allocating " + std::to_string(bytes) + " bytes");
  return Status::OK();
}

void HostMemory::Free(Device, void* p) { std::free(p); }

Status HostMemory::CopyToHost(Device, void* host, const void* src, size_t bytes) {
  if (bytes && host != src) std::memcpy(host, src, bytes);
  return Status::OK();
}

Status HostMemory::CopyFromHost(Device, void* dst, const void* host, size_t bytes) {
  if (bytes && dst != host) std::memcpy(dst, host, bytes);
  return Status::OK();
}

Status HostMemory::BatchedCopy(Device, const CopyEntry* entries, int n, DataType dt,
                               const Scaling& s) {
  const size_t es = DataTypeSize(dt);
  for (int i = 0; i < n; ++i) {
    const CopyEntry& e = entries[i];
    if (!e.count) continue;
    if (!e.src) std::memset(e.dst, 0, e.count * es);
    else if (e.src != e.dst) std::memcpy(e.dst, e.src, e.count * es);
    if (!s.identity()) ApplyScaling(e.dst, e.count, dt, s);
  }
  return Status::OK();
}

}  // namespace sdl
