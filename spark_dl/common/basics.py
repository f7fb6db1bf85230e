"""init/shutdown and the topology queries, shared by every framework front end.

A process learns its place in the job from the environment its launcher set
(``sdlrun`` and ``spark_dl.spark.run`` set ``SDL_RANK``, ``SDL_SIZE``, ...;
Horovod's ``HOROVOD_*`` names and Open MPI's ``OMPI_COMM_WORLD_*`` are read
too). With none of them it runs alone: rank 0 of 1.
"""

import atexit
import os
import warnings

from spark_dl.common import elastic
from spark_dl.common.native import core as _core, mpi_missing_reason
from spark_dl.common.exceptions import InvalidArgumentError, raise_from_core
from spark_dl.config import knobs as knob_table

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "mpi_threads_supported", "gloo_built",
    "gloo_enabled", "mpi_built", "mpi_enabled", "nccl_built", "cuda_built", "rocm_built",
    "ddl_built", "ccl_built", "counters", "set_knob", "transport", "start_timeline",
    "stop_timeline", "flight_recorder", "autotune_state",
]

_TOPOLOGY_VARS = {
    "rank": ("SDL_RANK", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"),
    "size": ("SDL_SIZE", "HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"),
    "local_rank": ("SDL_LOCAL_RANK", "HOROVOD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"),
    "local_size": ("SDL_LOCAL_SIZE", "HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "cross_rank": ("SDL_CROSS_RANK", "HOROVOD_CROSS_RANK", "OMPI_COMM_WORLD_NODE_RANK"),
    "cross_size": ("SDL_CROSS_SIZE", "HOROVOD_CROSS_SIZE"),
}
_RENDEZVOUS_VARS = ("SDL_RENDEZVOUS_ADDR", "SDL_RENDEZVOUS_PORT", "SDL_SECRET_KEY",
                    "SDL_START_TIMEOUT")
_rendezvous = {}  # kept from the first init; the secret is then removed from os.environ
_atexit_registered = False
_homogeneous = True
_controller = ""  # "gloo" or "mpi" once initialized
_inits = 0  # runtimes started by this process


class _StoreAdapter:
    """Presents the runner's authenticated KV client as the core's store."""

    def __init__(self, client):
        self._client = client

    def set(self, key, value):
        self._client.set("sdl", key, value)

    def get(self, key, timeout):
        return self._client.get("sdl", key, timeout)


def _topology_from_env(environ):
    topo = {}
    for field, names in _TOPOLOGY_VARS.items():
        for name in names:
            if name in environ:
                try:
                    topo[field] = int(environ[name])
                except ValueError:
                    raise InvalidArgumentError(f"{name}={environ[name]!r} is not an integer") from None
                break
    topo.setdefault("rank", 0)
    topo.setdefault("size", 1)
    topo.setdefault("local_rank", topo["rank"])
    topo.setdefault("local_size", topo["size"])
    topo.setdefault("cross_rank", 0)
    topo.setdefault("cross_size", max(1, topo["size"] // max(1, topo["local_size"])))
    if not 0 <= topo["rank"] < topo["size"]:
        raise InvalidArgumentError(f"rank {topo['rank']} is outside size {topo['size']}")
    return topo


def _rendezvous_environ(environ):
    """The launcher's rendezvous variables; the secret leaves os.environ on first use so
    that processes this worker starts do not inherit it (a later init() still has it)."""
    if "SDL_SECRET_KEY" in environ:
        _rendezvous.update({k: environ[k] for k in _RENDEZVOUS_VARS if k in environ})
        if environ is os.environ:
            del os.environ["SDL_SECRET_KEY"]
    return {**environ, **_rendezvous}


def _controller_knob(knobs):
    """``auto``, ``gloo`` or ``mpi``: ``init(controller=...)``, else ``SDL_CONTROLLER``."""
    try:
        if "controller" in knobs:
            return knob_table.table()["controller"].parse(str(knobs["controller"]), "controller")
        return knob_table.value("controller")
    except ValueError as e:
        raise InvalidArgumentError(str(e)) from None


def _use_mpi(comm, environ, controller):
    mpi = bool(_core.build_info()["mpi"])
    if comm is not None or controller == "mpi":
        if not mpi:
            raise InvalidArgumentError(
                "MPI was requested (init(comm=...) or SDL_CONTROLLER=mpi), but "
                + mpi_missing_reason() + "; or use Gloo")
        return True
    if controller == "gloo":
        return False
    under_mpirun = "OMPI_COMM_WORLD_SIZE" in environ or "PMI_SIZE" in environ
    return mpi and under_mpirun and "SDL_RENDEZVOUS_ADDR" not in environ


def _mpi_comm_args(comm):
    """(address of an MPI_Comm, ranks) for init(comm=...)."""
    if comm is None:
        return 0, []
    if isinstance(comm, (list, tuple)):
        return 0, [int(r) for r in comm]
    try:
        from mpi4py import MPI
    except ImportError:
        raise InvalidArgumentError("init(comm=...) takes an mpi4py communicator or a list of "
                                   "ranks; mpi4py is not installed") from None
    if not isinstance(comm, MPI.Comm):
        raise InvalidArgumentError(f"init(comm=...) got {type(comm).__name__}; expected an "
                                   "mpi4py communicator or a list of ranks")
    return MPI._addressof(comm), []


def init(comm=None, process_sets=None, **knobs):
    """Starts the runtime on this process (idempotent while initialized).

    Args:
        comm: run on an MPI communicator instead of the launcher's environment:
            an mpi4py communicator (e.g. a split of ``COMM_WORLD``) or a list of
            ``COMM_WORLD`` ranks. Needs an MPI build.
        process_sets: extra process sets to register now, as
            :class:`~spark_dl.common.process_sets.ProcessSet` objects or lists of
            ranks; every rank must pass the same list.
        **knobs: knob values that override the environment for this init, by
            field name (see :mod:`spark_dl.common.knobs`), e.g.
            ``fusion_threshold=0``.

    Raises:
        InvalidArgumentError: inconsistent environment or unknown knob.
        PeerFailureError: the other ranks could not be reached in time.
    """
    global _atexit_registered, _homogeneous, _controller, _inits
    from spark_dl.common import process_sets as ps_module

    environ = os.environ
    controller = _controller_knob(knobs)
    use_mpi = _use_mpi(comm, environ, controller)
    store = None
    epoch = -1  # the core numbers successive init()s itself
    if use_mpi:
        topo = dict(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1)
    else:
        topo = _topology_from_env(environ)
        if elastic.is_elastic(environ) and not is_initialized():
            topo, epoch = _elastic_topology(environ)
        if topo["size"] > 1:
            from spark_dl.rendezvous.client import client_from_env

            client = client_from_env(_rendezvous_environ(environ))
            if client is None:
                if "OMPI_COMM_WORLD_SIZE" in environ or "PMI_SIZE" in environ:
                    raise InvalidArgumentError(
                        "this process runs under mpirun, but spark_dl is not using MPI ("
                        + ("SDL_CONTROLLER=gloo" if controller == "gloo" else
                           mpi_missing_reason())
                        + "); or launch with sdlrun --gloo")
                raise InvalidArgumentError(
                    f"SDL_SIZE={topo['size']} but no rendezvous server is set "
                    "(SDL_RENDEZVOUS_ADDR/SDL_RENDEZVOUS_PORT/SDL_SECRET_KEY): start the job "
                    "with sdlrun or spark_dl.spark.run, or under mpirun with an MPI build")
            store = _StoreAdapter(client)
    comm_addr, comm_ranks = _mpi_comm_args(comm) if use_mpi else (0, [])
    sets = []
    for s in process_sets or ():
        sets.append(list(s.ranks) if isinstance(s, ps_module.ProcessSet) else [int(r) for r in s])
    hostname = environ.get("SDL_HOSTNAME", "127.0.0.1" if topo["local_size"] == topo["size"] else "")
    try:
        started = _core.init(topo["rank"], topo["size"], topo["local_rank"], topo["local_size"],
                             topo["cross_rank"], topo["cross_size"], hostname, store, sets,
                             {k: str(int(v) if isinstance(v, bool) else v) for k, v in knobs.items()},
                             use_mpi, comm_addr, comm_ranks, epoch)
    except _core.CoreError as e:
        raise_from_core(e)
    if started:
        _inits += 1
        _controller = "mpi" if use_mpi else "gloo"
        t = _core.topology()
        _homogeneous = t["size"] % t["local_size"] == 0
        ps_module._on_init(process_sets or ())
        if t["rank"] == 0:
            _warn_misspelled(environ)
    if not _atexit_registered:
        atexit.register(_at_exit)
        _atexit_registered = True


def _elastic_topology(environ):
    """An elastic worker's topology: the launcher's next generation that includes it
    (docs/elastic.md). Its values also replace the rank variables in ``os.environ``, so
    that code reading them sees the current generation."""
    topo = elastic.membership(_rendezvous_environ(environ)).join()
    epoch = topo.pop("generation")
    if environ is os.environ:
        for field, names in _TOPOLOGY_VARS.items():
            for name in names[:2]:  # SDL_ and HOROVOD_
                os.environ[name] = str(topo[field])
    return topo, epoch


def _warn_misspelled(environ):
    """Rank 0 names the ``SDL_`` variables that nothing reads but look meant for a knob (a
    typo or a renamed variable): their value is not applied, which is otherwise silent."""
    for var, instead in knob_table.misspelled(environ).items():
        why = "was renamed" if var in knob_table.RENAMED else "is no spark_dl setting"
        warnings.warn(f"{var} {why} and is ignored: set {instead} instead", stacklevel=3)


def _at_exit():
    shutdown()
    _core.mpi_finalize()


def shutdown():
    """Stops the runtime; pending operations fail with ShutdownError. Idempotent."""
    _core.shutdown()
    from spark_dl.common import handles

    handles._forget_all()


def init_serial():
    """How many times this process started the runtime (unnamed operations are numbered
    afresh in each: see :func:`spark_dl.common.ops.auto_name`)."""
    return _inits


def is_initialized():
    """True between ``init()`` and ``shutdown()``."""
    return _core.is_initialized()


def _topo(field):
    try:
        return _core.topology()[field]
    except _core.CoreError as e:
        raise_from_core(e)


def rank():
    """This process's rank in the job, 0..size()-1."""
    return _topo("rank")


def size():
    """The number of ranks in the job."""
    return _topo("size")


def local_rank():
    """This process's rank among the ranks on its host."""
    return _topo("local_rank")


def local_size():
    """The number of ranks on this host."""
    return _topo("local_size")


def cross_rank():
    """The index of this host among the job's hosts."""
    return _topo("cross_rank")


def cross_size():
    """The number of hosts in the job."""
    return _topo("cross_size")


def is_homogeneous():
    """True when every host runs the same number of ranks."""
    _topo("rank")
    return _homogeneous


def mpi_threads_supported():
    """True when MPI runs with MPI_THREAD_MULTIPLE (known after init on MPI)."""
    return bool(_core.mpi_threads_supported())


def gloo_built():
    return bool(_core.build_info()["gloo"])


def gloo_enabled():
    """True when the running job uses Gloo between processes (and before init, when built)."""
    return _controller == "gloo" if _controller else gloo_built()


def mpi_built():
    return bool(_core.build_info()["mpi"])


def mpi_enabled():
    """True when the running job (or the next init, by its configuration) uses MPI."""
    return _controller == "mpi"


def nccl_built():
    return bool(_core.build_info()["nccl"])


def cuda_built():
    return bool(_core.build_info()["cuda"])


def rocm_built():
    return False


def ddl_built():
    return False


def ccl_built():
    return False


_FLIGHT_CODES = ("ok", "invalid_argument", "mismatch", "peer_failure", "shutdown",
                 "not_initialized", "duplicate_name", "timeout")


def flight_recorder():
    """This rank's flight recorder: its last ``SDL_FLIGHT_RECORDER_SIZE`` collectives,
    oldest first, one dict each (id, name, op, dtype, shape, process_set, the steady-clock
    seconds since init when it was enqueued / negotiated / started / done, 0 for a step
    not reached, from_cache, state, and wall_time_base: the Unix time of second 0).
    Readable after a failure too (until the next ``init()``)."""
    try:
        base, rows = _core.flight_recorder()
    except _core.CoreError as e:
        raise_from_core(e)
    keys = ("id", "name", "op", "dtype", "shape", "process_set", "enqueued", "negotiated",
            "started", "done", "from_cache")
    out = []
    for row in rows:
        rec = dict(zip(keys, row[:11]))
        rec["shape"] = list(rec["shape"])
        rec["state"] = (_FLIGHT_CODES[row[11]] if rec["done"] else
                        "running" if rec["started"] else "waiting")
        rec["wall_time_base"] = base
        out.append(rec)
    return out


_TUNED_KEYS = ("serial", "fusion_threshold", "cycle_time_ms", "response_cache",
               "hierarchical_allreduce", "hierarchical_tuned", "done")


def autotune_state():
    """Autotune's parameters on this rank (docs/observability.md, section Autotune).

    A dict: ``applied`` (the values in force: serial, fusion_threshold,
    cycle_time_ms, response_cache, hierarchical_allreduce, hierarchical_tuned,
    done; serial 0 when autotune is off), ``world_cycles`` (negotiation cycles
    of the global process set so far) and ``changes``: every change of the
    applied values as ``(cycle, values)``, cycle being the first world cycle
    (0-based) that ran with them. Every rank switches in the same cycle, so
    ``changes`` is the same list on every rank.
    """
    try:
        applied, cycles, changes = _core.autotune_state()
    except _core.CoreError as e:
        raise_from_core(e)
    return {"applied": dict(zip(_TUNED_KEYS, applied)), "world_cycles": cycles,
            "changes": [(c, dict(zip(_TUNED_KEYS, p))) for c, p in changes]}


def counters():
    """What the core did so far: cycles, full_negotiations, cache_hits, collectives, ..."""
    try:
        return dict(_core.counters())
    except _core.CoreError as e:
        raise_from_core(e)


def set_knob(name, value):
    """Changes a tunable knob (e.g. ``fusion_threshold``, ``cycle_time_ms``) while running."""
    try:
        _core.set_knob(name, str(int(value) if isinstance(value, bool) else value))
    except _core.CoreError as e:
        raise_from_core(e)


def transport(process_set=None):
    """Which transport a process set uses on this rank: 'shm', 'gloo', 'mpi',
    'hierarchical' or 'self' (also after the runtime stopped)."""
    ps_id = 0 if process_set is None else process_set.process_set_id
    try:
        return _core.transport(ps_id)
    except _core.CoreError as e:
        raise_from_core(e)


def start_timeline(file_path, mark_cycles=False):
    """Starts writing the timeline (a Chrome-trace JSON file) to ``file_path``.

    Only rank 0 writes: its coordinator sees when every rank reports a tensor
    ready. Any rank may call it (Horovod's scripts call it on every rank); on
    the others it does nothing. A timeline already running is stopped first
    and its file closed. ``SDL_TIMELINE`` (or ``HOROVOD_TIMELINE``) starts one
    at :func:`init` instead. See docs/observability.md.

    Args:
        file_path: where rank 0 writes the trace (truncated if it exists).
        mark_cycles: also mark every negotiation cycle (``CYCLE_START``).

    Returns:
        True on the rank that writes the file (rank 0), else False.
    """
    try:
        return bool(_core.start_timeline(os.fspath(file_path), bool(mark_cycles)))
    except _core.CoreError as e:
        raise_from_core(e)


def stop_timeline():
    """Stops the timeline: rank 0 writes what is queued, the count of dropped
    records, and closes the file (which stays valid JSON). Does nothing where
    no timeline runs (and on other ranks than 0)."""
    try:
        _core.stop_timeline()
    except _core.CoreError as e:
        raise_from_core(e)
