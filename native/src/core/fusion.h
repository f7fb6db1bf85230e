// Fusion: ready allreduces of the same kind are packed into one collective.
#pragma once

#include <cstdint>
#include <vector>

#include "common/message.h"

namespace sdl {

// Merges compatible single-op allreduce responses (same dtype, device, reduce op and
// scale factors, no error, not part of a group) into fused responses of at
// most threshold bytes, keeping the first-ready order otherwise. Grouped
// responses are already one response per group and pass through unchanged.
// Deterministic: equal inputs give equal outputs on every rank.
std::vector<Response> FuseResponses(std::vector<Response> ready, int64_t threshold);

int64_t ResponseBytes(const Response& r);

}  // namespace sdl
