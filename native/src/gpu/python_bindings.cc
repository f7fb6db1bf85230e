#include "gpu/python_bindings.h"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "common/types.h"
#include "gpu/build_config.h"  // generated: why CUDA/NCCL were left out

#ifdef SDL_HAVE_CUDA
#include "gpu/cuda_util.h"
#include "gpu/dynlib.h"
#include "gpu/kernels.h"
#endif
#ifdef SDL_HAVE_NCCL
#include "gpu/nccl_comm.h"
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace sdl {
namespace gpu {
namespace {

#ifdef SDL_HAVE_CUDA
// Python's sys.path joins the search roots of the library loader, so the
// nvidia-* wheels are found wherever this interpreter installs packages.
void AddPythonSearchRoots() {
  std::vector<std::string> roots;
  for (nb::handle p : nb::module_::import_("sys").attr("path"))
    if (nb::isinstance<nb::str>(p)) roots.push_back(nb::cast<std::string>(p));
  AddSearchRoots(roots);
}

DataType ParseDataType(const std::string& name) {
  for (int i = 0; i <= static_cast<int>(DataType::kUInt64); ++i) {
    auto dt = static_cast<DataType>(i);
    if (name == DataTypeName(dt)) return dt;
  }
  throw Error(ErrorCode::kInvalidArgument, "unknown dtype '" + name + "'");
}

void* AsPtr(uintptr_t p) { return reinterpret_cast<void*>(p); }

// A CUDA array from Python, framework-neutral where possible: torch-like
// objects through data_ptr()/nbytes/dtype (cheap C calls), anything else
// through __cuda_array_interface__ (contiguous only). TEST ONLY (benchmarks).
struct CudaArrayView {
  uintptr_t ptr = 0;
  size_t bytes = 0;
  std::string dtype;  // a DataTypeName, "" when unknown
};

CudaArrayView ViewOf(nb::handle obj) {
  CudaArrayView v;
  if (nb::hasattr(obj, "data_ptr") && nb::hasattr(obj, "nbytes")) {
    if (nb::hasattr(obj, "is_contiguous") && !nb::cast<bool>(obj.attr("is_contiguous")()))
      throw Error(ErrorCode::kInvalidArgument, "cuda_pack_for_tests: a tensor is not contiguous");
    v.ptr = nb::cast<uintptr_t>(obj.attr("data_ptr")());
    v.bytes = nb::cast<size_t>(obj.attr("nbytes"));
    std::string name = nb::cast<std::string>(nb::str(obj.attr("dtype")));
    size_t dot = name.rfind('.');
    v.dtype = dot == std::string::npos ? name : name.substr(dot + 1);  // "torch.float32"
    return v;
  }
  if (!nb::hasattr(obj, "__cuda_array_interface__"))
    throw Error(ErrorCode::kInvalidArgument,
                "cuda_pack_for_tests: expected CUDA tensors (data_ptr() or "
                "__cuda_array_interface__)");
  nb::dict cai = nb::cast<nb::dict>(obj.attr("__cuda_array_interface__"));
  if (cai.contains("strides") && !cai["strides"].is_none())
    throw Error(ErrorCode::kInvalidArgument, "cuda_pack_for_tests: an array is not contiguous");
  v.ptr = nb::cast<uintptr_t>(nb::cast<nb::tuple>(cai["data"])[0]);
  std::string typestr = nb::cast<std::string>(cai["typestr"]);  // "<f4"
  size_t item = static_cast<size_t>(std::stoul(typestr.substr(2)));
  size_t n = 1;
  for (nb::handle d : nb::cast<nb::tuple>(cai["shape"])) n *= nb::cast<size_t>(d);
  v.bytes = n * item;
  const char kind = typestr[1];
  static const std::pair<std::string, const char*> kNames[] = {
      {"f2", "float16"}, {"f4", "float32"}, {"f8", "float64"}, {"i1", "int8"},
      {"i2", "int16"},   {"i4", "int32"},   {"i8", "int64"},   {"u1", "uint8"},
      {"b1", "bool"}};
  for (const auto& [code, name] : kNames)
    if (code == std::string(1, kind) + typestr.substr(2)) v.dtype = name;
  return v;
}
#endif

#ifdef SDL_HAVE_NCCL
ReduceOp ParseReduceOp(const std::string& name) {
  for (ReduceOp op : {ReduceOp::kAverage, ReduceOp::kSum, ReduceOp::kMin, ReduceOp::kMax,
                      ReduceOp::kProduct})
    if (name == ReduceOpName(op)) return op;
  throw Error(ErrorCode::kInvalidArgument, "unknown reduce op '" + name + "'");
}

// TEST ONLY: an NCCL communicator driven from Python with raw device pointers,
// each call run to completion (stream synchronized) before it returns. The
// real path goes through the operations layer, never through this class.
class SelftestNccl {
 public:
  SelftestNccl(int device, int rank, int size, nb::object exchange, double timeout_s) {
    AddPythonSearchRoots();
    // exchange(bytes or None) -> bytes: rank 0 passes the id and gets it back,
    // the others pass None and get rank 0's (a file or a store in the test).
    BroadcastFromRoot bcast = [&](std::string* id) -> Status {
      if (size == 1) return Status::OK();
      nb::object arg = rank == 0 ? nb::object(nb::bytes(id->data(), id->size())) : nb::none();
      nb::bytes got = nb::cast<nb::bytes>(exchange(arg));
      id->assign(got.c_str(), got.size());
      return Status::OK();
    };
    NcclOptions options;
    options.timeout_s = timeout_s;
    NcclCommunicator::Create(device, rank, size, bcast, options, &comm_).ThrowIfError();
    Event::Create(device, &done_).ThrowIfError();
  }

  void Allreduce(uintptr_t send, uintptr_t recv, size_t count, const std::string& dt,
                 const std::string& op) {
    Run(comm_->Allreduce(AsPtr(send), AsPtr(recv), count, ParseDataType(dt), ParseReduceOp(op)));
  }
  void Allgather(uintptr_t send, uintptr_t recv, std::vector<size_t> counts,
                 const std::string& dt) {
    Run(comm_->Allgather(AsPtr(send), AsPtr(recv), counts, ParseDataType(dt)));
  }
  void Broadcast(uintptr_t buf, size_t count, const std::string& dt, int root) {
    Run(comm_->Broadcast(AsPtr(buf), count, ParseDataType(dt), root));
  }
  void Alltoall(uintptr_t send, std::vector<size_t> send_counts, uintptr_t recv,
                std::vector<size_t> recv_counts, const std::string& dt) {
    Run(comm_->Alltoall(AsPtr(send), send_counts, AsPtr(recv), recv_counts, ParseDataType(dt)));
  }
  void Reducescatter(uintptr_t send, uintptr_t recv, std::vector<size_t> counts,
                     const std::string& dt, const std::string& op) {
    Run(comm_->Reducescatter(AsPtr(send), AsPtr(recv), counts, ParseDataType(dt),
                             ParseReduceOp(op)));
  }
  // The fused path the operations layer runs: pack every tensor into one
  // device buffer with prescale, one allreduce, unpack with postscale (and
  // 1/size for Average).
  void FusedAllreduce(std::vector<uintptr_t> srcs, std::vector<uintptr_t> dsts,
                      std::vector<size_t> counts, const std::string& dt_name,
                      const std::string& op_name, double prescale, double postscale) {
    DataType dt = ParseDataType(dt_name);
    ReduceOp op = ParseReduceOp(op_name);
    const size_t es = DataTypeSize(dt);
    std::vector<CopySpan> pack, unpack;
    size_t offset = 0;
    for (size_t i = 0; i < counts.size(); ++i) offset = AlignFusionOffset(offset + counts[i] * es);
    fusion_.Reserve(comm_->device(), offset).ThrowIfError();
    offset = 0;
    for (size_t i = 0; i < counts.size(); ++i) {
      char* slot = static_cast<char*>(fusion_.data()) + offset;
      pack.push_back(CopySpan{AsPtr(srcs[i]), slot, counts[i]});
      unpack.push_back(CopySpan{slot, AsPtr(dsts[i]), counts[i]});
      offset = AlignFusionOffset(offset + counts[i] * es);
    }
    const size_t elements = offset / es;  // alignment padding is reduced too (harmless)
    DeviceGuard guard(Cuda(), comm_->device());
    guard.status().ThrowIfError();
    // Average: 1/size folded into the postscale, or an exact division for integers.
    const int64_t divisor = op == ReduceOp::kAverage && !IsFloating(dt) ? comm_->size() : 1;
    if (op == ReduceOp::kAverage && IsFloating(dt)) postscale /= comm_->size();
    PackFusion(pack, dt, prescale, comm_->stream()).ThrowIfError();
    comm_->Allreduce(fusion_.data(), fusion_.data(), elements, dt,
                     op == ReduceOp::kAverage ? ReduceOp::kSum : op)
        .ThrowIfError();
    Run(UnpackFusion(unpack, dt, postscale, comm_->stream(), divisor));
  }

 private:
  void Run(const Status& s) {
    s.ThrowIfError();
    comm_->RecordDone(done_).ThrowIfError();
    nb::gil_scoped_release nogil;
    done_.Synchronize().ThrowIfError();
    comm_->CheckAsyncError().ThrowIfError();
  }

  std::unique_ptr<NcclCommunicator> comm_;
  Event done_;
  DeviceBuffer fusion_;
};
#endif

}  // namespace

void RegisterPythonBindings(nb::module_& m) {
#ifdef SDL_HAVE_CUDA
  AddPythonSearchRoots();  // no library is loaded until first use
#endif
  m.def(
      "gpu_runtime_info",
      [] {
        nb::dict d;
#ifdef SDL_HAVE_CUDA
        AddPythonSearchRoots();
        const CudaAvailability& c = QueryCuda();
        d["cuda_built"] = true;
        d["cuda_usable"] = c.usable;
        d["cuda_reason"] = c.reason;
        d["cuda_library"] = c.library;
        d["cuda_runtime_version"] = c.runtime_version;
        d["cuda_driver_version"] = c.driver_version;
        d["device_count"] = c.device_count;
        d["cuda_architectures"] = KernelArchitectures();
#else
        d["cuda_built"] = false;
        d["cuda_usable"] = false;
        d["cuda_reason"] = "spark_dl was built without CUDA: " SDL_CUDA_BUILD_NOTE;
        d["cuda_library"] = "";
        d["cuda_runtime_version"] = 0;
        d["cuda_driver_version"] = 0;
        d["device_count"] = 0;
        d["cuda_architectures"] = "";
#endif
#ifdef SDL_HAVE_NCCL
        const NcclAvailability& n = QueryNccl();
        d["nccl_built"] = true;
        d["nccl_usable"] = n.usable;
        d["nccl_reason"] = n.reason;
        d["nccl_library"] = n.library;
        d["nccl_version"] = n.version;
#else
        d["nccl_built"] = false;
        d["nccl_usable"] = false;
        d["nccl_reason"] = "spark_dl was built without NCCL: " SDL_NCCL_BUILD_NOTE;
        d["nccl_library"] = "";
        d["nccl_version"] = 0;
#endif
        return d;
      },
      "Whether CUDA and NCCL can be used by this process: {cuda_usable, cuda_reason, "
      "nccl_usable, nccl_reason, device_count, the libraries loaded and their versions}. "
      "Loads the libraries on first call (dlopen); cheap after that.");

#ifdef SDL_HAVE_CUDA
  // ---- TEST ONLY below: raw pointers as integers, no API guarantees. ----
  m.def(
      "_gpu_test_open_library",
      [](const std::string& what, std::vector<std::string> sonames,
         std::vector<std::string> subdir_globs, std::vector<std::string> fixed_dirs) {
        LibrarySearch s{std::move(sonames), std::move(subdir_globs), std::move(fixed_dirs)};
        std::string error;
        DynLib lib = OpenLibrary(what.c_str(), s, &error);
        std::optional<std::string> path;
        if (lib.loaded()) path = lib.path;
        return std::make_tuple(path, error);
      },
      "TEST ONLY: the library loader on arbitrary names -> (path or None, error).");
  m.def(
      "_gpu_test_plan_batches",
      [](std::vector<uint64_t> counts, size_t elem_size) {
        // Entry i gets src == i so each chunk can name the span it came from.
        std::vector<CopySpan> spans;
        for (size_t i = 0; i < counts.size(); ++i)
          spans.push_back(CopySpan{reinterpret_cast<const void*>(static_cast<uintptr_t>(i)),
                                   nullptr, static_cast<size_t>(counts[i])});
        nb::list launches;
        for (const BatchParams& p : PlanBatches(spans, elem_size, 1.0)) {
          nb::list chunks;
          for (uint32_t c = 0; c < p.chunk_begin[p.num_entries]; ++c) {
            int e;
            uint64_t b, en;
            ChunkRange(p, c, &e, &b, &en);
            chunks.append(nb::make_tuple(reinterpret_cast<uintptr_t>(p.entries[e].src), b, en));
          }
          launches.append(nb::make_tuple(p.num_entries, p.chunk_elems, GridFor(p, 1u << 30),
                                         chunks));
        }
        return launches;
      },
      "TEST ONLY: how a batched copy of spans with these element counts is cut into "
      "launches -> [(entries, chunk_elems, grid, [(span, begin, end) per chunk])].");
  m.def(
      "_gpu_selftest_scaled_copy",
      [](std::vector<uintptr_t> srcs, std::vector<uintptr_t> dsts, std::vector<size_t> counts,
         const std::string& dtype, double scale, int device, int64_t divisor) {
        if (srcs.size() != dsts.size() || srcs.size() != counts.size())
          throw Error(ErrorCode::kInvalidArgument, "srcs, dsts and counts differ in length");
        std::vector<CopySpan> spans;
        for (size_t i = 0; i < srcs.size(); ++i)
          spans.push_back(CopySpan{AsPtr(srcs[i]), AsPtr(dsts[i]), counts[i]});
        std::string error;
        const CudaApi* api = Cuda(&error);
        if (!api) throw Error(ErrorCode::kInvalidArgument, error);
        DeviceGuard guard(api, device);
        guard.status().ThrowIfError();
        Stream stream;
        Stream::Create(device, 0, &stream).ThrowIfError();
        BatchedScaledCopy(spans, ParseDataType(dtype), scale, stream.get(), divisor)
            .ThrowIfError();
        nb::gil_scoped_release nogil;
        stream.Synchronize().ThrowIfError();
      },
      "srcs"_a, "dsts"_a, "counts"_a, "dtype"_a, "scale"_a, "device"_a, "divisor"_a = 1,
      "TEST ONLY: dst = src scaled (integers / divisor, then * scale; src 0 writes zeros) "
      "for device pointers (ints) with one batched kernel "
      "launch per 128 spans on a private stream, synchronized before returning. The caller "
      "synchronizes its own stream first.");
  m.def(
      "cuda_pack_for_tests",
      [](nb::list tensors, nb::handle buffer, bool unpack, double scale, uintptr_t stream) {
        // The name and form benchmarks/gpu.py expects. Tensors lie back to back
        // in `buffer` (no padding); nothing is synchronized.
        CudaArrayView buf = ViewOf(buffer);
        std::vector<CopySpan> spans;
        spans.reserve(tensors.size());
        std::string dtype;
        size_t offset = 0;
        for (nb::handle t : tensors) {
          CudaArrayView v = ViewOf(t);
          if (dtype.empty()) dtype = v.dtype;
          if (v.dtype != dtype)
            throw Error(ErrorCode::kInvalidArgument,
                        "cuda_pack_for_tests: tensors of " + dtype + " and " + v.dtype);
          char* slot = reinterpret_cast<char*>(buf.ptr) + offset;
          spans.push_back(unpack ? CopySpan{slot, AsPtr(v.ptr), v.bytes}
                                 : CopySpan{AsPtr(v.ptr), slot, v.bytes});
          offset += v.bytes;
        }
        if (offset > buf.bytes)
          throw Error(ErrorCode::kInvalidArgument,
                      "cuda_pack_for_tests: the tensors hold " + std::to_string(offset) +
                          " bytes, the buffer " + std::to_string(buf.bytes));
        if (spans.empty()) return;
        // Counts so far are bytes; a scaled copy needs elements of the dtype.
        DataType dt = DataType::kUInt8;
        if (scale != 1.0) {
          dt = ParseDataType(dtype);
          for (auto& s : spans) s.count /= DataTypeSize(dt);
        }
        int device = -1;
        PointerDevice(AsPtr(buf.ptr), &device).ThrowIfError();
        if (device < 0)
          throw Error(ErrorCode::kInvalidArgument, "cuda_pack_for_tests: buffer is not on a GPU");
        std::string error;
        const CudaApi* api = Cuda(&error);
        DeviceGuard guard(api, device);
        guard.status().ThrowIfError();
        BatchedScaledCopy(spans, dt, scale, reinterpret_cast<cudaStream_t>(stream))
            .ThrowIfError();
      },
      "tensors"_a, "buffer"_a, "unpack"_a, "scale"_a = 1.0, "stream"_a = 0,
      "TEST ONLY (benchmarks/gpu.py): pack CUDA tensors back to back into `buffer` "
      "(unpack=False) or unpack it into them, times `scale`, in batched kernel launches "
      "enqueued on `stream` (a cudaStream_t as int; 0: the legacy default stream, torch's "
      "current stream unless one was set). Returns without synchronizing.");
#endif
#ifdef SDL_HAVE_NCCL
  nb::class_<SelftestNccl>(m, "_GpuSelftestNccl",
                           "TEST ONLY: an NCCL communicator over raw device pointers.")
      .def(nb::init<int, int, int, nb::object, double>(), "device"_a, "rank"_a = 0,
           "size"_a = 1, "exchange"_a = nb::none(), "timeout_s"_a = 60.0)
      .def("allreduce", &SelftestNccl::Allreduce)
      .def("allgather", &SelftestNccl::Allgather)
      .def("broadcast", &SelftestNccl::Broadcast)
      .def("alltoall", &SelftestNccl::Alltoall)
      .def("reducescatter", &SelftestNccl::Reducescatter)
      .def("fused_allreduce", &SelftestNccl::FusedAllreduce);
#endif
}

}  // namespace gpu
}  // namespace sdl
