#include "core/timeline.h"

#include <fcntl.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <unordered_map>

#include "common/status.h"

namespace sdl {
namespace {

// How often the writer drains the queue: short enough that a reader sees a
// running job's trace within a blink, long enough to cost nothing.
constexpr auto kWriterPeriod = std::chrono::milliseconds(5);
constexpr int kPid = 0;

void AppendEscaped(std::string* out, const std::string& s) {
  for (char c : s) {
    switch (c) {
      case '"': *out += "\\\""; break;
      case '\\': *out += "\\\\"; break;
      case '\n': *out += "\\n"; break;
      case '\t': *out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          *out += buf;
        } else {
          *out += c;
        }
    }
  }
}

std::string Upper(const char* s) {
  std::string u(s);
  for (char& c : u) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return u;
}

// Pairs records into spans, one row per tensor (writer thread only). The
// writer's CPU time is the timeline's main cost on a busy host (it grows with
// tensors x phases), so events are appended without temporaries: phase names
// are the core's own (never escaped), each row keeps its ","pid":0,"tid":N"
// text, and times are printed from integer nanoseconds.
class Formatter {
 public:
  explicit Formatter(double t0) : t0_(t0) {}

  // Appends the events of rec to out, each preceded by ",\n".
  void Add(const Timeline::Record& rec, std::string* out) {
    switch (rec.kind) {
      case Timeline::Kind::kTick: {
        Row& row = RowOf(rec.ps, rec.name, out);
        if (row.negotiate < 0) row.negotiate = rec.t0;
        const std::string rank = std::to_string(rec.rank);
        Open(out, "rank ");
        *out += rank;
        *out += " ready\",\"ph\":\"i\"";
        At(out, row, rec.t0);
        *out += ",\"s\":\"t\",\"args\":{\"rank\":";
        *out += rank;
        *out += "}}";
        break;
      }
      case Timeline::Kind::kReady: {
        const std::string phase = "NEGOTIATE_" + Upper(OpTypeName(rec.op));
        for (const std::string& name : *rec.names) {
          Row& row = RowOf(rec.ps, name, out);
          Span(out, phase, row, row.negotiate >= 0 ? row.negotiate : rec.t0, rec.t1);
          *out += rec.cached ? ",\"args\":{\"cached\":true}}" : "}";
          row.negotiate = -1;
          row.ready = rec.t1;
        }
        break;
      }
      case Timeline::Kind::kSpan:
        for (const std::string& name : *rec.names) {
          Span(out, rec.name, RowOf(rec.ps, name, out), rec.t0, rec.t1);
          *out += "}";
        }
        break;
      case Timeline::Kind::kOuter: {
        const std::string phase = Upper(OpTypeName(rec.op));
        std::string args = ",\"args\":{\"transport\":\"";
        AppendEscaped(&args, rec.name);
        args += "\",\"tensors\":" + std::to_string(rec.names->size()) + "}}";
        for (const std::string& name : *rec.names) {
          Row& row = RowOf(rec.ps, name, out);
          if (row.ready >= 0) {
            Span(out, "QUEUE", row, row.ready, rec.t0);
            *out += "}";
            row.ready = -1;
          }
          Span(out, phase, row, rec.t0, rec.t1);
          *out += args;
        }
        break;
      }
      case Timeline::Kind::kCycle:
        Open(out, "CYCLE_START");
        *out += "\",\"ph\":\"i\"";
        At(out, cycles_, rec.t0);
        *out += ",\"s\":\"p\"}";
        break;
    }
  }

 private:
  struct Row {
    std::string ids;        // ,"pid":0,"tid":N
    double negotiate = -1;  // first tick not yet closed by a ready
    double ready = -1;      // ready, execution not yet started
  };

  Row& RowOf(int32_t ps, const std::string& name, std::string* out) {
    if (ps == 0) {  // the common case: look up without building a key
      auto it = rows_.find(name);
      if (it != rows_.end()) return it->second;
    }
    std::string key = ps == 0 ? name : name + " (process set " + std::to_string(ps) + ")";
    auto it = rows_.find(key);
    if (it != rows_.end()) return it->second;
    const std::string tid = std::to_string(rows_.size() + 1);  // tid 0: cycle markers
    Row row;
    row.ids = ",\"pid\":0,\"tid\":" + tid;
    *out += ",\n{\"name\":\"thread_name\",\"ph\":\"M\"" + row.ids + ",\"args\":{\"name\":\"";
    AppendEscaped(out, key);
    *out += "\"}},\n{\"name\":\"thread_sort_index\",\"ph\":\"M\"" + row.ids +
            ",\"args\":{\"sort_index\":" + tid + "}}";
    return rows_.emplace(std::move(key), std::move(row)).first->second;
  }

  // Microseconds with three decimals, from integer nanoseconds.
  static void Micros(std::string* out, double seconds) {
    int64_t ns = static_cast<int64_t>(seconds * 1e9 + 0.5);
    if (ns < 0) {
      *out += '-';
      ns = -ns;
    }
    char buf[24];
    int n = 0;
    const int64_t frac = ns % 1000;
    for (int64_t us = ns / 1000; n == 0 || us > 0; us /= 10) buf[n++] = static_cast<char>('0' + us % 10);
    while (n) *out += buf[--n];
    *out += '.';
    *out += static_cast<char>('0' + frac / 100);
    *out += static_cast<char>('0' + frac / 10 % 10);
    *out += static_cast<char>('0' + frac % 10);
  }

  // Starts an event: ,\n{"name":"<name (unescaped: the core's own)>
  static void Open(std::string* out, const std::string& name) {
    *out += ",\n{\"name\":\"";
    *out += name;
  }
  void At(std::string* out, const Row& row, double t) {
    *out += row.ids;
    *out += ",\"ts\":";
    Micros(out, t - t0_);
  }
  // A complete event up to its closing brace (the caller adds args and "}").
  void Span(std::string* out, const std::string& name, const Row& row, double t0, double t1) {
    Open(out, name);
    *out += "\",\"ph\":\"X\"";
    At(out, row, t0);
    *out += ",\"dur\":";
    Micros(out, std::max(t1 - t0, 0.0));
  }

  double t0_;
  Row cycles_{",\"pid\":0,\"tid\":0"};
  std::unordered_map<std::string, Row> rows_;
};

bool WriteAll(int fd, const std::string& s, off_t at) {
  size_t done = 0;
  while (done < s.size()) {
    ssize_t n = pwrite(fd, s.data() + done, s.size() - done, at + static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

}  // namespace

double TimelineNow() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

Timeline::Timeline(size_t capacity) {
  size_t n = 2;
  while (n < capacity) n <<= 1;
  cells_ = std::vector<Cell>(n);
  for (size_t i = 0; i < n; ++i) cells_[i].seq.store(i, std::memory_order_relaxed);
  mask_ = n - 1;
}

Timeline::~Timeline() { Stop(); }

std::string Timeline::path() {
  std::lock_guard<std::mutex> lk(control_mu_);
  return on() ? path_ : std::string();
}

bool Timeline::Push(Record&& rec) {
  size_t pos = head_.load(std::memory_order_relaxed);
  while (true) {
    Cell& c = cells_[pos & mask_];
    const size_t seq = c.seq.load(std::memory_order_acquire);
    const intptr_t diff = static_cast<intptr_t>(seq) - static_cast<intptr_t>(pos);
    if (diff == 0) {
      if (head_.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) {
        c.rec = std::move(rec);
        c.seq.store(pos + 1, std::memory_order_release);
        return true;
      }
    } else if (diff < 0) {
      dropped_.fetch_add(1, std::memory_order_relaxed);  // full: never wait
      return false;
    } else {
      pos = head_.load(std::memory_order_relaxed);
    }
  }
}

bool Timeline::Pop(Record* rec) {
  const size_t pos = tail_.load(std::memory_order_relaxed);
  Cell& c = cells_[pos & mask_];
  if (c.seq.load(std::memory_order_acquire) != pos + 1) return false;
  *rec = std::move(c.rec);
  c.rec = Record();
  tail_.store(pos + 1, std::memory_order_relaxed);
  c.seq.store(pos + mask_ + 1, std::memory_order_release);
  return true;
}

void Timeline::Start(const std::string& path, bool mark_cycles) {
  Stop();
  std::lock_guard<std::mutex> lk(control_mu_);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0)
    throw Error(ErrorCode::kInvalidArgument,
                "cannot create the timeline file " + path + ": " + std::strerror(errno));
  fd_ = fd;
  path_ = path;
  t0_ = TimelineNow();
  dropped_ = 0;
  written_ = 0;
  // The array is complete from the first byte on: metadata, then "]".
  std::string head =
      "[\n{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":0,\"args\":{\"name\":\"spark_dl rank 0\"}},"
      "\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":0,\"tid\":0,\"args\":{\"name\":\"cycles\"}}"
      "\n]";
  if (!WriteAll(fd_, head, 0)) {
    ::close(fd_);
    fd_ = -1;
    throw Error(ErrorCode::kInvalidArgument, "cannot write the timeline file " + path);
  }
  session_.fetch_add(1);
  mark_cycles_.store(mark_cycles);
  stop_writer_.store(false);
  end_ = static_cast<int64_t>(head.size()) - 1;  // where "]" is
  writer_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "sdl_timeline");
    WriterLoop();
  });
  on_.store(true);
}

void Timeline::Stop() {
  std::lock_guard<std::mutex> lk(control_mu_);
  if (!writer_.joinable()) return;
  on_.store(false);
  stop_writer_.store(true);
  writer_.join();
  ::close(fd_);
  fd_ = -1;
}

void Timeline::WriterLoop() {
  Formatter fmt(t0_);
  const uint32_t session = session_.load();
  int64_t reported = 0;
  bool ok = true;
  while (true) {
    const bool last = stop_writer_.load();
    std::string batch;
    Record rec;
    while (Pop(&rec)) {
      if (rec.session != session) continue;  // made before this session started
      fmt.Add(rec, &batch);
      written_.fetch_add(1, std::memory_order_relaxed);
    }
    const int64_t dropped = dropped_.load();
    if (dropped != reported || last) {
      // A counter track, so a reader sees losses where they happened; the
      // final one also as metadata (the total at stop).
      batch += ",\n{\"name\":\"timeline dropped records\",\"ph\":\"C\",\"pid\":0,\"ts\":" +
               std::to_string((TimelineNow() - t0_) * 1e6) + ",\"args\":{\"dropped\":" +
               std::to_string(dropped) + "}}";
      reported = dropped;
    }
    if (last)
      batch += ",\n{\"name\":\"timeline_stats\",\"ph\":\"M\",\"pid\":0,\"args\":{\"dropped\":" +
               std::to_string(dropped) + ",\"records\":" + std::to_string(written_.load()) + "}}";
    if (ok && !batch.empty()) {
      batch += "\n]";
      ok = WriteAll(fd_, batch, static_cast<off_t>(end_));
      if (ok) end_ += static_cast<int64_t>(batch.size()) - 1;
    }
    if (last) return;
    std::this_thread::sleep_for(kWriterPeriod);
  }
}

void Timeline::Tick(int32_t ps, const std::string& name, int32_t rank, double t) {
  Record rec;
  rec.kind = Kind::kTick;
  rec.session = session_.load(std::memory_order_relaxed);
  rec.ps = ps;
  rec.rank = rank;
  rec.t0 = t;
  rec.name = name;
  Push(std::move(rec));
}

void Timeline::Ready(int32_t ps, const Response& r, double since, double t, bool cached) {
  Record rec;
  rec.kind = Kind::kReady;
  rec.session = session_.load(std::memory_order_relaxed);
  rec.ps = ps;
  rec.op = r.op;
  rec.cached = cached;
  rec.t0 = since;
  rec.t1 = t;
  rec.names = std::make_shared<const std::vector<std::string>>(r.names);
  Push(std::move(rec));
}

void Timeline::Begin(int32_t ps, const Response& r, double t) {
  cur_ps_ = ps;
  cur_op_ = r.op;
  cur_start_ = t;
  cur_names_ = std::make_shared<const std::vector<std::string>>(r.names);
}

Timeline::Record Timeline::Current(Kind kind, double t0, double t1,
                                   const std::string& name) const {
  Record rec;
  rec.kind = kind;
  rec.session = session_.load(std::memory_order_relaxed);
  rec.ps = cur_ps_;
  rec.op = cur_op_;
  rec.t0 = t0;
  rec.t1 = t1;
  rec.name = name;
  rec.names = cur_names_;
  return rec;
}

void Timeline::Phase(const std::string& phase, double t0, double t1) {
  if (cur_names_) Push(Current(Kind::kSpan, t0, t1, phase));
}

void Timeline::End(const std::string& transport, double t) {
  if (!cur_names_) return;
  Push(Current(Kind::kOuter, cur_start_, t, transport));
  cur_names_.reset();
}

void Timeline::Cycle(double t) {
  Record rec;
  rec.kind = Kind::kCycle;
  rec.session = session_.load(std::memory_order_relaxed);
  rec.t0 = t;
  Push(std::move(rec));
}

}  // namespace sdl
