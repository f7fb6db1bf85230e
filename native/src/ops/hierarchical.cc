#include "ops/hierarchical.h"

#include <algorithm>
#include <cstring>
#include <map>

#include "common/reduce.h"

namespace sdl {

std::vector<int> HostLayout::Group(int l) const {
  std::vector<int> members(hosts, -1);
  for (size_t i = 0; i < host.size(); ++i)
    if (local[i] == l) members[host[i]] = static_cast<int>(i);
  return members;
}

bool MakeHostLayout(const std::vector<std::string>& host_of_member, int me, HostLayout* out) {
  HostLayout layout;
  std::map<std::string, int> index;  // host identity -> host index
  std::vector<int> members;          // per host: members so far
  for (const std::string& h : host_of_member) {
    auto it = index.find(h);
    if (it == index.end()) {
      it = index.emplace(h, static_cast<int>(members.size())).first;
      members.push_back(0);
    }
    layout.host.push_back(it->second);
    layout.local.push_back(members[it->second]++);
  }
  if (members.empty() || me < 0 || me >= static_cast<int>(host_of_member.size())) return false;
  // The shards of one local rank must have one size on every host.
  if (std::any_of(members.begin(), members.end(), [&](int n) { return n != members[0]; }))
    return false;
  layout.me = me;
  layout.hosts = static_cast<int>(members.size());
  layout.local_size = members[0];
  *out = std::move(layout);
  return true;
}

void ExchangeHostIds(Comm& comm, const HostLayout& layout, std::string* id) {
  std::vector<std::string> all =
      comm.AllgatherBytes(layout.local_rank() == 0 ? *id : std::string());
  *id = all.at(layout.Group(0)[layout.host_index()]);
}

std::vector<size_t> ShardCounts(size_t count, int parts) {
  std::vector<size_t> counts(parts, count / parts);
  for (size_t i = 0; i < count % parts; ++i) ++counts[i];
  return counts;
}

Status CommAcrossHosts::Allreduce(void* host, const std::vector<size_t>& shard_counts,
                                  DataType dt, ReduceOp op) {
  const HostLayout& L = *layout_;
  if (L.hosts == 1) return Status::OK();
  const size_t es = DataTypeSize(dt);
  const int n = static_cast<int>(L.host.size());
  const size_t count = shard_counts[L.local_rank()];
  const size_t bytes = count * es;
  // Every member passes the whole matrix (the other groups exchange in the same
  // call); only members of one group (same local rank) send to each other.
  std::vector<size_t> matrix(static_cast<size_t>(n) * n, 0);
  for (int p = 0; p < n; ++p)
    for (int q = 0; q < n; ++q)
      if (p != q && L.local[p] == L.local[q]) matrix[p * n + q] = shard_counts[L.local[p]] * es;
  const size_t peers = static_cast<size_t>(L.hosts - 1);
  // send_: one copy of the shard per peer (Alltoallv takes pieces in dst order),
  // then one more kept as this host's piece for the reduction below.
  send_.resize(std::max<size_t>((peers + 1) * bytes, 1));
  recv_.resize(std::max<size_t>(peers * bytes, 1));
  for (size_t i = 0; i <= peers; ++i) std::memcpy(send_.data() + i * bytes, host, bytes);
  comm_->Alltoallv(send_.data(), recv_.data(), matrix);
  // Pieces arrive in set order; reduce them in host order so that every member
  // of the group computes the same bits.
  std::vector<const char*> by_host(L.hosts, nullptr);
  size_t at = 0;
  for (int q = 0; q < n; ++q) {
    if (q == L.me || L.local[q] != L.local_rank()) continue;
    by_host[L.host[q]] = recv_.data() + at;
    at += bytes;
  }
  by_host[L.host_index()] = send_.data() + peers * bytes;
  if (!count) return Status::OK();
  std::memcpy(host, by_host[0], bytes);
  for (int h = 1; h < L.hosts; ++h) Reduce(host, host, by_host[h], count, dt, op);
  return Status::OK();
}

HierarchicalScratch::~HierarchicalScratch() { Release(); }

void HierarchicalScratch::Release() {
  if (device_shard_) memory_->Free(device_, device_shard_);
  if (host_shard_) memory_->FreeStaging(device_, host_shard_);
  device_shard_ = host_shard_ = nullptr;
  capacity_ = 0;
}

Status HierarchicalScratch::Reserve(Device d, size_t bytes, void** device_shard,
                                    void** host_shard) {
  // At least one vector's worth, so an empty shard still has valid pointers.
  bytes = std::max<size_t>(bytes, 64);
  if (capacity_ < bytes || !(device_ == d)) {
    Release();
    device_ = d;
    SDL_RETURN_IF_ERROR(memory_->Alloc(d, bytes, &device_shard_));
    Status s = memory_->AllocStaging(d, bytes, &host_shard_);
    if (!s.ok()) {
      host_shard_ = nullptr;
      Release();
      return s;
    }
    capacity_ = bytes;
  }
  *device_shard = device_shard_;
  *host_shard = host_shard_;
  return Status::OK();
}

Status HierarchicalAllreduce(const HostLayout& layout, IntraHost& local, AcrossHosts& across,
                             DeviceMemory& memory, HierarchicalScratch& scratch, Device d,
                             const void* in, void* out, size_t count, DataType dt, ReduceOp op) {
  const size_t es = DataTypeSize(dt);
  const std::vector<size_t> counts = ShardCounts(count, layout.local_size);
  const size_t mine = counts[layout.local_rank()] * es;
  void* shard = nullptr;
  void* staged = nullptr;
  SDL_RETURN_IF_ERROR(scratch.Reserve(d, mine, &shard, &staged));
  SDL_RETURN_IF_ERROR(local.Reducescatter(in, shard, counts, dt, op));
  if (layout.hosts > 1) {
    // The staging buffer was last read by the previous call's CopyFromHost.
    SDL_RETURN_IF_ERROR(memory.StagingFence(d));
    SDL_RETURN_IF_ERROR(memory.CopyToHost(d, staged, shard, mine));
    // Collective over the whole set even when this shard is empty.
    SDL_RETURN_IF_ERROR(across.Allreduce(staged, counts, dt, op));
    SDL_RETURN_IF_ERROR(memory.CopyFromHost(d, shard, staged, mine));
  }
  return local.Allgather(shard, out, counts, dt);
}

}  // namespace sdl
