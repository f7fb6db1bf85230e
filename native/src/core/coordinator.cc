#include "core/coordinator.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <sstream>

#include "core/fusion.h"

namespace sdl {
namespace {

bool CanCache(OpType op) {
  return op == OpType::kAllreduce || op == OpType::kAllgather || op == OpType::kBroadcast ||
         op == OpType::kAlltoall || op == OpType::kReducescatter;
}

std::string RankList(const std::vector<int>& ranks) {
  std::string s = "[";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s + "]";
}

// "rank 1 (host a)" or "ranks [1, 2] (hosts a, b)"; hosts may be null.
std::string RanksOnHosts(const std::vector<int>& ranks, const std::vector<std::string>* hosts) {
  std::string s = ranks.size() == 1 ? "rank " + std::to_string(ranks[0]) : "ranks " + RankList(ranks);
  if (!hosts) return s;
  std::vector<std::string> seen;
  for (int r : ranks)
    if (r < static_cast<int>(hosts->size()) && !(*hosts)[r].empty() &&
        std::find(seen.begin(), seen.end(), (*hosts)[r]) == seen.end())
      seen.push_back((*hosts)[r]);
  if (seen.empty()) return s;
  s += seen.size() == 1 ? " (host " : " (hosts ";
  for (size_t i = 0; i < seen.size() && i < 8; ++i) s += (i ? ", " : "") + seen[i];
  if (seen.size() > 8) s += " and " + std::to_string(seen.size() - 8) + " more";
  return s + ")";
}

// Compares one property across members; on mismatch returns a message such
// as "Mismatched allreduce shapes for tensor 'w': rank 0 has [2, 3], rank 1 has [3]".
// key decides equality; show (default: key) is what the message prints per rank,
// so that devices compare by memory kind but print as "cuda:1".
template <typename F, typename G>
std::string Compare(const ProcessSet& ps, const PendingName& p, const Request& first,
                    const char* what, F key, G show) {
  std::string base = key(first);
  for (int i = 0; i < ps.size(); ++i) {
    if (!p.have[i]) continue;
    std::string mine = key(p.reqs[i]);
    if (mine != base) {
      std::ostringstream msg;
      msg << "Mismatched " << OpTypeName(first.op) << " " << what << " for tensor '" << first.name
          << "':";
      std::map<std::string, std::vector<int>> by_value;
      for (int j = 0; j < ps.size(); ++j)
        if (p.have[j]) by_value[show(p.reqs[j])].push_back(ps.ranks[j]);
      bool firstv = true;
      for (auto& [value, ranks] : by_value) {
        msg << (firstv ? " " : "; ") << "rank" << (ranks.size() > 1 ? "s " : " ")
            << (ranks.size() > 1 ? RankList(ranks) : std::to_string(ranks[0])) << " "
            << (ranks.size() > 1 ? "have " : "has ") << value;
        firstv = false;
      }
      return msg.str();
    }
  }
  return "";
}

template <typename F>
std::string Compare(const ProcessSet& ps, const PendingName& p, const Request& first,
                    const char* what, F describe) {
  return Compare(ps, p, first, what, describe, describe);
}

double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string Tail(const std::vector<int64_t>& shape) {
  std::vector<int64_t> t(shape.begin() + (shape.empty() ? 0 : 1), shape.end());
  return "rank " + std::to_string(shape.size()) + " with trailing dims " + ShapeString(t);
}

Response Validate(const ProcessSet& ps, const PendingName& p) {
  const Request* first = nullptr;
  std::vector<int> missing;
  for (int i = 0; i < ps.size(); ++i) {
    if (p.have[i] && !first) first = &p.reqs[i];
    if (!p.have[i]) missing.push_back(ps.ranks[i]);
  }
  Response r;
  r.op = first->op;
  r.dtype = first->dtype;
  r.reduce = first->reduce;
  r.device = MemoryKind(first->device);
  r.root = first->root;
  r.prescale = first->prescale;
  r.postscale = first->postscale;
  r.names = {first->name};
  r.shapes = {first->shape};
  r.group = first->group;
  r.ranks = first->ranks;

  std::string err = Compare(ps, p, *first, "operations",
                            [](const Request& q) { return std::string(OpTypeName(q.op)); });
  // Devices: every member's tensor must be in the same kind of memory (host or
  // CUDA): the backend is chosen per response, and one backend serves one kind.
  if (err.empty())
    err = Compare(
        ps, p, *first, "devices",
        [](const Request& q) { return std::string(MemoryKindName(MemoryKind(q.device))); },
        [](const Request& q) { return DeviceName(q.device); });
  if (err.empty())
    err = Compare(ps, p, *first, "data types",
                  [](const Request& q) { return std::string(DataTypeName(q.dtype)); });
  if (err.empty() && !missing.empty() && first->op != OpType::kAllreduce)
    err = std::string(OpTypeName(first->op)) + " of tensor '" + first->name + "' cannot run: rank" +
          (missing.size() > 1 ? "s " : " ") + RankList(missing) +
          " already joined (only allreduce runs while ranks are joined)";
  if (err.empty()) {
    switch (first->op) {
      case OpType::kAllreduce:
      case OpType::kReducescatter:
        err = Compare(ps, p, *first, "reduce ops",
                      [](const Request& q) { return std::string(ReduceOpName(q.reduce)); });
        if (err.empty())
          err = Compare(ps, p, *first, "scale factors", [](const Request& q) {
            std::ostringstream s;
            s << "prescale " << q.prescale << ", postscale " << q.postscale;
            return s.str();
          });
        if (err.empty())
          err = Compare(ps, p, *first, "shapes",
                        [](const Request& q) { return ShapeString(q.shape); });
        if (err.empty())
          err = Compare(ps, p, *first, "groups", [](const Request& q) {
            return q.group.empty() ? std::string("no group")
                                   : "group '" + q.group + "' of " + std::to_string(q.group_size);
          });
        break;
      case OpType::kBroadcast:
        // Roots travel as indices in the set; errors name them as global ranks, as callers pass them.
        err = Compare(ps, p, *first, "root ranks", [&ps](const Request& q) {
          bool in_set = q.root >= 0 && q.root < ps.size();
          return "root " + std::to_string(in_set ? ps.ranks[q.root] : q.root);
        });
        if (err.empty())
          err = Compare(ps, p, *first, "shapes",
                        [](const Request& q) { return ShapeString(q.shape); });
        break;
      case OpType::kAllgather:
      case OpType::kAlltoall:
        err = Compare(ps, p, *first, "shapes", [](const Request& q) { return Tail(q.shape); });
        break;
      case OpType::kProcessSetAdd:
        err = Compare(ps, p, *first, "process set ranks",
                      [](const Request& q) { return ShapeString({q.ranks.begin(), q.ranks.end()}); });
        break;
      default:
        break;
    }
  }
  if (!err.empty()) {
    r.error = err;
    r.error_code = ErrorCode::kMismatch;
    return r;
  }
  if (first->op == OpType::kAllgather) {
    for (int i = 0; i < ps.size(); ++i) r.first_dims.push_back(p.reqs[i].shape[0]);
  } else if (first->op == OpType::kAlltoall) {
    for (int i = 0; i < ps.size(); ++i)
      r.split_matrix.insert(r.split_matrix.end(), p.reqs[i].splits.begin(), p.reqs[i].splits.end());
  }
  r.cacheable = missing.empty() && CanCache(first->op);
  return r;
}

}  // namespace

void CoordinatorAdd(ProcessSet& ps, int member, std::vector<Request> reqs, bool joined) {
  Coordinator& c = ps.coord;
  if (c.joined.empty()) c.joined.assign(ps.size(), false);
  if (joined && !c.joined[member]) {
    c.joined[member] = true;
    c.last_joined = ps.ranks[member];
  }
  for (Request& r : reqs) {
    auto it = c.table.find(r.name);
    if (it == c.table.end()) {
      PendingName p;
      p.reqs.resize(ps.size());
      p.have.assign(ps.size(), false);
      p.when.assign(ps.size(), 0.0);
      p.first_seen = NowSeconds();
      it = c.table.emplace(r.name, std::move(p)).first;
      c.order.push_back(r.name);
    }
    PendingName& p = it->second;
    if (!p.have[member]) {
      p.have[member] = true;
      p.when[member] = NowSeconds();
      ++p.count;
    }
    p.reqs[member] = std::move(r);
  }
}

namespace {

bool Complete(const ProcessSet& ps, const PendingName& p) {
  bool complete = p.count > 0;
  for (int i = 0; i < ps.size(); ++i) complete &= p.have[i] || ps.coord.joined[i];
  return complete;
}

// Names that can never complete, with their errors: each waited longer than
// mismatch_s, and every member missing from it (not joined) has waited longer
// than mismatch_s on other incomplete names of its own. Decided for every name
// before any is removed, so the names on both sides of a mismatch fail together.
std::map<std::string, std::string> Unmatchable(const ProcessSet& ps, double mismatch_s,
                                               double now) {
  std::map<std::string, std::string> out;
  if (mismatch_s <= 0) return out;
  const Coordinator& c = ps.coord;
  std::vector<std::vector<std::string>> waiting(ps.size());  // member -> its long-waiting names
  for (const std::string& name : c.order) {
    auto it = c.table.find(name);
    if (it == c.table.end() || Complete(ps, it->second)) continue;
    for (int i = 0; i < ps.size(); ++i)
      if (it->second.have[i] && now - it->second.when[i] > mismatch_s) waiting[i].push_back(name);
  }
  for (const std::string& name : c.order) {
    auto it = c.table.find(name);
    if (it == c.table.end()) continue;
    const PendingName& p = it->second;
    if (Complete(ps, p) || p.count == 0 || now - p.first_seen <= mismatch_s) continue;
    std::vector<int> have, missing;
    std::string others;
    bool stuck = true;
    for (int i = 0; i < ps.size() && stuck; ++i) {
      if (p.have[i]) {
        have.push_back(ps.ranks[i]);
        continue;
      }
      if (c.joined[i]) continue;
      missing.push_back(ps.ranks[i]);
      std::vector<std::string> theirs;
      for (const std::string& n : waiting[i])
        if (n != name) theirs.push_back(n);
      if (theirs.empty()) stuck = false;  // silent (or just slow): not a mismatch
      others += (others.empty() ? "" : "; ") + std::string("rank ") + std::to_string(ps.ranks[i]) +
                " waits on ";
      for (size_t k = 0; k < theirs.size() && k < 8; ++k)
        others += (k ? ", '" : "'") + theirs[k] + "'";
      if (theirs.size() > 8) others += " and " + std::to_string(theirs.size() - 8) + " more";
    }
    if (!stuck || missing.empty()) continue;
    const Request* any = nullptr;
    for (int i = 0; i < ps.size() && !any; ++i)
      if (p.have[i]) any = &p.reqs[i];
    std::ostringstream msg;
    msg << "Mismatched submissions: " << OpTypeName(any->op) << " of tensor '" << name
        << "' (submitted by rank" << (have.size() > 1 ? "s " : " ")
        << (have.size() > 1 ? RankList(have) : std::to_string(have[0])) << ") cannot complete: "
        << "for more than " << mismatch_s << " s (SDL_TIMEOUT) rank"
        << (missing.size() > 1 ? "s " : " ")
        << (missing.size() > 1 ? RankList(missing) : std::to_string(missing[0]))
        << " submitted other operations instead (" << others
        << "). Every rank must submit the same collectives; one rank's script may have "
           "raised and moved on, or names differ between ranks";
    out[name] = msg.str();
  }
  return out;
}

int FirstHave(const ProcessSet& ps, const PendingName& p) {
  for (int i = 0; i < ps.size(); ++i)
    if (p.have[i]) return i;
  return 0;
}

std::string Seconds(double s) {
  std::ostringstream o;
  o << s << " s";
  return o.str();
}

// The stalled names grouped by the members missing from them, bounded: up to
// 4 groups of up to 8 names each, e.g. "missing rank 1 (host h1): allreduce
// 'a' (submitted by rank 0, waiting 3 s), allreduce 'b' (...)".
std::string DescribeStalled(const ProcessSet& ps, const std::vector<std::string>& names, double now,
                            const std::vector<std::string>* hosts) {
  const Coordinator& c = ps.coord;
  std::vector<std::pair<std::vector<int>, std::vector<std::string>>> groups;
  for (const std::string& name : names) {
    const PendingName& p = c.table.at(name);
    std::vector<int> missing;
    for (int i = 0; i < ps.size(); ++i)
      if (!p.have[i] && !c.joined[i]) missing.push_back(ps.ranks[i]);
    auto g = std::find_if(groups.begin(), groups.end(), [&](const auto& e) { return e.first == missing; });
    if (g == groups.end()) {
      groups.push_back({missing, {}});
      g = groups.end() - 1;
    }
    g->second.push_back(name);
  }
  std::string out;
  for (size_t k = 0; k < groups.size() && k < 4; ++k) {
    const auto& [missing, members] = groups[k];
    out += (k ? "; " : "") + std::string("missing ") + RanksOnHosts(missing, hosts) + ": ";
    for (size_t i = 0; i < members.size() && i < 8; ++i) {
      const PendingName& p = c.table.at(members[i]);
      std::vector<int> have;
      for (int m = 0; m < ps.size(); ++m)
        if (p.have[m]) have.push_back(ps.ranks[m]);
      out += (i ? ", " : "") + std::string(OpTypeName(p.reqs[FirstHave(ps, p)].op)) + " '" +
             members[i] + "' (submitted by " + RanksOnHosts(have, nullptr) + ", waiting " +
             std::to_string(static_cast<int>(now - p.first_seen)) + " s)";
    }
    if (members.size() > 8) out += " and " + std::to_string(members.size() - 8) + " more";
  }
  if (groups.size() > 4) out += "; and " + std::to_string(groups.size() - 4) + " more groups";
  return out;
}

}  // namespace

std::vector<Response> CoordinatorReady(ProcessSet& ps, int64_t fusion_threshold,
                                       const StallOptions& stall, double mismatch_s,
                                       std::vector<std::string>* warnings) {
  const double now = NowSeconds();
  Coordinator& c = ps.coord;
  if (c.joined.empty()) c.joined.assign(ps.size(), false);
  int joined = 0;
  for (bool j : c.joined) joined += j;
  const std::map<std::string, std::string> unmatchable = Unmatchable(ps, mismatch_s, now);

  std::vector<Response> ready;
  std::map<std::string, std::vector<Response>> groups;  // group -> validated members
  std::map<std::string, int> group_size;
  std::vector<std::string> still;
  std::vector<std::string> stalled, dead;  // incomplete past the check / shutdown time
  for (const std::string& name : c.order) {
    auto it = c.table.find(name);
    if (it == c.table.end()) continue;
    PendingName& p = it->second;
    auto bad = unmatchable.find(name);
    if (bad != unmatchable.end()) {
      const Request* any = nullptr;
      for (int i = 0; i < ps.size() && !any; ++i)
        if (p.have[i]) any = &p.reqs[i];
      Response r;
      r.op = any->op;
      r.dtype = any->dtype;
      r.names = {name};
      r.shapes = {any->shape};
      r.error = bad->second;
      r.error_code = ErrorCode::kMismatch;
      ready.push_back(std::move(r));
      c.table.erase(it);
      continue;
    }
    if (!Complete(ps, p)) {
      if (stall.check_s > 0 && now - p.first_seen > stall.check_s) stalled.push_back(name);
      if (stall.shutdown_s > 0 && now - p.first_seen > stall.shutdown_s) dead.push_back(name);
      still.push_back(name);
      continue;
    }
    Response r = Validate(ps, p);
    const Request* any = nullptr;
    for (int i = 0; i < ps.size() && !any; ++i)
      if (p.have[i]) any = &p.reqs[i];
    if (!any->group.empty()) {
      groups[any->group].push_back(std::move(r));
      group_size[any->group] = any->group_size;
      still.push_back(name);  // leaves the table only with its whole group
    } else {
      ready.push_back(std::move(r));
      c.table.erase(it);
    }
  }
  c.order.swap(still);
  if (!dead.empty()) {
    // The stall shutdown: one error response that ends the runtime everywhere
    // (nothing else runs in this cycle: the members stop on it).
    Response r;
    r.op = c.table.at(dead[0]).reqs[FirstHave(ps, c.table.at(dead[0]))].op;
    r.names = {dead[0]};
    r.shapes = {{}};
    r.error = "Stalled for more than " + Seconds(stall.shutdown_s) +
              " (SDL_STALL_SHUTDOWN_TIME) on process set " + std::to_string(ps.id) + ": " +
              DescribeStalled(ps, dead, now, stall.hosts) +
              ". Every rank stops; each dumped its flight recorder";
    r.error_code = ErrorCode::kPeerFailure;
    return {r};
  }
  if (!stalled.empty() && now - c.stall_warned_at >= stall.check_s) {
    c.stall_warned_at = now;
    warnings->push_back("stall inspector: " + std::to_string(stalled.size()) + " tensor" +
                        (stalled.size() > 1 ? "s" : "") + " of process set " +
                        std::to_string(ps.id) + " waited more than " + Seconds(stall.check_s) +
                        " (SDL_STALL_CHECK_TIME) for ranks that have not submitted them: " +
                        DescribeStalled(ps, stalled, now, stall.hosts) +
                        ". A rank is stalled, or ranks call operations with different names");
  }
  for (auto& [g, members] : groups) {
    if (static_cast<int>(members.size()) < group_size[g]) continue;
    for (const Response& m : members) c.table.erase(m.names[0]);
    std::string group_error;
    for (const Response& m : members)
      if (group_error.empty() && !m.error.empty()) group_error = m.error;
    if (!group_error.empty()) {  // the whole group fails together
      for (Response& m : members) {
        m.error = group_error;
        m.error_code = ErrorCode::kMismatch;
        ready.push_back(std::move(m));
      }
      continue;
    }
    if (members[0].op != OpType::kAllreduce) {  // only allreduce fuses; the rest run in turn
      for (Response& m : members) ready.push_back(std::move(m));
      continue;
    }
    // One fused allreduce per dtype and device: a fusion buffer holds one type on
    // one device (members of other kinds must not be packed as the first member's).
    std::vector<Response> by_dtype;
    for (Response& m : members) {
      auto same = std::find_if(by_dtype.begin(), by_dtype.end(), [&](const Response& r) {
        return r.dtype == m.dtype && r.device == m.device;
      });
      if (same == by_dtype.end()) {
        by_dtype.push_back(std::move(m));
      } else {
        same->names.push_back(m.names[0]);
        same->shapes.push_back(m.shapes[0]);
        same->cacheable &= m.cacheable;
      }
    }
    for (Response& r : by_dtype) ready.push_back(std::move(r));
  }
  if (!groups.empty()) {
    std::vector<std::string> order;
    for (const std::string& n : c.order)
      if (c.table.count(n)) order.push_back(n);
    c.order.swap(order);
  }
  if (joined == ps.size()) {
    Response j;
    j.op = OpType::kJoin;
    j.names = {"join"};
    j.shapes = {{}};
    j.last_joined = c.last_joined;
    ready.push_back(j);
    c.joined.assign(ps.size(), false);
    c.last_joined = -1;
  }
  return FuseResponses(std::move(ready), fusion_threshold);
}

std::string CoordinatorDivergence(const ProcessSet& ps, const std::vector<std::string>* hosts) {
  const Coordinator& c = ps.coord;
  if (c.joined.size() != static_cast<size_t>(ps.size())) return "";
  int waiting = 0;
  std::string first;
  for (const std::string& name : c.order) {
    auto it = c.table.find(name);
    if (it == c.table.end() || Complete(ps, it->second)) continue;
    if (waiting++ == 0) {
      const PendingName& p = it->second;
      std::vector<int> have, missing;
      for (int i = 0; i < ps.size(); ++i)
        if (p.have[i]) have.push_back(ps.ranks[i]);
        else if (!c.joined[i]) missing.push_back(ps.ranks[i]);
      first = std::string(OpTypeName(p.reqs[FirstHave(ps, p)].op)) + " '" + name +
              "' on process set " + std::to_string(ps.id) + ", submitted by " +
              RanksOnHosts(have, hosts) + ", not by " + RanksOnHosts(missing, hosts);
    }
  }
  if (waiting > 1) first += " (" + std::to_string(waiting - 1) + " later name" + (waiting > 2 ? "s" : "") + " wait too)";
  return first;
}

void AppendMerged(std::vector<Response>* out, std::vector<size_t>* groups, const Response& r) {
  if (!r.group.empty() && r.op == OpType::kAllreduce) {
    // A cycle holds few groups: a scan beats building a key per member.
    for (size_t i : *groups) {
      Response& m = (*out)[i];
      if (m.group == r.group && m.dtype == r.dtype && m.device == r.device) {
        m.names.push_back(r.names[0]);
        m.shapes.push_back(r.shapes[0]);
        return;
      }
    }
    groups->push_back(out->size());
  }
  out->push_back(r);
}

std::vector<Response> MergeGroups(const std::vector<Response>& ready) {
  std::vector<Response> out;
  std::vector<size_t> groups;
  for (const Response& r : ready) AppendMerged(&out, &groups, r);
  return out;
}

}  // namespace sdl
