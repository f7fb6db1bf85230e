// Status values: how the operations layer and its device hooks report errors
// (CUDA and NCCL calls return codes, not exceptions). The executor turns a
// failed Status into sdl::Error, which the background thread treats like a
// transport failure: every pending operation fails with the message.
#pragma once

#include <string>
#include <utility>

#include "common/types.h"

namespace sdl {

struct Status {
  ErrorCode code = ErrorCode::kOk;
  std::string message;

  static Status OK() { return Status(); }
  static Status Fail(ErrorCode c, std::string msg) {
    Status s;
    s.code = c;
    s.message = std::move(msg);
    return s;
  }
  bool ok() const { return code == ErrorCode::kOk; }
};

inline void ThrowIfError(const Status& s) {
  if (!s.ok()) throw Error(s.code, s.message);
}

// Returns from the enclosing function when expr fails.
#define SDL_RETURN_IF_ERROR(expr)            \
  do {                                       \
    ::sdl::Status sdl_status_ = (expr);      \
    if (!sdl_status_.ok()) return sdl_status_; \
  } while (0)

}  // namespace sdl
