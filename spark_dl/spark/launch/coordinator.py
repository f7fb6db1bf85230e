"""Task 0 of the barrier job: the job's coordinator.

The caller of :func:`spark_dl.spark.run` may be unreachable from the executors (a Spark
Connect client: a Databricks notebook, a laptop), so nothing in the job connects to it
unless it can. The coordination that needs a fixed address lives in the job's task 0
instead, in the executor that runs it:

1. task 0 starts the driver service (registrations, code, results, errors, output:
   :mod:`~spark_dl.spark.launch.driver.service`) and the rendezvous server, and every
   task learns their addresses through the caller link or ``BarrierTaskContext.allGather``
   (:mod:`~spark_dl.spark.launch.barrier`);
2. every task (task 0 too, on a thread) starts its task service and registers;
3. task 0 assigns ranks grouped by host, starts the workers through the task services
   (Gloo) or runs ``mpirun`` with the rsh agent (MPI: ``orted`` still runs inside the
   executors), and waits for the results or the first failure (stopping every worker
   then, bounded);
4. task 0 returns the outcome as the job's rows (:mod:`~spark_dl.spark.launch.rows`):
   the results by rank, or the failure naming the rank, host and cause; the workers'
   output went to the caller while the job ran (:mod:`~spark_dl.spark.launch.link`).

Phases are reported as wall-clock times (``time.time()``): the caller measures from its
own call, on another machine perhaps, so they are as exact as the clocks agree.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence

from spark_dl.runner.kvstore import KVStoreServer
from spark_dl.spark.launch import rows
from spark_dl.spark.launch.driver.plan import plan_ranks
from spark_dl.spark.launch.driver.report import failure_report, ranks_text
from spark_dl.spark.launch.driver.service import TASK_SILENT_S, DriverService, Failure
from spark_dl.spark.launch.errors import RunError, WorkerFailedError
from spark_dl.spark.launch.launcher import GlooLauncher, Launcher, LaunchContext
from spark_dl.spark.launch.link import OutputRoute, Spool
from spark_dl.spark.launch.network import interface_addresses
from spark_dl.spark.launch.service import Endpoint, ServiceClient, log_to_stderr

__all__ = ["JobSettings", "Coordinator", "make_launcher", "error_document"]

# Bounds of the clean-up after a failure: stop the workers.
_STOP_WAIT_S_EXTRA = 4.0
# After success: workers exit right after posting their results.
_FINISH_WAIT_S = 30.0
# How long task 0 waits for the caller's answer when it may be the one cut off.
_CALLER_PROBE_S = 3.0
# Before stopping its services, task 0 lets the other tasks learn the job is over (their
# next ping, every second) and say they ended.
_TASKS_END_WAIT_S = 5.0


@dataclass
class JobSettings:
    """Everything the job's tasks need, shipped inside the Spark job (never logged)."""

    job_id: str
    secret: bytes = field(repr=False)
    num_proc: int = 1
    code: bytes = field(default=b"", repr=False)
    pickler: str = ""
    start_timeout: float = 600.0
    user_env: Mapping[str, str] = field(default_factory=dict, repr=False)
    verbose: int = 1
    nics: Optional[Sequence[str]] = None
    prefix_timestamp: bool = False
    kill_grace: float = 3.0
    launcher: str = "gloo"
    extra_mpi_args: Any = None
    # Every executor runs on the caller's machine (local/local-cluster masters): the
    # services bind and advertise 127.0.0.1.
    local: bool = False
    caller: Optional[List[Endpoint]] = None
    spool: Optional[Spool] = None
    # How the tasks learn where task 0 listens: "gather" (BarrierTaskContext.allGather),
    # or "link" (through the caller link, where the executors are sure to reach it).
    exchange: str = "gather"


def make_launcher(name: str, extra_mpi_args=None) -> Launcher:
    """The launcher ``name`` (``gloo`` or ``mpi``); raises MpiNotBuiltError for ``mpi``
    without Open MPI's ``mpirun`` on this executor."""
    if name == "mpi":
        from spark_dl.spark.launch.mpi_launcher import MpiLauncher

        return MpiLauncher(extra_mpi_args)
    return GlooLauncher()


def coordinator_addresses(settings: JobSettings, spark_address: str) -> List[str]:
    """Where task 0's services bind and are advertised: the ``nics`` interfaces, else
    127.0.0.1 on local masters, else the executor's address as Spark knows it (the one
    the other executors already reach it by)."""
    if settings.nics:
        return interface_addresses(settings.nics)
    if settings.local:
        return ["127.0.0.1"]
    from spark_dl.spark.launch.network import _resolve

    host = spark_address.rsplit(":", 1)[0].strip("[]") if spark_address else ""
    return [_resolve(host) if host else "127.0.0.1"]


def error_document(exc: BaseException, job_id: str) -> dict:
    """A failure as JSON-able fields (rebuilt into the same error class by the caller)."""
    doc = {"class": type(exc).__name__, "message": str(exc), "job_id": job_id}
    if isinstance(exc, WorkerFailedError):
        doc.update(rank=exc.rank, traceback=exc.remote_traceback, exit_code=exc.exit_code,
                   failures=list(exc.failures))
    elif not isinstance(exc, RunError):
        doc["traceback"] = "".join(traceback.format_exception(type(exc), exc,
                                                              exc.__traceback__))
    python = getattr(exc, "python", None)
    if python:
        doc["python"] = python
    return doc


class Coordinator:
    """Task 0's part of one job (see the module doc).

    Args:
        settings: the job's settings.
        spark_address: this executor's ``host:port`` as Spark knows it.
    """

    def __init__(self, settings: JobSettings, spark_address: str):
        s = settings
        self.settings = s
        self.times: Dict[str, float] = {}
        self._log = log_to_stderr("spark_dl coordinator") if s.verbose >= 2 else None
        self.addresses = coordinator_addresses(s, spark_address)
        self.route: Optional[OutputRoute] = None
        self.driver: Optional[DriverService] = None
        self.kv: Optional[KVStoreServer] = None
        self.endpoints: List[Endpoint] = []
        self.rendezvous = ("", 0)
        self._cut_off = False  # this host judged cut off from the rest (_weigh_silence)

    # ------------------------------------------------------------------ start

    def start(self) -> List[Endpoint]:
        """Starts the output route, the driver service and the rendezvous server;
        returns the driver service's endpoints (for the other tasks)."""
        s = self.settings
        self.route = OutputRoute(s.secret, s.caller, s.spool, echo=_echo_to_stderr)
        self.driver = DriverService(s.secret, s.num_proc, s.code, self.addresses,
                                    self.route.write, log=self._log, pickler=s.pickler)
        self.kv = KVStoreServer(s.secret, host=self.addresses[0])
        self.endpoints = self.driver.start()
        self.rendezvous = (self.addresses[0], self.kv.start())
        self.times["services"] = time.time()
        return self.endpoints

    def stop(self) -> None:
        # The rendezvous server's stop waits for its serve loop's next poll (up to 0.1 s):
        # overlapped with the rest and with the end of the task.
        if self.kv is not None:
            threading.Thread(target=_quietly, args=(self.kv.stop,), name="sdl-kvstore-stop",
                             daemon=True).start()
        if self.driver is not None:
            _quietly(self.driver.stop)
        if self.route is not None:
            self.route.close()

    def log(self, text: str) -> None:
        if self.route is not None:
            self.route.write("stderr", f"spark_dl.spark.run: {text}\n".encode())

    # ------------------------------------------------------------------ the job

    def run(self) -> Iterator[rows.Row]:
        """Coordinates the job; yields its rows (results, or the failure)."""
        s = self.settings
        outcome: List[rows.Row] = []
        ctx = LaunchContext(s.job_id, s.secret, [], self.endpoints, self.rendezvous,
                            s.start_timeout, dict(s.user_env), {}, driver=self.driver,
                            write_output=self.route.write, prefix_timestamp=s.prefix_timestamp,
                            verbose=s.verbose, nics=list(s.nics or []) or None,
                            kill_grace=s.kill_grace)
        launcher: Optional[Launcher] = None
        try:
            launcher = make_launcher(s.launcher, s.extra_mpi_args)
            blobs = self._run(ctx, launcher)
            for rank, blob in enumerate(blobs):
                outcome.extend(rows.pieces("result", rank, blob))
        except BaseException as exc:  # every failure goes back to the caller as rows
            outcome.extend(self._error_rows(exc))
            if ctx.tasks:
                self._stop(ctx, launcher)
        finally:
            for client in ctx.tasks.values():
                client.close()
        self._wait_for_tasks()
        self.times.update(self.driver.wall_times())
        self.route.close()
        outcome.extend(self._output_rows())
        outcome.append(("phases", -1, 0, json.dumps(self.times).encode()))
        return iter(outcome)

    def _run(self, ctx: LaunchContext, launcher: Launcher) -> List[bytes]:
        s = self.settings
        advice = (f"Check that the executors can reach each other (task 0's services at "
                  f"{self.endpoints}; choose interfaces with nics=), that spark_dl is "
                  "installed on the executors, and the executor logs of those tasks.")
        try:
            regs = self.driver.wait_for_registrations(s.start_timeout, lambda: None, advice)
        except RunError:
            raise
        except RuntimeError as exc:
            raise RunError(f"the workers could not start: {exc}", s.job_id) from None
        ctx.placements = plan_ranks(regs)
        ctx.tasks = {r.index: ServiceClient("task", s.secret, r.endpoints, timeout=30.0)
                     for r in regs}
        self.driver.set_ranks({p.task.index: p.rank for p in ctx.placements})
        self.route.report("plan", {p.task.index: [p.rank, p.task.hostname]
                                   for p in ctx.placements})
        if s.verbose >= 2:
            self.log(f"job {s.job_id}: {s.num_proc} workers ({launcher.name}), coordinator "
                     f"at {self.endpoints}, rendezvous at {self.rendezvous[0]}:"
                     f"{self.rendezvous[1]}")
            for p in ctx.placements:
                self.log(f"rank {p.rank} (local {p.slot.local_rank}/{p.slot.local_size}) "
                         f"-> task {p.task.index} on {p.task.hostname} "
                         f"{p.task.endpoints} gpus={p.task.gpus}")
        launcher.start(ctx)
        self.times["launched"] = time.time()
        failures = self.driver.wait_for_outcome(lambda: None)
        if failures:
            raise self._error(self._weigh_silence(failures, ctx.placements))
        blobs = self.driver.results()
        if self.driver.wait_for_exits([p.rank for p in ctx.placements], _FINISH_WAIT_S):
            self.log("warning: workers did not end after returning their results; "
                     "stopping them")
            self._stop(ctx, launcher)
        return blobs

    def _weigh_silence(self, failures: List[Failure], placements) -> List[Failure]:
        """When every task on the other hosts fell silent at once, that alone does not say
        whether their hosts or this one (task 0's) lost the network. The caller's link
        tells: if the caller cannot be reached either, this host is the one cut off, and
        its ranks are the lost ones; without a link the report names both possibilities."""
        silent = {f.rank for f in failures if f.unreachable}
        task0 = next((p.task for p in placements if p.task.index == 0), None)
        if task0 is None:
            return failures
        here = task0.host_hash
        away = {p.rank for p in placements if p.task.host_hash != here}
        if not away or not away <= silent:
            return failures
        reachable = self.route.caller_reachable(_CALLER_PROBE_S)
        if reachable:
            return failures  # the other hosts are cut off, as reported
        name = task0.hostname
        local = sorted(p.rank for p in placements if p.task.host_hash == here)
        others: Dict[str, List[int]] = {}
        for p in placements:
            if p.rank in away:
                others.setdefault(p.task.hostname, []).append(p.rank)
        heard = "; ".join(f"{host}: {ranks_text(sorted(r))}" for host, r in others.items())
        if reachable is None:
            root = failures[0]
            root.summary += (f". Or {name}, task 0's own host, is the one cut off: every "
                             f"other host fell silent at once ({heard}), and with no link "
                             "to the caller task 0 cannot tell which")
            return failures
        self._cut_off = True
        summary = (f"{ranks_text(local)} on {name} were lost: {name}, the host of task 0 (the "
                   "job's coordinator), is cut off from the network: no task on any other "
                   f"host has been heard from for {TASK_SILENT_S:g} s ({heard}), and the "
                   "caller cannot be reached from it either")
        root = Failure(1, summary, rank=local[0], lost=True, unreachable=True)
        return [root] + [f for f in failures if not f.unreachable]

    def _error(self, failures: List[Failure]) -> RunError:
        job_id = self.settings.job_id
        root = failures[0]
        message, lines = failure_report(failures, self.driver.finished_ranks())
        if root.rank is None:
            return RunError(message, job_id)
        error = WorkerFailedError(message, root.rank, root.traceback, root.exit_code,
                                  lines, job_id)
        error.cause_blob = root.exception
        return error

    def _error_rows(self, exc: BaseException) -> List[rows.Row]:
        doc = error_document(exc, self.settings.job_id)
        if self._cut_off:
            # The caller need not wait for the Spark job to end: it cannot before Spark
            # gives up on this executor (spark.network.timeout).
            doc["task0_cut_off"] = True
        cause = getattr(exc, "cause_blob", None)
        # First to the caller directly: Spark may fail the job (and kill this task)
        # before its rows arrive, e.g. when the failure was an executor lost.
        self.route.report("outcome", doc, cause)
        out = [("error", -1, 0, json.dumps(doc).encode())]
        if cause:
            out.extend(rows.pieces("cause", -1, cause))
        return out

    def _stop(self, ctx: LaunchContext, launcher: Optional[Launcher]) -> None:
        """Stops every worker (bounded)."""
        start = time.monotonic()
        self.driver.begin_stop()
        if launcher is not None:
            launcher.stop(ctx)
        left = self.settings.kill_grace + _STOP_WAIT_S_EXTRA - (time.monotonic() - start)
        missing = self.driver.wait_for_exits([p.rank for p in ctx.placements], max(left, 0.5))
        if missing and self.settings.verbose >= 1:
            self.log(f"ranks {missing} did not report their end; their tasks stop them")

    def _wait_for_tasks(self) -> None:
        """Lets the other tasks learn that the job is over before the services stop."""
        self.driver.begin_stop()
        self.driver.wait_for_tasks_ended(_TASKS_END_WAIT_S)

    def _output_rows(self) -> List[rows.Row]:
        route = self.route
        out: List[rows.Row] = []
        seq = 0
        if route.dropped_bytes:
            note = (f"spark_dl.spark.run: {route.dropped_bytes} bytes of the workers' "
                    "earliest output did not fit in the job's result (see the executor log "
                    "of task 0)\n").encode()
            out.append(("stderr", -1, seq, note))
            seq += 1
        for _, stream, data in route.kept:
            for _, _, _, piece in rows.pieces(stream, -1, data):
                out.append((stream, -1, seq, piece))
                seq += 1
        return out


def _quietly(stop: Callable[[], None]) -> None:
    try:
        stop()
    except Exception:  # stopping: nothing left to report to
        pass


def _echo_to_stderr(stream: str, data: bytes) -> None:
    """Output the caller does not get live also goes to the executor's log."""
    try:
        sys.stderr.write(data.decode("utf-8", errors="replace"))
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
