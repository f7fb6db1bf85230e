"""How workers are started once ranks are assigned: one :class:`Launcher` per controller.

- :class:`GlooLauncher`: asks each task service to start the worker bootstrap for its
  rank, with the rank environment; workers meet through the authenticated rendezvous
  server on the driver.
- :class:`~spark_dl.spark.launch.mpi_launcher.MpiLauncher`: runs ``mpirun`` on the driver with
  an rsh agent that asks the task service of each host to start ``orted``, so MPI
  processes live inside the executors and no sshd is needed (see that module).

The MPI launcher builds on this module, so this module never imports it: the choice
between the two is :func:`spark_dl.spark.launch.spark_run.select_launcher`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from spark_dl.runner.gloo_run import worker_environment
from spark_dl.spark.launch.driver.plan import Placement
from spark_dl.spark.launch.driver.service import DriverService
from spark_dl.spark.launch.errors import RunError
from spark_dl.spark.launch.service import Endpoint, ServiceClient
from spark_dl.spark.launch.task.environment import DRIVER_VAR, format_endpoints

__all__ = ["Launcher", "GlooLauncher", "LaunchContext", "call_tasks"]

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
    # What a launcher that supervises processes on the driver (MPI) also needs.
    driver: Optional[DriverService] = None
    write_output: Optional[Callable[[str, bytes], None]] = None  # (stream, bytes)
    prefix_timestamp: bool = False
    verbose: int = 1
    nics: Optional[Sequence[str]] = None
    kill_grace: float = 3.0


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


def call_tasks(ctx: LaunchContext, placements: Sequence[Placement],
               call: Callable[[Placement], None]) -> None:
    """Runs ``call(placement)`` for each placement concurrently (each calls that rank's
    task service).

    Raises:
        RunError: some failed; one line per failed rank.
    """
    errors = _for_each(placements, call)
    failed = [(p, e) for p, e in zip(placements, errors) if e is not None]
    if failed:
        lines = [f"rank {p.rank} (task {p.task.index} on {p.task.hostname}): {e}"
                 for p, e in failed]
        raise RunError("could not start the workers through the task services:\n  "
                       + "\n  ".join(lines), ctx.job_id)


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

        call_tasks(ctx, ctx.placements, launch)
