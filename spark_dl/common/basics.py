"""init/shutdown and the topology queries, shared by every framework front end.

A process learns its place in the job from the environment its launcher set
(``sdlrun`` and ``spark_dl.spark.run`` set ``SDL_RANK``, ``SDL_SIZE``, ...;
Horovod's ``HOROVOD_*`` names and Open MPI's ``OMPI_COMM_WORLD_*`` are read
too). With none of them it runs alone: rank 0 of 1.
"""

import atexit
import os

from spark_dl import _core
from spark_dl.common.exceptions import InvalidArgumentError, raise_from_core

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "mpi_threads_supported", "gloo_built",
    "gloo_enabled", "mpi_built", "mpi_enabled", "nccl_built", "cuda_built", "rocm_built",
    "ddl_built", "ccl_built", "counters", "set_knob", "transport",
]

_TOPOLOGY_VARS = {
    "rank": ("SDL_RANK", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"),
    "size": ("SDL_SIZE", "HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"),
    "local_rank": ("SDL_LOCAL_RANK", "HOROVOD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"),
    "local_size": ("SDL_LOCAL_SIZE", "HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "cross_rank": ("SDL_CROSS_RANK", "HOROVOD_CROSS_RANK", "OMPI_COMM_WORLD_NODE_RANK"),
    "cross_size": ("SDL_CROSS_SIZE", "HOROVOD_CROSS_SIZE"),
}
_atexit_registered = False
_homogeneous = True


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


def init(comm=None, process_sets=None, **knobs):
    """Starts the runtime on this process (idempotent while initialized).

    Args:
        comm: reserved for an mpi4py communicator or a list of ranks (MPI
            builds); must be None in this build.
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
    global _atexit_registered, _homogeneous
    if comm is not None:
        raise InvalidArgumentError(
            "init(comm=...) needs spark_dl's MPI support, which this build does not have; "
            "launch with sdlrun (Gloo) and call init() without comm")
    from spark_dl.common import process_sets as ps_module

    environ = os.environ
    topo = _topology_from_env(environ)
    store = None
    if topo["size"] > 1:
        from spark_dl.runner.kvstore import client_from_env

        client = client_from_env(environ)
        if client is None:
            raise InvalidArgumentError(
                f"SDL_SIZE={topo['size']} but no rendezvous server is set "
                "(SDL_RENDEZVOUS_ADDR/SDL_RENDEZVOUS_PORT/SDL_SECRET_KEY): start the job "
                "with sdlrun or spark_dl.spark.run")
        store = _StoreAdapter(client)
    sets = []
    for s in process_sets or ():
        sets.append(list(s.ranks) if isinstance(s, ps_module.ProcessSet) else [int(r) for r in s])
    hostname = environ.get("SDL_HOSTNAME", "127.0.0.1" if topo["local_size"] == topo["size"] else "")
    try:
        started = _core.init(topo["rank"], topo["size"], topo["local_rank"], topo["local_size"],
                             topo["cross_rank"], topo["cross_size"], hostname, store, sets,
                             {k: str(int(v) if isinstance(v, bool) else v) for k, v in knobs.items()})
    except _core.CoreError as e:
        raise_from_core(e)
    if started:
        _homogeneous = topo["size"] % topo["local_size"] == 0
        ps_module._on_init(process_sets or ())
    if not _atexit_registered:
        atexit.register(shutdown)
        _atexit_registered = True


def shutdown():
    """Stops the runtime; pending operations fail with ShutdownError. Idempotent."""
    _core.shutdown()
    from spark_dl.common import handles

    handles._forget_all()


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
    """False: this build has no MPI (answers truthfully once MPI is built)."""
    return False


def gloo_built():
    return bool(_core.build_info()["gloo"])


def gloo_enabled():
    return gloo_built()


def mpi_built():
    return False


def mpi_enabled():
    return False


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
    """Which transport a process set uses on this rank: 'shm', 'gloo' or 'self'."""
    ps_id = 0 if process_set is None else process_set.process_set_id
    try:
        return _core.transport(ps_id)
    except _core.CoreError as e:
        raise_from_core(e)
