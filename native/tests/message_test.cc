// Negotiation messages: every field survives an encode/decode round trip, and
// truncated input is an error rather than garbage.
#include <gtest/gtest.h>

#include <stdexcept>

#include "common/message.h"

namespace sdl {
namespace {

Request FullRequest() {
  Request r;
  r.op = OpType::kAlltoall;
  r.dtype = DataType::kBFloat16;
  r.reduce = ReduceOp::kMax;
  r.root = 3;
  r.prescale = 0.5;
  r.postscale = 4.0;
  r.name = "layer.weight";
  r.shape = {4, 2, 7};
  r.splits = {1, 3};
  r.group = "g";
  r.group_size = 5;
  r.ranks = {0, 2};
  r.device = Device{DeviceType::kCUDA, 3};
  return r;
}

TEST(Message, RequestRoundTripKeepsEveryFieldIncludingDevice) {
  Request a = FullRequest();
  Request b;
  b.name = "cpu";
  b.device = Device{DeviceType::kCUDAHost, 0};
  bool joined = false, shutdown = false;
  std::vector<Request> out = DecodeRequests(EncodeRequests({a, b}, true, false), &joined, &shutdown);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_TRUE(joined);
  EXPECT_FALSE(shutdown);
  EXPECT_TRUE(out[0].SameSignature(a));
  EXPECT_EQ(out[0].device, (Device{DeviceType::kCUDA, 3}));
  EXPECT_TRUE(out[1].SameSignature(b));
  EXPECT_EQ(out[1].device.type, DeviceType::kCUDAHost);
}

TEST(Message, SignatureDiffersByDevice) {
  Request a = FullRequest();
  Request b = a;
  b.device.index = 0;
  EXPECT_FALSE(a.SameSignature(b));
  b.device = a.device;
  EXPECT_TRUE(a.SameSignature(b));
}

TEST(Message, ResponseRoundTripKeepsEveryField) {
  Response r;
  r.op = OpType::kAllgather;
  r.dtype = DataType::kInt16;
  r.reduce = ReduceOp::kMin;
  r.device = DeviceType::kCUDA;
  r.root = 1;
  r.prescale = 2.0;
  r.postscale = 0.25;
  r.names = {"a", "b"};
  r.shapes = {{2, 3}, {}};
  r.first_dims = {2, 5};
  r.split_matrix = {1, 2, 3, 4};
  r.ranks = {7};
  r.group = "grp";
  r.error = "boom";
  r.error_code = ErrorCode::kMismatch;
  r.last_joined = 2;
  r.cacheable = true;
  std::vector<Response> out = DecodeResponses(EncodeResponses({r, Response()}));
  ASSERT_EQ(out.size(), 2u);
  const Response& o = out[0];
  EXPECT_EQ(o.op, r.op);
  EXPECT_EQ(o.dtype, r.dtype);
  EXPECT_EQ(o.reduce, r.reduce);
  EXPECT_EQ(o.device, DeviceType::kCUDA);
  EXPECT_EQ(o.root, 1);
  EXPECT_EQ(o.prescale, 2.0);
  EXPECT_EQ(o.postscale, 0.25);
  EXPECT_EQ(o.names, r.names);
  EXPECT_EQ(o.shapes, r.shapes);
  EXPECT_EQ(o.first_dims, r.first_dims);
  EXPECT_EQ(o.split_matrix, r.split_matrix);
  EXPECT_EQ(o.ranks, r.ranks);
  EXPECT_EQ(o.group, "grp");
  EXPECT_EQ(o.error, "boom");
  EXPECT_EQ(o.error_code, ErrorCode::kMismatch);
  EXPECT_EQ(o.last_joined, 2);
  EXPECT_TRUE(o.cacheable);
  EXPECT_EQ(out[1].device, DeviceType::kCPU);
  EXPECT_TRUE(out[1].names.empty());
}

TEST(Message, TruncatedInputThrows) {
  std::string buf = EncodeRequests({FullRequest()}, false, false);
  bool j, s;
  for (size_t cut : {size_t{0}, size_t{1}, buf.size() / 2, buf.size() - 1})
    EXPECT_THROW(DecodeRequests(buf.substr(0, cut), &j, &s), std::runtime_error) << cut;
  std::string resp = EncodeResponses({Response()});
  EXPECT_THROW(DecodeResponses(resp.substr(0, resp.size() - 1)), std::runtime_error);
}

TEST(Message, DeviceNames) {
  EXPECT_EQ(DeviceName(Device{}), "cpu");
  EXPECT_EQ(DeviceName(Device{DeviceType::kCUDA, 2}), "cuda:2");
  EXPECT_EQ(DeviceName(Device{DeviceType::kCUDAHost, 0}), "cuda_host");
  EXPECT_EQ(MemoryKind(Device{DeviceType::kCUDAHost, 0}), DeviceType::kCPU);
  EXPECT_EQ(MemoryKind(Device{DeviceType::kCUDA, 1}), DeviceType::kCUDA);
}

}  // namespace
}  // namespace sdl
