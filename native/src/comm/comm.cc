#include "comm/comm.h"

#include <cstring>
#include <numeric>

namespace sdl {

void Comm::AllreduceInto(const void* in, void* out, size_t count, DataType dt, ReduceOp op) {
  if (in != out && count) std::memcpy(out, in, count * DataTypeSize(dt));
  Allreduce(out, count, dt, op);
}

void Comm::Reducescatter(const void* in, void* out, const std::vector<size_t>& counts,
                         DataType dt, ReduceOp op) {
  size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
  size_t es = DataTypeSize(dt);
  std::vector<char> tmp(total * es);
  if (total) std::memcpy(tmp.data(), in, total * es);
  Allreduce(tmp.data(), total, dt, op);
  size_t offset = std::accumulate(counts.begin(), counts.begin() + rank(), size_t{0});
  if (counts[rank()]) std::memcpy(out, tmp.data() + offset * es, counts[rank()] * es);
}

std::vector<std::string> Comm::AllgatherBytes(const std::string& mine) {
  int n = size();
  std::vector<uint64_t> sizes(n, 0);
  sizes[rank()] = mine.size();
  std::vector<size_t> eight(n, sizeof(uint64_t));
  uint64_t my_size = mine.size();
  Allgatherv(&my_size, sizes.data(), eight);
  std::vector<size_t> bytes(sizes.begin(), sizes.end());
  size_t total = std::accumulate(bytes.begin(), bytes.end(), size_t{0});
  std::string all(total, '\0');
  Allgatherv(mine.data(), all.data(), bytes);
  std::vector<std::string> out(n);
  size_t off = 0;
  for (int r = 0; r < n; ++r) {
    out[r] = all.substr(off, bytes[r]);
    off += bytes[r];
  }
  return out;
}

std::vector<std::string> Comm::GatherBytes(const std::string& mine, int root) {
  const int n = size(), me = rank();
  uint64_t my_size = mine.size();
  std::vector<uint64_t> sizes(n, 0);
  if (!Gatherv(&my_size, sizes.data(), std::vector<size_t>(n, sizeof(uint64_t)), root)) {
    std::vector<std::string> all = AllgatherBytes(mine);
    if (me != root) all.clear();
    return all;
  }
  std::vector<size_t> bytes(n, 0);
  if (me == root) bytes.assign(sizes.begin(), sizes.end());
  bytes[me] = mine.size();
  size_t total = me == root ? std::accumulate(bytes.begin(), bytes.end(), size_t{0}) : 0;
  std::string all(total, '\0');
  Gatherv(mine.data(), me == root ? all.data() : nullptr, bytes, root);
  std::vector<std::string> out;
  if (me != root) return out;
  out.resize(n);
  size_t off = 0;
  for (int r = 0; r < n; ++r) {
    out[r] = all.substr(off, bytes[r]);
    off += bytes[r];
  }
  return out;
}

void Comm::BroadcastBytes(std::string* msg, int root) {
  uint64_t n = msg->size();
  Broadcast(&n, sizeof n, root);
  msg->resize(n);
  if (n) Broadcast(msg->data(), n, root);
}

void SelfComm::Allgatherv(const void* in, void* out, const std::vector<size_t>& bytes) {
  if (bytes[0] && in != out) std::memcpy(out, in, bytes[0]);
}

void SelfComm::Alltoallv(const void* in, void* out, const std::vector<size_t>& matrix) {
  if (matrix[0] && in != out) std::memcpy(out, in, matrix[0]);
}

}  // namespace sdl
