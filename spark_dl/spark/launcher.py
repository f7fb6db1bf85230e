"""How workers are started once ranks are assigned: one :class:`Launcher` per controller.

- :class:`GlooLauncher` (available): asks each task service to start the worker
  bootstrap for its rank, with the rank environment; workers meet through the
  authenticated rendezvous server on the driver.
- :class:`MpiLauncher` (not built yet): will run ``mpirun`` on the driver with
  ``-mca plm_rsh_agent`` pointing to a small agent (``python -m
  spark_dl.spark.mpi_rsh``) that receives the secret on an inherited pipe and asks the
  task service of the named host (its ``launch`` method with ``command=``) to run
  ``orted``, so MPI processes live inside the executors and no sshd is needed. Every
  piece it needs on the task side exists: ``launch(command=...)`` runs an arbitrary
  argv with the secret on stdin and forwards its output.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from spark_dl.runner.gloo_run import worker_environment
from spark_dl.spark.driver.plan import Placement
from spark_dl.spark.run_errors import MpiNotBuiltError, RunError
from spark_dl.spark.service import Endpoint, ServiceClient
from spark_dl.spark.task.environment import DRIVER_VAR, format_endpoints

__all__ = ["Launcher", "GlooLauncher", "MpiLauncher", "LaunchContext", "select_launcher"]

_PARALLEL_CALLS = 32


@dataclass
class LaunchContext:
    """What a launcher needs to start a job's workers."""

    job_id: str
    secret: bytes = field(repr=False)
    placements: List[Placement]
    driver_endpoints: List[Endpoint]
    rendezvous: Tuple[str, int]
    start_timeout: float
    user_env: Mapping[str, str]
    tasks: Dict[int, ServiceClient]  # task index -> client of its task service


def _for_each(items: Sequence, call) -> List[Optional[BaseException]]:
    """Runs ``call(item)`` concurrently; returns each call's exception or None."""
    def guarded(item):
        try:
            call(item)
            return None
        except Exception as exc:
            return exc

    if not items:
        return []
    with ThreadPoolExecutor(min(_PARALLEL_CALLS, len(items))) as pool:
        return list(pool.map(guarded, items))


class Launcher(ABC):
    """Starts and stops the workers of one job through the task services."""

    name = ""

    @abstractmethod
    def start(self, ctx: LaunchContext) -> None:
        """Starts every rank's process; raises :class:`RunError` if one cannot start."""

    def stop(self, ctx: LaunchContext, timeout: float = 5.0) -> None:
        """Asks every task service to stop its process (best effort, bounded)."""
        _for_each(list(ctx.tasks.values()),
                  lambda client: client.call("terminate", timeout=timeout))


class GlooLauncher(Launcher):
    """One worker per task, started by its task service."""

    name = "gloo"

    def worker_env(self, ctx: LaunchContext, placement: Placement) -> Dict[str, str]:
        """The variables of one worker (everything but the secret)."""
        single_host = len({p.task.host_hash for p in ctx.placements}) == 1
        peer_address = "127.0.0.1" if single_host else placement.task.endpoints[0][0]
        env = worker_environment(placement.slot, peer_address, ctx.rendezvous[0],
                                 ctx.rendezvous[1], ctx.secret, ctx.job_id, ctx.start_timeout)
        del env["SDL_SECRET_KEY"]  # reaches the worker on its stdin instead
        env[DRIVER_VAR] = format_endpoints(ctx.driver_endpoints)
        # The core groups ranks for shared memory by this identity: make it the grouping
        # the ranks were assigned by (same host, boot and namespaces).
        env["SDL_HOST_ID"] = placement.task.host_hash
        return {**ctx.user_env, **env}

    def start(self, ctx: LaunchContext) -> None:
        def launch(placement: Placement) -> None:
            ctx.tasks[placement.task.index].call(
                "launch", rank=placement.rank, env=self.worker_env(ctx, placement))

        errors = _for_each(ctx.placements, launch)
        failed = [(p, e) for p, e in zip(ctx.placements, errors) if e is not None]
        if failed:
            lines = [f"rank {p.rank} (task {p.task.index} on {p.task.hostname}): {e}"
                     for p, e in failed]
            raise RunError("could not start the workers through the task services:\n  "
                           + "\n  ".join(lines), ctx.job_id)


class MpiLauncher(Launcher):
    """``mpirun`` through the task services (see the module docstring); not built yet."""

    name = "mpi"

    def __init__(self, extra_mpi_args: Optional[str] = None):
        raise MpiNotBuiltError(
            "spark_dl.spark.run(use_mpi=True): the MPI launcher of spark_dl.spark.run "
            "(mpirun reaching the executors through the task services) is not built yet in "
            "this version; run with Gloo (use_mpi=None or False, the default), or use "
            "sdlrun --mpi outside Spark")

    def start(self, ctx: LaunchContext) -> None:  # pragma: no cover - not constructible
        raise MpiNotBuiltError("MPI launcher not built")


def select_launcher(use_mpi: Optional[bool], use_gloo: Optional[bool],
                    extra_mpi_args: Optional[str] = None) -> Launcher:
    """Picks the launcher: an explicit choice, else Gloo (Horovod prefers MPI when it is
    built; here Gloo is the only launcher built for Spark).

    Raises:
        ValueError: both or neither explicitly chosen.
        MpiNotBuiltError: MPI asked for (this build has no MPI).
    """
    if use_mpi and use_gloo:
        raise ValueError("use_mpi and use_gloo are mutually exclusive")
    if use_mpi or (use_gloo is False and use_mpi is None):
        return MpiLauncher(extra_mpi_args)
    if use_mpi is False and use_gloo is False:
        raise ValueError("use_mpi=False and use_gloo=False leave no way to start the workers")
    if extra_mpi_args:
        warnings.warn("extra_mpi_args is ignored: the workers run with Gloo", stacklevel=3)
    return GlooLauncher()
