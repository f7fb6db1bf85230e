#include "core/runtime.h"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>

#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/store.h>

#include "comm/gloo_comm.h"
#include "comm/hierarchical_comm.h"
#ifdef SDL_HAVE_MPI
#include "comm/mpi_comm.h"
#endif
#include "comm/shm_comm.h"
#include "core/coordinator.h"
#include "ops/gpu_backends.h"
#include "common/reduce.h"

namespace sdl {
namespace {

std::string HostIdentity(const std::string& override_id) {
  if (!override_id.empty()) return override_id;
  char buf[256] = {0};
  gethostname(buf, sizeof buf - 1);
  std::string boot;
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::getline(f, boot);
  return std::string(buf) + "/" + boot;
}

std::string HostName() {
  char buf[256] = {0};
  gethostname(buf, sizeof buf - 1);
  return buf;
}

// Peers exchange "identity\nhost name": the identity groups ranks by host,
// the name is what messages print (on Spark the identity is a hash).
std::string HostRecord(const std::string& identity) { return identity + "\n" + HostName(); }
void SplitHostRecord(const std::string& rec, std::string* identity, std::string* name) {
  size_t nl = rec.find('\n');
  *identity = rec.substr(0, nl);
  *name = nl == std::string::npos ? *identity : rec.substr(nl + 1);
}

std::string RandomToken() {
  std::random_device rd;
  std::ostringstream s;
  s << std::hex << rd() << rd();
  return s.str();
}

std::vector<char> Bytes(const std::string& s) { return {s.begin(), s.end()}; }

std::string StoreGet(gloo::rendezvous::Store& store, const std::string& key, double timeout_s) {
  store.wait({key}, std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
  std::vector<char> v = store.get(key);
  return std::string(v.begin(), v.end());
}

}  // namespace

Runtime::Runtime(RuntimeOptions opts)
    : opts_(std::move(opts)),
      config_(opts_.config),
      recorder_(static_cast<size_t>(std::max<int64_t>(opts_.config.flight_recorder_size, 0))),
      controller_(
          counters_,
          [this](ProcessSet& ps, const Response& r, bool from_cache) { Execute(ps, r, from_cache); },
          [this](int level, const std::string& msg) { Log(level, msg); }) {
  // CUDA memory and NCCL in a GPU build (before the background thread starts);
  // creating an NCCL communicator waits for every member, as starting does.
  AddGpuBackends(ops_, config_.start_timeout_s, config_.hierarchical_allreduce, &host_of_rank_);
  if (opts_.add_ops) opts_.add_ops(ops_);
  if (opts_.use_mpi) {
    InitMpi();
  } else {
    InitStore();
  }
  controller_.set_hosts(host_name_of_rank_);
#ifdef SDL_HAVE_MPI
  // MPI calls from several threads need MPI_THREAD_MULTIPLE (cycles never
  // overlap, but a caller's cycle and the background's run on different threads).
  inline_ok_ = !opts_.use_mpi || MpiThreadsSupported();
#endif
  const Topology& t = opts_.topo;
  std::vector<int32_t> all(t.size);
  for (int r = 0; r < t.size; ++r) all[r] = r;
  active_[0] = MakeProcessSet(0, all);
  for (auto& ranks : opts_.process_sets) {
    int32_t id = next_set_id_++;
    active_[id] = MakeProcessSet(id, ranks);
  }
  if (config_.verbose >= 1 && t.rank == 0) {
    std::ostringstream s;
    s << "started " << t.size << " rank(s); global transport " << TransportOf(0) << "; knobs:";
    for (auto& [k, v] : config_.Items()) s << " " << k << "=" << v;
    Log(1, s.str());
  }
  if (t.rank == 0) {
    timeline_ = std::make_unique<Timeline>(static_cast<size_t>(config_.timeline_queue_capacity));
    controller_.set_timeline(timeline_.get());
    ops_.set_timeline(timeline_.get());
    if (!config_.timeline.empty()) timeline_->Start(config_.timeline, config_.timeline_mark_cycles);
  }
  if (config_.autotune && t.rank == 0) {
    AutotuneOptions a;
    a.warmup_samples = static_cast<int>(config_.autotune_warmup_samples);
    a.steps_per_sample = static_cast<int>(config_.autotune_steps_per_sample);
    a.max_samples = static_cast<int>(config_.autotune_bayes_opt_max_samples);
    a.noise = config_.autotune_gaussian_process_noise;
    a.log_path = config_.autotune_log;
    a.tune_cache = config_.cache_capacity > 0;
    // Decided from the global host map: a world set whose transport is
    // hierarchical (several hosts, some holding several ranks).
    a.tune_hierarchical = TransportOf(0) == "hierarchical";
    a.start.fusion_threshold = config_.fusion_threshold;
    a.start.cycle_time_ms = config_.cycle_time_ms;
    a.start.response_cache = true;
    a.start.hierarchical = true;  // the hierarchical transport's own path
    tuner_ = std::make_unique<Autotuner>(a, [this](int level, const std::string& msg) { Log(level, msg); });
    controller_.set_proposal(tuner_->proposal());
  }
  thread_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "sdl_background");  // named in top, perf, gdb
    Loop();
  });
}

void Runtime::InitStore() {
  const Topology& t = opts_.topo;
  if (t.size < 1 || t.rank < 0 || t.rank >= t.size)
    throw Error(ErrorCode::kInvalidArgument, "invalid rank " + std::to_string(t.rank) +
                                                 " for size " + std::to_string(t.size));
  host_of_rank_.assign(t.size, HostIdentity(config_.host_id));
  host_name_of_rank_.assign(t.size, HostName());
  if (t.size == 1) return;
  if (!opts_.store)
    throw Error(ErrorCode::kInvalidArgument,
                "size is " + std::to_string(t.size) +
                    " but no rendezvous store was given: start workers with sdlrun or "
                    "spark_dl.spark.run (they set SDL_RENDEZVOUS_ADDR/PORT and SDL_SECRET_KEY)");
  auto& store = *opts_.store;
  std::string prefix = "e" + std::to_string(opts_.epoch) + "/";
  store.set(prefix + "host/" + std::to_string(t.rank), Bytes(HostRecord(host_of_rank_[t.rank])));
  if (t.rank == 0) {
    job_token_ = RandomToken();
    store.set(prefix + "job", Bytes(job_token_));
  }
  for (int r = 0; r < t.size; ++r)
    SplitHostRecord(StoreGet(store, prefix + "host/" + std::to_string(r), config_.start_timeout_s),
                    &host_of_rank_[r], &host_name_of_rank_[r]);
  job_token_ = StoreGet(store, prefix + "job", config_.start_timeout_s);
}

void Runtime::InitMpi() {
#ifdef SDL_HAVE_MPI
  MpiInit();
  MPI_Comm base = opts_.mpi_comm_addr ? *reinterpret_cast<MPI_Comm*>(opts_.mpi_comm_addr)
                                      : MPI_COMM_WORLD;
  auto* world = new MPI_Comm(MPI_COMM_NULL);
  mpi_world_ = world;
  if (!opts_.mpi_ranks.empty()) {
    MPI_Group base_group, group;
    MPI_Comm_group(base, &base_group);
    MPI_Group_incl(base_group, static_cast<int>(opts_.mpi_ranks.size()), opts_.mpi_ranks.data(), &group);
    int base_rank = 0;
    MPI_Comm_rank(base, &base_rank);
    bool member = std::find(opts_.mpi_ranks.begin(), opts_.mpi_ranks.end(), base_rank) !=
                  opts_.mpi_ranks.end();
    if (!member)
      throw Error(ErrorCode::kInvalidArgument,
                  "MPI rank " + std::to_string(base_rank) + " is not in init(comm=" +
                      ShapeString({opts_.mpi_ranks.begin(), opts_.mpi_ranks.end()}) +
                      "); only the listed ranks may call init with it");
    MPI_Comm_create_group(base, group, 7341, world);
    MPI_Group_free(&group);
    MPI_Group_free(&base_group);
  } else {
    MPI_Comm_dup(base, world);
  }
  Topology& t = opts_.topo;
  MPI_Comm_rank(*world, &t.rank);
  MPI_Comm_size(*world, &t.size);
  MPI_Comm local, cross;
  MPI_Comm_split_type(*world, MPI_COMM_TYPE_SHARED, t.rank, MPI_INFO_NULL, &local);
  MPI_Comm_rank(local, &t.local_rank);
  MPI_Comm_size(local, &t.local_size);
  MPI_Comm_split(*world, t.local_rank, t.rank, &cross);
  MPI_Comm_rank(cross, &t.cross_rank);
  MPI_Comm_size(cross, &t.cross_size);
  MPI_Comm_free(&local);
  MPI_Comm_free(&cross);
  // Host identities and the job token travel over a throwaway duplicate.
  MPI_Comm boot;
  MPI_Comm_dup(*world, &boot);
  std::vector<int> all(t.size);
  for (int r = 0; r < t.size; ++r) all[r] = r;
  MpiComm bootstrap(boot, all);
  std::vector<std::string> recs = bootstrap.AllgatherBytes(HostRecord(HostIdentity(config_.host_id)));
  host_of_rank_.assign(t.size, "");
  host_name_of_rank_.assign(t.size, "");
  for (int r = 0; r < t.size; ++r) SplitHostRecord(recs[r], &host_of_rank_[r], &host_name_of_rank_[r]);
  job_token_ = t.rank == 0 ? RandomToken() : "";
  bootstrap.BroadcastBytes(&job_token_, 0);
#else
  throw Error(ErrorCode::kInvalidArgument,
              "this spark_dl core has no MPI support: install Open MPI (Debian/Ubuntu: "
              "apt-get install openmpi-bin libopenmpi-dev; a source build then needs rebuilding), "
              "or use SDL_CONTROLLER=gloo");
#endif
}

Runtime::~Runtime() {
  Shutdown();
#ifdef SDL_HAVE_MPI
  {
    std::lock_guard<std::mutex> lk(sets_mu_);
    active_.clear();
    staged_.clear();
  }
  if (mpi_world_) {
    auto* world = static_cast<MPI_Comm*>(mpi_world_);
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && *world != MPI_COMM_NULL) MPI_Comm_free(world);
    delete world;
  }
#endif
}

void Runtime::Log(int level, const std::string& msg) {
  if (config_.verbose >= level)
    std::fprintf(stderr, "[spark_dl rank %d] %s\n", opts_.topo.rank, msg.c_str());
}

void Runtime::DumpFlightRecorder(const std::string& why) {
  if (recorder_.capacity() == 0) return;
  const int rank = opts_.topo.rank;
  const std::string host =
      rank < static_cast<int>(host_name_of_rank_.size()) ? host_name_of_rank_[rank] : "";
  // The reason is a failure's message: bounded, the log line stays readable.
  const std::string reason = why.size() > 300 ? why.substr(0, 300) + "..." : why;
  const std::string dir = config().flight_recorder_dir;
  std::string where;
  if (!dir.empty()) {
    // Written whole to a temporary name, then renamed: a reader never sees half a dump.
    const std::string path = dir + "/flight_recorder.rank" + std::to_string(rank) + ".json";
    std::ofstream f(path + ".tmp", std::ios::trunc);
    f << recorder_.Json(rank, host, reason);
    f.close();
    if (f && std::rename((path + ".tmp").c_str(), path.c_str()) == 0) where = "; full dump in " + path;
    else where = "; could not write " + path;
  }
  std::fprintf(stderr, "[spark_dl rank %d] %s%s\n", rank, recorder_.Text(rank, host, reason, 32).c_str(),
               where.c_str());
}

std::string Runtime::DivergenceLocked() {
  std::vector<std::shared_ptr<ProcessSet>> sets;
  {
    std::lock_guard<std::mutex> lk(sets_mu_);
    for (auto& [id, ps] : active_)
      if (ps->my_rank == 0) sets.push_back(ps);
  }
  for (auto& ps : sets) {
    std::string d = CoordinatorDivergence(*ps, &host_name_of_rank_);
    if (!d.empty()) return d;
  }
  // The table is empty when the failure came before the names reached it (a
  // peer died before the negotiation): rank 0's own oldest unfinished
  // collective is then where the others left it.
  if (opts_.topo.rank != 0) return "";
  for (const FlightRecord& r : recorder_.Snapshot()) {
    if (r.done != 0) continue;
    return std::string(OpTypeName(r.op)) + " '" + r.name + "' on process set " +
           std::to_string(r.process_set) + ", which rank 0 had submitted (" +
           (r.started != 0 ? "it was running" : "not yet negotiated with every rank") + ")";
  }
  return "";
}

Config Runtime::config() {
  std::lock_guard<std::mutex> lk(config_mu_);
  return config_;
}

void Runtime::SetKnob(const std::string& name, const std::string& value) {
  for (const KnobInfo& k : KnobTable()) {
    if (k.field == name || k.env == name) {
      if (!k.tunable)
        throw Error(ErrorCode::kInvalidArgument,
                    "knob " + k.field + " (" + k.env + ") is fixed at init; set it in the environment");
      std::lock_guard<std::mutex> lk(config_mu_);
      config_.Set(name, value);
      return;
    }
  }
  throw Error(ErrorCode::kInvalidArgument, "unknown knob '" + name + "'");
}

std::shared_ptr<ProcessSet> Runtime::MakeProcessSet(int32_t id, std::vector<int32_t> ranks) {
  std::sort(ranks.begin(), ranks.end());
  if (ranks.empty() || std::adjacent_find(ranks.begin(), ranks.end()) != ranks.end() ||
      ranks.front() < 0 || ranks.back() >= opts_.topo.size)
    throw Error(ErrorCode::kInvalidArgument,
                "a process set needs distinct ranks in [0, " + std::to_string(opts_.topo.size) +
                    "), got " + ShapeString({ranks.begin(), ranks.end()}));
  auto it = std::find(ranks.begin(), ranks.end(), opts_.topo.rank);
  int my = it == ranks.end() ? -1 : static_cast<int>(it - ranks.begin());
  auto ps = std::make_shared<ProcessSet>(id, ranks, my, config_.cache_capacity);
  if (my >= 0) {
    ps->comm = MakeComm(id, ranks, my);
    ps->transport = ps->comm->kind();
  }
  return ps;
}

std::unique_ptr<Comm> Runtime::MakeComm(int32_t id, const std::vector<int32_t>& ranks, int my) {
  int n = static_cast<int>(ranks.size());
  if (n == 1) return std::make_unique<SelfComm>();
  const std::string& my_host = host_of_rank_[ranks[my]];
  std::vector<int32_t> local, leaders;  // members on my host; first member of each host
  std::vector<std::string> seen;
  for (int32_t r : ranks) {
    if (host_of_rank_[r] == my_host) local.push_back(r);
    if (std::find(seen.begin(), seen.end(), host_of_rank_[r]) == seen.end()) {
      seen.push_back(host_of_rank_[r]);
      leaders.push_back(r);
    }
  }
  const std::string tag = std::to_string(id);
  if (config_.shm && static_cast<int>(local.size()) == n)
    return MakeShm(tag, local, my);
  // Hierarchical when some host holds several members; decided from the
  // global host map, so every member takes the same branch.
  if (config_.shm && config_.hierarchical && leaders.size() < ranks.size()) {
    // Leaders meet on a communicator of their own; every member also joins the flat one.
    int local_index = static_cast<int>(std::find(local.begin(), local.end(), ranks[my]) - local.begin());
    int leader_index = static_cast<int>(std::find(leaders.begin(), leaders.end(), ranks[my]) - leaders.begin());
    std::string host_index = std::to_string(std::find(seen.begin(), seen.end(), my_host) - seen.begin());
    std::unique_ptr<Comm> local_comm = MakeShm(tag + "_h" + host_index, local, local_index);
    std::unique_ptr<Comm> cross;
    if (local_index == 0) cross = MakeNetwork(tag + "_leaders", leaders, leader_index);
    // Pipelined allreduces run the leaders' transport on a second thread: MPI
    // allows that only with MPI_THREAD_MULTIPLE (inline_ok_ says so, the same on
    // every rank of a job).
    const size_t chunk = inline_ok_ && config_.hierarchical_chunk_bytes > 0
                             ? static_cast<size_t>(config_.hierarchical_chunk_bytes)
                             : 0;
    return std::make_unique<HierarchicalComm>(std::move(local_comm), std::move(cross),
                                              MakeNetwork(tag, ranks, my), chunk);
  }
  return MakeNetwork(tag, ranks, my);
}

std::unique_ptr<Comm> Runtime::MakeShm(const std::string& tag, const std::vector<int32_t>& ranks,
                                       int my) {
  if (ranks.size() == 1) return std::make_unique<SelfComm>();
  std::string name = "/sdl_" + job_token_ + "_" + std::to_string(opts_.epoch) + "_" + tag;
  return std::make_unique<ShmComm>(name, my, static_cast<int>(ranks.size()),
                                   std::vector<int>(ranks.begin(), ranks.end()),
                                   config_.shm_buffer_bytes, config_.timeout_s,
                                   config_.start_timeout_s);
}

// Gloo or MPI among ranks (global ranks, ascending); tag names the rendezvous.
std::unique_ptr<Comm> Runtime::MakeNetwork(const std::string& tag, const std::vector<int32_t>& ranks,
                                           int my) {
  int n = static_cast<int>(ranks.size());
  std::vector<int> global(ranks.begin(), ranks.end());
#ifdef SDL_HAVE_MPI
  if (opts_.use_mpi) {
    MPI_Comm world = *static_cast<MPI_Comm*>(mpi_world_);
    MPI_Group world_group, group;
    MPI_Comm_group(world, &world_group);
    MPI_Group_incl(world_group, n, global.data(), &group);
    MPI_Comm comm;
    MPI_Comm_create_group(world, group, static_cast<int>(std::hash<std::string>()(tag) & 0x7fff),
                          &comm);
    MPI_Group_free(&group);
    MPI_Group_free(&world_group);
    return std::make_unique<MpiComm>(comm, global);
  }
#endif
  if (!gloo_device_) gloo_device_ = MakeGlooDevice(config_.gloo_iface, opts_.hostname);
  gloo::rendezvous::PrefixStore prefixed("e" + std::to_string(opts_.epoch) + "/ps" + tag,
                                         *opts_.store);
  return std::make_unique<GlooComm>(gloo_device_, prefixed, my, n, global, config_.timeout_s,
                                    config_.start_timeout_s);
}

std::shared_ptr<ProcessSet> Runtime::FindSet(int32_t id) {
  std::lock_guard<std::mutex> lk(sets_mu_);
  auto it = active_.find(id);
  if (it == active_.end())
    throw Error(ErrorCode::kInvalidArgument,
                "process set " + std::to_string(id) + " is not registered (or was removed)");
  return it->second;
}

namespace {

std::string RankList(const std::vector<int32_t>& ranks) {
  if (ranks.size() == 1) return "rank " + std::to_string(ranks[0]);
  return "ranks " + ShapeString({ranks.begin(), ranks.end()});
}

}  // namespace

std::string Runtime::StopMessageLocked(OpType op, const std::string& name) const {
  if (failed_.load()) return stop_message_;
  if (stopped_by_peers_.empty()) return kShutDownMessage;
  // A peer shut down while this rank still calls collectives: the ranks' calls
  // did not match (a script that ran fewer steps, or an early exit).
  std::string what = name.empty() ? std::string("spark_dl")
                                  : std::string(OpTypeName(op)) + " '" + name + "'";
  return what + " on rank " + std::to_string(opts_.topo.rank) + " cannot run: " +
         RankList(stopped_by_peers_) +
         " had already shut down; every rank must make the same collective calls in the "
         "same order";
}

void Runtime::CheckUsable(const Request* req) {
  if (stopped_.load() || shutdown_requested_.load()) {
    std::lock_guard<std::mutex> lk(status_mu_);
    throw Error(failed_.load() ? stop_code_ : ErrorCode::kShutdown,
                req ? StopMessageLocked(req->op, req->name) : StopMessageLocked(OpType::kBarrier, ""));
  }
}

int64_t Runtime::Enqueue(int32_t ps_id, Request req, const void* in, void* out,
                         bool core_output, uintptr_t stream) {
  std::vector<Submission> one(1);
  one[0].req = std::move(req);
  one[0].in = in;
  one[0].out = out;
  one[0].core_output = core_output;
  one[0].stream = stream;
  return EnqueueMany(ps_id, std::move(one));
}

void Runtime::CheckSubmission(const ProcessSet& ps, Submission& sub,
                              std::shared_ptr<Buffer>* output_ptr) {
  Request& req = sub.req;
  const void* in = sub.in;
  void*& out = sub.out;
  const bool core_output = sub.core_output;
  std::shared_ptr<Buffer>& output = *output_ptr;
  if (req.name.empty()) throw Error(ErrorCode::kInvalidArgument, "operation name is empty");
  const bool tensor_op = req.op != OpType::kBarrier && req.op != OpType::kJoin &&
                         req.op != OpType::kProcessSetAdd && req.op != OpType::kProcessSetRemove;
  if (tensor_op && req.op == OpType::kAllreduce) CheckReduceSupported(req.dtype, req.reduce);
  if (req.op == OpType::kReducescatter) CheckReduceSupported(req.dtype, req.reduce);
  if ((req.prescale != 1.0 || req.postscale != 1.0) && req.dtype == DataType::kBool)
    throw Error(ErrorCode::kInvalidArgument, "scale factors are not defined for bool tensors");
  if ((req.op == OpType::kAllgather || req.op == OpType::kAlltoall ||
       req.op == OpType::kReducescatter) && req.shape.empty())
    throw Error(ErrorCode::kInvalidArgument, std::string(OpTypeName(req.op)) + " of '" + req.name +
                                                 "' needs a tensor with at least one dimension");
  if (req.op == OpType::kBroadcast && (req.root < 0 || req.root >= ps.size()))
    throw Error(ErrorCode::kInvalidArgument,
                "broadcast root " + std::to_string(req.root) + " of '" + req.name +
                    "' is outside the process set of size " + std::to_string(ps.size()));
  if (req.op == OpType::kAlltoall) {
    if (static_cast<int>(req.splits.size()) != ps.size())
      throw Error(ErrorCode::kInvalidArgument,
                  "alltoall of '" + req.name + "' needs one split per rank (" +
                      std::to_string(ps.size()) + "), got " + std::to_string(req.splits.size()));
    int64_t sum = 0;
    for (int64_t s : req.splits) {
      if (s < 0) throw Error(ErrorCode::kInvalidArgument, "alltoall splits must be >= 0");
      sum += s;
    }
    if (sum != req.shape[0])
      throw Error(ErrorCode::kInvalidArgument,
                  "alltoall splits of '" + req.name + "' sum to " + std::to_string(sum) +
                      " but the first dimension is " + std::to_string(req.shape[0]));
  }
  ops_.CheckServable(req);  // the backend choice refuses devices this build cannot serve
  for (int64_t d : req.shape)
    if (d < 0) throw Error(ErrorCode::kInvalidArgument, "negative dimension in '" + req.name + "'");
  if (tensor_op && in == nullptr && req.NumElements() > 0)
    throw Error(ErrorCode::kInvalidArgument, std::string(OpTypeName(req.op)) + " of '" + req.name +
                                                 "' has no input tensor");
  if (core_output && (req.op != OpType::kAllreduce || out != nullptr))
    throw Error(ErrorCode::kInvalidArgument,
                std::string(OpTypeName(req.op)) + " of '" + req.name +
                    "': only an allreduce without an output tensor can ask the core for its output");
  // A device tensor's output is allocated by the operations layer on the
  // background thread (device memory is its to manage); out stays null until then.
  const bool device_output = core_output && !req.device.host();
  if (core_output && !device_output) {
    // Allocated here, outside the collective: a pool miss maps and pre-faults
    // fresh memory on the caller's thread, not while peers wait.
    output = std::make_shared<Buffer>(static_cast<size_t>(req.NumElements()) * DataTypeSize(req.dtype));
    output->dtype = req.dtype;
    output->shape = req.shape;
    out = output->data.get();
  }
  if ((req.op == OpType::kAllreduce || req.op == OpType::kBroadcast) && out == nullptr &&
      !device_output && req.NumElements() > 0)
    throw Error(ErrorCode::kInvalidArgument,
                std::string(OpTypeName(req.op)) + " of '" + req.name +
                    "' needs an output tensor (pass the input again to work in place)");
}

int64_t Runtime::EnqueueMany(int32_t ps_id, std::vector<Submission> subs) {
  if (subs.empty()) throw Error(ErrorCode::kInvalidArgument, "nothing to enqueue");
  CheckUsable(&subs[0].req);
  const OpType op = subs[0].req.op;      // for the stop message of a raced shutdown
  const std::string name = subs[0].req.name;
  std::shared_ptr<ProcessSet> ps = FindSet(ps_id);
  if (!ps->member())
    throw Error(ErrorCode::kInvalidArgument, "rank " + std::to_string(opts_.topo.rank) +
                                                 " is not a member of process set " +
                                                 std::to_string(ps_id) + " " +
                                                 ShapeString({ps->ranks.begin(), ps->ranks.end()}));
  std::vector<std::shared_ptr<Buffer>> outputs(subs.size());
  for (size_t i = 0; i < subs.size(); ++i) CheckSubmission(*ps, subs[i], &outputs[i]);
  int64_t first;
  std::vector<std::shared_ptr<const ReadyMark>> marks(subs.size());
  {
    std::lock_guard<std::mutex> lk(ps->mu);
    // Device tensors: what their framework streams have queued now (the
    // producers), one mark per (device, stream) of the batch. Under the lock,
    // so on one stream the marks follow the entries' order (WaitInputs waits
    // for the last one only). The core waits for this point, not for work the
    // framework queues later.
    for (size_t i = 0; i < subs.size(); ++i) {
      const Device d = subs[i].req.device;
      if (d.host()) continue;
      for (size_t j = 0; j < i && !marks[i]; ++j)
        if (subs[j].req.device == d && subs[j].stream == subs[i].stream) marks[i] = marks[j];
      if (marks[i]) continue;
      Status s = ops_.MarkReady(d, subs[i].stream, &marks[i]);
      if (!s.ok())
        throw Error(s.code, std::string(OpTypeName(subs[i].req.op)) + " of '" +
                                subs[i].req.name + "': " + s.message);
    }
    for (size_t i = 0; i < subs.size(); ++i) {
      if (!ps->inflight.insert(subs[i].req.name).second) {
        for (size_t j = 0; j < i; ++j) ps->inflight.erase(subs[j].req.name);  // all or nothing
        throw Error(ErrorCode::kDuplicateName,
                    "an operation named '" + subs[i].req.name +
                        "' is already in flight on this rank; wait for it or use another name");
      }
    }
    first = handles_.CreateRange(static_cast<int64_t>(subs.size()));
    for (size_t i = 0; i < subs.size(); ++i) {
      Entry e;
      e.req = std::move(subs[i].req);
      e.in = subs[i].in;
      e.out = subs[i].out;
      e.output = std::move(outputs[i]);
      e.handle = first + static_cast<int64_t>(i);
      e.stream = subs[i].stream;
      e.ready = std::move(marks[i]);
      ps->incoming.push_back(std::move(e));
    }
  }
  // While a caller runs cycles inline, its next cycle takes this in: no
  // wake-up (the last caller to leave wakes the background thread when work
  // is left; see LeaveInline).
  WakeBackground(inline_waiters_.load() == 0);
  // A failure or shutdown may have raced with the enqueue: do not strand it.
  if (stopped_.load()) {
    std::lock_guard<std::mutex> lk(status_mu_);
    handles_.FailAll(stop_code_, StopMessageLocked(op, name));
  }
  return first;
}

std::pair<int32_t, int64_t> Runtime::AddProcessSet(std::vector<int32_t> ranks) {
  CheckUsable();
  int32_t id;
  {
    std::lock_guard<std::mutex> lk(sets_mu_);
    id = next_set_id_++;
  }
  std::shared_ptr<ProcessSet> ps = MakeProcessSet(id, std::move(ranks));
  {
    std::lock_guard<std::mutex> lk(sets_mu_);
    staged_[id] = ps;
  }
  Request req;
  req.op = OpType::kProcessSetAdd;
  req.name = "process_set.add." + std::to_string(id);
  req.root = id;
  req.ranks = ps->ranks;
  return {id, Enqueue(0, std::move(req), nullptr, nullptr)};
}

int64_t Runtime::RemoveProcessSet(int32_t id) {
  if (id == 0) throw Error(ErrorCode::kInvalidArgument, "the global process set cannot be removed");
  FindSet(id);
  Request req;
  req.op = OpType::kProcessSetRemove;
  req.name = "process_set.remove." + std::to_string(id);
  req.root = id;
  return Enqueue(0, std::move(req), nullptr, nullptr);
}

std::vector<int32_t> Runtime::ProcessSetRanks(int32_t id) { return FindSet(id)->ranks; }

std::vector<int32_t> Runtime::ProcessSetIds() {
  std::lock_guard<std::mutex> lk(sets_mu_);
  std::vector<int32_t> ids;
  for (auto& [id, ps] : active_) ids.push_back(id);
  return ids;
}

std::string Runtime::TransportOf(int32_t id) {
  auto ps = FindSet(id);
  return ps->member() ? ps->transport : "none (not a member)";
}

void Runtime::Shutdown() {
  shutdown_requested_.store(true);
  WakeBackground(true);
  if (thread_.joinable()) thread_.join();
  StopTimeline();
}

bool Runtime::StartTimeline(const std::string& path, bool mark_cycles) {
  if (!timeline_) return false;
  timeline_->Start(path, mark_cycles);
  return true;
}

void Runtime::StopTimeline() {
  if (timeline_) timeline_->Stop();
}

}  // namespace sdl
