// Registers what the GPU build adds to the operations layer: CUDA device
// memory (which also enables host staging of CUDA tensors over the CPU
// transport) and, with NCCL, the NCCL backend first in the priority order.
// A CPU-only build registers nothing: CUDA tensors are refused at enqueue.
#pragma once

#include <memory>

#include "ops/operations.h"
#ifdef SDL_HAVE_CUDA
#include "ops/cuda_memory.h"
#endif
#ifdef SDL_HAVE_NCCL
#include "ops/nccl_backend.h"
#endif

namespace sdl {

// comm_timeout_s bounds creating an NCCL communicator (every member must join)
// and any NCCL call still in progress past it.
inline void AddGpuBackends(Operations& ops, double comm_timeout_s) {
#ifdef SDL_HAVE_CUDA
  auto memory = std::make_unique<CudaMemory>();
  CudaMemory* cuda = memory.get();
  ops.AddDeviceMemory(std::move(memory));
#ifdef SDL_HAVE_NCCL
  gpu::NcclOptions options;
  options.timeout_s = comm_timeout_s;
  ops.AddBackend(kPriorityDevice, std::make_unique<NcclBackend>(cuda, options));
#else
  (void)cuda;
#endif
#endif
  (void)ops;
  (void)comm_timeout_s;
}

}  // namespace sdl
