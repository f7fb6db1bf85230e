"""Worker processes: start, watch, and stop them as one group.

Each worker runs in its own session (hence its own process group), so that stopping it
reaches everything it started, and so that a Ctrl-C in the launcher's terminal reaches
the launcher only, which then forwards it. The rules:

- the first worker to exit non-zero (or be killed by a signal) is the job's failure: every
  other worker gets SIGTERM, then SIGKILL after ``kill_grace`` seconds, and the launcher
  returns that worker's exit code (128+N for signal N);
- a SIGINT/SIGTERM to the launcher is forwarded to every worker, with the same SIGKILL
  escalation; a second one kills at once; the launcher returns 128+N;
- a worker that fails while another is stopped (SIGSTOP: its peers time out waiting for
  it) is reported as a consequence, naming the stopped one as the cause;
- a start check (e.g. remote workers that must register within the start timeout) that
  reports a problem stops the job like a failure, with exit code 1;
- if the launcher itself dies, a watchdog process (:mod:`spark_dl.runner.watchdog`) stops
  the workers.

SIGKILL reaches a worker's whole session, not only its process group: ``mpirun`` (one
"worker" running many ranks) puts each rank in a process group of its own.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple

from spark_dl.runner.output import OutputForwarder, TagDemux
from spark_dl.runner.watchdog import Watchdog, kill_session, session_processes

# Seconds to wait, after the last worker exited, for output still in flight through
# processes a worker left behind holding its pipes.
_DRAIN_S = 2.0
_POLL_S = 0.05


@dataclass
class WorkerSpec:
    """One process to start for one rank.

    Attributes:
        rank: the rank it runs (for prefixes and messages).
        hostname: where it runs (for messages).
        argv: the program and its arguments (the user command, or ssh for remote ranks).
        env: its complete environment.
        stdin_data: written to its stdin, which then stays open until the worker is stopped
            (the remote bootstrap stops its worker when stdin closes); None: /dev/null.
        cwd: working directory, None for the launcher's.
        label: how messages name it (default ``rank <rank> on <hostname>``).
        demux: for a process that runs many ranks and tags their output (``mpirun``):
            a :class:`~spark_dl.runner.output.TagDemux` per stream, ``stdout`` and
            ``stderr``; None: the output is this rank's.
        ranks: with ``demux``, the ranks it runs (their output files are created up front).
        report_failure: log its failure; False when the caller explains it better.
        starter: starts the process instead of ``subprocess.Popen`` (e.g. a fork server's
            :meth:`~spark_dl.runner.forkserver.ForkServer.spawn`), returning an object with
            Popen's ``pid``, ``stdin``, ``stdout``, ``stderr`` and ``wait()``, or None to
            have it started the ordinary way.
    """

    rank: int
    hostname: str
    argv: Sequence[str]
    env: Mapping[str, str]
    stdin_data: Optional[bytes] = None
    cwd: Optional[str] = None
    label: Optional[str] = None
    demux: Optional[Mapping[str, TagDemux]] = None
    ranks: Sequence[int] = ()
    report_failure: bool = True
    starter: Optional[Callable[["WorkerSpec"], Optional[object]]] = None

    def describe(self) -> str:
        return self.label or f"rank {self.rank} on {self.hostname}"


class Stopper:
    """Collects stop requests (signals) for a running group; safe from signal handlers."""

    def __init__(self):
        self.signum: Optional[int] = None
        self.count = 0

    def request(self, signum: int) -> None:
        if self.signum is None:
            self.signum = signum
        self.count += 1


def exit_code(returncode: int) -> int:
    """Maps a Popen return code to a shell-style exit status (signal N -> 128+N)."""
    return 128 - returncode if returncode < 0 else returncode


class WorkerGroup:
    """Starts the workers of one job and supervises them to the end.

    Args:
        specs: one per rank.
        forwarder: receives the workers' stdout/stderr and launcher messages.
        kill_grace: seconds between SIGTERM and SIGKILL.
        stopper: stop requests from signal handlers (see :class:`Stopper`).
        verbose: report each exit, not only failures.
    """

    def __init__(self, specs: Sequence[WorkerSpec], forwarder: OutputForwarder,
                 kill_grace: float = 3.0, stopper: Optional[Stopper] = None,
                 verbose: bool = False):
        self._specs = {spec.rank: spec for spec in specs}
        self._out = forwarder
        self._kill_grace = kill_grace
        self._stopper = stopper or Stopper()
        self._verbose = verbose
        self._procs: Dict[int, subprocess.Popen] = {}
        self._exits: "queue.Queue[tuple]" = queue.Queue()
        self._running: Dict[int, subprocess.Popen] = {}
        self._watchdog: Optional[Watchdog] = None

    def log(self, text: str) -> None:
        self._out.log("stderr", f"sdlrun: {text}\n")

    def run(self, start_check: Optional[Callable[[], Optional[str]]] = None) -> int:
        """Starts every worker, waits for the end of the job and returns its exit code.

        Args:
            start_check: called about every 50 ms while workers run; returns None while
                all is well, or a message that stops the job (exit code 1).
        """
        self._watchdog = Watchdog(self._kill_grace)
        try:
            failure = self._start_all()
            if failure is not None:
                self._out.start()
                return self._shut_down(*failure)
            self._out.start()
            return self._supervise(start_check)
        finally:
            self._finish()

    def run_custom(self, supervise: Callable[[], int]) -> int:
        """Runs a caller's supervision loop instead of :meth:`run`'s fail-fast one (the
        elastic launcher starts workers as it goes, with :meth:`start`, and reads their
        ends with :meth:`next_exit`), with the same watchdog, output and clean-up."""
        self._watchdog = Watchdog(self._kill_grace)
        try:
            self._out.start()
            return supervise()
        finally:
            self._finish()

    def next_exit(self, timeout: float) -> Optional[Tuple[int, int]]:
        """The next worker that ended, as (rank, Popen return code), or None after
        ``timeout`` seconds."""
        try:
            rank, rc = self._exits.get(timeout=timeout)
        except queue.Empty:
            return None
        self._reaped(rank)
        return rank, rc

    def stop_one(self, rank: int) -> None:
        """Asks one worker to stop (SIGTERM; :meth:`stop_all` or the end of the group
        kills what is left)."""
        proc = self._running.get(rank)
        if proc is not None:
            _signal_group(proc, signal.SIGTERM)
            _signal_group(proc, signal.SIGCONT)

    def stop_all(self, code: int) -> int:
        """Stops every running worker (SIGTERM, SIGKILL after the grace period) and
        returns ``code``."""
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self._kill_grace
        while self._running and time.monotonic() < deadline:
            self.next_exit(_POLL_S)
        self._signal_all(signal.SIGKILL)
        for proc in self._procs.values():
            proc.wait()
        return code

    def _start_all(self) -> Optional[Tuple[str, int]]:
        """Starts every worker; on an error returns (message, exit code 127 or 126)."""
        for spec in list(self._specs.values()):
            failure = self.start(spec)
            if failure is not None:
                return failure
        return None

    def start(self, spec: WorkerSpec) -> Optional[Tuple[str, int]]:
        """Starts one worker (also one added after the others started, as the elastic
        launcher does); on an error returns (message, exit code 127 or 126)."""
        self._specs[spec.rank] = spec
        try:
            proc = spec.starter(spec) if spec.starter is not None else None
            if proc is None:
                proc = subprocess.Popen(
                    list(spec.argv), env=dict(spec.env), cwd=spec.cwd,
                    stdin=(subprocess.PIPE if spec.stdin_data is not None
                           else subprocess.DEVNULL),
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        except OSError as exc:
            code = 127 if isinstance(exc, FileNotFoundError) else 126
            return f"cannot start {spec.describe()}: {exc}", code
        self._watchdog.add(proc.pid)
        self._procs[spec.rank] = proc
        self._running[spec.rank] = proc
        for name, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr)):
            if spec.demux is None:
                self._out.add(spec.rank, name, pipe)
            else:
                self._out.add_tagged(name, pipe, spec.demux[name], spec.ranks)
        if spec.stdin_data is not None:
            # A thread, so that a slow ssh connection never blocks the launcher.
            threading.Thread(target=self._feed_stdin, args=(proc, spec.stdin_data),
                             daemon=True).start()
        threading.Thread(target=self._wait_one, args=(spec.rank, proc), daemon=True).start()
        return None

    @staticmethod
    def _feed_stdin(proc: subprocess.Popen, data: bytes) -> None:
        try:
            proc.stdin.write(data)
            proc.stdin.flush()
        except (OSError, ValueError):
            pass  # the process is gone; its exit is reported by its waiter

    def _wait_one(self, rank: int, proc: subprocess.Popen) -> None:
        self._exits.put((rank, proc.wait()))

    def _supervise(self, start_check) -> int:
        first_failure: Optional[tuple] = None
        stop_reason: Optional[str] = None
        result = 0
        kill_at: Optional[float] = None
        signals_seen = 0
        finished = []  # ranks that exited 0 before any failure
        while self._running:
            try:
                rank, rc = self._exits.get(timeout=_POLL_S)
            except queue.Empty:
                rank = None
            if rank is not None:
                self._reaped(rank)
                spec = self._specs[rank]
                first = rc != 0 and first_failure is None and stop_reason is None
                if rc == 0 and first_failure is None and spec.demux is None:
                    finished.append(rank)
                if first:
                    first_failure = (rank, rc)
                    result = exit_code(rc)
                    what = f"signal {-rc}" if rc < 0 else f"exit code {rc}"
                    if spec.report_failure:
                        self.log(self._hung_cause() + f"{spec.describe()} failed with {what}"
                                 + _after_finished(finished, spec)
                                 + ("; stopping the other workers" if self._running else ""))
                elif self._verbose:
                    self.log(f"{spec.describe()} exited with code {exit_code(rc)}")
            if self._stopper.count > signals_seen:
                signals_seen = self._stopper.count
                signum = self._stopper.signum
                if stop_reason is None and first_failure is None:
                    stop_reason = f"signal {signum}"
                    result = 128 + signum
                    self.log(f"received {signal.Signals(signum).name}; stopping the workers")
                if signals_seen > 1:
                    kill_at = time.monotonic()  # asked twice: no more grace
                else:
                    self._signal_all(signum)
                    kill_at = kill_at or time.monotonic() + self._kill_grace
            if first_failure is not None and kill_at is None:
                self._signal_all(signal.SIGTERM)
                kill_at = time.monotonic() + self._kill_grace
            if (start_check is not None and first_failure is None and stop_reason is None
                    and self._running):
                problem = start_check()
                if problem is not None:
                    stop_reason = problem
                    result = 1
                    self.log(problem)
                    self._signal_all(signal.SIGTERM)
                    kill_at = time.monotonic() + self._kill_grace
            if kill_at is not None and time.monotonic() >= kill_at and self._running:
                if self._verbose:
                    self.log(f"killing ranks {sorted(self._running)} (grace period over)")
                self._signal_all(signal.SIGKILL)
                kill_at = float("inf")
        return result

    def _hung_cause(self) -> str:
        """When a worker fails while another is stopped (SIGSTOP, a debugger), the stopped
        one is the likely cause (its peers time out waiting for it): a sentence naming it,
        or "" (local workers only: a remote worker's state is not visible here)."""
        stopped = [rank for rank, proc in sorted(self._running.items())
                   if any(state in "Tt" for state in session_processes(proc.pid).values())]
        if not stopped:
            return ""
        names = ", ".join(self._specs[r].describe() for r in stopped)
        verb = "is" if len(stopped) == 1 else "are"
        return (f"{names} {verb} stopped (SIGSTOP, or held by a debugger) and hung the job; "
                "as a consequence, ")

    def _shut_down(self, message: str, code: int) -> int:
        self.log(message)
        return self.stop_all(code)

    def _reaped(self, rank: int) -> None:
        proc = self._running.pop(rank, None)
        if proc is not None:
            self._watchdog.remove(proc.pid)

    def _signal_all(self, signum: int) -> None:
        for proc in list(self._running.values()):
            _signal_group(proc, signum)
            if signum == signal.SIGTERM:
                _signal_group(proc, signal.SIGCONT)  # a stopped worker gets its SIGTERM too
            if proc.stdin is not None:
                # The remote bootstrap stops its worker when its stdin closes.
                try:
                    proc.stdin.close()
                except OSError:
                    pass

    def _finish(self) -> None:
        if not self._out.join(_DRAIN_S):
            # Someone a worker left behind still holds its pipes: end them.
            for proc in self._procs.values():
                _signal_group(proc, signal.SIGKILL)
            self._out.join(_DRAIN_S)
        self._out.close()
        self._watchdog.close()
        for proc in self._procs.values():
            if proc.stdin is not None:
                try:
                    proc.stdin.close()
                except OSError:
                    pass


def _after_finished(finished: Sequence[int], spec: WorkerSpec) -> str:
    """A note for a rank that failed after others had finished: if its error is a
    ShutdownError, the others' shutdown is its cause (it called a collective they never
    called), not a second failure."""
    if not finished or spec.demux is not None:
        return ""
    ranks = sorted(finished)
    names = (f"rank {ranks[0]} had" if len(ranks) == 1 else
             "ranks " + ", ".join(map(str, ranks)) + " had")
    return (f" after {names} finished with exit code 0 (if it raised ShutdownError, it "
            "called a collective that its finished peers never called: every rank must call "
            "the same collectives, in the same order)")


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    """Signals the worker's whole process group (its pid: it leads its own session); a
    SIGKILL also reaches the rest of its session."""
    try:
        os.killpg(proc.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass
    if signum == signal.SIGKILL:
        kill_session(proc.pid)
