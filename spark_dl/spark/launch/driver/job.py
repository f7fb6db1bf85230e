"""The Spark job that hosts the task services: ``num_proc`` barrier-mode tasks.

Barrier mode gang-schedules the tasks (all start together, or none), which is what a
collective job needs. The job runs on a background thread under its own job group, so
that :meth:`SparkJob.cancel` can stop it (and Spark then kills the tasks' Python
processes; the task services' watchdogs then stop the workers).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterable, Optional

__all__ = ["SparkJob"]

# Lines of a failed job's error kept in messages (the JVM part is long and rarely useful).
_MAX_ERROR_LINES = 40


def _summarize(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    if len(lines) > _MAX_ERROR_LINES:
        lines = lines[:_MAX_ERROR_LINES] + [f"... ({len(lines) - _MAX_ERROR_LINES} more lines)"]
    return "\n".join(lines)


class SparkJob:
    """Runs ``task_fn`` over ``num_proc`` barrier partitions on a background thread.

    Args:
        sc: the active SparkContext.
        num_proc: number of tasks.
        task_fn: the ``mapPartitions`` function (picklable; see
            :class:`spark_dl.spark.launch.task.main.TaskMain`).
        group_id: the Spark job group, unique per run.
        description: shown in the Spark UI.
    """

    def __init__(self, sc, num_proc: int, task_fn: Callable[[Iterable[Any]], Iterable[Any]],
                 group_id: str, description: str):
        self._sc = sc
        self._num_proc = num_proc
        self._task_fn = task_fn
        self.group_id = group_id
        self._description = description
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._finished = threading.Event()
        self._cancelled = False

    def start(self) -> None:
        # InheritableThread carries the caller's local properties (scheduler pool, ...)
        # to the JVM thread that submits the job, in pinned-thread mode (the default).
        from pyspark import InheritableThread

        self._thread = InheritableThread(target=self._run, name=f"sdl-spark-job-{self.group_id}",
                                         daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            sc = self._sc
            sc.setJobGroup(self.group_id, self._description, interruptOnCancel=True)
            sc.parallelize(range(self._num_proc), self._num_proc) \
                .barrier().mapPartitions(self._task_fn).collect()
        except BaseException as exc:  # reported through problem()
            self._error = exc
        finally:
            self._finished.set()

    def problem(self) -> Optional[str]:
        """A message when the job ended before the workers finished, else None."""
        if not self._finished.is_set():
            return None
        if self._error is not None:
            return "the Spark job hosting the workers failed: " + _summarize(self._error)
        return "the Spark job hosting the workers ended before every worker returned"

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    def cancel(self) -> None:
        """Cancels the job (idempotent); its tasks' Python processes are then killed."""
        if self._cancelled or self._finished.is_set():
            return
        self._cancelled = True
        try:
            self._sc.cancelJobGroup(self.group_id)
        except Exception:  # the context may already be stopping
            pass

    def join(self, timeout: float) -> bool:
        """Waits for the job to end; False on timeout."""
        return self._finished.wait(timeout)
