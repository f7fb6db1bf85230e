#include "comm/mpi_comm.h"

#include <climits>
#include <map>
#include <mutex>
#include <utility>

#include "common/reduce.h"

namespace sdl {
namespace {

bool g_owned = false;
int g_provided = MPI_THREAD_SINGLE;

// MPI user ops carry no context, so one function is instantiated per
// (dtype, op) pair; MPI's contract is inout[i] = in[i] (op) inout[i].
template <DataType DT, ReduceOp OP>
void UserOp(void* in, void* inout, int* len, MPI_Datatype*) {
  Reduce(inout, in, inout, static_cast<size_t>(*len), DT, OP);
}

template <DataType DT>
MPI_User_function* PickOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kAverage:
    case ReduceOp::kSum: return &UserOp<DT, ReduceOp::kSum>;
    case ReduceOp::kMin: return &UserOp<DT, ReduceOp::kMin>;
    case ReduceOp::kMax: return &UserOp<DT, ReduceOp::kMax>;
    case ReduceOp::kProduct: return &UserOp<DT, ReduceOp::kProduct>;
    case ReduceOp::kBitAnd: return &UserOp<DT, ReduceOp::kBitAnd>;
  }
  return nullptr;
}

MPI_User_function* UserFunction(DataType dt, ReduceOp op) {
  switch (dt) {
    case DataType::kFloat16: return PickOp<DataType::kFloat16>(op);
    case DataType::kBFloat16: return PickOp<DataType::kBFloat16>(op);
    case DataType::kBool: return PickOp<DataType::kBool>(op);
    default: return nullptr;
  }
}

MPI_Datatype NativeType(DataType dt) {
  switch (dt) {
    case DataType::kUInt8: return MPI_UINT8_T;
    case DataType::kInt8: return MPI_INT8_T;
    case DataType::kInt16: return MPI_INT16_T;
    case DataType::kUInt16: return MPI_UINT16_T;
    case DataType::kInt32: return MPI_INT32_T;
    case DataType::kInt64: return MPI_INT64_T;
    case DataType::kUInt64: return MPI_UINT64_T;
    case DataType::kFloat32: return MPI_FLOAT;
    case DataType::kFloat64: return MPI_DOUBLE;
    case DataType::kFloat16: case DataType::kBFloat16: return MPI_UINT16_T;
    case DataType::kBool: return MPI_UINT8_T;
  }
  return MPI_BYTE;
}

MPI_Op NativeOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kAverage: case ReduceOp::kSum: return MPI_SUM;
    case ReduceOp::kMin: return MPI_MIN;
    case ReduceOp::kMax: return MPI_MAX;
    case ReduceOp::kProduct: return MPI_PROD;
    case ReduceOp::kBitAnd: return MPI_BAND;
  }
  return MPI_SUM;
}

// Custom ops are created once per (dtype, op) and live until MPI_Finalize.
MPI_Op CustomOp(DataType dt, ReduceOp op) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, MPI_Op> ops;
  std::lock_guard<std::mutex> lk(mu);
  auto key = std::make_pair(static_cast<int>(dt), static_cast<int>(op));
  auto it = ops.find(key);
  if (it != ops.end()) return it->second;
  MPI_Op m;
  MPI_Op_create(UserFunction(dt, op), /*commute=*/1, &m);
  ops[key] = m;
  return m;
}

std::vector<int> Ints(const std::vector<size_t>& v, const char* what) {
  std::vector<int> out;
  for (size_t x : v) {
    if (x > static_cast<size_t>(INT_MAX))
      throw Error(ErrorCode::kInvalidArgument, std::string(what) + " over 2 GiB per rank is not supported on MPI");
    out.push_back(static_cast<int>(x));
  }
  return out;
}

}  // namespace

int MpiInit() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &g_provided);
    g_owned = true;
  } else {
    MPI_Query_thread(&g_provided);
  }
  return g_provided;
}

void MpiFinalizeIfOwned() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (g_owned && !finalized) MPI_Finalize();
  g_owned = false;
}

bool MpiThreadsSupported() { return g_provided >= MPI_THREAD_MULTIPLE; }

MpiComm::MpiComm(MPI_Comm comm, std::vector<int> global_ranks)
    : comm_(comm), global_ranks_(std::move(global_ranks)) {
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
}

MpiComm::~MpiComm() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

void MpiComm::Check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  throw Error(ErrorCode::kPeerFailure, std::string("MPI ") + what + " failed on rank " +
                                           std::to_string(global_ranks_[rank_]) + ": " +
                                           std::string(msg, len));
}

void MpiComm::Allreduce(void* buf, size_t count, DataType dt, ReduceOp op) {
  MPI_Datatype type = NativeType(dt);
  MPI_Op mop = UserFunction(dt, op) ? CustomOp(dt, op) : NativeOp(op);
  const size_t es = DataTypeSize(dt);
  for (size_t off = 0; off < count; off += INT_MAX / 2) {
    int n = static_cast<int>(std::min<size_t>(INT_MAX / 2, count - off));
    Check(MPI_Allreduce(MPI_IN_PLACE, static_cast<char*>(buf) + off * es, n, type, mop, comm_),
          "allreduce");
  }
}

bool MpiComm::Gatherv(const void* in, void* out, const std::vector<size_t>& bytes, int root) {
  std::vector<int> counts = Ints(bytes, "gather"), displs(size_, 0);
  for (int q = 1; q < size_; ++q) displs[q] = displs[q - 1] + counts[q - 1];
  static char empty[8];
  // Only root's counts and displacements are read (MPI's rule), as only root knows them all.
  Check(MPI_Gatherv(in ? in : empty, counts[rank_], MPI_BYTE, out ? out : empty, counts.data(),
                    displs.data(), MPI_BYTE, root, comm_),
        "gather");
  return true;
}

void MpiComm::Allgatherv(const void* in, void* out, const std::vector<size_t>& bytes) {
  std::vector<int> counts = Ints(bytes, "allgather"), displs(size_, 0);
  for (int q = 1; q < size_; ++q) displs[q] = displs[q - 1] + counts[q - 1];
  static char empty[8];
  Check(MPI_Allgatherv(in ? in : empty, counts[rank_], MPI_BYTE, out ? out : empty, counts.data(),
                       displs.data(), MPI_BYTE, comm_),
        "allgather");
}

void MpiComm::Broadcast(void* buf, size_t bytes, int root) {
  if (bytes == 0) return;
  Check(MPI_Bcast(buf, Ints({bytes}, "broadcast")[0], MPI_BYTE, root, comm_), "broadcast");
}

void MpiComm::Alltoallv(const void* in, void* out, const std::vector<size_t>& matrix) {
  std::vector<size_t> send(size_), recv(size_);
  for (int q = 0; q < size_; ++q) {
    send[q] = matrix[rank_ * size_ + q];
    recv[q] = matrix[q * size_ + rank_];
  }
  std::vector<int> sc = Ints(send, "alltoall"), rc = Ints(recv, "alltoall");
  std::vector<int> sd(size_, 0), rd(size_, 0);
  for (int q = 1; q < size_; ++q) {
    sd[q] = sd[q - 1] + sc[q - 1];
    rd[q] = rd[q - 1] + rc[q - 1];
  }
  static char empty[8];
  Check(MPI_Alltoallv(in ? in : empty, sc.data(), sd.data(), MPI_BYTE, out ? out : empty,
                      rc.data(), rd.data(), MPI_BYTE, comm_),
        "alltoall");
}

void MpiComm::Barrier() { Check(MPI_Barrier(comm_), "barrier"); }

}  // namespace sdl
