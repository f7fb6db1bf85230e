#include "common/types.h"

namespace sdl {

std::string DeviceName(Device d) {
  switch (d.type) {
    case DeviceType::kCPU: return "cpu";
    case DeviceType::kCUDA: return "cuda:" + std::to_string(d.index);
    case DeviceType::kCUDAHost: return "cuda_host";
  }
  return "?";
}

DeviceType MemoryKind(Device d) { return d.host() ? DeviceType::kCPU : DeviceType::kCUDA; }

const char* MemoryKindName(DeviceType kind) {
  return kind == DeviceType::kCUDA ? "cuda" : "cpu";
}

size_t DataTypeSize(DataType dt) {
  switch (dt) {
    case DataType::kUInt8: case DataType::kInt8: case DataType::kBool: return 1;
    case DataType::kInt16: case DataType::kUInt16: case DataType::kFloat16:
    case DataType::kBFloat16: return 2;
    case DataType::kInt32: case DataType::kFloat32: return 4;
    case DataType::kInt64: case DataType::kFloat64: case DataType::kUInt64: return 8;
  }
  return 0;
}

const char* DataTypeName(DataType dt) {
  switch (dt) {
    case DataType::kUInt8: return "uint8";
    case DataType::kInt8: return "int8";
    case DataType::kInt16: return "int16";
    case DataType::kUInt16: return "uint16";
    case DataType::kInt32: return "int32";
    case DataType::kInt64: return "int64";
    case DataType::kFloat16: return "float16";
    case DataType::kBFloat16: return "bfloat16";
    case DataType::kFloat32: return "float32";
    case DataType::kFloat64: return "float64";
    case DataType::kBool: return "bool";
    case DataType::kUInt64: return "uint64";
  }
  return "?";
}

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kAverage: return "Average";
    case ReduceOp::kSum: return "Sum";
    case ReduceOp::kMin: return "Min";
    case ReduceOp::kMax: return "Max";
    case ReduceOp::kProduct: return "Product";
    case ReduceOp::kBitAnd: return "BitAnd";
  }
  return "?";
}

const char* OpTypeName(OpType op) {
  switch (op) {
    case OpType::kAllreduce: return "allreduce";
    case OpType::kAllgather: return "allgather";
    case OpType::kBroadcast: return "broadcast";
    case OpType::kAlltoall: return "alltoall";
    case OpType::kReducescatter: return "reducescatter";
    case OpType::kBarrier: return "barrier";
    case OpType::kJoin: return "join";
    case OpType::kProcessSetAdd: return "add_process_set";
    case OpType::kProcessSetRemove: return "remove_process_set";
  }
  return "?";
}

bool IsFloating(DataType dt) {
  return dt == DataType::kFloat16 || dt == DataType::kBFloat16 || dt == DataType::kFloat32 ||
         dt == DataType::kFloat64;
}

}  // namespace sdl
