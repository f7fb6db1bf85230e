#include "core/flight_recorder.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>

namespace sdl {
namespace {

double SteadyNow() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

const char* CodeName(ErrorCode c) {
  switch (c) {
    case ErrorCode::kOk: return "ok";
    case ErrorCode::kInvalidArgument: return "invalid_argument";
    case ErrorCode::kMismatch: return "mismatch";
    case ErrorCode::kPeerFailure: return "peer_failure";
    case ErrorCode::kShutdown: return "shutdown";
    case ErrorCode::kNotInitialized: return "not_initialized";
    case ErrorCode::kDuplicateName: return "duplicate_name";
    case ErrorCode::kTimeout: return "timeout";
  }
  return "unknown";
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (unsigned char ch : s) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += static_cast<char>(ch);
    } else if (ch < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", ch);
      out += buf;
    } else {
      out += static_cast<char>(ch);
    }
  }
  return out + "\"";
}

std::string Fixed(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6f", v);
  return buf;
}

// "1.204 s" or "-" for a time not reached.
std::string When(double t) {
  if (t == 0) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f s", t);
  return buf;
}

// Where a collective got to, for the log.
const char* State(const FlightRecord& r) {
  if (r.done != 0) return r.code == ErrorCode::kOk ? "done" : "failed";
  if (r.started != 0) return "RUNNING";
  return "WAITING for the other ranks";
}

}  // namespace

FlightRecorder::FlightRecorder(size_t capacity) : ring_(capacity) {
  steady_base_ = SteadyNow();
  wall_base_ = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

double FlightRecorder::Now() const { return SteadyNow() - steady_base_; }

uint64_t FlightRecorder::Enqueued(int32_t ps, const Request& req, double steady_s) {
  if (ring_.empty()) return 0;
  const double now = steady_s - steady_base_;
  std::lock_guard<std::mutex> lk(mu_);
  const uint64_t id = next_id_++;
  FlightRecord& r = ring_[id % ring_.size()];
  r.id = id;
  r.process_set = ps;
  r.name = req.name;    // copy-assignment: reuses the slot's memory
  r.op = req.op;
  r.dtype = req.dtype;
  r.shape = req.shape;
  r.enqueued = now;
  r.negotiated = r.started = r.done = 0;
  r.from_cache = false;
  r.code = ErrorCode::kOk;
  return id;
}

void FlightRecorder::CycleStarted() {
  if (ring_.empty()) return;
  const double now = Now();
  std::lock_guard<std::mutex> lk(mu_);
  cycle_start_ = now;
}

FlightRecord* FlightRecorder::Find(uint64_t id) {
  if (id == 0) return nullptr;
  FlightRecord& r = ring_[id % ring_.size()];
  return r.id == id ? &r : nullptr;
}

void FlightRecorder::Started(const ProcessSet& ps, const Response& resp, bool from_cache) {
  if (ring_.empty()) return;
  const double now = Now();
  std::lock_guard<std::mutex> lk(mu_);
  for (const std::string& name : resp.names) {
    auto it = ps.pending.find(name);
    if (it == ps.pending.end()) continue;  // a joined rank runs names it never enqueued
    FlightRecord* r = Find(it->second.flight_id);
    if (!r) continue;
    // Taken in during the cycle that ran it: negotiated from then on.
    r->negotiated = std::max(cycle_start_ > 0 ? cycle_start_ : now, r->enqueued);
    r->started = now;
    r->from_cache = from_cache;
  }
}

void FlightRecorder::Done(uint64_t id, ErrorCode code) {
  if (ring_.empty() || id == 0) return;
  const double now = Now();
  std::lock_guard<std::mutex> lk(mu_);
  FlightRecord* r = Find(id);
  if (!r) return;
  r->done = now;
  r->code = code;
}

std::vector<FlightRecord> FlightRecorder::Snapshot() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<FlightRecord> out;
  if (ring_.empty()) return out;
  const uint64_t n = ring_.size();
  const uint64_t first = next_id_ > n ? next_id_ - n : 1;
  for (uint64_t id = first; id < next_id_; ++id) {
    const FlightRecord& r = ring_[id % n];
    if (r.id == id) out.push_back(r);
  }
  return out;
}

std::string FlightRecordLine(const FlightRecord& r) {
  std::ostringstream s;
  s << "#" << r.id << " " << OpTypeName(r.op) << " '" << r.name << "' set " << r.process_set
    << " " << DataTypeName(r.dtype) << " " << ShapeString(r.shape) << ": " << State(r)
    << "; taken in " << When(r.enqueued) << ", negotiated " << When(r.negotiated)
    << (r.from_cache ? " (cache)" : "") << ", started " << When(r.started) << ", done "
    << When(r.done);
  if (r.done != 0 && r.code != ErrorCode::kOk) s << " (" << CodeName(r.code) << ")";
  return s.str();
}

std::string FlightRecorder::Text(int rank, const std::string& host, const std::string& reason,
                                 size_t max_lines) const {
  std::vector<FlightRecord> recs = Snapshot();
  std::ostringstream s;
  const size_t shown = recs.size() < max_lines ? recs.size() : max_lines;
  s << "flight recorder of rank " << rank << (host.empty() ? "" : " (host " + host + ")") << ", "
    << reason << ": last " << shown << " of " << recs.size()
    << " recorded collectives, oldest first (times in s since init):";
  for (size_t i = recs.size() - shown; i < recs.size(); ++i) s << "\n  " << FlightRecordLine(recs[i]);
  return s.str();
}

std::string FlightRecorder::Json(int rank, const std::string& host, const std::string& reason) const {
  std::vector<FlightRecord> recs = Snapshot();
  std::ostringstream s;
  s << "{\"rank\": " << rank << ", \"host\": " << JsonString(host)
    << ", \"reason\": " << JsonString(reason) << ", \"wall_time_base\": " << Fixed(wall_base_)
    << ", \"capacity\": " << ring_.size() << ", \"records\": [";
  for (size_t i = 0; i < recs.size(); ++i) {
    const FlightRecord& r = recs[i];
    s << (i ? ",\n  " : "\n  ") << "{\"id\": " << r.id << ", \"name\": " << JsonString(r.name)
      << ", \"op\": \"" << OpTypeName(r.op) << "\", \"dtype\": \"" << DataTypeName(r.dtype)
      << "\", \"shape\": " << ShapeString(r.shape) << ", \"process_set\": " << r.process_set
      << ", \"enqueued\": " << Fixed(r.enqueued) << ", \"negotiated\": " << Fixed(r.negotiated)
      << ", \"started\": " << Fixed(r.started) << ", \"done\": " << Fixed(r.done)
      << ", \"from_cache\": " << (r.from_cache ? "true" : "false") << ", \"state\": \""
      << (r.done != 0 ? CodeName(r.code) : r.started != 0 ? "running" : "waiting") << "\"}";
  }
  s << "]}\n";
  return s.str();
}

}  // namespace sdl
