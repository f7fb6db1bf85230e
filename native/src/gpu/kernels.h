// Batched pack/unpack/scale on the GPU: one kernel launch copies up to
// kBatchMaxEntries tensors between their own memory and a fusion buffer,
// applying a scale factor on the way (prescale fused into the pack,
// postscale/average into the unpack). The kernels are compiled into the
// extension as a fatbin and loaded through the run-time CUDA runtime.
//
// Every function here enqueues on `stream` and returns without waiting; the
// caller's device must be current (DeviceGuard) and the stream must belong to it.
#pragma once

#include <cstddef>
#include <vector>

#include "common/types.h"
#include "gpu/cuda_api.h"
#include "gpu/kernel_params.h"
#include "gpu/status.h"

namespace sdl {
namespace gpu {

// One copy: `count` elements from src to dst (device pointers on one device).
// src == nullptr writes zeros (a joined rank's contribution); src == dst scales
// in place.
struct CopySpan {
  const void* src;
  void* dst;
  size_t count;
};

// Offsets of entries in a fusion buffer should be multiples of this: the
// kernels use 16-byte vector loads and stores where both sides are 16-byte
// aligned (and fall back to element copies elsewhere); 64 keeps whole cache
// sectors per tensor.
constexpr size_t kFusionAlignment = 64;
inline size_t AlignFusionOffset(size_t bytes) {
  return (bytes + kFusionAlignment - 1) / kFusionAlignment * kFusionAlignment;
}

// OK when the kernels can scale `dt` as asked (scale 1 and divisor 1 is a plain
// copy, fine for every dtype); bool cannot be scaled (as in the CPU transports).
Status CheckScaleSupported(DataType dt, double scale, int64_t divisor = 1);

// dst = src scaled, for every span: integers are first divided by `divisor`
// (exactly, toward zero: an integer Average's rank count), then every type is
// multiplied by `scale` (integers in double, truncated toward zero); for
// floating types a divisor is folded into the scale. This is the operations
// layer's Scaling{factor, divisor}. Batches of kBatchMaxEntries spans are one
// launch each; spans with count 0 are skipped; an identity scaling is a byte copy.
Status BatchedScaledCopy(const std::vector<CopySpan>& spans, DataType dt, double scale,
                         cudaStream_t stream, int64_t divisor = 1);

// Pack: tensors (span.src) into the fusion buffer (span.dst), multiplied by prescale.
inline Status PackFusion(const std::vector<CopySpan>& spans, DataType dt, double prescale,
                         cudaStream_t stream) {
  return BatchedScaledCopy(spans, dt, prescale, stream);
}
// Unpack: fusion buffer (span.src) into the output tensors (span.dst),
// multiplied by postscale; for Average the caller folds 1/size into postscale
// (floating types) or passes divisor = size (integers).
inline Status UnpackFusion(const std::vector<CopySpan>& spans, DataType dt, double postscale,
                           cudaStream_t stream, int64_t divisor = 1) {
  return BatchedScaledCopy(spans, dt, postscale, stream, divisor);
}
// buf scaled in place (a single tensor that skipped the fusion buffer).
Status ScaleInPlace(void* buf, size_t count, DataType dt, double scale, cudaStream_t stream,
                    int64_t divisor = 1);

// --- host-side planning (no GPU needed; shared with the tests) ---------------------

// The parameter blocks the launches of one BatchedScaledCopy receive, in
// launch order. elem_size: the bytes per element of the counts in `spans`.
// For a plain copy (scale 1) the caller passes byte counts and elem_size 1.
std::vector<BatchParams> PlanBatches(const std::vector<CopySpan>& spans, size_t elem_size,
                                     double scale, int64_t divisor = 1);

// The grid for a block: enough blocks to cover every chunk, capped at
// `max_resident_blocks` (the device's SM count times the blocks that fit on
// one SM); each block then loops over chunks.
unsigned GridFor(const BatchParams& p, unsigned max_resident_blocks);

// Loads the embedded kernels (first call in the process) and reports whether
// they can be launched; the error says why not (no runtime, no matching
// architecture in the fatbin ...). Lazy loading means an architecture mismatch
// may still only surface at the first launch.
Status LoadKernels();

// The architectures compiled into the fatbin ("sm_75 sm_80 ... compute_75").
const char* KernelArchitectures();

}  // namespace gpu
}  // namespace sdl
