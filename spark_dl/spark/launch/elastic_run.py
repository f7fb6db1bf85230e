"""``spark_dl.spark.run_elastic``: an elastic job on Spark executors (docs/elastic.md).

A barrier stage cannot change its size, so an elastic job is one Spark job of
``max_num_proc`` ordinary (non-barrier) tasks, each hosting one worker process for as
long as the job trains. The caller's process is the membership authority (the same
:class:`~spark_dl.runner.elastic.MembershipAuthority` as ``sdlrun``'s), serving its
authenticated rendezvous server to the executors:

- a task registers (``elastic/task/<partition>.<attempt>``: that is the worker's id),
  starts its worker, and beats every half second (``elastic/alive/<id>``) while the worker
  runs; it ships the worker's output in pieces (``elastic/out/<id>/<n>``) and its exit code
  (``elastic/exit/<id>``);
- the worker (:mod:`spark_dl.spark.launch.elastic_worker`) fetches the pickled function
  and runs it; its ``init()`` joins the authority's generations, as under sdlrun; it posts
  its return value or its error;
- a worker whose task stops beating for :data:`DEAD_AFTER_S` (its executor was lost) or
  that exits counts as gone: the survivors re-form without it. A task whose worker failed
  fails itself where Spark will retry it, and Spark's retry (on any executor, a new one
  included) is a new worker that joins the job. Tasks beyond the free slots wait in Spark
  and join when they start: the job grows when executors are added.

When a member of the current generation returns, the job is finishing: the caller waits for
the others, marks the job done (tasks still waiting to start then end at once), and
returns the values of the last generation's members in rank order. The executors must
reach the caller's process (classic sessions, and Spark Connect clients on the cluster's
network): unlike :func:`spark_dl.spark.run`, there is no task 0 to coordinate, since any
task may be lost.
"""

from __future__ import annotations

import json
import re
import secrets
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, TextIO

from spark_dl.common.elastic import SCOPE
from spark_dl.config import knobs
from spark_dl.rendezvous.secret import make_secret, secret_to_hex
from spark_dl.runner.elastic import ElasticOptions, MembershipAuthority
from spark_dl.runner.kvstore import KVStoreServer
from spark_dl.spark.launch import pickling
from spark_dl.spark.launch.barrier import SparkJob, summarize
from spark_dl.spark.launch.errors import RunError, WorkerFailedError

__all__ = ["run_elastic", "ElasticTaskMain"]

BEAT_S = 0.5
DEAD_AFTER_S = 3.0
_POLL_S = 0.1
_DONE_WAIT_S = 30.0  # the Spark job's end after the result: its tasks see "done" at once


@dataclass
class ElasticSettings:
    """What every task of the job needs (pickled into the Spark job's function)."""

    job_id: str
    secret_hex: str
    address: str
    port: int
    env: Mapping[str, str]
    start_timeout: float
    elastic_timeout: float
    max_failures: int


def task_key(wid: str) -> str:
    return f"task/{wid}"


class ElasticTaskMain:
    """What each task of the elastic job runs (picklable): one worker, supervised."""

    def __init__(self, settings: ElasticSettings):
        self.s = settings

    def partitions(self, _iterator):  # classic sessions: over an RDD
        yield from self._run()

    def __call__(self, _batches):  # Spark Connect: a mapInArrow
        import pyarrow as pa

        rows = list(self._run())
        yield pa.RecordBatch.from_arrays([pa.array([r[0] for r in rows], pa.string()),
                                          pa.array([r[1] for r in rows], pa.int32())],
                                         names=["worker", "rc"])

    def _run(self):
        import os
        import signal
        import socket
        import subprocess
        import threading

        from pyspark import TaskContext

        from spark_dl.rendezvous.client import KVStoreClient
        from spark_dl.rendezvous.secret import secret_from_hex
        from spark_dl.runner.network import route_address

        s = self.s
        ctx = TaskContext.get()
        attempt = ctx.attemptNumber()
        wid = f"{ctx.partitionId()}.{attempt}"
        kv = KVStoreClient(s.address, s.port, secret_from_hex(s.secret_hex),
                           timeout=s.start_timeout)
        if _is_done(kv):  # started after the job ended (it waited for a slot)
            yield (wid, 0)
            return
        address = route_address(s.address) or socket.gethostname()
        kv.set(SCOPE, task_key(wid), json.dumps({"host": socket.gethostname(),
                                                 "address": address}).encode())
        env = {**os.environ, **s.env, "SDL_ELASTIC_WORKER_ID": wid,
               "SDL_HOSTNAME": address, "SDL_RENDEZVOUS_ADDR": s.address,
               "SDL_RENDEZVOUS_PORT": str(s.port), "SDL_JOB_ID": s.job_id,
               "SDL_CONTROLLER": "gloo", "SDL_START_TIMEOUT": f"{s.start_timeout:g}",
               "SDL_ELASTIC_TIMEOUT": f"{s.elastic_timeout:g}", "PYTHONUNBUFFERED": "1"}
        env.pop("SDL_SECRET_KEY", None)
        proc = subprocess.Popen([sys.executable, "-m", "spark_dl.spark.launch.elastic_worker"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        # The secret on stdin, which then stays open: the worker ends itself at its EOF
        # (this task gone), so no worker outlives its task.
        proc.stdin.write(s.secret_hex.encode() + b"\n")
        proc.stdin.flush()
        stop = threading.Event()

        def beat():
            while not stop.wait(BEAT_S):
                try:
                    kv.set(SCOPE, f"alive/{wid}", str(time.time()).encode())
                    if _is_done(kv):
                        # The job ended (its members are done): a worker still running was
                        # not needed (e.g. a retry still starting); end it now.
                        os.killpg(proc.pid, signal.SIGKILL)
                        return
                except Exception:
                    pass  # the caller is gone: the worker's own waits are bounded

        def ship():
            n = 0
            for chunk in iter(lambda: proc.stdout.read1(65536), b""):
                try:
                    kv.set(SCOPE, f"out/{wid}/{n}", chunk)
                    n += 1
                except Exception:
                    pass

        threads = [threading.Thread(target=f, daemon=True) for f in (beat, ship)]
        for t in threads:
            t.start()
        try:
            rc = proc.wait()
            threads[1].join(10)
        finally:
            stop.set()
            proc.stdin.close()
        kv.set(SCOPE, f"exit/{wid}", str(rc).encode())
        if rc != 0 and not _is_done(kv) and attempt + 1 < s.max_failures:
            # Spark retries the task: a new worker joins the job in its place.
            raise RuntimeError(f"spark_dl elastic worker {wid} failed with exit code {rc}")
        yield (wid, rc)


def _is_done(kv) -> bool:
    try:
        kv.get(SCOPE, "done", timeout=0)
        return True
    except TimeoutError:
        return False


def _max_failures(spark, master: str) -> int:
    """How many attempts Spark gives a task (local masters: ``local[N,F]``'s F, else 1)."""
    from spark_dl.spark.launch.session import conf_get

    local = re.fullmatch(r"local\[(\*|\d+)(?:,\s*(\d+))?\]", master.strip())
    if local:
        return int(local.group(2) or 1)
    if master.strip() == "local":
        return 1
    try:
        return int(conf_get(spark, "spark.task.maxFailures") or 4)
    except ValueError:
        return 4


class _Worker:
    def __init__(self, wid: str, seq: int):
        self.wid, self.seq = wid, seq
        self.beat: Optional[bytes] = None
        self.beat_seen = time.monotonic()
        self.out_next = 0
        self.partial = b""  # the end of its output after the last newline


def run_elastic(fn: Callable, args: Sequence = (), kwargs: Optional[Mapping[str, Any]] = None,
                num_proc: Optional[int] = None, min_num_proc: Optional[int] = None,
                max_num_proc: Optional[int] = None, start_timeout: Optional[float] = None,
                elastic_timeout: Optional[float] = None, reset_limit: Optional[int] = None,
                env: Optional[Mapping[str, str]] = None, stdout: Optional[TextIO] = None,
                stderr: Optional[TextIO] = None, verbose: int = 1,
                nics: Optional[Sequence[str]] = None) -> List[Any]:
    """Runs ``fn(*args, **kwargs)`` as an elastic job on Spark executors.

    ``fn`` uses an elastic front end (``spark_dl.torch.elastic``, ...): its ``init()``
    joins the job's generations; ``@hvd.elastic.run`` re-forms and resumes after a worker
    is lost or added (docs/elastic.md).

    Args:
        fn, args, kwargs: the function and its arguments (cloudpickle).
        num_proc: the workers to start with (default: ``SparkContext.defaultParallelism``).
        min_num_proc: the fewest that may train (default ``num_proc``).
        max_num_proc: the most at once (default ``num_proc``): the job has this many Spark
            tasks; those beyond the free slots start, and join, when slots free up.
        start_timeout: seconds the first ``min_num_proc`` workers may take to meet
            (default: the ``spark_start_timeout_s`` knob).
        elastic_timeout: seconds the job may have fewer than ``min_num_proc`` workers
            (default: ``SDL_ELASTIC_TIMEOUT``, else 600).
        reset_limit: most re-formations (default: no limit).
        env: variables set in every worker.
        stdout, stderr: where the workers' output goes, prefixed ``[<worker id>]``.
        verbose: 0 quiet, 1 membership changes, 2 more.
        nics: the caller's network interfaces the executors reach it on.

    Returns:
        The values ``fn`` returned on the members of the last generation, by rank.

    Raises:
        RunError: the job could not gather ``min_num_proc`` workers in time, re-formed more
            than ``reset_limit`` times, or the Spark job failed.
        WorkerFailedError: a member of the last generation failed while the job was
            finishing.
    """
    from spark_dl.spark.launch.network import caller_addresses
    from spark_dl.spark.launch.session import (active_session, check_server_version,
                                               master_of, spark_context)
    from spark_dl.spark.launch.spark_run import _default_num_proc, _start_timeout

    code = pickling.dumps_call(fn, tuple(args), dict(kwargs or {}),
                               "spark_dl.spark.run_elastic")
    spark = active_session()
    check_server_version(spark)
    sc = spark_context(spark)
    master = master_of(spark)
    if sc is not None:
        from spark_dl.spark.launch.executor_python import use_driver_python

        use_driver_python(sc)
    num_proc = _default_num_proc(spark, sc) if num_proc is None else int(num_proc)
    options = ElasticOptions(
        min_np=num_proc if min_num_proc is None else int(min_num_proc),
        max_np=num_proc if max_num_proc is None else int(max_num_proc),
        timeout=(knobs.value("elastic_timeout_s") if elastic_timeout is None
                 else float(elastic_timeout)),
        reset_limit=reset_limit)
    options.validate()
    timeout = _start_timeout(start_timeout)
    bind, advertised = caller_addresses(spark, master, nics)
    if not bind:
        raise RunError("run_elastic needs an address of this process that the executors "
                       "reach (pass nics=[...]): the caller is the job's membership "
                       "authority")
    out = _Output(stdout, stderr)
    job_id = secrets.token_hex(8)
    secret = make_secret()
    server = KVStoreServer(secret, host=bind[0])
    port = server.start()
    try:
        server.put(SCOPE, "code", code)
        settings = ElasticSettings(job_id, secret_to_hex(secret), advertised[0], port,
                                   {str(k): str(v) for k, v in (env or {}).items()},
                                   timeout, options.timeout, _max_failures(spark, master))
        authority = MembershipAuthority(server, options, timeout,
                                        lambda text: out.log(text) if verbose else None)
        main = ElasticTaskMain(settings)
        job = SparkJob(spark, lambda session: _frame(session, options.max_np, main),
                       f"spark_dl-elastic-{job_id}",
                       f"spark_dl.spark.run_elastic: {options.min_np}-{options.max_np} "
                       f"workers of {getattr(fn, '__name__', fn)}")
        job.start()
        try:
            return _Supervisor(server, authority, job, options.max_np, out, verbose).run()
        finally:
            server.put(SCOPE, "done", b"1")
            if not job.join(_DONE_WAIT_S):
                job.cancel()
                job.join(10.0)
    finally:
        server.stop()


def _frame(spark, tasks: int, main: ElasticTaskMain):
    from spark_dl.spark.launch.session import spark_context

    sc = spark_context(spark)
    if sc is not None:
        return sc.parallelize(range(tasks), tasks).mapPartitions(main.partitions)
    return spark.range(0, tasks, 1, tasks).mapInArrow(main, "worker string, rc int")


class _Output:
    def __init__(self, stdout, stderr):
        self.stdout = stdout or sys.stdout
        self.stderr = stderr or sys.stderr

    def log(self, text: str) -> None:
        self.stderr.write(f"spark_dl.spark.run_elastic: {text}\n")
        self.stderr.flush()

    def worker(self, wid: str, lines: bytes) -> None:
        """Writes whole lines of a worker's output, each prefixed ``[<worker id>]:``."""
        text = lines.decode("utf-8", errors="replace")
        self.stdout.write("".join(f"[{wid}]:{line}" for line in text.splitlines(True)))
        self.stdout.flush()


class _Supervisor:
    """The caller's loop: tasks registering, beating, ending; the authority's steps."""

    def __init__(self, server: KVStoreServer, authority: MembershipAuthority, job: SparkJob,
                 tasks: int, out: _Output, verbose: int):
        self.kv = server
        self.auth = authority
        self.job = job
        self.out = out
        self.verbose = verbose
        self.next_attempt = [0] * tasks
        self.workers: Dict[str, _Worker] = {}
        self.seq = 0

    def run(self) -> List[Any]:
        while True:
            self._discover()
            self._watch()
            if self.auth.members_done():
                # Workers still waiting to join (a late retry) exit 0 on this.
                self.auth.end("the job finished", finished=True)
                return self._results()
            error, _ = self.auth.step()
            if error is not None:
                self.auth.end(error)
                raise RunError(error)
            if self.job.finished:
                self._watch()
                if self.auth.finishing:
                    return self._results()
                error = (summarize(self.job.error) if self.job.error is not None
                         else "every task ended before the job finished")
                self.auth.end("the Spark job ended")
                raise RunError(f"the Spark job of the elastic run ended before its "
                               f"workers finished: {error}")
            time.sleep(_POLL_S)

    def _discover(self) -> None:
        for part, attempt in enumerate(self.next_attempt):
            # A task's later attempts (Spark's retries) are new workers.
            for a in (attempt, attempt + 1):
                wid = f"{part}.{a}"
                raw = self.kv.get(SCOPE, task_key(wid))
                if raw is None:
                    continue
                host = json.loads(raw)["host"]
                self.workers[wid] = _Worker(wid, self.seq)
                self.auth.started(wid, host, self.seq)
                self.seq += 1
                self.next_attempt[part] = a + 1
                if self.verbose >= 2:
                    self.out.log(f"worker {wid} started on {host}")

    def _watch(self) -> None:
        now = time.monotonic()
        for wid, w in self.workers.items():
            self._forward(w)
            state = self.auth.workers[wid]
            if not state.alive:
                continue
            rc = self.kv.get(SCOPE, f"exit/{wid}")
            if rc is not None:
                self._forward(w, final=True)
                self.auth.exited(wid, int(rc))
                if int(rc) != 0:
                    self.out.log(f"worker {wid} on {state.host} failed with exit code "
                                 f"{int(rc)}; the others go on")
                continue
            beat = self.kv.get(SCOPE, f"alive/{wid}")
            if beat != w.beat:
                w.beat, w.beat_seen = beat, now
            elif now - w.beat_seen > DEAD_AFTER_S:
                self.auth.exited(wid, -9)
                self.out.log(f"worker {wid} on {state.host} is lost (its task stopped "
                             f"beating for {DEAD_AFTER_S:g} s: executor lost?); the others "
                             "go on")

    def _forward(self, w: _Worker, final: bool = False) -> None:
        """Writes what arrived of ``w``'s output, whole lines only (pieces are cut where
        the pipe was read); ``final``: the rest too (the worker ended)."""
        data = w.partial
        while True:
            key = f"out/{w.wid}/{w.out_next}"
            chunk = self.kv.get(SCOPE, key)
            if chunk is None:
                break
            self.kv.delete(SCOPE, key)
            w.out_next += 1
            data += chunk
        cut = len(data) if final else data.rfind(b"\n") + 1
        if cut:
            self.out.worker(w.wid, data[:cut])
        w.partial = data[cut:]

    def _results(self) -> List[Any]:
        values = []
        for wid in self.auth.current.members:
            state = self.auth.workers[wid]
            error = self.kv.get(SCOPE, f"error/{wid}")
            if state.rc != 0 or error is not None:
                detail = json.loads(error) if error else {}
                rank = self.auth.current.members.index(wid)
                raise WorkerFailedError(
                    f"worker {wid} (rank {rank}) on {state.host} failed while the job was "
                    f"finishing: {detail.get('summary', f'exit code {state.rc}')}", rank,
                    remote_traceback=detail.get("traceback"), exit_code=state.rc)
            raw = self.kv.get(SCOPE, f"result/{wid}")
            values.append(pickling.pickler().loads(raw) if raw is not None else None)
        return values
