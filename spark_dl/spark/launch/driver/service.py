"""The driver service: where tasks register and workers fetch code and report back.

It runs in the Spark driver for the duration of one :func:`spark_dl.spark.run`. Methods
(all authenticated, see :mod:`spark_dl.spark.launch.service`):

================  =====================================================================
``register``      a task service announces itself: index, host hash, endpoints, GPUs
``task_failed``   a task's own code failed (before or while hosting its worker)
``ping``          a task service asks whether to keep going (``{"stop": bool}``), every
                  second; the connection it pings on is the task's: if it closes before
                  the task's rank reported its end, that rank is reported lost (executor
                  lost, task killed) after :data:`TASK_LOST_S`; if it stays open but
                  silent for :data:`TASK_SILENT_S`, the rank is reported unreachable
                  (its host cut off: no connection closes then)
``code``          a worker fetches the pickled ``(fn, args, kwargs)``, which pickler made
                  it, and the variables to set in-process before running it (MPI path)
``result``        a worker posts its pickled return value
``error``         a worker posts its exception: summary, traceback, pickled exception
``output``        a task service forwards rank-prefixed worker output
``worker_exit``   a task service reports its worker's exit code
``task_end``      a task is about to end (its worker ended or the job is over)
================  =====================================================================

The driver thread waits on this object (:meth:`DriverService.wait_for_registrations`,
:meth:`DriverService.wait_for_outcome`); handlers only record and notify. On the MPI path
the launcher, not the task services, learns how the ranks' processes ended (from
``mpirun``) and reports it with :meth:`DriverService.job_ended`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence

from spark_dl.spark.launch.errors import CONSEQUENCES, StartTimeoutError, strip_ansi
from spark_dl.spark.launch.service import Endpoint, ServiceServer

__all__ = ["DriverService", "Registration", "Failure"]

CONSEQUENCE_PRIORITY = 3
# After the first failure, wait this long for the other ranks' reports, so the root
# cause (e.g. a killed rank) wins over its consequences (peers that lost it).
SETTLE_S = 1.0
# While the only failures are consequences or lost tasks, wait up to this long for their
# cause: on MPI a killed rank is known only once mpirun has stopped the job (about 1-2 s
# later, more on a loaded machine), and the task hosting mpirun may vanish before that.
CONSEQUENCE_SETTLE_S = 6.0
# Largest payload per method, checked on the authenticated header before the body is
# read (other methods: the service's default, 64 KiB). A result is the function's pickled
# return value; an error carries a pickled exception and its traceback; output comes in
# batches of about 1 MiB.
# A task's kept-alive connection (its pings and exit report) that closed without its
# rank's exit being reported, and is not replaced by a new ping within this long, means
# the task is gone (its executor was lost or Spark killed it): that rank is the cause.
TASK_LOST_S = 2.0
# A launched task that has not pinged (every second) for this long is cut off from task 0
# (its host's network is down, or it is stalled): its rank fails the job as lost. Below
# the core's default SDL_TIMEOUT (30 s), after which its peers would fail with
# PeerFailureError, naming no host; above any pause of a task's ping thread seen on a
# loaded 2-core machine (a few seconds).
TASK_SILENT_S = 15.0
REQUEST_LIMITS = {"result": 1 << 31, "error": 256 << 20, "output": 64 << 20,
                  "task_failed": 16 << 20, "register": 1 << 20}


@dataclass(frozen=True)
class Registration:
    """What one task service told the driver about itself."""

    index: int
    host_hash: str
    hostname: str
    endpoints: List[Endpoint]
    gpus: List[str]
    pid: int
    # The network (CIDR) of the interface holding each endpoint's address, where the task
    # could tell (Open MPI's btl_tcp_if_include needs them across hosts).
    networks: List[Optional[str]] = field(default_factory=list)


@dataclass
class Failure:
    """One failed rank or task.

    ``priority`` orders root causes: 0 an exception of the function, 1 a worker exit
    without an exception (killed, ``os._exit``), 2 a task failure, 3 an exception caused
    by another rank's failure.
    """

    priority: int
    summary: str
    rank: Optional[int] = None
    traceback: Optional[str] = None
    exit_code: Optional[int] = None
    exception: Optional[bytes] = None
    at: float = field(default_factory=time.monotonic)
    # For an exception: "ShutdownError: spark_dl has been shut down" (its type's name
    # and message, without the "rank N raised" of the summary).
    detail: Optional[str] = None
    # A rank whose task vanished without reporting the worker's end: the truth, but often
    # the echo of another rank's failure (mpirun tearing the job down after one rank was
    # killed), whose own report may still be on its way.
    lost: bool = False
    # A rank whose task stopped pinging (:data:`TASK_SILENT_S`): its host is cut off from
    # task 0's, or task 0's from the rest (the coordinator weighs which).
    unreachable: bool = False

    def __post_init__(self):
        # Text from a worker may carry its terminal's colour codes (Keras, rich); the
        # error it becomes is read in logs and notebooks, where they show as "[1m".
        self.summary = strip_ansi(self.summary)
        if self.traceback:
            self.traceback = strip_ansi(self.traceback)
        if self.detail:
            self.detail = strip_ansi(self.detail)

    @property
    def consequence(self) -> bool:
        """Whether this is an exception a rank raises because another rank failed or
        finished first (:data:`CONSEQUENCES`): never the root cause of a job's failure
        while another failure is known."""
        return self.priority == CONSEQUENCE_PRIORITY

    @property
    def inconclusive(self) -> bool:
        """A consequence or a lost task: the outcome waits longer for a more specific
        cause (:data:`CONSEQUENCE_SETTLE_S`), which then comes first."""
        return self.consequence or self.lost


def describe_exit(code: int) -> str:
    """``exit code 1`` or ``exit code 137 (signal 9, SIGKILL)``."""
    text = f"exit code {code}"
    if code > 128:
        import signal

        try:
            text += f" (signal {code - 128}, {signal.Signals(code - 128).name})"
        except ValueError:
            pass
    return text


class DriverService:
    """The driver's side of one job.

    Args:
        secret: the job secret.
        num_proc: number of tasks and workers.
        code: the pickled ``(fn, args, kwargs)`` workers fetch.
        pickler: names the pickler that made ``code`` (for workers' error messages).
        hosts: addresses to bind.
        write_output: ``(stream, data)`` sink for forwarded worker output.
        log: diagnostics sink (refused requests); None: silent.
    """

    def __init__(self, secret: bytes, num_proc: int, code: bytes, hosts: Sequence[str],
                 write_output: Callable[[str, bytes], None],
                 log: Optional[Callable[[str], None]] = None, pickler: str = ""):
        self.num_proc = num_proc
        self._code = {"function": code, "pickler": pickler}
        self._worker_env: Dict[int, Dict[str, str]] = {}
        self._write_output = write_output
        self._cond = threading.Condition()
        self._registrations: Dict[int, Registration] = {}
        self._rank_of: Optional[Dict[int, int]] = None  # task index -> rank, once launched
        self._results: Dict[int, bytes] = {}
        self._exits: Dict[int, int] = {}
        self._errors: set = set()  # ranks that posted an exception
        self._failures: List[Failure] = []
        self._stopping = False
        self._ended = False  # the launcher reported that every rank's process ended
        self._lost: Dict[int, float] = {}  # task index -> when its connection closed
        self._heard: Dict[int, float] = {}  # task index -> its last registration or ping
        self._fetched: set = set()  # ranks that fetched the function
        self._tasks_ended: set = set()  # task indexes that said they end
        # When each stage of the job was complete on every task or rank (monotonic
        # seconds): "registered", "code_fetched", "results", "exited" (see times()).
        self._times: Dict[str, float] = {}
        self.server = ServiceServer("driver", secret, {
            "register": self._register, "task_failed": self._task_failed,
            "ping": self._ping, "code": self._get_code, "result": self._result,
            "error": self._error, "output": self._output, "worker_exit": self._worker_exit,
            "task_end": self._task_end,
        }, hosts=hosts, limits=REQUEST_LIMITS, log=log, on_disconnect=self._disconnected)

    def start(self) -> List[Endpoint]:
        return self.server.start()

    def stop(self) -> None:
        self.server.stop()

    # ---- handlers (service threads) -------------------------------------------------

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.num_proc:
            raise ValueError(f"task index {index} outside 0..{self.num_proc - 1}")

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_proc:
            raise ValueError(f"rank {rank} outside 0..{self.num_proc - 1}")

    def _register(self, index: int, host_hash: str, hostname: str, endpoints, gpus,
                  pid: int, networks=None) -> dict:
        self._check_index(index)
        self.server.tag("task", index)  # its pings and exit report follow on this connection
        reg = Registration(index, str(host_hash), str(hostname),
                           [(str(h), int(p)) for h, p in endpoints], [str(g) for g in gpus],
                           int(pid), [None if n is None else str(n) for n in networks or ()])
        with self._cond:
            if self._rank_of is not None:
                # Spark restarted a task (stage retry) after the workers were launched:
                # the job cannot continue with a rank's process gone.
                self._fail(Failure(2, f"task {index} on {hostname} was started again by "
                                      "Spark after the workers were launched (a task or "
                                      "executor of this job failed; see the executor logs)"))
                return {"accepted": False}
            self._registrations[index] = reg  # a retry before launch replaces the first
            self._heard[index] = time.monotonic()
            if len(self._registrations) == self.num_proc:
                self._times.setdefault("registered", time.monotonic())
            self._cond.notify_all()
        return {"accepted": True}

    def _task_failed(self, index: int, traceback: str) -> None:
        self._check_index(index)
        with self._cond:
            reg = self._registrations.get(index)
            where = f" on {reg.hostname}" if reg else ""
            rank = None if self._rank_of is None else self._rank_of.get(index)
            self._fail(Failure(2, f"task {index}{where} failed", rank=rank,
                               traceback=traceback))

    def _ping(self, index: int) -> dict:
        self._check_index(index)
        self.server.tag("task", index)
        with self._cond:
            self._lost.pop(index, None)  # (re)connected: not lost
            self._heard[index] = time.monotonic()
            return {"stop": self._stopping or self._ended}

    def _task_end(self, index: int) -> None:
        self._check_index(index)
        with self._cond:
            self._tasks_ended.add(index)
            self._cond.notify_all()

    def _disconnected(self, tags: dict) -> None:
        index = tags.get("task")
        with self._cond:
            if index is None or self._rank_of is None or self._stopping or self._ended:
                return
            rank = self._rank_of.get(index)
            if rank is not None and rank not in self._exits:
                self._lost[index] = time.monotonic()
                self._cond.notify_all()

    def _check_lost(self, confirmed: bool = False) -> None:
        """Caller holds the condition: fails the ranks whose task is gone (see
        :data:`TASK_LOST_S`); ``confirmed``: the Spark job failed, so every task whose
        connection closed is gone, without waiting."""
        now = time.monotonic()
        for index, since in list(self._lost.items()):
            rank = self._rank_of.get(index) if self._rank_of else None
            if rank is None or rank in self._exits or self._stopping or self._ended:
                del self._lost[index]
                continue
            if now - since < TASK_LOST_S and not confirmed:
                continue
            del self._lost[index]
            reg = self._registrations.get(index)
            where = f" on {reg.hostname} (task process pid {reg.pid})" if reg else ""
            self._exits[rank] = -1
            self._fail(Failure(1, f"rank {rank} was lost: its Spark task {index}{where} "
                                  "disappeared without reporting the worker's end (its "
                                  "executor was lost or the task was killed; see the Spark "
                                  "executor logs)", rank=rank, lost=True))
        if self._rank_of is None or self._stopping or self._ended:
            return
        for index, rank in sorted(self._rank_of.items(), key=lambda item: item[1]):
            silent = now - self._heard.get(index, now)
            if silent < TASK_SILENT_S or rank in self._exits or rank in self._results or \
                    rank in self._errors or index in self._tasks_ended:
                continue
            reg = self._registrations.get(index)
            where = f" on {reg.hostname}" if reg else ""
            self._exits[rank] = -1
            self._fail(Failure(1, f"rank {rank}{where} is unreachable: its Spark task "
                                  f"{index} has not been heard from for {silent:.0f} s (its "
                                  "host is cut off from task 0's, or stalled)", rank=rank,
                               lost=True, unreachable=True))

    def _get_code(self, rank: int) -> dict:
        self._check_rank(rank)
        with self._cond:
            self._fetched.add(rank)
            if len(self._fetched) == self.num_proc:
                self._times.setdefault("code_fetched", time.monotonic())
        return {**self._code, "env": self._worker_env.get(rank, {})}

    def _result(self, rank: int, value: bytes) -> None:
        self._check_rank(rank)
        with self._cond:
            self._results[rank] = value
            if len(self._results) == self.num_proc:
                self._times.setdefault("results", time.monotonic())
            self._cond.notify_all()

    def _error(self, rank: int, exc_type: str, summary: str, traceback: str,
               exception: Optional[bytes]) -> None:
        self._check_rank(rank)
        name = exc_type.rsplit(".", 1)[-1]
        prefix = f"rank {rank} raised "
        detail = summary[len(prefix):] if summary.startswith(prefix) else summary
        with self._cond:
            self._errors.add(rank)
            self._fail(Failure(CONSEQUENCE_PRIORITY if name in CONSEQUENCES else 0, summary,
                               rank=rank, traceback=traceback, exception=exception,
                               detail=detail))

    def _output(self, stream: str, data: bytes) -> None:
        self._write_output("stderr" if stream == "stderr" else "stdout", data)

    def _worker_exit(self, index: int, rank: int, code: int) -> None:
        self._check_rank(rank)
        with self._cond:
            self._exits[rank] = code
            if len(self._exits) == self.num_proc:
                self._times.setdefault("exited", time.monotonic())
            reg = self._registrations.get(index)
            where = f" on {reg.hostname}" if reg else ""
            if rank in self._results:
                if code != 0 and not self._stopping:
                    # The result is in: report the exit, but do not fail the job for it.
                    self._write_output("stderr", (
                        f"spark_dl.spark.run: warning: rank {rank}{where} returned its result "
                        f"but then ended with {describe_exit(code)}\n").encode())
            elif rank not in self._errors:
                if code != 0:
                    self._fail(Failure(1, f"rank {rank}{where} ended with "
                                          f"{describe_exit(code)}", rank=rank,
                                       exit_code=code))
                else:
                    self._fail(Failure(1, f"rank {rank}{where} exited without returning a "
                                          "result", rank=rank, exit_code=code))
            self._cond.notify_all()

    def _fail(self, failure: Failure) -> None:
        # Caller holds the condition. Once stopping, new failures are consequences.
        if not self._stopping:
            self._failures.append(failure)
            self._cond.notify_all()

    # ---- the driver thread ----------------------------------------------------------

    def wait_for_registrations(self, timeout: float, problem: Callable[[], Optional[str]],
                               advice: str = "") -> List[Registration]:
        """Waits until every task registered; returns them by task index.

        Args:
            timeout: seconds (``start_timeout``).
            problem: polled; a message when the Spark job ended (stops the wait).
            advice: appended to the timeout error (what to check).

        Raises:
            StartTimeoutError: not all registered in time; the message names the missing
                tasks.
            RuntimeError: ``problem()`` reported one, or a task failed before registering.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self._registrations) < self.num_proc:
                if self._failures:
                    raise RuntimeError(_failure_text(self._failures[0]))
                text = problem()
                if text is not None:
                    raise RuntimeError(text)
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(self.num_proc)) - set(self._registrations))
                    raise StartTimeoutError(
                        f"{len(missing)} of {self.num_proc} Spark tasks did not register "
                        f"with the job's coordinator (task 0) within {timeout:g} s: tasks "
                        f"{', '.join(map(str, missing))}. {advice}".rstrip())
                self._cond.wait(min(left, 0.1))
            return [self._registrations[i] for i in range(self.num_proc)]

    def set_worker_env(self, env_of: Mapping[int, Mapping[str, str]]) -> None:
        """Per rank, variables its bootstrap sets in-process before running the function
        (MPI path: one ``orted`` starts every rank of a host with one environment)."""
        with self._cond:
            self._worker_env = {int(r): dict(env) for r, env in env_of.items()}

    def job_ended(self, code: int, failure: Optional[Failure] = None) -> None:
        """The launcher reports that every rank's process ended (MPI: ``mpirun`` exited
        with ``code``) and the failure it identified (e.g. the rank ``mpirun`` names).

        A failure naming a rank that posted its result or exception is dropped (that
        rank's own report says more). Ranks that posted neither fail the job, unless a
        failure that is not a mere consequence is known already. Task services learn from
        their next ping that the job is over.
        """
        with self._cond:
            self._ended = True
            for rank in range(self.num_proc):
                self._exits.setdefault(rank, code)
            missing = [r for r in range(self.num_proc)
                       if r not in self._results and r not in self._errors]
            if failure is not None and failure.rank is not None and failure.rank not in missing:
                failure = None
            if failure is not None:
                self._fail(failure)
            elif missing and all(f.consequence for f in self._failures):
                what = f"ended with {describe_exit(code)}" if code else "ended"
                self._fail(Failure(1, f"the workers' job {what} before ranks {missing} "
                                      "returned a result", rank=missing[0],
                                   exit_code=0 if code == 0 else None))
            elif code != 0 and not missing and not self._stopping:
                self._write_output("stderr", (
                    "spark_dl.spark.run: warning: every rank returned its result but the "
                    f"workers' job then ended with {describe_exit(code)}\n").encode())
            self._cond.notify_all()

    def set_ranks(self, rank_of: Dict[int, int]) -> None:
        """Freezes registration: from now on a re-registering task fails the job."""
        with self._cond:
            self._rank_of = dict(rank_of)

    def wait_for_outcome(self, problem: Callable[[], Optional[str]],
                         settle_s: float = SETTLE_S,
                         consequence_settle_s: float = CONSEQUENCE_SETTLE_S) -> List[Failure]:
        """Waits until every rank posted a result (returns []) or something failed
        (returns the failures, root cause first, after ``settle_s`` for the others, or
        ``consequence_settle_s`` while every failure is a consequence of another), or
        until every rank's end is known."""
        with self._cond:
            while True:
                self._check_lost()
                if self._failures:
                    only_consequences = all(f.consequence for f in self._failures)
                    inconclusive = all(f.inconclusive for f in self._failures)
                    wait = consequence_settle_s if inconclusive else settle_s
                    settled = time.monotonic() >= self._failures[0].at + wait
                    accounted = all(r in self._exits for r in range(self.num_proc))
                    # Every rank posted its result or its exception: no cause is still
                    # on its way (a rank that calls a collective after its peers
                    # returned fails alone, with ShutdownError).
                    reported = only_consequences and all(
                        r in self._results or r in self._errors for r in range(self.num_proc))
                    if settled or accounted or reported:
                        return sorted(self._failures,
                                      key=lambda f: (f.priority, f.lost, f.at))
                elif len(self._results) == self.num_proc:
                    return []
                else:
                    text = problem()
                    if text is not None:
                        # Let reports already on their way arrive before blaming Spark;
                        # a task whose connection closed is the cause (its executor).
                        self._cond.wait(0.5)
                        self._check_lost(confirmed=True)
                        if not self._failures:
                            self._failures.append(Failure(2, text))
                        continue
                self._cond.wait(0.05)

    def times(self) -> Dict[str, float]:
        """When each stage was complete for every task or rank (``time.monotonic()``):
        ``registered`` (every task service registered), ``code_fetched`` (every worker
        process was up and fetched the function), ``results`` (every rank posted its
        result), ``exited`` (every worker's exit was reported). Stages not reached are
        absent."""
        with self._cond:
            return dict(self._times)

    def wall_times(self) -> Dict[str, float]:
        """:meth:`times` as wall-clock times (``time.time()``)."""
        offset = time.time() - time.monotonic()
        return {name: at + offset for name, at in self.times().items()}

    def wait_for_tasks_ended(self, timeout: float) -> bool:
        """Waits until every registered task said it ends; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not set(self._registrations) <= self._tasks_ended:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.1))
            return True

    def finished_ranks(self) -> List[int]:
        """The ranks that posted their result, in order."""
        with self._cond:
            return sorted(self._results)

    def results(self) -> List[bytes]:
        with self._cond:
            return [self._results[r] for r in range(self.num_proc)]

    def begin_stop(self) -> None:
        """Task services learn from their next ping that the job is over."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def wait_for_exits(self, ranks: Sequence[int], timeout: float) -> List[int]:
        """Waits until the given ranks' exits were reported; returns those still missing."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                missing = [r for r in ranks if r not in self._exits]
                left = deadline - time.monotonic()
                if not missing or left <= 0:
                    return missing
                self._cond.wait(min(left, 0.1))


def _failure_text(failure: Failure) -> str:
    text = failure.summary
    if failure.traceback:
        text += "\n" + failure.traceback.rstrip()
    return text
