// Response cache: lets steady-state steps skip full negotiation.
//
// Invariant: every member of a process set holds the same entries in the same
// slots. That holds because the cache changes only while executing responses,
// which every member executes in the same order (Put for negotiated responses,
// Touch for cache hits in ascending slot order), and eviction is a
// deterministic LRU over those updates. A rank then announces a ready cached
// tensor by setting bit `slot` in the per-cycle bit vector; the AND over ranks
// says which tensors every rank has ready.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/message.h"

namespace sdl {

class ResponseCache {
 public:
  explicit ResponseCache(size_t capacity) : slots_(capacity) {}
  size_t capacity() const { return slots_.size(); }
  // The slot whose cached request equals req (same name and signature), else -1.
  int Lookup(const Request& req) const;
  const Response& response(int slot) const { return slots_[slot].resp; }
  const Request& request(int slot) const { return slots_[slot].req; }
  // Stores (or replaces, by name) a single-tensor response with this rank's request.
  void Put(const Request& req, const Response& resp);
  void Touch(int slot) { slots_[slot].last_use = ++clock_; }
  void Erase(const std::string& name);

 private:
  struct Slot {
    bool used = false;
    Request req;
    Response resp;
    uint64_t last_use = 0;
  };
  std::vector<Slot> slots_;
  std::unordered_map<std::string, int> by_name_;
  uint64_t clock_ = 0;
};

}  // namespace sdl
