"""Errors raised by :func:`spark_dl.spark.run`.

Every error says what happened and what to check; a failed worker's error carries its
rank and its remote traceback.
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

__all__ = ["RunError", "WorkerFailedError", "NotEnoughSlotsError", "StartTimeoutError",
           "MpiNotBuiltError", "ExecutorPythonError", "strip_ansi", "CONSEQUENCES"]

# Exceptions a rank raises because another rank failed (or finished) first: never the
# root cause while another failure is known. Matched on the exception type's name (its
# message wording belongs to the core and may change).
CONSEQUENCES = ("PeerFailureError", "ShutdownError", "HorovodInternalError")

# Terminal colour and style codes (Keras bolds the error inside "Exception encountered when
# calling ..."; rich tracebacks colour whole lines): in an error relayed from a worker they
# show as "[1m" in logs, notebooks and Spark's job output.
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def strip_ansi(text: str) -> str:
    """``text`` without terminal escape sequences (colours, bold)."""
    return _ANSI.sub("", text)


class RunError(RuntimeError):
    """``run`` could not complete: the job failed to start or a worker failed.

    Attributes:
        job_id: the job's id (workers carry it on their command line).
    """

    def __init__(self, message: str, job_id: Optional[str] = None):
        super().__init__(message)
        self.job_id = job_id


class WorkerFailedError(RunError):
    """A worker raised, exited without a result, or was killed.

    Attributes:
        rank: the failed worker's rank (the root cause when several failed).
        remote_traceback: the worker's formatted traceback, or None when it died
            without one (e.g. killed by a signal).
        exit_code: its exit code when known (128+N: killed by signal N).
        failures: one line per failed rank, the root cause first.
    """

    def __init__(self, message: str, rank: int, remote_traceback: Optional[str] = None,
                 exit_code: Optional[int] = None, failures: Sequence[str] = (),
                 job_id: Optional[str] = None):
        super().__init__(message, job_id)
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.exit_code = exit_code
        self.failures = list(failures)


class NotEnoughSlotsError(RunError, ValueError):
    """``num_proc`` exceeds the task slots the Spark cluster can run at once."""


class StartTimeoutError(RunError, TimeoutError):
    """Some tasks did not register with the driver within ``start_timeout``."""


class MpiNotBuiltError(NotImplementedError):
    """``use_mpi=True`` was asked for, but MPI cannot be used from here: Open MPI's
    ``mpirun`` is not on the driver's ``PATH``, or spark_dl was built without MPI."""


class ExecutorPythonError(RunError):
    """The Spark executors' Python cannot run spark_dl (it lacks spark_dl, cloudpickle or
    the native core, or cannot run a PySpark task at all); found by a small job before
    the real one (:mod:`spark_dl.spark.launch.executor_probe`).

    Attributes:
        python: the executors' interpreter (``sys.executable`` as they reported it, else
            the path the driver asked for).
    """

    def __init__(self, message: str, job_id: Optional[str] = None, python: str = ""):
        super().__init__(message, job_id)
        self.python = python
