// MPI communicator (Open MPI or any MPI-3 library), used when the job runs
// under mpirun or init() is given an mpi4py communicator.
//
// Threading: the background thread issues every collective; process sets are
// created on the caller's thread. MPI is therefore initialised with
// MPI_THREAD_MULTIPLE where the library offers it (see MpiInit).
#pragma once

#include <mpi.h>

#include <string>
#include <vector>

#include "comm/comm.h"

namespace sdl {

// Initialises MPI unless the application (e.g. mpi4py) already did; returns
// the thread level provided. Safe to call repeatedly.
int MpiInit();
// Finalises MPI if MpiInit initialised it (call once at process exit).
void MpiFinalizeIfOwned();
bool MpiThreadsSupported();

class MpiComm : public Comm {
 public:
  // Takes ownership of comm (freed on destruction). global_ranks[i] is
  // member i's rank in the job, for error messages.
  MpiComm(MPI_Comm comm, std::vector<int> global_ranks);
  ~MpiComm() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* kind() const override { return "mpi"; }
  MPI_Comm handle() const { return comm_; }

  void Allreduce(void* buf, size_t count, DataType dt, ReduceOp op) override;
  void Allgatherv(const void* in, void* out, const std::vector<size_t>& bytes) override;
  bool Gatherv(const void* in, void* out, const std::vector<size_t>& bytes, int root) override;
  void Broadcast(void* buf, size_t bytes, int root) override;
  void Alltoallv(const void* in, void* out, const std::vector<size_t>& matrix) override;
  void Barrier() override;

 private:
  void Check(int rc, const char* what);
  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
  std::vector<int> global_ranks_;
};

}  // namespace sdl
