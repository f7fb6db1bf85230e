#include "core/response_cache.h"

namespace sdl {

int ResponseCache::Lookup(const Request& req) const {
  auto it = by_name_.find(req.name);
  if (it == by_name_.end()) return -1;
  return slots_[it->second].req.SameSignature(req) ? it->second : -1;
}

void ResponseCache::Put(const Request& req, const Response& resp) {
  if (slots_.empty()) return;
  int slot;
  auto it = by_name_.find(req.name);
  if (it != by_name_.end()) {
    slot = it->second;
  } else {
    slot = -1;
    uint64_t oldest = UINT64_MAX;
    for (size_t i = 0; i < slots_.size(); ++i) {
      if (!slots_[i].used) {
        slot = static_cast<int>(i);
        break;
      }
      if (slots_[i].last_use < oldest) {
        oldest = slots_[i].last_use;
        slot = static_cast<int>(i);
      }
    }
    if (slots_[slot].used) by_name_.erase(slots_[slot].req.name);
    by_name_[req.name] = slot;
  }
  Slot& s = slots_[slot];
  s.used = true;
  s.req = req;
  s.resp = resp;
  s.last_use = ++clock_;
}

void ResponseCache::Erase(const std::string& name) {
  auto it = by_name_.find(name);
  if (it == by_name_.end()) return;
  slots_[it->second] = Slot();
  by_name_.erase(it);
}

}  // namespace sdl
