"""The barrier stage that hosts a job: how the caller submits it, what each task runs.

One path for classic and Spark Connect sessions: the caller builds
``spark.range(num_proc, numPartitions=num_proc).mapInArrow(BarrierMain(settings),
rows.SCHEMA, barrier=True)`` (:func:`barrier_frame`: DataFrame API only, Spark >= 3.5; a
classic session runs the same function over a barrier RDD, which starts faster) and
collects it on a background thread (:class:`SparkJob`). Barrier mode gang-schedules the
tasks (all start together, or none), and fails the whole stage when one task fails.

Each task (:class:`BarrierMain`):

- task 0 starts the job's coordinator (:mod:`~spark_dl.spark.launch.coordinator`) and
  tells the others where it listens: through the caller link where the executors surely
  reach the caller (classic sessions, local masters: ``exchange="link"``), else through
  ``BarrierTaskContext.allGather`` (whose early callers wait for its next one-second
  tick); then runs its own task role on a thread while it coordinates, and yields the
  job's rows;
- every other task learns task 0's address the same way and runs its task role (:class:`~spark_dl.spark.launch.task.main.TaskMain`): it yields nothing, or a
  report of a failure it could not send to task 0.

The job's settings, with its secret and the pickled function, travel inside the
``mapInArrow`` function, i.e. inside Spark's serialized plan (protect it with
``spark.authenticate``/``spark.network.crypto.enabled``, and TLS to a Connect server, on
untrusted networks); they are never logged.
"""

from __future__ import annotations

import json
import socket
import threading
from typing import Iterable, Iterator, List, Optional

from spark_dl.spark.launch import rows
from spark_dl.spark.launch.coordinator import Coordinator, JobSettings, error_document
from spark_dl.spark.launch.link import coordinator_from_caller
from spark_dl.spark.launch.task.main import TaskMain, TaskSettings, _assigned_gpus

__all__ = ["BarrierMain", "SparkJob", "barrier_frame"]

# Lines of a failed Spark job's error kept in messages (the JVM part is long).
_MAX_ERROR_LINES = 40


def _task_settings(s: JobSettings, endpoints) -> TaskSettings:
    return TaskSettings(s.job_id, s.secret, [(str(h), int(p)) for h, p in endpoints],
                        s.start_timeout, nics=s.nics, verbose=s.verbose,
                        prefix_timestamp=s.prefix_timestamp, kill_grace=s.kill_grace)


class BarrierMain:
    """The ``mapInArrow`` function of the job's barrier stage (picklable)."""

    def __init__(self, settings: JobSettings):
        self.settings = settings

    def __call__(self, batches: Iterable) -> Iterator:
        """The ``mapInArrow`` function: the task's rows as one Arrow batch."""
        out = self._run(batches)
        if out:
            yield rows.batch(out)

    def partitions(self, items: Iterable) -> Iterator[rows.Row]:
        """The same as a ``mapPartitions`` function of a barrier RDD: the rows as tuples
        (a classic session's cheaper form: no query planning, no Arrow worker)."""
        yield from self._run(items)

    def _run(self, items: Iterable) -> List[rows.Row]:
        from pyspark import BarrierTaskContext

        for _ in items:  # one row per task: its index, which the context also gives
            pass
        ctx = BarrierTaskContext.get()
        index = ctx.partitionId()
        gpus = _assigned_gpus(ctx)
        return self._task0(ctx, gpus) if index == 0 else self._other(ctx, index, gpus)

    def _task0(self, ctx, gpus: List[str]) -> List[rows.Row]:
        s = self.settings
        try:
            address = ctx.getTaskInfos()[0].address
        except Exception:
            address = ""
        coordinator, failure = None, None
        try:
            coordinator = Coordinator(s, address)
            message = {"endpoints": coordinator.start()}
        except BaseException as exc:  # the others must still learn that it failed
            failure, message = exc, {"error": f"{type(exc).__name__}: {exc}"}
        try:
            self._tell(ctx, coordinator, message)
        except BaseException as exc:  # the caller link is down: nobody can be told
            failure = failure or exc
        if failure is not None:
            if coordinator is not None:
                coordinator.stop()
            return [("error", -1, 0, json.dumps(error_document(failure, s.job_id)).encode())]
        endpoints = message["endpoints"]
        reports: List[dict] = []
        role = threading.Thread(
            target=lambda: reports.append(TaskMain(_task_settings(s, endpoints))(0, gpus)),
            name="sdl-task-0", daemon=True)
        role.start()
        try:
            out = list(coordinator.run())
        finally:
            role.join(s.kill_grace + 10.0)
            coordinator.stop()
        out.extend(("task", 0, 0, json.dumps(r).encode()) for r in reports if r)
        return out

    def _tell(self, ctx, coordinator: Optional[Coordinator], message: dict) -> None:
        """Task 0 tells the other tasks where it listens (``endpoints``), or why it could
        not start (``error``): through ``allGather``, or the caller link.

        Raises:
            ConnectionError: the caller link is down.
        """
        if self.settings.exchange == "gather":
            ctx.allGather(json.dumps(message))
        elif coordinator is not None and coordinator.route is not None:
            coordinator.route.announce(**message)
        else:
            raise ConnectionError("task 0 could not start its output route to the caller")

    def _other(self, ctx, index: int, gpus: List[str]) -> List[rows.Row]:
        s = self.settings
        if s.exchange == "gather":
            first = json.loads(ctx.allGather("")[0])
        else:
            try:
                first = coordinator_from_caller(s.secret, s.caller, s.start_timeout + 60.0)
            except Exception as exc:
                return [("task", index, 0, json.dumps(
                    {"index": index, "host": socket.gethostname(),
                     "traceback": f"{type(exc).__name__}: {exc}"}).encode())]
        if "endpoints" not in first:
            return []  # task 0 could not start: its rows say why
        report = TaskMain(_task_settings(self.settings, first["endpoints"]))(index, gpus)
        return [("task", index, 0, json.dumps(report).encode())] if report else []


def summarize(exc: BaseException) -> str:
    """A Spark job's error, cut to its first lines."""
    lines = str(exc).strip().splitlines()
    if len(lines) > _MAX_ERROR_LINES:
        lines = lines[:_MAX_ERROR_LINES] + [f"... ({len(lines) - _MAX_ERROR_LINES} more lines)"]
    return "\n".join(lines)


def barrier_frame(spark, num_proc: int, main: BarrierMain):
    """What the job collects: ``num_proc`` barrier tasks of ``main``. Under Spark Connect
    a barrier ``mapInArrow`` (the DataFrame API is all there is); in a classic session the
    same function over a barrier RDD, which starts faster (no query to plan, no Arrow
    worker: 0.1 s of a warm trivial job, seconds of an application's first)."""
    from spark_dl.spark.launch.session import spark_context

    sc = spark_context(spark)
    if sc is not None:
        return sc.parallelize(range(num_proc), num_proc).barrier().mapPartitions(
            main.partitions)
    return spark.range(0, num_proc, 1, num_proc).mapInArrow(main, rows.SCHEMA, barrier=True)


class SparkJob:
    """Collects a DataFrame on a background thread, cancellable, in a classic or Spark
    Connect session (the barrier stage of a job; the executor probe).

    Args:
        spark: the session (classic or Connect).
        make_frame: ``make_frame(spark)`` -> the DataFrame to collect.
        tag: unique per job: the job group (classic) or operation tag (Connect) that
            :meth:`cancel` cancels.
        description: shown in the Spark UI.
    """

    def __init__(self, spark, make_frame, tag: str, description: str):
        from spark_dl.spark.launch.session import spark_context

        self._spark = spark
        self._sc = spark_context(spark)
        self._make_frame = make_frame
        self.tag = tag
        self._description = description
        self._thread: Optional[threading.Thread] = None
        self.rows: Optional[list] = None
        self.error: Optional[BaseException] = None
        self._finished = threading.Event()
        self._cancelled = False

    def start(self) -> None:
        if self._sc is not None:
            # InheritableThread carries the caller's local properties (scheduler pool,
            # ...) to the JVM thread that submits the job, in pinned-thread mode.
            from pyspark import InheritableThread as Thread
        else:
            Thread = threading.Thread
        self._thread = Thread(target=self._run, name=f"sdl-spark-job-{self.tag}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            spark = self._spark
            if self._sc is not None:
                self._sc.setJobGroup(self.tag, self._description, interruptOnCancel=True)
            else:
                spark.addTag(self.tag)  # this thread's operations (Connect: thread-local)
            self.rows = self._make_frame(spark).collect()
        except BaseException as exc:  # reported through error
            self.error = exc
        finally:
            if self._sc is None:
                try:
                    self._spark.removeTag(self.tag)
                except Exception:
                    pass
            self._finished.set()

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    def cancel(self) -> None:
        """Cancels the job (idempotent); its tasks' Python processes are then killed."""
        if self._cancelled or self._finished.is_set():
            return
        self._cancelled = True
        try:
            if self._sc is not None:
                self._sc.cancelJobGroup(self.tag)
            else:
                self._spark.interruptTag(self.tag)
        except Exception:  # the session may already be stopping
            pass

    def join(self, timeout: float) -> bool:
        """Waits for the job to end; False on timeout."""
        return self._finished.wait(timeout)
