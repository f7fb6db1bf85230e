#include "common/message.h"

#include <cstring>
#include <stdexcept>

namespace sdl {

int64_t Request::NumElements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

bool Request::SameSignature(const Request& o) const {
  return op == o.op && dtype == o.dtype && reduce == o.reduce && root == o.root &&
         prescale == o.prescale && postscale == o.postscale && name == o.name &&
         shape == o.shape && splits == o.splits && group == o.group &&
         group_size == o.group_size && ranks == o.ranks && device == o.device;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

namespace {

class Writer {
 public:
  template <typename T> void Pod(T v) { buf_.append(reinterpret_cast<const char*>(&v), sizeof v); }
  void Str(const std::string& s) {
    Pod<uint32_t>(static_cast<uint32_t>(s.size()));
    buf_.append(s);
  }
  template <typename T> void Vec(const std::vector<T>& v) {
    Pod<uint32_t>(static_cast<uint32_t>(v.size()));
    buf_.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
  }
  std::string Take() { return std::move(buf_); }

 private:
  std::string buf_;
};

class Reader {
 public:
  explicit Reader(const std::string& b) : b_(b) {}
  template <typename T> T Pod() {
    Need(sizeof(T));
    T v;
    std::memcpy(&v, b_.data() + pos_, sizeof v);
    pos_ += sizeof v;
    return v;
  }
  std::string Str() {
    uint32_t n = Pod<uint32_t>();
    Need(n);
    std::string s = b_.substr(pos_, n);
    pos_ += n;
    return s;
  }
  template <typename T> std::vector<T> Vec() {
    uint32_t n = Pod<uint32_t>();
    Need(static_cast<size_t>(n) * sizeof(T));
    std::vector<T> v(n);
    if (n) std::memcpy(v.data(), b_.data() + pos_, n * sizeof(T));
    pos_ += n * sizeof(T);
    return v;
  }

 private:
  void Need(size_t n) {
    if (pos_ + n > b_.size()) throw std::runtime_error("truncated negotiation message");
  }
  const std::string& b_;
  size_t pos_ = 0;
};

}  // namespace

std::string EncodeRequests(const std::vector<Request>& reqs, bool joined, bool shutdown) {
  Writer w;
  w.Pod<uint8_t>(joined);
  w.Pod<uint8_t>(shutdown);
  w.Pod<uint32_t>(static_cast<uint32_t>(reqs.size()));
  for (const Request& r : reqs) {
    w.Pod(r.op);
    w.Pod(r.dtype);
    w.Pod(r.reduce);
    w.Pod(r.root);
    w.Pod(r.prescale);
    w.Pod(r.postscale);
    w.Str(r.name);
    w.Vec(r.shape);
    w.Vec(r.splits);
    w.Str(r.group);
    w.Pod(r.group_size);
    w.Vec(r.ranks);
    w.Pod(r.device.type);
    w.Pod(r.device.index);
  }
  return w.Take();
}

std::vector<Request> DecodeRequests(const std::string& buf, bool* joined, bool* shutdown) {
  Reader rd(buf);
  *joined = rd.Pod<uint8_t>();
  *shutdown = rd.Pod<uint8_t>();
  std::vector<Request> reqs(rd.Pod<uint32_t>());
  for (Request& r : reqs) {
    r.op = rd.Pod<OpType>();
    r.dtype = rd.Pod<DataType>();
    r.reduce = rd.Pod<ReduceOp>();
    r.root = rd.Pod<int32_t>();
    r.prescale = rd.Pod<double>();
    r.postscale = rd.Pod<double>();
    r.name = rd.Str();
    r.shape = rd.Vec<int64_t>();
    r.splits = rd.Vec<int64_t>();
    r.group = rd.Str();
    r.group_size = rd.Pod<int32_t>();
    r.ranks = rd.Vec<int32_t>();
    r.device.type = rd.Pod<DeviceType>();
    r.device.index = rd.Pod<int32_t>();
  }
  return reqs;
}

std::string EncodeResponses(const std::vector<Response>& resps) {
  Writer w;
  w.Pod<uint32_t>(static_cast<uint32_t>(resps.size()));
  for (const Response& r : resps) {
    w.Pod(r.op);
    w.Pod(r.dtype);
    w.Pod(r.reduce);
    w.Pod(r.device);
    w.Pod(r.root);
    w.Pod(r.prescale);
    w.Pod(r.postscale);
    w.Pod<uint32_t>(static_cast<uint32_t>(r.names.size()));
    for (size_t i = 0; i < r.names.size(); ++i) {
      w.Str(r.names[i]);
      w.Vec(r.shapes[i]);
    }
    w.Vec(r.first_dims);
    w.Vec(r.split_matrix);
    w.Vec(r.ranks);
    w.Str(r.group);
    w.Str(r.error);
    w.Pod(r.error_code);
    w.Pod(r.last_joined);
    w.Pod<uint8_t>(r.cacheable);
  }
  return w.Take();
}

std::vector<Response> DecodeResponses(const std::string& buf) {
  Reader rd(buf);
  std::vector<Response> resps(rd.Pod<uint32_t>());
  for (Response& r : resps) {
    r.op = rd.Pod<OpType>();
    r.dtype = rd.Pod<DataType>();
    r.reduce = rd.Pod<ReduceOp>();
    r.device = rd.Pod<DeviceType>();
    r.root = rd.Pod<int32_t>();
    r.prescale = rd.Pod<double>();
    r.postscale = rd.Pod<double>();
    uint32_t n = rd.Pod<uint32_t>();
    r.names.resize(n);
    r.shapes.resize(n);
    for (uint32_t i = 0; i < n; ++i) {
      r.names[i] = rd.Str();
      r.shapes[i] = rd.Vec<int64_t>();
    }
    r.first_dims = rd.Vec<int64_t>();
    r.split_matrix = rd.Vec<int64_t>();
    r.ranks = rd.Vec<int32_t>();
    r.group = rd.Str();
    r.error = rd.Str();
    r.error_code = rd.Pod<ErrorCode>();
    r.last_joined = rd.Pod<int32_t>();
    r.cacheable = rd.Pod<uint8_t>();
  }
  return resps;
}

}  // namespace sdl
