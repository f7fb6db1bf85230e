// Registers what the GPU build adds to the operations layer: CUDA device
// memory (which also enables host staging of CUDA tensors over the CPU
// transport) and, with NCCL, the NCCL backend first in the priority order.
// A CPU-only build, or a host without a usable CUDA runtime, registers
// nothing: CUDA tensors are refused at enqueue.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "ops/operations.h"
#ifdef SDL_HAVE_CUDA
#include "ops/cuda_memory.h"
#endif
#ifdef SDL_HAVE_NCCL
#include "ops/nccl_backend.h"
#endif

namespace sdl {

// comm_timeout_s bounds creating an NCCL communicator (every member must join)
// and any NCCL call still in progress past it. hierarchical: allreduce of CUDA
// tensors through a per-host NCCL communicator and the CPU transport across
// hosts (SDL_HIERARCHICAL_ALLREDUCE; see ops/nccl_backend.h).
// Only where CUDA is usable (a runtime and a device): elsewhere no CUDA tensor
// can be valid, and one is refused at enqueue (Operations::CheckServable) instead
// of failing the runtime when it runs.
inline void AddGpuBackends(Operations& ops, double comm_timeout_s,
                           bool hierarchical_allreduce = false,
                           const std::vector<std::string>* host_of_rank = nullptr) {
#ifdef SDL_HAVE_CUDA
  if (!gpu::QueryCuda().usable) return;
  auto memory = std::make_unique<CudaMemory>();
  CudaMemory* cuda = memory.get();
  ops.AddDeviceMemory(std::move(memory));
#ifdef SDL_HAVE_NCCL
  gpu::NcclOptions options;
  options.timeout_s = comm_timeout_s;
  HierarchicalOptions hierarchical;
  hierarchical.enabled = hierarchical_allreduce;
  hierarchical.host_of_rank = host_of_rank;
  ops.AddBackend(kPriorityDevice,
                 std::make_unique<NcclBackend>(cuda, options, nullptr, hierarchical));
#else
  (void)cuda;
#endif
#endif
  (void)ops;
  (void)comm_timeout_s;
  (void)hierarchical_allreduce;
  (void)host_of_rank;
}

}  // namespace sdl
