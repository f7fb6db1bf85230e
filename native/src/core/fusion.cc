#include "core/fusion.h"

namespace sdl {
namespace {

bool Fusable(const Response& r) {
  return r.op == OpType::kAllreduce && r.error.empty() && r.group.empty();
}

bool SameKind(const Response& a, const Response& b) {
  return a.dtype == b.dtype && a.device == b.device && a.reduce == b.reduce && a.prescale == b.prescale &&
         a.postscale == b.postscale;
}

}  // namespace

int64_t ResponseBytes(const Response& r) {
  int64_t total = 0;
  for (const auto& shape : r.shapes) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    total += n;
  }
  return total * static_cast<int64_t>(DataTypeSize(r.dtype));
}

std::vector<Response> FuseResponses(std::vector<Response> ready, int64_t threshold) {
  std::vector<Response> out;
  std::vector<int64_t> bytes;
  for (Response& r : ready) {
    int64_t b = ResponseBytes(r);
    bool merged = false;
    if (Fusable(r) && threshold > 0) {
      for (size_t i = 0; i < out.size(); ++i) {
        if (Fusable(out[i]) && SameKind(out[i], r) && bytes[i] + b <= threshold) {
          out[i].names.insert(out[i].names.end(), r.names.begin(), r.names.end());
          out[i].shapes.insert(out[i].shapes.end(), r.shapes.begin(), r.shapes.end());
          bytes[i] += b;
          merged = true;
          break;
        }
      }
    }
    if (!merged) {
      bytes.push_back(b);
      out.push_back(std::move(r));
    }
  }
  return out;
}

}  // namespace sdl
