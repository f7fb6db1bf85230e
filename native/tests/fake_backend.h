// A backend for C++ tests that moves no bytes: every collective returns OK at
// once. Tests derive from it and override what they observe (Enabled, Poll,
// Abort, a counted Allreduce).
#pragma once

#include <vector>

#include "ops/backend.h"

namespace sdl {

class NoOpBackend : public OpBackend {
 public:
  const char* name() const override { return key(); }
  bool Enabled(const Response&, Device) const override { return false; }
  Status Allreduce(const OpContext&, const void*, void*, size_t, DataType, ReduceOp) override {
    return Status::OK();
  }
  Status Allgatherv(const OpContext&, const void*, void*, const std::vector<size_t>&) override {
    return Status::OK();
  }
  Status Broadcast(const OpContext&, void*, size_t, int) override { return Status::OK(); }
  Status Alltoallv(const OpContext&, const void*, void*, const std::vector<size_t>&) override {
    return Status::OK();
  }
  Status Reducescatter(const OpContext&, const void*, void*, const std::vector<size_t>&,
                       DataType, ReduceOp) override {
    return Status::OK();
  }
};

}  // namespace sdl
