"""Backends: what runs an estimator's training function on its workers.

An estimator hands its backend one function and its arguments; the backend runs it on
``num_processes()`` workers that can reach each other with ``spark_dl``'s collectives and
returns the results ordered by rank. :class:`SparkBackend` (the default) does that with
:func:`spark_dl.spark.run`, inside the running Spark application. A custom backend (the
estimator's ``backend`` param) implements :class:`Backend`; Horovod-style backends whose
``run`` takes only ``(fn, args, kwargs, env)`` work too: the estimator passes the output
streams only to a ``run`` that accepts them.
"""

import abc
import inspect
from typing import Any, Callable, List, Mapping, Optional, Sequence, TextIO

__all__ = ["Backend", "SparkBackend", "ElasticSparkBackend", "run_on_backend"]


class Backend(abc.ABC):
    """Runs a function on a group of training workers."""

    @abc.abstractmethod
    def run(self, fn: Callable, args: Sequence = (), kwargs: Optional[Mapping] = None,
            env: Optional[Mapping[str, str]] = None, stdout: Optional[TextIO] = None,
            stderr: Optional[TextIO] = None) -> List[Any]:
        """Runs ``fn(*args, **kwargs)`` on every worker; returns the results by rank.

        ``env`` is added to each worker's environment; ``stdout``/``stderr`` receive the
        workers' output lines (rank-prefixed).
        """

    @abc.abstractmethod
    def num_processes(self) -> int:
        """How many workers :meth:`run` starts."""


class SparkBackend(Backend):
    """Runs the function on Spark-hosted workers with :func:`spark_dl.spark.run`.

    Args:
        num_proc: number of workers (default: the session's default parallelism, read
            when first needed).
        env: variables set in every worker.
        stdout, stderr: default streams for the workers' output (an estimator passes its
            own, which show progress).
        prefix_output_with_timestamp, start_timeout, verbose, nics, use_mpi, use_gloo,
            extra_mpi_args: as for :func:`spark_dl.spark.run`.
    """

    def __init__(self, num_proc: Optional[int] = None, env: Optional[Mapping[str, str]] = None,
                 stdout: Optional[TextIO] = None, stderr: Optional[TextIO] = None,
                 prefix_output_with_timestamp: bool = False,
                 start_timeout: Optional[float] = None, verbose: int = 1,
                 nics: Optional[Sequence[str]] = None, use_mpi: Optional[bool] = None,
                 use_gloo: Optional[bool] = None, extra_mpi_args: Optional[str] = None):
        if num_proc is not None and int(num_proc) < 1:
            raise ValueError(f"num_proc must be at least 1, got {num_proc}")
        self._num_proc = None if num_proc is None else int(num_proc)
        self._env = dict(env or {})
        self._stdout = stdout
        self._stderr = stderr
        self._options = dict(prefix_output_with_timestamp=prefix_output_with_timestamp,
                             start_timeout=start_timeout, verbose=verbose, nics=nics,
                             use_mpi=use_mpi, use_gloo=use_gloo, extra_mpi_args=extra_mpi_args)

    def __getstate__(self):
        # Streams do not pickle (an estimator holding this backend may be saved).
        state = dict(self.__dict__)
        state["_stdout"] = state["_stderr"] = None
        return state

    def run(self, fn, args=(), kwargs=None, env=None, stdout=None, stderr=None,
            output_spool=None):
        """See :meth:`Backend.run`; ``output_spool``: where the job's coordinating task
        writes the workers' output when it cannot reach this process (see
        :func:`spark_dl.spark.run`)."""
        from spark_dl.spark.launch.spark_run import run

        merged = dict(self._env)
        merged.update(env or {})
        return run(fn, args=args, kwargs=kwargs, num_proc=self.num_processes(), env=merged,
                   stdout=stdout or self._stdout, stderr=stderr or self._stderr,
                   output_spool=output_spool, **self._options)

    def check_capacity(self) -> None:
        """Raises ``NotEnoughSlotsError`` at once when the Spark application cannot run
        :meth:`num_processes` tasks together (an estimator calls it before preparing data;
        it waits up to the start timeout for executors that are still registering), and
        ``RuntimeError`` for a session on Spark older than 3.5 (classic or Connect)."""
        from spark_dl.spark.launch.driver.slots import check_slots
        from spark_dl.spark.launch.session import active_session, check_server_version
        from spark_dl.spark.launch.spark_run import _start_timeout

        spark = active_session()
        check_server_version(spark)
        check_slots(spark, self.num_processes(),
                    wait_s=_start_timeout(self._options["start_timeout"]))

    def num_processes(self) -> int:
        if self._num_proc is None:
            from spark_dl.spark.launch.session import active_session, spark_context
            from spark_dl.spark.launch.spark_run import _default_num_proc

            spark = active_session()
            self._num_proc = _default_num_proc(spark, spark_context(spark))
        return self._num_proc


class ElasticSparkBackend(SparkBackend):
    """Runs the function as an elastic job with :func:`spark_dl.spark.run_elastic`
    (an estimator's ``elastic=True``; docs/elastic.md).

    Args:
        num_proc: the workers to start with (default: the default parallelism).
        min_num_proc, max_num_proc: the fewest that train and the most at once (default
            ``num_proc``).
        elastic_timeout, reset_limit: as for :func:`spark_dl.spark.run_elastic`.
        env, stdout, stderr, start_timeout, verbose, nics: as for :class:`SparkBackend`.
    """

    def __init__(self, num_proc: Optional[int] = None, min_num_proc: Optional[int] = None,
                 max_num_proc: Optional[int] = None, elastic_timeout: Optional[float] = None,
                 reset_limit: Optional[int] = None, env: Optional[Mapping[str, str]] = None,
                 stdout: Optional[TextIO] = None, stderr: Optional[TextIO] = None,
                 start_timeout: Optional[float] = None, verbose: int = 1,
                 nics: Optional[Sequence[str]] = None):
        super().__init__(num_proc=num_proc, env=env, stdout=stdout, stderr=stderr,
                         start_timeout=start_timeout, verbose=verbose, nics=nics)
        self._options = dict(start_timeout=start_timeout, verbose=verbose, nics=nics,
                             elastic_timeout=elastic_timeout, reset_limit=reset_limit)
        self._min, self._max = min_num_proc, max_num_proc

    def run(self, fn, args=(), kwargs=None, env=None, stdout=None, stderr=None,
            output_spool=None):
        """See :meth:`Backend.run` (the output always comes to this process: the
        executors of an elastic job reach it)."""
        from spark_dl.spark.launch.elastic_run import run_elastic

        merged = dict(self._env)
        merged.update(env or {})
        return run_elastic(fn, args=args, kwargs=kwargs, num_proc=self.num_processes(),
                           min_num_proc=self.min_processes(),
                           max_num_proc=self._max, env=merged,
                           stdout=stdout or self._stdout, stderr=stderr or self._stderr,
                           **self._options)

    def min_processes(self) -> int:
        return self.num_processes() if self._min is None else int(self._min)

    def check_capacity(self) -> None:
        """Raises ``NotEnoughSlotsError`` when the application cannot run
        ``min_num_proc`` tasks together (the rest join as slots free up)."""
        from spark_dl.spark.launch.driver.slots import check_slots
        from spark_dl.spark.launch.session import active_session, check_server_version
        from spark_dl.spark.launch.spark_run import _start_timeout

        spark = active_session()
        check_server_version(spark)
        check_slots(spark, self.min_processes(),
                    wait_s=_start_timeout(self._options["start_timeout"]))


def run_on_backend(backend, fn: Callable, args: Sequence, env: Mapping[str, str],
                   stdout: TextIO, stderr: TextIO, output_spool=None) -> List[Any]:
    """``backend.run(...)``, passing the streams (and the output spool) only if its
    ``run`` accepts them."""
    try:
        accepted = inspect.signature(backend.run).parameters
        any_keyword = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in accepted.values())
        takes_streams = ("stdout" in accepted and "stderr" in accepted) or any_keyword
        takes_spool = "output_spool" in accepted or any_keyword
    except (TypeError, ValueError):
        takes_streams = takes_spool = False
    extra = {"output_spool": output_spool} if takes_spool and output_spool is not None else {}
    if takes_streams:
        return backend.run(fn, args=args, kwargs={}, env=dict(env), stdout=stdout,
                           stderr=stderr, **extra)
    return backend.run(fn, args=args, kwargs={}, env=dict(env))
