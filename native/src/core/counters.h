// Counters that tests and benchmarks read to see what the core did.
#pragma once

#include <atomic>
#include <cstdint>

namespace sdl {

struct Counters {
  std::atomic<int64_t> cycles{0};            // negotiation cycles (all sets)
  std::atomic<int64_t> inline_cycles{0};     // rounds of cycles a waiting caller ran itself
  std::atomic<int64_t> full_negotiations{0};  // cycles that exchanged request lists
  std::atomic<int64_t> cache_hits{0};        // tensors run straight from the response cache
  std::atomic<int64_t> negotiated{0};        // tensors run after full negotiation
  std::atomic<int64_t> collectives{0};       // data collectives issued to a transport
  std::atomic<int64_t> fused_tensors{0};     // tensors that shared a collective with others
  std::atomic<int64_t> tensors{0};           // finished tensor operations
  std::atomic<int64_t> bytes{0};             // payload bytes of finished operations
};

}  // namespace sdl
