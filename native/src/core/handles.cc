#include "core/handles.h"

#include <chrono>

namespace sdl {

int64_t HandleTable::Create() {
  std::lock_guard<std::mutex> lk(mu_);
  int64_t h = next_++;
  states_[h];
  return h;
}

void HandleTable::Complete(int64_t h, Result r) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = states_.find(h);
    if (it == states_.end() || it->second.done) return;
    it->second.done = true;
    it->second.result = std::move(r);
  }
  cv_.notify_all();
}

bool HandleTable::Poll(int64_t h) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = states_.find(h);
  if (it == states_.end())
    throw Error(ErrorCode::kInvalidArgument, "unknown handle " + std::to_string(h));
  return it->second.done;
}

bool HandleTable::Wait(int64_t h, double timeout_s) {
  std::unique_lock<std::mutex> lk(mu_);
  auto done = [&] {
    auto it = states_.find(h);
    if (it == states_.end())
      throw Error(ErrorCode::kInvalidArgument, "unknown handle " + std::to_string(h));
    return it->second.done;
  };
  if (timeout_s < 0) {
    cv_.wait(lk, done);
    return true;
  }
  return cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), done);
}

Result HandleTable::Take(int64_t h) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = states_.find(h);
  if (it == states_.end())
    throw Error(ErrorCode::kInvalidArgument, "unknown handle " + std::to_string(h));
  if (!it->second.done)
    throw Error(ErrorCode::kInvalidArgument, "handle " + std::to_string(h) + " is not finished");
  Result r = std::move(it->second.result);
  states_.erase(it);
  return r;
}

void HandleTable::FailAll(ErrorCode code, const std::string& msg) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& [h, s] : states_) {
      if (s.done) continue;
      s.done = true;
      s.result.code = code;
      s.result.message = msg;
    }
  }
  cv_.notify_all();
}

}  // namespace sdl
