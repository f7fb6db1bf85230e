"""``spark_dl.spark.run``: run a function on ``num_proc`` workers hosted by Spark executors.

The flow (see ``docs/spark.md``), the same for classic and Spark Connect sessions:

1. Check, in the caller, what can be checked before any job: the function pickles, the
   session (Spark >= 3.5), the slots the cluster has for ``num_proc`` barrier tasks, the
   executors' Python (one small job, where it is not known already).
2. Submit one barrier ``mapInArrow`` of ``num_proc`` tasks (:mod:`~spark_dl.spark.launch.
   barrier`). Task 0 coordinates (:mod:`~spark_dl.spark.launch.coordinator`): it runs the
   driver service and the rendezvous server (fresh secret per job), the tasks register,
   ranks are assigned by host, the launcher starts the workers (Gloo: one per task; MPI:
   ``mpirun`` in task 0, one ``orted`` per host through a task service); workers fetch the
   function, run it and post results or exceptions to task 0.
3. Meanwhile the workers' output reaches the caller live where the executors can connect
   to it, else through the Store or at the end (:mod:`~spark_dl.spark.launch.link`).
4. Task 0 returns the results ordered by rank as the job's rows, or the failure: then
   every worker was stopped and ``run`` raises, naming the rank, its host and carrying its
   traceback.

Nothing connects from the executors to the caller unless it can, so this works from a
Spark Connect client (Databricks notebooks, ``SparkSession.builder.remote(...)``).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import sys
import threading
import time
import warnings
from typing import Any, Callable, List, Mapping, Optional, Sequence, TextIO

from spark_dl.config import knobs
from spark_dl.rendezvous.secret import make_secret
from spark_dl.spark.launch import pickling, rows
from spark_dl.spark.launch.barrier import BarrierMain, SparkJob, barrier_frame, summarize
from spark_dl.spark.launch.coordinator import JobSettings
from spark_dl.spark.launch.driver.report import ranks_text
from spark_dl.spark.launch.driver.slots import check_slots
from spark_dl.spark.launch.errors import (ExecutorPythonError, MpiNotBuiltError,
                                          NotEnoughSlotsError, RunError, StartTimeoutError,
                                          WorkerFailedError)
from spark_dl.spark.launch.executor_probe import check_executor_python_for_session
from spark_dl.spark.launch.launcher import GlooLauncher, Launcher
from spark_dl.spark.launch.link import CallerLink, Reports, Spool, SpoolFollower
from spark_dl.spark.launch.network import caller_addresses, is_local_master
from spark_dl.spark.launch.session import (active_session, check_server_version, conf_get,
                                           conf_of, master_of, runs_here, spark_context)

__all__ = ["run", "select_launcher", "PHASES"]

#: The phases of one run, in order, as logged (see :class:`_Phases`).
PHASES = ("checked", "probed", "submitted", "services", "registered", "launched",
          "code_fetched", "results", "exited", "job_ended", "returned")
_log = logging.getLogger("spark_dl.spark.run")

KILL_GRACE_S = 3.0
# After a failure seen by the caller (start timeout, interrupt): the Spark job's end.
_CANCEL_WAIT_S = 10.0
# After a failed Spark job: how long to wait for task 0's process to end (Spark kills a
# barrier stage's other tasks, their Python workers within spark.python.task.killTimeout,
# 2 s by default), then for the workers, which kill themselves when it does.
_TASK0_GONE_WAIT_S = 8.0
_WORKER_END_S = 0.3
# After task 0 told the caller its verdict (a failure), how long the Spark job may take to
# end by itself: task 0 stops the workers (at most the kill grace plus 4 s) and gives the
# other tasks 5 s. A task on a host cut off from the network never ends, and Spark
# notices its executor only after spark.network.timeout (120 s): the caller then cancels
# the job and raises the verdict (at once when task 0 says its own host is the one cut off).
_VERDICT_END_WAIT_S = 20.0
# Task 0 calls the caller link at least every BEAT_S (link.py). Silent this long, its host
# is taken as cut off from the caller and the job fails at once, where Spark would notice
# the executor only after spark.network.timeout (120 s). Longer than task 0's own verdict
# on a silence (15 s, up to 6 s for a more specific cause, 3 s asking the caller), which
# reaches the caller through the spool where there is one.
TASK0_SILENT_S = 30.0
# A pass of the caller's wait loop that came this much later than due means this process
# itself was stalled (a laptop asleep, a stopped process): task 0's silence may be ours,
# and counts only from then.
_CALLER_STALL_S = 5.0
# Spark Connect's default bound on one request (spark.connect.grpc.maxInboundMessageSize):
# the job's plan carries the pickled function.
_CONNECT_MAX_MESSAGE = 128 << 20
_ERRORS = {cls.__name__: cls for cls in (RunError, WorkerFailedError, NotEnoughSlotsError,
                                         StartTimeoutError, ExecutorPythonError)}


def select_launcher(use_mpi: Optional[bool], use_gloo: Optional[bool],
                    extra_mpi_args: Optional[str] = None) -> Launcher:
    """Picks the launcher: an explicit choice, else Gloo (Horovod prefers MPI when it is
    built; here Gloo, which needs nothing outside spark_dl, is the default).

    Raises:
        ValueError: both or neither explicitly chosen; bad ``extra_mpi_args``.
        MpiNotBuiltError: MPI asked for, but there is no Open MPI ``mpirun`` on the
            driver, or spark_dl was built without MPI.
    """
    if use_mpi and use_gloo:
        raise ValueError("use_mpi and use_gloo are mutually exclusive")
    if use_mpi or (use_gloo is False and use_mpi is None):
        # Imported here: the Gloo path never loads the MPI launcher.
        from spark_dl.spark.launch.mpi_launcher import MpiLauncher

        return MpiLauncher(extra_mpi_args)
    if use_mpi is False and use_gloo is False:
        raise ValueError("use_mpi=False and use_gloo=False leave no way to start the workers")
    if extra_mpi_args:
        warnings.warn("extra_mpi_args is ignored: the workers run with Gloo", stacklevel=3)
    return GlooLauncher()


def _start_timeout(value: Optional[float]) -> float:
    if value is None:  # the knob (SDL_SPARK_START_TIMEOUT, else HOROVOD_SPARK_START_TIMEOUT)
        value = knobs.value("spark_start_timeout_s")
    if value <= 0:
        raise ValueError(f"start_timeout must be positive, got {value}")
    return float(value)


def _launcher_name(use_mpi: Optional[bool], use_gloo: Optional[bool], extra_mpi_args,
                   local: bool) -> str:
    """``gloo`` or ``mpi``, checked here as far as the caller can: on a local master the
    executors share this machine, so MPI's presence is checked here too; elsewhere task 0
    checks its executor's ``mpirun`` (an error names it)."""
    if local:
        return select_launcher(use_mpi, use_gloo, extra_mpi_args).name
    if use_mpi and use_gloo:
        raise ValueError("use_mpi and use_gloo are mutually exclusive")
    if use_mpi or (use_gloo is False and use_mpi is None):
        from spark_dl.spark.launch.mpi_launcher import spark_mpi_args

        spark_mpi_args(extra_mpi_args)  # refuses bad flags before anything starts
        return "mpi"
    return select_launcher(use_mpi, use_gloo, extra_mpi_args).name


# What the caller having imported a framework says its workers will import (auto).
# torch._dynamo: torch's first optimizer step imports it (seconds); a cold worker overlaps
# that with its rendezvous, a warm one has it already.
_WARM_STACKS = (("torch", ("torch", "torch._dynamo", "spark_dl.torch")),
                ("lightning", ("lightning.pytorch", "spark_dl.lightning")),
                ("pytorch_lightning", ("pytorch_lightning", "spark_dl.lightning")))


def warm_worker_env(env: Optional[Mapping[str, str]]) -> dict:
    """The job's ``env`` with ``SDL_SPARK_WARM_MODULES`` resolved from ``auto`` by this
    process's imports; the warm-worker knobs are checked here, before any Spark job."""
    env = {str(k): str(v) for k, v in (env or {}).items()}
    seen = {**os.environ, **env}
    knobs.value("spark_warm_workers", seen)
    knobs.value("spark_warm_idle_s", seen)
    if knobs.value("spark_warm_modules", seen) == "auto":
        modules = [m for top, stack in _WARM_STACKS if top in sys.modules for m in stack]
        env["SDL_SPARK_WARM_MODULES"] = ",".join(dict.fromkeys(modules))
    return env


def _default_num_proc(spark, sc) -> int:
    if sc is not None:
        return sc.defaultParallelism
    from spark_dl.spark.launch.driver.slots import configured_slots

    value = conf_get(spark, "spark.default.parallelism")
    if value:
        return int(value)
    slots = configured_slots(master_of(spark), conf_of(spark))
    if slots:
        return slots
    raise ValueError("num_proc is not set and this Spark Connect session does not say how "
                     "many task slots its cluster has: pass num_proc")


def _check_code_size(spark, code: bytes) -> None:
    """Under Spark Connect the job's plan carries the pickled function; one request is
    bounded by the server (128 MiB by default): say so before submitting."""
    limit = _CONNECT_MAX_MESSAGE
    try:
        limit = int(conf_get(spark, "spark.connect.grpc.maxInboundMessageSize") or limit)
    except ValueError:
        pass
    # The plan holds the function once, plus a little of its own.
    if len(code) > limit - (1 << 20):
        raise ValueError(
            f"the function and its arguments pickle to {len(code) / 2**20:.1f} MiB, more "
            f"than a Spark Connect request carries ({limit / 2**20:.0f} MiB: the server's "
            "spark.connect.grpc.maxInboundMessageSize): pass large objects (a model, data) "
            "through storage both sides reach (e.g. a Store path) and load them in the "
            "function, or raise that limit on the server")


class _Phases:
    """Where the seconds of one run go: when each phase ended, in seconds from the call.

    ``checked`` (function pickled, session and slots checked), ``probed`` (the executors'
    Python checked: :mod:`~spark_dl.spark.launch.executor_probe`; no job on local masters
    running this interpreter, nor after a check that passed), ``submitted`` (barrier job
    handed to Spark), ``services`` (task 0 runs: its driver service and rendezvous server
    are up), ``registered`` (every task service registered: Spark scheduled the tasks and
    their Python workers started), ``launched`` (every worker process started),
    ``code_fetched`` (every worker process was up and fetched the function), ``results``
    (every rank posted its result), ``exited`` (every worker's exit was reported),
    ``job_ended`` (the Spark job finished: its rows are here), ``returned`` (run returns).
    Task 0's phases are wall-clock times on its executor, as exact as the clocks agree.

    At the end of every run that submitted its job (failed ones too) they go to the
    ``spark_dl.spark.run`` logger as one DEBUG record whose ``phases`` attribute is the
    dict, and with ``verbose >= 2`` to the run's stderr: a benchmark or a user asking
    "where did the seconds go" reads them without a setting.
    """

    def __init__(self):
        self.start = time.monotonic()
        self.wall_start = time.time()
        self.marks: dict = {}

    def mark(self, name: str, at: Optional[float] = None) -> None:
        self.marks[name] = round((time.monotonic() if at is None else at) - self.start, 4)

    def report(self, out: "_Output", verbose: int, wall_times: Mapping[str, float],
               job_id: str) -> dict:
        for name, at in wall_times.items():
            self.marks[name] = round(at - self.wall_start, 4)
        self.mark("returned")
        phases = {k: self.marks[k] for k in PHASES if k in self.marks}
        text = " ".join(f"{k}={v:.3f}" for k, v in phases.items())
        _log.debug("job %s phases (s from the call): %s", job_id, text,
                   extra={"phases": phases, "job_id": job_id})
        if verbose >= 2:
            out.log(f"job {job_id} phases (s from the call): {text}")
        return phases


class _Output:
    """Writes forwarded worker output and launcher messages to the caller's streams."""

    def __init__(self, stdout: Optional[TextIO], stderr: Optional[TextIO]):
        self._streams = {"stdout": stdout or sys.stdout, "stderr": stderr or sys.stderr}
        self._lock = threading.Lock()

    def write(self, stream: str, data: bytes) -> None:
        sink = self._streams[stream]
        with self._lock:
            try:
                sink.write(data.decode("utf-8", errors="replace"))
                sink.flush()
            except (OSError, ValueError):
                pass  # a closed stream must not stop the job

    def log(self, text: str) -> None:
        self.write("stderr", f"spark_dl.spark.run: {text}\n".encode())


def run(fn: Callable, args: Sequence = (), kwargs: Optional[Mapping[str, Any]] = None,
        num_proc: Optional[int] = None, start_timeout: Optional[float] = None,
        env: Optional[Mapping[str, str]] = None, stdout: Optional[TextIO] = None,
        stderr: Optional[TextIO] = None, verbose: int = 1,
        nics: Optional[Sequence[str]] = None, use_mpi: Optional[bool] = None,
        use_gloo: Optional[bool] = None, extra_mpi_args: Optional[str] = None,
        prefix_output_with_timestamp: bool = False,
        output_spool: Optional[Spool] = None) -> List[Any]:
    """Runs ``fn(*args, **kwargs)`` on ``num_proc`` workers inside Spark executors.

    Each worker is a fresh Python process started by a barrier-mode Spark task, with the
    rank environment ``spark_dl``'s ``init()`` reads, so ``fn`` may call
    ``spark_dl.numpy.init()`` (or a framework's) and use collectives across workers.
    Works from classic sessions and from Spark Connect clients alike: the job is
    coordinated by its own task 0, and nothing connects back to this process unless it
    can (see ``output_spool``).

    Args:
        fn: the function; pickled with cloudpickle (closures and lambdas work). One that
            cannot be pickled raises a TypeError naming the path to the part that fails
            (e.g. ``state.lock``: a closure variable holding a lock).
        args, kwargs: its arguments.
        num_proc: number of workers (default: ``SparkContext.defaultParallelism``; under
            Spark Connect ``spark.default.parallelism`` or the slots the master names).
        start_timeout: seconds the Spark tasks may take to start and register (default:
            ``SDL_SPARK_START_TIMEOUT`` or ``HOROVOD_SPARK_START_TIMEOUT``, else 600).
        env: variables set in every worker, on top of its executor's environment.
        stdout, stderr: text streams receiving the workers' output, each line prefixed
            with ``[rank]<stdout>:`` (default: this process's streams).
        verbose: 0 quiet, 1 warnings, 2 job progress and supervision messages.
        nics: network interfaces the services bind to (the caller's and the executors'),
            e.g. ``["eth0"]``; default: task 0's executor address as Spark knows it, each
            other executor's address on the route to it, and for the caller's output
            link the address Spark's driver uses (or the one on the route to the Spark
            Connect server).
        use_mpi, use_gloo: the controller: Gloo by default; ``use_mpi=True`` (or
            ``use_gloo=False``) launches through Open MPI's ``mpirun`` in task 0's
            executor (:mod:`spark_dl.spark.launch.mpi_launcher`).
        extra_mpi_args: extra ``mpirun`` arguments (MPI only; ignored with a warning).
        prefix_output_with_timestamp: put a timestamp before every forwarded line.
        output_spool: where task 0 writes the workers' output when it cannot connect to
            this process (a Spark Connect client the cluster cannot reach, or
            ``SDL_SPARK_CALLER_LINK=off``); this process follows it while the job runs.
            The estimators pass a folder of the run in their Store. Without one, such
            output arrives when the job ends (the last 8 MiB; the executor log of task 0
            has it all).

    Returns:
        The values ``fn`` returned, as a list ordered by rank.

    Raises:
        WorkerFailedError: a worker raised or died; names the rank, carries its
            traceback; the other workers were stopped and the Spark job cancelled.
        NotEnoughSlotsError: the cluster cannot run ``num_proc`` tasks at once.
        MpiNotBuiltError: ``use_mpi=True`` without Open MPI's ``mpirun`` (on this machine
            for local masters, else in task 0's executor), or with a spark_dl build
            without MPI.
        StartTimeoutError: tasks did not register within ``start_timeout`` (or, where
            this process is sure to hear from task 0, Spark did not start the job).
        ExecutorPythonError: the executors' Python cannot import spark_dl (checked by a
            small job before the barrier job, where the executors may not run this
            interpreter); names their Python and what to set.
        RunError: the job could not start for another reason, or the Spark job failed
            (an executor lost): its error, summarized.
        RuntimeError: no active SparkSession, or one on Spark older than 3.5.
    """
    phases = _Phases()
    # Before any work: a function that cannot travel is named with what holds it back.
    code = pickling.dumps_call(fn, tuple(args), dict(kwargs or {}), "spark_dl.spark.run")
    spark = active_session()
    check_server_version(spark)
    sc = spark_context(spark)
    master = master_of(spark)
    local = is_local_master(master)
    launcher = _launcher_name(use_mpi, use_gloo, extra_mpi_args, local)
    if sc is not None:
        from spark_dl.spark.launch.executor_python import use_driver_python

        use_driver_python(sc)
    else:
        _check_code_size(spark, code)
    num_proc = _default_num_proc(spark, sc) if num_proc is None else int(num_proc)
    if num_proc < 1:
        raise ValueError(f"num_proc must be at least 1, got {num_proc}")
    timeout = _start_timeout(start_timeout)
    env = warm_worker_env(env)
    check_slots(spark, num_proc, wait_s=timeout)
    phases.mark("checked")
    # Executors whose Python lacks spark_dl: one clear error now, not a page of traces
    # from the barrier job (no job on local masters running this interpreter).
    check_executor_python_for_session(spark, timeout, num_proc)
    phases.mark("probed")
    out = _Output(stdout, stderr)
    job_id = secrets.token_hex(8)
    secret = make_secret()
    link, advertised = None, []
    if knobs.value("spark_caller_link") != "off":
        bind, advertised = caller_addresses(spark, master, nics)
        if bind:
            link = CallerLink(secret, bind, out.write)
    wall_times: Mapping[str, float] = {}
    try:
        caller = None
        if link is not None:
            caller = [(host, port) for host, (_, port) in zip(advertised, link.start())]
        # Where the executors are sure to reach this process (a classic session's
        # executors reach its driver; executors on this machine), the tasks learn task 0's
        # address through the link; elsewhere through the barrier's allGather.
        exchange = "link" if caller and (sc is not None or runs_here(spark)) else "gather"
        settings = JobSettings(job_id, secret, num_proc, code, pickling.describe(), timeout,
                               env, verbose, list(nics or []) or None,
                               prefix_output_with_timestamp, KILL_GRACE_S, launcher,
                               extra_mpi_args, local, caller, output_spool, exchange)
        main = BarrierMain(settings)
        job = SparkJob(spark, lambda session: barrier_frame(session, num_proc, main),
                       f"spark_dl-run-{job_id}", f"spark_dl.spark.run: {num_proc} workers "
                       f"of {getattr(fn, '__name__', fn)}")
        if verbose >= 2:
            out.log(f"job {job_id}: {num_proc} workers ({launcher}) in a barrier job of "
                    f"{'a Spark Connect' if sc is None else 'this'} session; output link "
                    f"{caller or 'off'}, spool {output_spool!r}, addresses by {exchange}")
        job.start()
        phases.mark("submitted")
        # Task 0 makes contact at once where this process is sure to hear of it: only
        # then can a start that never comes be told from one that cannot reach us.
        follower = SpoolFollower(output_spool, out.write) if output_spool is not None else None
        sure = follower is not None or exchange == "link"
        outcome = _wait(job, link, follower, timeout if sure else None, job_id, num_proc)
        phases.mark("job_ended")
        wall_times = outcome.phases
        return _results(outcome, job_id, out, num_proc)
    finally:
        if link is not None:
            link.stop()
        phases.report(out, verbose, wall_times, job_id)


def _wait(job: SparkJob, link: Optional[CallerLink], follower: Optional[SpoolFollower],
          start_timeout: Optional[float], job_id: str, num_proc: int) -> rows.Outcome:
    """Waits for the job's rows, following the spool; cancels the job on a start
    timeout or an interrupt."""
    start = time.monotonic()
    # The job's tasks take a while to start in Spark after task 0 is scheduled.
    grace = 60.0
    reports = [r for r in (link.reports if link else None,
                           follower.reports if follower else None) if r is not None]
    verdict_at = None
    wait_s = _VERDICT_END_WAIT_S
    last_pass = resumed = time.monotonic()
    try:
        while not job.join(0.25):
            now = time.monotonic()
            if now - last_pass > _CALLER_STALL_S:
                resumed = now
            last_pass = now
            if follower is not None:
                follower.poll()
            if verdict_at is None and any(r.outcome is not None for r in reports):
                verdict_at = time.monotonic()
                # Task 0's own host cut off: its rows cannot come before Spark gives up
                # on its executor (spark.network.timeout), so waiting is pointless.
                wait_s = 0.0 if any((r.outcome or {}).get("task0_cut_off")
                                    for r in reports) else _VERDICT_END_WAIT_S
            if verdict_at is None and link is not None and link.contacted.is_set() and \
                    not link.task0_gone.is_set() and \
                    min(link.silent_s(), now - resumed) > TASK0_SILENT_S:
                raise _task0_silent(link.silent_s(), reports, job_id)
            if verdict_at is not None and time.monotonic() - verdict_at > wait_s:
                job.cancel()
                job.join(_CANCEL_WAIT_S)
                if job.rows is None:
                    raise _job_failure(job.error or RuntimeError("cancelled"), reports,
                                       job_id) from None
                break
            started = (link is not None and link.contacted.is_set()) or (
                follower is not None and follower.started)
            if start_timeout is not None and not started and \
                    time.monotonic() - start > start_timeout + grace:
                raise StartTimeoutError(
                    f"Spark did not start the job's {num_proc} barrier tasks within "
                    f"{start_timeout + grace:g} s (start_timeout plus {grace:g} s): a barrier "
                    "stage waits until all its slots are free at once; free the cluster or "
                    "lower num_proc", job_id)
    except BaseException:  # a start timeout, task 0's silence, an interrupt
        job.cancel()
        job.join(_CANCEL_WAIT_S)
        raise
    if follower is not None:
        follower.poll()
    if job.error is not None:
        if link is not None and link.contacted.is_set():
            # Spark failed the job (an executor lost) and kills the other tasks: wait,
            # bounded, until task 0's process is gone, so that its workers (which end with
            # it) are gone too when run raises.
            if link.task0_gone.wait(_TASK0_GONE_WAIT_S):
                time.sleep(_WORKER_END_S)
        raise _job_failure(job.error, reports, job_id) from None
    return rows.decode(job.rows or [])


def _plan(reports: Sequence[Reports]) -> dict:
    """Task 0's rank plan (task index -> [rank, host]) as a report brought it, or {}."""
    return next((r.plan for r in reports if r.plan), {})


def _task0_silent(silent_s: float, reports: Sequence[Reports], job_id: str) -> BaseException:
    """The error for a task 0 the caller stopped hearing from (see TASK0_SILENT_S)."""
    what = (f"task 0 (the job's coordinator) has not been heard from for {silent_s:.0f} s: "
            "its host is cut off from the caller (or the task is stalled), and Spark would "
            "notice its executor only after spark.network.timeout")
    plan = _plan(reports)
    if 0 not in plan:
        return RunError(what + "; see the Spark executor logs", job_id)
    host = plan[0][1]
    ranks = sorted(rank for rank, h in plan.values() if h == host)
    return WorkerFailedError(f"{ranks_text(ranks)} on {host} were lost: {what}", ranks[0],
                             None, None, [f"{ranks_text(ranks)}: lost with task 0's host {host}"],
                             job_id)


def _job_failure(error: BaseException, reports: Sequence[Reports],
                 job_id: str) -> BaseException:
    """The error for a Spark job that failed before task 0's rows arrived: task 0's own
    verdict if it sent one, else the rank of the barrier task that Spark names (an
    executor lost), else Spark's error, summarized."""
    for report in reports:
        if report.outcome is not None:
            return _rebuild_error(report.outcome, report.cause, job_id)
    text = summarize(error)
    failed = re.search(r"barrier task ResultTask\(\d+, (\d+)\)", text)
    plan = _plan(reports)
    if failed and int(failed.group(1)) in plan:
        index = int(failed.group(1))
        rank, host = plan[index]
        reason = next((line.strip() for line in text.splitlines()
                       if "ExecutorLostFailure" in line or "exited" in line), "")
        return WorkerFailedError(
            f"rank {rank} was lost: its Spark task {index} on {host} failed and Spark "
            f"ended the job ({reason or text.splitlines()[0]}); see the Spark executor "
            "logs", rank, None, None, [f"rank {rank}: lost with its Spark task {index}"],
            job_id)
    return RunError("the Spark job hosting the workers failed: " + text, job_id)


def _results(outcome: rows.Outcome, job_id: str, out: "_Output", num_proc: int) -> List[Any]:
    """The results by rank, or the job's error raised."""
    for stream, data in outcome.output:
        out.write(stream, data)
    if outcome.error is not None:
        raise _rebuild_error(outcome.error, outcome.cause, job_id)
    for report in outcome.task_reports:
        out.log(f"task {report.get('index')} on {report.get('host')} failed:\n"
                f"{report.get('traceback', '')}")
    missing = [r for r in range(num_proc) if r not in outcome.results]
    if missing:
        raise RunError(f"the Spark job hosting the workers ended without the results of "
                       f"ranks {missing} (see the executor log of task 0)", job_id)
    loads = pickling.pickler().loads
    return [loads(outcome.results[r]) for r in range(num_proc)]


def _rebuild_error(doc: dict, cause: Optional[bytes], job_id: str) -> BaseException:
    """The coordinator's failure (:func:`~spark_dl.spark.launch.coordinator.error_document`)
    as the exception it was."""
    name, message = doc.get("class", ""), doc.get("message", "")
    if name == "WorkerFailedError":
        error = WorkerFailedError(message, doc.get("rank"), doc.get("traceback"),
                                  doc.get("exit_code"), doc.get("failures", ()), job_id)
        if cause:
            try:
                error.__cause__ = pickling.pickler().loads(cause)
            except Exception:
                pass
        return error
    if name == "MpiNotBuiltError":
        return MpiNotBuiltError(message)
    if name == "ExecutorPythonError":
        return ExecutorPythonError(message, job_id, doc.get("python", ""))
    if name in _ERRORS:
        return _ERRORS[name](message, job_id)
    text = f"the job's coordinator (task 0) failed: {name}: {message}"
    if doc.get("traceback"):
        text += "\n" + doc["traceback"].rstrip()
    return RunError(text, job_id)
