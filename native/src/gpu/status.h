// Status values for the GPU layer: every call that can fail returns one (no
// exceptions cross the loaders, kernels or NCCL code), so the operations layer
// decides whether a failure becomes an Error on the caller's handle or a fallback
// to host staging. The codes are the core's ErrorCode (common/types.h).
#pragma once

#include <string>
#include <utility>  // std::move, std::declval

#include "common/types.h"

namespace sdl {
namespace gpu {

class Status {
 public:
  Status() = default;  // OK
  // From another status type with public `code` (an ErrorCode) and `message`
  // fields, such as the operations layer's sdl::Status: implicit, so a
  // std::function returning that type serves as a BroadcastFromRoot.
  template <typename S, typename = decltype(std::declval<const S&>().message),
            typename = decltype(std::declval<const S&>().code)>
  Status(const S& other) : code_(other.code), message_(other.message) {}  // NOLINT
  // The same value as such a type: status.As<sdl::Status>().
  template <typename S>
  S As() const {
    S s;
    s.code = code_;
    s.message = message_;
    return s;
  }

  static Status OK() { return Status(); }
  static Status Error(ErrorCode code, std::string message) {
    Status s;
    s.code_ = code;
    s.message_ = std::move(message);
    return s;
  }
  // A bad argument on this rank (unsupported dtype/op, null pointer, too many entries).
  static Status Invalid(std::string message) {
    return Error(ErrorCode::kInvalidArgument, std::move(message));
  }
  // The CUDA runtime or NCCL failed (a device error, a dead peer, an abort).
  static Status Failure(std::string message) {
    return Error(ErrorCode::kPeerFailure, std::move(message));
  }

  bool ok() const { return code_ == ErrorCode::kOk; }
  ErrorCode code() const { return code_; }
  const std::string& message() const { return message_; }

  // The core's exception for this status (for callers that report through
  // sdl::Error); no-op when OK.
  void ThrowIfError() const {
    if (!ok()) throw sdl::Error(code_, message_);
  }

 private:
  ErrorCode code_ = ErrorCode::kOk;
  std::string message_;
};

// Returns from the enclosing function when `expr` (a Status) is an error.
#define SDL_GPU_RETURN_IF_ERROR(expr)           \
  do {                                          \
    ::sdl::gpu::Status sdl_gpu_status_ = (expr); \
    if (!sdl_gpu_status_.ok()) return sdl_gpu_status_; \
  } while (0)

}  // namespace gpu
}  // namespace sdl
