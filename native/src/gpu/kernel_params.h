// The parameter block of the batched copy kernels, shared by the device code
// (kernels.cu, compiled by nvcc into the embedded fatbin) and the host code that
// fills it (kernels.cc). Plain C++ that both compilers accept.
//
// Work division: every entry (one tensor) is cut into chunks of `chunk_elems`
// elements; chunk_begin[] is the prefix sum of the chunk counts, so chunk c
// belongs to the entry e with chunk_begin[e] <= c < chunk_begin[e + 1]. Blocks
// take chunks in a grid-stride loop, so one launch balances a 64 MiB tensor and
// two hundred 16 KiB ones alike. chunk_elems is a multiple of the 16-byte vector
// width, so every chunk of an aligned entry starts on a vector boundary.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define SDL_HOST_DEVICE __host__ __device__
#else
#define SDL_HOST_DEVICE
#endif

namespace sdl {
namespace gpu {

// Entries per launch. The block is passed by value as a kernel parameter (no
// host-to-device upload, nothing to keep alive after the launch), which must
// stay under the classic 4 KiB parameter limit: 128 * 24 + 129 * 4 + 32 bytes.
constexpr int kBatchMaxEntries = 128;
constexpr uint32_t kBatchChunkBytes = 16384;
constexpr int kBatchThreads = 256;

struct BatchEntry {
  const void* src;  // nullptr: write zeros (a joined rank's contribution)
  void* dst;
  uint64_t count;  // elements (bytes for the plain copy kernel)
};

struct BatchParams {
  BatchEntry entries[kBatchMaxEntries];
  uint32_t chunk_begin[kBatchMaxEntries + 1];
  int32_t num_entries;
  uint32_t chunk_elems;
  double scale;      // ignored by the plain copy kernel
  int64_t divisor;   // integer kernels: x / divisor (exact, toward zero) before the scale
};

static_assert(sizeof(BatchParams) <= 4096, "kernel parameters must fit in 4 KiB");

// The entry and element range [*begin, *end) of chunk c (c < chunk_begin[num_entries]).
SDL_HOST_DEVICE inline void ChunkRange(const BatchParams& p, uint32_t c, int* entry,
                                       uint64_t* begin, uint64_t* end) {
  int lo = 0, hi = p.num_entries;  // invariant: chunk_begin[lo] <= c < chunk_begin[hi]
  while (hi - lo > 1) {
    int mid = (lo + hi) / 2;
    if (p.chunk_begin[mid] <= c) lo = mid; else hi = mid;
  }
  *entry = lo;
  *begin = static_cast<uint64_t>(c - p.chunk_begin[lo]) * p.chunk_elems;
  uint64_t e = *begin + p.chunk_elems;
  *end = e < p.entries[lo].count ? e : p.entries[lo].count;
}

}  // namespace gpu
}  // namespace sdl
