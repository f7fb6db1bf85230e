"""``spark_dl.spark.run``: run a function on ``num_proc`` workers hosted by Spark executors.

The flow (see ``docs/spark.md``):

1. Check that the cluster can run ``num_proc`` tasks at once (fail fast otherwise).
2. Start the driver service and the rendezvous server (fresh secret per job).
3. Submit one barrier-mode Spark job of ``num_proc`` tasks; each starts a task service
   and registers (index, host, endpoints, GPUs).
4. Assign ranks grouped by host; the launcher starts the workers through the task
   services (Gloo: one per task; MPI: ``mpirun`` on the driver, one ``orted`` per host
   started through a task service); workers fetch the function, run it and post results
   or exceptions.
5. Return the results ordered by rank; on any failure stop every worker, cancel the
   Spark job and raise, naming the rank and carrying its traceback.
"""

from __future__ import annotations

import logging
import secrets
import sys
import threading
import time
import warnings
from typing import Any, Callable, List, Mapping, Optional, Sequence, TextIO

from spark_dl.config import knobs
from spark_dl.rendezvous.secret import make_secret
from spark_dl.runner.kvstore import KVStoreServer
from spark_dl.spark.launch import pickling
from spark_dl.spark.launch.driver.job import SparkJob
from spark_dl.spark.launch.driver.plan import plan_ranks
from spark_dl.spark.launch.driver.report import failure_report
from spark_dl.spark.launch.driver.service import DriverService, Failure
from spark_dl.spark.launch.driver.slots import check_slots
from spark_dl.spark.launch.errors import RunError, WorkerFailedError
from spark_dl.spark.launch.executor_probe import check_executor_python
from spark_dl.spark.launch.launcher import GlooLauncher, Launcher, LaunchContext
from spark_dl.spark.launch.network import driver_addresses
from spark_dl.spark.launch.service import ServiceClient, log_to_stderr
from spark_dl.spark.launch.task.main import TaskMain, TaskSettings

__all__ = ["run", "select_launcher", "PHASES"]

#: The phases of one run, in order, as logged (see :class:`_Phases`).
PHASES = ("checked", "probed", "services", "submitted", "registered", "launched", "code_fetched",
          "results", "exited", "job_ended", "returned")
_log = logging.getLogger("spark_dl.spark.run")

KILL_GRACE_S = 3.0
# Bounds of the clean-up after a failure: stop the workers, then the Spark job.
_STOP_WAIT_S = KILL_GRACE_S + 4.0
_CANCEL_WAIT_S = 10.0
# After success: workers exit right after posting their results.
_FINISH_WAIT_S = 30.0


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


def _spark_context():
    from pyspark import SparkContext

    sc = SparkContext._active_spark_context
    if sc is None:
        raise RuntimeError("spark_dl.spark.run needs an active SparkContext (create a "
                           "SparkSession first); Spark Connect sessions have no "
                           "SparkContext and cannot host the workers")
    from spark_dl.spark.launch.executor_python import use_driver_python

    use_driver_python(sc)
    return sc


class _Phases:
    """Where the seconds of one run go: when each phase ended, in seconds from the call.

    ``checked`` (function pickled, context and slots checked), ``probed`` (the executors'
    Python checked: :mod:`~spark_dl.spark.launch.executor_probe`; no job on local masters
    running this interpreter, nor after a check that passed), ``services`` (driver
    service and rendezvous server up), ``submitted`` (barrier job handed to Spark),
    ``registered`` (every task service registered: Spark scheduled the tasks and their
    Python workers started), ``launched`` (every task service started its worker
    process), ``code_fetched`` (every worker process was up and fetched the function),
    ``results`` (every rank posted its result), ``exited`` (every worker's exit was
    reported), ``job_ended`` (the Spark job finished), ``returned`` (run returns).

    At the end of every run that started its services (failed ones too) they go to the
    ``spark_dl.spark.run`` logger as one DEBUG record whose ``phases`` attribute is the
    dict, and with ``verbose >= 2`` to the run's stderr: a benchmark or a user asking
    "where did the seconds go" reads them without a setting.
    """

    def __init__(self):
        self.start = time.monotonic()
        self.marks: dict = {}

    def mark(self, name: str, at: Optional[float] = None) -> None:
        self.marks[name] = round((time.monotonic() if at is None else at) - self.start, 4)

    def report(self, out: "_Output", verbose: int, driver: Optional["DriverService"],
               job_id: str) -> dict:
        if driver is not None:
            for name, at in driver.times().items():
                self.mark(name, at)
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
        prefix_output_with_timestamp: bool = False) -> List[Any]:
    """Runs ``fn(*args, **kwargs)`` on ``num_proc`` workers inside Spark executors.

    Each worker is a fresh Python process started by a barrier-mode Spark task, with the
    rank environment ``spark_dl``'s ``init()`` reads, so ``fn`` may call
    ``spark_dl.numpy.init()`` (or a framework's) and use collectives across workers.

    Args:
        fn: the function; pickled with cloudpickle (closures and lambdas work). One that
            cannot be pickled raises a TypeError naming the path to the part that fails
            (e.g. ``state.lock``: a closure variable holding a lock).
        args, kwargs: its arguments.
        num_proc: number of workers (default: ``SparkContext.defaultParallelism``).
        start_timeout: seconds the Spark tasks may take to start and register (default:
            ``SDL_SPARK_START_TIMEOUT`` or ``HOROVOD_SPARK_START_TIMEOUT``, else 600).
        env: variables set in every worker, on top of its executor's environment.
        stdout, stderr: text streams receiving the workers' output, each line prefixed
            with ``[rank]<stdout>:`` (default: this process's streams).
        verbose: 0 quiet, 1 warnings, 2 job progress and supervision messages.
        nics: network interfaces the services bind to (driver and executors), e.g.
            ``["eth0"]``; default: the address Spark's driver uses, and each executor's
            address on the route to it.
        use_mpi, use_gloo: the controller: Gloo by default; ``use_mpi=True`` (or
            ``use_gloo=False``) launches through Open MPI's ``mpirun`` on the driver
            (:mod:`spark_dl.spark.launch.mpi_launcher`).
        extra_mpi_args: extra ``mpirun`` arguments (MPI only; ignored with a warning).
        prefix_output_with_timestamp: put a timestamp before every forwarded line.

    Returns:
        The values ``fn`` returned, as a list ordered by rank.

    Raises:
        WorkerFailedError: a worker raised or died; names the rank, carries its
            traceback; the other workers were stopped and the Spark job cancelled.
        NotEnoughSlotsError: the cluster cannot run ``num_proc`` tasks at once.
        MpiNotBuiltError: ``use_mpi=True`` without Open MPI's ``mpirun`` on the driver,
            or with a spark_dl build without MPI.
        StartTimeoutError: tasks did not register within ``start_timeout``.
        ExecutorPythonError: the executors' Python cannot import spark_dl (checked by a
            small job before the barrier job, where the executors may not run this
            interpreter); names their Python and what to set.
        RunError: the job could not start for another reason.
    """
    phases = _Phases()
    launcher = select_launcher(use_mpi, use_gloo, extra_mpi_args)
    # Before any work: a function that cannot travel is named with what holds it back.
    code = pickling.dumps_call(fn, tuple(args), dict(kwargs or {}), "spark_dl.spark.run")
    sc = _spark_context()
    num_proc = sc.defaultParallelism if num_proc is None else int(num_proc)
    if num_proc < 1:
        raise ValueError(f"num_proc must be at least 1, got {num_proc}")
    timeout = _start_timeout(start_timeout)
    check_slots(sc, num_proc, wait_s=timeout)
    phases.mark("checked")
    # Executors whose Python lacks spark_dl: one clear error now, not a page of traces
    # from the barrier job (no job on local masters running this interpreter).
    check_executor_python(sc, timeout)
    phases.mark("probed")
    out = _Output(stdout, stderr)
    job_id = secrets.token_hex(8)
    secret = make_secret()
    bind, advertised = driver_addresses(sc.getConf().get, sc.master, nics)
    log = log_to_stderr("spark_dl driver") if verbose >= 2 else None
    driver = DriverService(secret, num_proc, code, bind, out.write, log=log,
                           pickler=pickling.describe())
    kv = KVStoreServer(secret, host=bind[0])
    try:
        driver.start()
        kv_port = kv.start()
        phases.mark("services")
        endpoints = [(host, port) for host, (_, port) in zip(advertised, driver.server.endpoints)]
        settings = TaskSettings(job_id, secret, endpoints, timeout, nics=list(nics or []) or None,
                                verbose=verbose, prefix_timestamp=prefix_output_with_timestamp,
                                kill_grace=KILL_GRACE_S)
        job = SparkJob(sc, num_proc, TaskMain(settings), f"spark_dl-run-{job_id}",
                       f"spark_dl.spark.run: {num_proc} workers of {getattr(fn, '__name__', fn)}")
        if verbose >= 2:
            out.log(f"job {job_id}: {num_proc} workers ({launcher.name}), driver service at "
                    f"{endpoints}, rendezvous at {advertised[0]}:{kv_port}")
        job.start()
        phases.mark("submitted")
        return _Run(driver, job, launcher, out, verbose, job_id, phases).execute(
            LaunchContext(job_id, secret, [], endpoints, (advertised[0], kv_port), timeout,
                          dict(env or {}), {}, driver=driver, write_output=out.write,
                          prefix_timestamp=prefix_output_with_timestamp, verbose=verbose,
                          nics=list(nics or []) or None, kill_grace=KILL_GRACE_S))
    finally:
        # The rendezvous server's stop waits for its serve loop's next poll (up to
        # 0.1 s): overlapped with the driver service's stop, which returns at once.
        stopper = threading.Thread(target=kv.stop, name="sdl-kvstore-stop", daemon=True)
        stopper.start()
        driver.stop()
        stopper.join()
        phases.report(out, verbose, driver, job_id)


class _Run:
    """The driver thread's part of one job, from registration to the clean-up."""

    def __init__(self, driver: DriverService, job: SparkJob, launcher: Launcher, out: _Output,
                 verbose: int, job_id: str, phases: _Phases):
        self.phases = phases
        self.driver = driver
        self.job = job
        self.launcher = launcher
        self.out = out
        self.verbose = verbose
        self.job_id = job_id

    def execute(self, ctx: LaunchContext) -> List[Any]:
        ok = False
        try:
            results = self._run(ctx)
            ok = True
            return results
        finally:
            if not ok:
                self._stop(ctx)
            for client in ctx.tasks.values():
                client.close()

    def _run(self, ctx: LaunchContext) -> List[Any]:
        advice = (f"Check that the executors can reach the driver service at "
                  f"{ctx.driver_endpoints} (firewalls; choose interfaces with nics=), that "
                  "spark_dl is installed on the executors, and the executor logs of those "
                  "tasks; a barrier stage also waits until all its slots are free.")
        try:
            regs = self.driver.wait_for_registrations(ctx.start_timeout, self.job.problem,
                                                      advice)
        except RunError as exc:
            exc.job_id = self.job_id
            raise
        except RuntimeError as exc:
            raise RunError(f"the workers could not start: {exc}", self.job_id) from None
        ctx.placements = plan_ranks(regs)
        ctx.tasks = {r.index: ServiceClient("task", ctx.secret, r.endpoints, timeout=30.0)
                     for r in regs}
        self.driver.set_ranks({p.task.index: p.rank for p in ctx.placements})
        if self.verbose >= 2:
            for p in ctx.placements:
                self.out.log(f"rank {p.rank} (local {p.slot.local_rank}/{p.slot.local_size}) "
                             f"-> task {p.task.index} on {p.task.hostname} "
                             f"{p.task.endpoints} gpus={p.task.gpus}")
        self.launcher.start(ctx)
        self.phases.mark("launched")
        failures = self.driver.wait_for_outcome(self.job.problem)
        if failures:
            raise self._error(failures)
        blobs = self.driver.results()
        ranks = [p.rank for p in ctx.placements]
        if self.driver.wait_for_exits(ranks, _FINISH_WAIT_S) or not self.job.join(_FINISH_WAIT_S):
            self.out.log("warning: workers or Spark tasks did not end after returning their "
                         "results; cancelling the Spark job")
            self.job.cancel()
        self.phases.mark("job_ended")
        loads = pickling.pickler().loads
        return [loads(b) for b in blobs]

    def _error(self, failures: List[Failure]) -> RunError:
        root = failures[0]
        message, lines = failure_report(failures, self.driver.finished_ranks())
        if root.rank is None:
            return RunError(message, self.job_id)
        error = WorkerFailedError(message, root.rank, root.traceback, root.exit_code,
                                  lines, self.job_id)
        if root.exception is not None:
            try:
                error.__cause__ = pickling.pickler().loads(root.exception)
            except Exception:
                pass
        return error

    def _stop(self, ctx: LaunchContext) -> None:
        """Stops every worker (bounded), then cancels the Spark job."""
        start = time.monotonic()
        self.driver.begin_stop()
        if ctx.tasks:
            self.launcher.stop(ctx)
            left = _STOP_WAIT_S - (time.monotonic() - start)
            missing = self.driver.wait_for_exits([p.rank for p in ctx.placements],
                                                 max(left, 0.5))
            if missing and self.verbose >= 1:
                self.out.log(f"ranks {missing} did not report their end; cancelling the "
                             "Spark job stops them")
        self.job.cancel()
        if self.job.join(_CANCEL_WAIT_S):
            self.phases.mark("job_ended")
        elif self.verbose >= 1:
            self.out.log("the Spark job did not end within "
                         f"{_CANCEL_WAIT_S:g} s of its cancellation")
