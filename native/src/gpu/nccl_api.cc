#include "gpu/nccl_api.h"

#include "gpu/cuda_api.h"

namespace sdl {
namespace gpu {
namespace {

template <typename F>
void Resolve(const DynLib& lib, const char* name, F* out, std::string* missing) {
  *out = reinterpret_cast<F>(lib.Symbol(name));
  if (!*out && missing) *missing += (missing->empty() ? "" : ", ") + std::string(name);
}

struct Loaded {
  NcclApi api;
  bool ok = false;
  std::string error;
};

Loaded* Load() {
  static Loaded* loaded = [] {
    auto* l = new Loaded();  // never unloaded (see DynLib)
    LibrarySearch search;
    search.sonames = {"libnccl.so.2"};
    search.subdir_globs = {"nvidia/nccl/lib", "nvidia/*/lib"};
    search.fixed_dirs = {"/usr/local/cuda/lib64", "/usr/lib/x86_64-linux-gnu",
                         "/usr/lib/aarch64-linux-gnu"};
    std::string error;
    DynLib lib = OpenLibrary("NCCL", search, &error);
    if (!lib.loaded()) {
      l->error = error + ". Install the nvidia-nccl-cu13 (or -cu12) wheel, which PyTorch's "
                         "CUDA builds bring, or the system's libnccl2";
      return l;
    }
    NcclApi& a = l->api;
    a.lib = lib;
    std::string missing;
    Resolve(lib, "ncclGetVersion", &a.GetVersion, &missing);
    Resolve(lib, "ncclGetUniqueId", &a.GetUniqueId, &missing);
    Resolve(lib, "ncclGetErrorString", &a.GetErrorString, &missing);
    Resolve(lib, "ncclGetLastError", &a.GetLastError, &missing);
    Resolve(lib, "ncclCommInitRank", &a.CommInitRank, &missing);
    Resolve(lib, "ncclCommInitRankConfig", &a.CommInitRankConfig, &missing);
    Resolve(lib, "ncclCommFinalize", &a.CommFinalize, &missing);
    Resolve(lib, "ncclCommDestroy", &a.CommDestroy, &missing);
    Resolve(lib, "ncclCommAbort", &a.CommAbort, &missing);
    Resolve(lib, "ncclCommGetAsyncError", &a.CommGetAsyncError, &missing);
    Resolve(lib, "ncclAllReduce", &a.AllReduce, &missing);
    Resolve(lib, "ncclBroadcast", &a.Broadcast, &missing);
    Resolve(lib, "ncclReduce", &a.Reduce, &missing);
    Resolve(lib, "ncclAllGather", &a.AllGather, &missing);
    Resolve(lib, "ncclReduceScatter", &a.ReduceScatter, &missing);
    Resolve(lib, "ncclSend", &a.Send, &missing);
    Resolve(lib, "ncclRecv", &a.Recv, &missing);
    Resolve(lib, "ncclGroupStart", &a.GroupStart, &missing);
    Resolve(lib, "ncclGroupEnd", &a.GroupEnd, &missing);
    if (a.GetVersion && a.GetVersion(&a.version) != ncclSuccess) a.version = 0;
    if (a.version < kMinNcclVersion) {
      l->error = "NCCL " + a.VersionString() + " at " + lib.path +
                 " is too old; spark_dl needs NCCL 2.14 or later";
      return l;
    }
    if (!missing.empty()) {
      l->error = "NCCL at " + lib.path + " lacks " + missing;
      return l;
    }
    l->ok = true;
    return l;
  }();
  return loaded;
}

}  // namespace

std::string NcclApi::Describe(ncclResult_t r, const char* what, ncclComm_t comm) const {
  std::string s = std::string(what) + " failed: ";
  const char* text = GetErrorString ? GetErrorString(r) : nullptr;
  s += text ? text : ("NCCL error " + std::to_string(static_cast<int>(r)));
  const char* detail = GetLastError ? GetLastError(comm) : nullptr;
  if (detail && detail[0]) s += std::string(" (") + detail + ")";
  return s;
}

std::string NcclApi::VersionString() const {
  // Since 2.9 the code is major * 10000 + minor * 100 + patch.
  return std::to_string(version / 10000) + "." + std::to_string(version / 100 % 100) + "." +
         std::to_string(version % 100);
}

const NcclApi* Nccl(std::string* error) {
  Loaded* l = Load();
  if (!l->ok) {
    if (error) *error = l->error;
    return nullptr;
  }
  return &l->api;
}

const NcclAvailability& QueryNccl() {
  static const NcclAvailability info = [] {
    NcclAvailability a;
    std::string error;
    const NcclApi* api = Nccl(&error);
    if (api) {
      a.library = api->lib.path;
      a.version = api->version;
    }
    const CudaAvailability& cuda = QueryCuda();
    if (!api) {
      a.reason = error;
    } else if (!cuda.usable) {
      a.reason = "NCCL " + api->VersionString() + " loaded, but CUDA is not usable: " +
                 cuda.reason;
    } else {
      a.usable = true;
    }
    return a;
  }();
  return info;
}

Status NcclReduceOp(ReduceOp op, ncclRedOp_t* out) {
  switch (op) {
    case ReduceOp::kSum: *out = ncclSum; return Status::OK();
    case ReduceOp::kProduct: *out = ncclProd; return Status::OK();
    case ReduceOp::kMin: *out = ncclMin; return Status::OK();
    case ReduceOp::kMax: *out = ncclMax; return Status::OK();
    case ReduceOp::kAverage:
    case ReduceOp::kBitAnd:
      break;
  }
  return Status::Invalid(std::string("reduce op ") + ReduceOpName(op) +
                         " has no NCCL equivalent (Average reduces as Sum, then scales)");
}

Status NcclReduceType(DataType dt, ReduceOp op, ncclDataType_t* out) {
  switch (dt) {
    case DataType::kUInt8: *out = ncclUint8; return Status::OK();
    case DataType::kInt8: *out = ncclInt8; return Status::OK();
    case DataType::kInt32: *out = ncclInt32; return Status::OK();
    case DataType::kInt64: *out = ncclInt64; return Status::OK();
    case DataType::kUInt64: *out = ncclUint64; return Status::OK();
    case DataType::kFloat16: *out = ncclFloat16; return Status::OK();
    case DataType::kBFloat16: *out = ncclBfloat16; return Status::OK();
    case DataType::kFloat32: *out = ncclFloat32; return Status::OK();
    case DataType::kFloat64: *out = ncclFloat64; return Status::OK();
    case DataType::kBool:
      if (op == ReduceOp::kSum || op == ReduceOp::kAverage)
        return Status::Invalid(std::string("reduce op ") + ReduceOpName(op) +
                               " is not defined for bool tensors; use Max (logical or) or "
                               "Min/Product (logical and)");
      *out = ncclUint8;  // 0/1 values: max = or, min = product = and
      return Status::OK();
    case DataType::kInt16:
    case DataType::kUInt16:
      break;
  }
  return Status::Invalid(std::string("NCCL has no ") + DataTypeName(dt) +
                         " reduction; such tensors are reduced through host memory");
}

Status NcclSupportsReduction(DataType dt, ReduceOp op) {
  ncclDataType_t t;
  SDL_GPU_RETURN_IF_ERROR(NcclReduceType(dt, op, &t));
  if (op == ReduceOp::kAverage) return Status::OK();  // Sum, then a scale kernel
  ncclRedOp_t o;
  return NcclReduceOp(op, &o);
}

}  // namespace gpu
}  // namespace sdl
