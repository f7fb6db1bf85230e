#include "ops/staging_pool.h"

#include <cstdlib>

namespace sdl {

StagingPool::~StagingPool() {
  for (auto& [p, info] : buffers_) {
    if (info.pinned) unpin_(p);
    else std::free(p);
  }
}

size_t StagingPool::SizeClass(size_t bytes) {
  size_t c = size_t{64} << 10;
  while (c < bytes) c <<= 1;
  return c;
}

Status StagingPool::Acquire(int device, size_t bytes, void** p) {
  const size_t cls = SizeClass(bytes);
  std::vector<void*>& pool = free_[{device, cls}];
  if (!pool.empty()) {
    *p = pool.back();
    pool.pop_back();
    return Status::OK();
  }
  void* q = nullptr;
  std::string why;
  const bool pinned = pin_ && pin_(device, cls, &q, &why);
  if (!pinned) {
    q = nullptr;
    if (!logged_ && log_) {
      log_("pinning a " + std::to_string(cls) + "-byte staging buffer for device " +
           std::to_string(device) + " failed (" + why +
           "); staging through pageable memory (synchronous copies)");
      logged_ = true;
    }
    q = std::malloc(cls);
    if (!q)
      return Status::Fail(ErrorCode::kPeerFailure,
                          "out of host memory allocating a " + std::to_string(cls) +
                              "-byte staging buffer");
  }
  buffers_[q] = Info{device, cls, pinned};
  *p = q;
  return Status::OK();
}

void StagingPool::Release(void* p) {
  auto it = buffers_.find(p);
  if (it == buffers_.end()) return;
  free_[{it->second.device, it->second.size_class}].push_back(p);
}

bool StagingPool::IsPinned(const void* p, size_t bytes) const {
  auto it = buffers_.upper_bound(const_cast<void*>(p));
  if (it == buffers_.begin()) return false;
  --it;
  const char* base = static_cast<const char*>(it->first);
  const char* q = static_cast<const char*>(p);
  return it->second.pinned && q >= base && q + bytes <= base + it->second.size_class;
}

size_t StagingPool::pinned() const {
  size_t n = 0;
  for (auto& [p, info] : buffers_) n += info.pinned;
  return n;
}

}  // namespace sdl
