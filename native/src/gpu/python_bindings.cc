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
    if (op == ReduceOp::kAverage) postscale /= comm_->size();
    PackFusion(pack, dt, prescale, comm_->stream()).ThrowIfError();
    comm_->Allreduce(fusion_.data(), fusion_.data(), elements, dt,
                     op == ReduceOp::kAverage ? ReduceOp::kSum : op)
        .ThrowIfError();
    Run(UnpackFusion(unpack, dt, postscale, comm_->stream()));
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
         const std::string& dtype, double scale, int device) {
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
        BatchedScaledCopy(spans, ParseDataType(dtype), scale, stream.get()).ThrowIfError();
        nb::gil_scoped_release nogil;
        stream.Synchronize().ThrowIfError();
      },
      "srcs"_a, "dsts"_a, "counts"_a, "dtype"_a, "scale"_a, "device"_a,
      "TEST ONLY: dst = src * scale for device pointers (ints) with one batched kernel "
      "launch per 128 spans on a private stream, synchronized before returning. The caller "
      "synchronizes its own stream first.");
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
