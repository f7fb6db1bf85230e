// spark_dl._core: the Python extension over the runtime. Tensors cross as
// DLPack (zero copy); nothing here knows any framework.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <memory>
#include <mutex>

#include <gloo/rendezvous/store.h>

#include "common/config.h"
#include "core/runtime.h"
#include "gpu/python_bindings.h"
#include "ops/operations.h"
#ifdef SDL_HAVE_CUDA
#include "gpu/cuda_api.h"
#endif
#ifdef SDL_HAVE_NCCL
#include "ops/nccl_backend.h"
#endif
#ifdef SDL_HAVE_MPI
#include "comm/mpi_comm.h"
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace sdl {
namespace {

PyObject* g_core_error = nullptr;
// Shared so that a thread inside wait() keeps the runtime alive while
// another thread shuts it down (the wait then fails with the stop message).
std::shared_ptr<Runtime> g_runtime;
std::mutex g_mu;
int g_epoch = 0;
bool g_shut_down = false;

// Rendezvous store backed by a Python object with set(key, bytes) and
// get(key, timeout_s) -> bytes (spark_dl.common.basics adapts the runner's
// authenticated KV client to it). Called only from threads that may take the GIL.
class PyStore : public gloo::rendezvous::Store {
 public:
  explicit PyStore(nb::object obj) : obj_(std::move(obj)) {}
  ~PyStore() override {
    nb::gil_scoped_acquire gil;
    obj_.reset();
  }
  void set(const std::string& key, const std::vector<char>& data) override {
    nb::gil_scoped_acquire gil;
    obj_.attr("set")(key, nb::bytes(data.data(), data.size()));
  }
  std::vector<char> get(const std::string& key) override {
    nb::gil_scoped_acquire gil;
    nb::bytes b = nb::cast<nb::bytes>(obj_.attr("get")(key, timeout_s_));
    const char* p = b.c_str();
    return std::vector<char>(p, p + b.size());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, std::chrono::milliseconds(0)); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    if (timeout.count() > 0) timeout_s_ = timeout.count() / 1000.0;
    nb::gil_scoped_acquire gil;
    for (const auto& k : keys) obj_.attr("get")(k, timeout_s_);
  }

 private:
  nb::object obj_;
  double timeout_s_ = 120.0;
};

Runtime& Rt() {
  if (!g_runtime)
    throw Error(ErrorCode::kNotInitialized,
                g_shut_down ? "spark_dl has been shut down; call init() again to use it"
                            : "spark_dl is not initialized; call init() first");
  return *g_runtime;
}

std::shared_ptr<Runtime> RtShared() {
  Rt();  // throws the not-initialized error
  return g_runtime;
}

DataType FromDLPack(nb::dlpack::dtype t) {
  using C = nb::dlpack::dtype_code;
  auto code = static_cast<C>(t.code);
  if (t.lanes == 1) {
    if (code == C::Int && t.bits == 8) return DataType::kInt8;
    if (code == C::Int && t.bits == 16) return DataType::kInt16;
    if (code == C::Int && t.bits == 32) return DataType::kInt32;
    if (code == C::Int && t.bits == 64) return DataType::kInt64;
    if (code == C::UInt && t.bits == 8) return DataType::kUInt8;
    if (code == C::UInt && t.bits == 16) return DataType::kUInt16;
    if (code == C::Float && t.bits == 16) return DataType::kFloat16;
    if (code == C::Float && t.bits == 32) return DataType::kFloat32;
    if (code == C::Float && t.bits == 64) return DataType::kFloat64;
    if (code == C::Bfloat && t.bits == 16) return DataType::kBFloat16;
    if (code == C::Bool && t.bits == 8) return DataType::kBool;
  }
  throw Error(ErrorCode::kInvalidArgument,
              "unsupported tensor dtype (DLPack code " + std::to_string(t.code) + ", " +
                  std::to_string(t.bits) + " bits); supported: uint8, int8, uint16, int16, "
                  "int32, int64, float16, bfloat16, float32, float64, bool");
}

nb::dlpack::dtype ToDLPack(DataType dt) {
  using C = nb::dlpack::dtype_code;
  nb::dlpack::dtype t;
  t.lanes = 1;
  t.bits = static_cast<uint8_t>(DataTypeSize(dt) * 8);
  switch (dt) {
    case DataType::kInt8: case DataType::kInt16: case DataType::kInt32: case DataType::kInt64:
      t.code = static_cast<uint8_t>(C::Int); break;
    case DataType::kUInt8: case DataType::kUInt16: case DataType::kUInt64: t.code = static_cast<uint8_t>(C::UInt); break;
    case DataType::kFloat16: case DataType::kFloat32: case DataType::kFloat64:
      t.code = static_cast<uint8_t>(C::Float); break;
    case DataType::kBFloat16: t.code = static_cast<uint8_t>(C::Bfloat); break;
    case DataType::kBool: t.code = static_cast<uint8_t>(C::Bool); break;
  }
  return t;
}

// The tensor's device from its DLPack capsule. Whether some backend can run an
// operation on it is decided by the core's operations layer at enqueue, not here.
template <typename A>
Device DeviceOf(const A& a, const std::string& name, const char* what) {
  switch (a.device_type()) {
    case nb::device::cpu::value: return Device{DeviceType::kCPU, 0};
    case nb::device::cuda::value: return Device{DeviceType::kCUDA, a.device_id()};
    case nb::device::cuda_host::value: return Device{DeviceType::kCUDAHost, 0};
    default:
      throw Error(ErrorCode::kInvalidArgument,
                  std::string(what) + " of '" + name + "' is on an unsupported device (DLPack "
                  "device type " + std::to_string(a.device_type()) + "); spark_dl runs CPU and "
                  "CUDA tensors");
  }
}

template <typename A>
void CheckTensor(const A& a, const std::string& name, const char* what) {
  if (a.size() == 0) return;  // empty tensors have no layout to get wrong
  int64_t expect = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) > 1 && a.stride(i) != expect)
      throw Error(ErrorCode::kInvalidArgument,
                  std::string(what) + " of '" + name + "' is not C-contiguous; make a contiguous copy");
    expect *= static_cast<int64_t>(a.shape(i));
  }
}

nb::object ToArray(const std::shared_ptr<Buffer>& buf) {
  auto* keep = new std::shared_ptr<Buffer>(buf);
  nb::capsule owner(keep, [](void* p) noexcept { delete static_cast<std::shared_ptr<Buffer>*>(p); });
  std::vector<size_t> shape(buf->shape.begin(), buf->shape.end());
  static char empty[8];
  void* data = buf->data ? buf->data.get() : empty;
  const int32_t device_type = buf->device.type == DeviceType::kCUDA ? nb::device::cuda::value
                              : buf->device.type == DeviceType::kCUDAHost
                                  ? nb::device::cuda_host::value
                                  : nb::device::cpu::value;
  nb::ndarray<> arr(data, shape.size(), shape.data(), owner, nullptr, ToDLPack(buf->dtype),
                    device_type, buf->device.index);
  return nb::cast(arr);
}

// Host memory that claims to be CUDA memory: the backend choice only asks a
// memory for its type, so the choice can be checked without a GPU.
class FakeCudaMemory : public HostMemory {
 public:
  DeviceType type() const override { return DeviceType::kCUDA; }
};

bool g_fake_nccl_usable = false;

std::string OpsBackendChoiceForTests(int op, int dtype, int reduce, int device_type,
                                     bool nccl_usable) {
  Operations ops;
  ops.AddDeviceMemory(std::make_unique<FakeCudaMemory>());
#ifdef SDL_HAVE_NCCL
  g_fake_nccl_usable = nccl_usable;
  ops.AddBackend(kPriorityDevice, std::make_unique<NcclBackend>(
                                      nullptr, gpu::NcclOptions(), [] { return g_fake_nccl_usable; }));
#else
  (void)nccl_usable;
  (void)g_fake_nccl_usable;
#endif
  Response r;
  r.op = static_cast<OpType>(op);
  r.dtype = static_cast<DataType>(dtype);
  r.reduce = static_cast<ReduceOp>(reduce);
  const Device d{static_cast<DeviceType>(device_type), 0};
  r.device = MemoryKind(d);
  r.names = {"t"};
  r.shapes = {{4}};
  OpBackend* b = ops.Choose(r, d);
  return b ? b->name() : "";
}

int64_t Enqueue(int op, const std::string& name, std::optional<nb::ndarray<nb::ro>> input,
                std::optional<nb::ndarray<>> output, int32_t process_set, int reduce,
                double prescale, double postscale, int32_t root, std::vector<int64_t> splits,
                std::string group, int32_t group_size, bool core_output, uintptr_t stream) {
  Runtime& rt = Rt();
  Request req;
  req.op = static_cast<OpType>(op);
  req.name = name;
  req.reduce = static_cast<ReduceOp>(reduce);
  req.prescale = prescale;
  req.postscale = postscale;
  req.root = root;
  req.splits = std::move(splits);
  req.group = std::move(group);
  req.group_size = group_size;
  const void* in = nullptr;
  void* out = nullptr;
  if (input) {
    CheckTensor(*input, name, "input");
    req.device = DeviceOf(*input, name, "input");
    req.dtype = FromDLPack(input->dtype());
    for (size_t i = 0; i < input->ndim(); ++i) req.shape.push_back(static_cast<int64_t>(input->shape(i)));
    in = input->data();
  }
  if (output) {
    CheckTensor(*output, name, "output");
    Device out_device = DeviceOf(*output, name, "output");
    if (input && out_device != req.device)
      throw Error(ErrorCode::kInvalidArgument,
                  "output of '" + name + "' is on " + DeviceName(out_device) +
                      " but its input is on " + DeviceName(req.device) +
                      "; pass an output on the input's device");
    if (FromDLPack(output->dtype()) != req.dtype || output->size() != (input ? input->size() : 0))
      throw Error(ErrorCode::kInvalidArgument,
                  "output of '" + name + "' must have the input's dtype and number of elements");
    out = output->data();
  }
  nb::gil_scoped_release nogil;
  return rt.Enqueue(process_set, std::move(req), in, out, core_output, stream);
}

// A batch of operations of one kind on caller memory given by address: one
// call and one wake-up for a step's tensors. The bindings pass addresses they
// read from their framework (torch's data_ptr()) after checking what the
// DLPack path checks (CPU, C-contiguous, supported dtype), and keep the
// tensors alive until the handles are taken: exporting a DLPack capsule costs
// a few microseconds per torch tensor, more than the rest of the enqueue.
// out_addrs[i] == 0 asks the core to allocate that allreduce's output.
// device_type/device_index (DeviceType codes): where every tensor of the batch
// lives; stream: the framework's stream of device tensors (DLPack's numbering),
// one for the batch (a step's gradients, handed over together by one thread).
int64_t EnqueueMany(int op, const std::vector<std::string>& names,
                    const std::vector<uintptr_t>& in_addrs, const std::vector<uintptr_t>& out_addrs,
                    const std::vector<std::vector<int64_t>>& shapes, const std::vector<int>& dtypes,
                    int32_t process_set, int reduce, double prescale, double postscale,
                    int32_t root, const std::string& group, int32_t group_size,
                    int device_type, int32_t device_index, uintptr_t stream) {
  Runtime& rt = Rt();
  if (device_type != static_cast<int>(DeviceType::kCPU) &&
      device_type != static_cast<int>(DeviceType::kCUDA))
    throw Error(ErrorCode::kInvalidArgument,
                "enqueue_many: bad device type code " + std::to_string(device_type));
  const Device device{static_cast<DeviceType>(device_type),
                      device_type == static_cast<int>(DeviceType::kCPU) ? 0 : device_index};
  const size_t n = names.size();
  if (in_addrs.size() != n || out_addrs.size() != n || shapes.size() != n || dtypes.size() != n)
    throw Error(ErrorCode::kInvalidArgument,
                "enqueue_many: names, addresses, shapes and dtypes must have one entry per tensor");
  std::vector<Runtime::Submission> subs(n);
  for (size_t i = 0; i < n; ++i) {
    if (dtypes[i] < 0 || dtypes[i] > static_cast<int>(DataType::kBool))
      throw Error(ErrorCode::kInvalidArgument, "enqueue_many: bad dtype code for '" + names[i] + "'");
    Request& req = subs[i].req;
    req.op = static_cast<OpType>(op);
    req.name = names[i];
    req.dtype = static_cast<DataType>(dtypes[i]);
    req.reduce = static_cast<ReduceOp>(reduce);
    req.prescale = prescale;
    req.postscale = postscale;
    req.root = root;
    req.shape = shapes[i];
    req.group = group;
    req.group_size = group_size;
    req.device = device;
    subs[i].in = reinterpret_cast<const void*>(in_addrs[i]);
    subs[i].out = reinterpret_cast<void*>(out_addrs[i]);
    subs[i].core_output = out_addrs[i] == 0 && req.op == OpType::kAllreduce;
    subs[i].stream = device.host() ? 0 : stream;
  }
  nb::gil_scoped_release nogil;
  return rt.EnqueueMany(process_set, std::move(subs));
}

// Waits in slices without the GIL, checking for signals between them, so that
// Ctrl-C and pytest-timeout's alarm interrupt a stuck collective (the handles
// stay pending).
bool WaitRange(int64_t first, int64_t n, double timeout_s) {
  std::shared_ptr<Runtime> keep = RtShared();
  Runtime& rt = *keep;
  constexpr double kSliceS = 0.05;
  const auto start = std::chrono::steady_clock::now();
  while (true) {
    double slice = kSliceS;
    if (timeout_s >= 0) {
      double left = timeout_s - std::chrono::duration<double>(
                                    std::chrono::steady_clock::now() - start).count();
      if (left <= 0) return rt.handles().WaitRange(first, n, 0.0);
      slice = std::min(slice, left);
    }
    bool done;
    {
      nb::gil_scoped_release nogil;
      done = rt.WaitRange(first, n, slice);  // may run this rank's cycles meanwhile
    }
    if (done) return true;
    if (PyErr_CheckSignals() != 0) throw nb::python_error();
  }
}

// The results of [first, first + n): (failures, outputs). failures lists
// (index, code, message) of the operations that failed; outputs is None when
// no operation returned buffers (in-place allreduces), else one list of
// DLPack tensors per operation.
nb::tuple TakeRange(int64_t first, int64_t n) {
  std::vector<Result> results = Rt().handles().TakeRange(first, n);
  nb::list failures;
  bool any_output = false;
  for (size_t i = 0; i < results.size(); ++i) {
    if (results[i].code != ErrorCode::kOk)
      failures.append(nb::make_tuple(i, static_cast<int>(results[i].code), results[i].message));
    any_output |= !results[i].outputs.empty();
  }
  nb::object outputs = nb::none();
  if (any_output) {
    nb::list all;
    for (Result& r : results) {
      nb::list outs;
      for (auto& b : r.outputs) outs.append(ToArray(b));
      all.append(outs);
    }
    outputs = all;
  }
  return nb::make_tuple(failures, outputs);
}

nb::tuple Take(int64_t h) {
  Result r = Rt().handles().Take(h);
  nb::list outs;
  for (auto& b : r.outputs) outs.append(ToArray(b));
  nb::list ints;
  for (int64_t v : r.ints) ints.append(v);
  return nb::make_tuple(static_cast<int>(r.code), r.message, outs, ints);
}

void TranslateErrors(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const Error& e) {
    nb::object args = nb::make_tuple(static_cast<int>(e.code), e.what());
    PyErr_SetObject(g_core_error, args.ptr());
  } catch (const std::invalid_argument& e) {
    nb::object args = nb::make_tuple(static_cast<int>(ErrorCode::kInvalidArgument), e.what());
    PyErr_SetObject(g_core_error, args.ptr());
  }
}

}  // namespace
}  // namespace sdl

#ifndef SDL_MODULE_NAME
#define SDL_MODULE_NAME _core
#endif
NB_MODULE(SDL_MODULE_NAME, m) {
  using namespace sdl;
  m.doc() = "spark_dl native collective core (use spark_dl.common, not this module)";
  g_core_error = PyErr_NewException("spark_dl._core.CoreError", PyExc_RuntimeError, nullptr);
  m.attr("CoreError") = nb::handle(g_core_error);
  nb::register_exception_translator(TranslateErrors);

  // Enumerations the Python layer uses, exported so no copy is kept by hand.
  nb::dict reduce_ops, op_types, error_codes, dtypes;
  for (ReduceOp r : {ReduceOp::kAverage, ReduceOp::kSum, ReduceOp::kMin, ReduceOp::kMax,
                     ReduceOp::kProduct})
    reduce_ops[ReduceOpName(r)] = static_cast<int>(r);
  for (OpType o : {OpType::kAllreduce, OpType::kAllgather, OpType::kBroadcast, OpType::kAlltoall,
                   OpType::kReducescatter, OpType::kBarrier, OpType::kJoin})
    op_types[OpTypeName(o)] = static_cast<int>(o);
  const std::pair<const char*, ErrorCode> codes[] = {
      {"ok", ErrorCode::kOk}, {"invalid_argument", ErrorCode::kInvalidArgument},
      {"mismatch", ErrorCode::kMismatch}, {"peer_failure", ErrorCode::kPeerFailure},
      {"shutdown", ErrorCode::kShutdown}, {"not_initialized", ErrorCode::kNotInitialized},
      {"duplicate_name", ErrorCode::kDuplicateName}, {"timeout", ErrorCode::kTimeout}};
  for (auto& [n, c] : codes) error_codes[n] = static_cast<int>(c);
  for (DataType d : {DataType::kUInt8, DataType::kInt8, DataType::kUInt16, DataType::kInt16,
                     DataType::kInt32,
                     DataType::kInt64, DataType::kFloat16, DataType::kBFloat16,
                     DataType::kFloat32, DataType::kFloat64, DataType::kBool})
    dtypes[DataTypeName(d)] = static_cast<int>(d);
  m.attr("DTYPES") = dtypes;
  m.attr("REDUCE_OPS") = reduce_ops;
  m.attr("OP_TYPES") = op_types;
  m.attr("ERROR_CODES") = error_codes;

  m.def("knob_table", [] {
    nb::list out;
    for (const KnobInfo& k : KnobTable()) {
      nb::dict d;
      d["name"] = k.field;
      d["env"] = k.env;
      d["type"] = k.type;
      d["default"] = k.default_value;
      d["tunable"] = k.tunable;
      d["doc"] = k.doc;
      d["choices"] = k.choices;
      d["fallback_env"] = k.fallback_env;
      out.append(d);
    }
    return out;
  });
  // The C++ side of the value grammar, so tests can check that both sides agree.
  m.def(
      "parse_knob",
      [](const std::string& name, const std::string& text) {
        try {
          return ParseKnob(name, text);
        } catch (const std::invalid_argument& e) {
          throw nb::value_error(e.what());  // as the Python parser raises
        }
      },
      "name"_a, "text"_a,
        "The value of knob `name` (field or variable) for `text`, parsed by the core; "
        "ValueError naming the variable when it does not parse.");
  m.def("build_info", [] {
    nb::dict d;
    d["gloo"] = true;
#ifdef SDL_HAVE_MPI
    d["mpi"] = true;
#else
    d["mpi"] = false;
#endif
#ifdef SDL_HAVE_NCCL
    d["nccl"] = true;
#else
    d["nccl"] = false;
#endif
#ifdef SDL_HAVE_CUDA
    d["cuda"] = true;  // compiled in; gpu_runtime_info() tells whether usable here
#else
    d["cuda"] = false;
#endif
    d["shm"] = true;
    return d;
  });

  m.def("cuda_usable", [] {
#ifdef SDL_HAVE_CUDA
    return gpu::QueryCuda().usable;  // then the operations layer has CUDA memory registered
#else
    return false;
#endif
  }, "Whether the core takes CUDA tensors in this process (built with CUDA, a runtime and a "
     "device present).");
  m.def("_ops_backend_choice_for_tests", &OpsBackendChoiceForTests, "op"_a, "dtype"_a,
        "reduce"_a, "device_type"_a, "nccl_usable"_a,
        "Test only: the backend name the operations layer of this build picks for a one-tensor "
        "response on a device of type device_type (as DeviceType), with CUDA memory faked by "
        "host memory and NCCL's usability given (the real NCCL backend class decides).");

  gpu::RegisterPythonBindings(m);  // gpu_runtime_info() and test-only _gpu_* entries

  m.def(
      "init",
      [](int rank, int size, int local_rank, int local_size, int cross_rank, int cross_size,
         const std::string& hostname, nb::object store,
         std::vector<std::vector<int32_t>> process_sets, std::map<std::string, std::string> knobs,
         bool use_mpi, intptr_t mpi_comm_addr, std::vector<int32_t> mpi_ranks, int epoch) {
        std::lock_guard<std::mutex> lk(g_mu);
        if (g_runtime) return false;  // already initialized: init() is idempotent
        RuntimeOptions o;
        o.topo = {rank, size, local_rank, local_size, cross_rank, cross_size};
        o.hostname = hostname;
        if (!store.is_none()) o.store = std::make_shared<PyStore>(store);
        // Successive init()s of one process meet in their own store namespace; an
        // elastic job names it (its generation), so that ranks that joined later meet
        // the ones that re-initialized.
        if (epoch >= 0) g_epoch = epoch;
        o.epoch = g_epoch++;
        o.process_sets = std::move(process_sets);
        o.config = Config::FromEnv();
        for (auto& [k, v] : knobs) o.config.Set(k, v);
        o.use_mpi = use_mpi;
        o.mpi_comm_addr = mpi_comm_addr;
        o.mpi_ranks = std::move(mpi_ranks);
        g_runtime = std::make_shared<Runtime>(std::move(o));
        g_shut_down = false;
        return true;
      },
      "rank"_a, "size"_a, "local_rank"_a, "local_size"_a, "cross_rank"_a, "cross_size"_a,
      "hostname"_a, "store"_a.none(), "process_sets"_a, "knobs"_a, "use_mpi"_a = false,
      "mpi_comm_addr"_a = 0, "mpi_ranks"_a = std::vector<int32_t>(), "epoch"_a = -1);
  m.def("mpi_threads_supported", [] {
#ifdef SDL_HAVE_MPI
    return MpiThreadsSupported();
#else
    return false;
#endif
  });
  m.def("mpi_finalize", [] {
#ifdef SDL_HAVE_MPI
    MpiFinalizeIfOwned();
#endif
  });
  m.def("shutdown", [] {
    std::shared_ptr<Runtime> rt;
    {
      std::lock_guard<std::mutex> lk(g_mu);
      rt = std::move(g_runtime);
      if (rt) g_shut_down = true;
    }
    if (rt) {
      nb::gil_scoped_release nogil;
      rt->Shutdown();  // a waiting thread may hold the last reference
      rt.reset();
    }
  });
  m.def("is_initialized", [] { return static_cast<bool>(g_runtime); });
  m.def("topology", [] {
    const Topology& t = Rt().topology();
    nb::dict d;
    d["rank"] = t.rank;
    d["size"] = t.size;
    d["local_rank"] = t.local_rank;
    d["local_size"] = t.local_size;
    d["cross_rank"] = t.cross_rank;
    d["cross_size"] = t.cross_size;
    return d;
  });
  m.def("enqueue", &Enqueue, "op"_a, "name"_a, "input"_a.none(), "output"_a.none(),
        "process_set"_a = 0, "reduce"_a = 1, "prescale"_a = 1.0, "postscale"_a = 1.0,
        "root"_a = 0, "splits"_a = std::vector<int64_t>(), "group"_a = "", "group_size"_a = 0,
        "core_output"_a = false, "stream"_a = 0);
  // A writable NumPy array over a DLPack capsule from take(), without a copy
  // (numpy.from_dlpack marks arrays from unversioned capsules read-only).
  m.def(
      "to_numpy",
      [](nb::ndarray<> a) {
        auto* keep = new nb::ndarray<>(a);  // holds the capsule's memory while NumPy uses it
        nb::capsule owner(keep, [](void* p) noexcept { delete static_cast<nb::ndarray<>*>(p); });
        std::vector<size_t> shape(a.ndim());
        for (size_t i = 0; i < a.ndim(); ++i) shape[i] = a.shape(i);
        return nb::ndarray<nb::numpy>(a.data(), a.ndim(), shape.data(), owner, nullptr, a.dtype(),
                                      nb::device::cpu::value);
      },
      "capsule"_a);
  m.def("poll", [](int64_t h) { return Rt().handles().Poll(h); });
  m.def("wait", [](int64_t h, double timeout_s) { return WaitRange(h, 1, timeout_s); },
        "handle"_a, "timeout_s"_a = -1.0);
  m.def("wait_range", &WaitRange, "first"_a, "count"_a, "timeout_s"_a = -1.0);
  m.def("take_range", &TakeRange, "first"_a, "count"_a);
  m.def("enqueue_many", &EnqueueMany, "op"_a, "names"_a, "in_addrs"_a, "out_addrs"_a, "shapes"_a,
        "dtypes"_a, "process_set"_a = 0, "reduce"_a = 1, "prescale"_a = 1.0, "postscale"_a = 1.0,
        "root"_a = 0, "group"_a = "", "group_size"_a = 0, "device_type"_a = 0,
        "device_index"_a = 0, "stream"_a = 0);
  m.def("take", &Take);
  m.def("add_process_set", [](std::vector<int32_t> ranks) { return Rt().AddProcessSet(std::move(ranks)); });
  m.def("remove_process_set", [](int32_t id) { return Rt().RemoveProcessSet(id); });
  m.def("process_set_ranks", [](int32_t id) { return Rt().ProcessSetRanks(id); });
  m.def("process_set_ids", [] { return Rt().ProcessSetIds(); });
  m.def("transport", [](int32_t id) { return Rt().TransportOf(id); }, "process_set"_a = 0);
  m.def("counters", [] {
    Counters& c = Rt().counters();
    std::map<std::string, int64_t> d{
        {"cycles", c.cycles}, {"inline_cycles", c.inline_cycles},
        {"full_negotiations", c.full_negotiations},
        {"cache_hits", c.cache_hits}, {"negotiated", c.negotiated},
        {"collectives", c.collectives}, {"fused_tensors", c.fused_tensors},
        {"tensors", c.tensors}, {"bytes", c.bytes}};
    for (auto& [k, v] : Rt().operations().Counters()) d[k] = v;
    if (Timeline* t = Rt().timeline()) {  // rank 0: the current or last timeline session
      d["timeline_records"] = t->written();
      d["timeline_dropped"] = t->dropped();
    }
    return d;
  });
  m.def("autotune_state", [] {
    // (applied, world cycles, changes); spark_dl.common.basics.autotune_state() names the fields.
    using Params = std::tuple<uint64_t, int64_t, double, bool, bool, bool, bool>;
    auto row = [](const TunedParams& p) {
      return Params(p.serial, p.fusion_threshold, p.cycle_time_ms, p.response_cache,
                    p.hierarchical, p.tune_hierarchical, p.done);
    };
    Controller::TunedHistory h = Rt().autotune_state();
    std::vector<std::pair<int64_t, Params>> changes;
    for (auto& [cycle, p] : h.changes) changes.emplace_back(cycle, row(p));
    return std::make_tuple(row(h.applied), h.world_cycles, changes);
  });
  m.def("flight_recorder", [] {
    // The records as tuples; spark_dl.common.basics.flight_recorder() names the fields.
    using Row = std::tuple<uint64_t, std::string, std::string, std::string, std::vector<int64_t>,
                           int32_t, double, double, double, double, bool, int>;
    std::vector<Row> out;
    for (const FlightRecord& r : Rt().flight_recorder().Snapshot())
      out.emplace_back(r.id, r.name, OpTypeName(r.op), DataTypeName(r.dtype), r.shape,
                       r.process_set, r.enqueued, r.negotiated, r.started, r.done, r.from_cache,
                       static_cast<int>(r.code));
    return std::make_pair(Rt().flight_recorder().wall_base(), out);
  });
  m.def("config", [] { return Rt().config().Items(); });
  m.def("set_knob", [](const std::string& name, const std::string& value) { Rt().SetKnob(name, value); });
  m.def("start_timeline", [](const std::string& path, bool mark_cycles) {
    return Rt().StartTimeline(path, mark_cycles);
  }, "path"_a, "mark_cycles"_a = false);
  m.def("stop_timeline", [] { Rt().StopTimeline(); });
}
