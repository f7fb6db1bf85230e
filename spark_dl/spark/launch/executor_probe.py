"""Can the executors' Python run spark_dl? One tiny Spark job says, before the real one.

An executor whose Python lacks spark_dl (the system ``python3`` while spark_dl lives in a
virtualenv, a cluster whose nodes never got the package) fails the first spark_dl job with
a page of Java and Python traces ending in ``ModuleNotFoundError``, after the barrier job
started and timed out. :func:`check_executor_python` runs, before it, one small
non-barrier job (one task per registered executor) whose function needs nothing but the
standard library to load: it reports the executor's ``sys.executable``, its Python
version, and whether it imports what a spark_dl task and worker import. Any failure
becomes one :class:`~spark_dl.spark.launch.errors.ExecutorPythonError` that names the
Python the executors ran and what to do (``PYSPARK_PYTHON``, ``spark.pyspark.python``,
``spark.archives`` with a packed virtualenv: docs/spark.md).

Cost: nothing where the answer is known. On a local master whose executors run this
driver's interpreter (:mod:`~spark_dl.spark.launch.executor_python` arranges that) no
job runs; elsewhere the check runs once per application and executor Python (a fit's
``prepare_data`` and its ``spark.run`` share it), and its Python workers are reused by
the next job (``spark.python.worker.reuse``).
"""

from __future__ import annotations

import os
import re
import secrets
import sys
import threading
from typing import List, Optional, Tuple

from spark_dl.spark.launch.errors import ExecutorPythonError

__all__ = ["check_executor_python", "check_executor_python_for_session", "PROBE_MODULES",
           "same_interpreter"]

#: What the probe imports on the executors: the barrier task's code, the pickler of the
#: function, and the native core every worker's ``init()`` loads.
# spark_dl.common.native: the core, as spark_dl loads it (a wheel without Open MPI falls back).
PROBE_MODULES = ("spark_dl.spark.launch.barrier", "cloudpickle", "spark_dl.common.native")

# The probe function is compiled from source in a namespace that is no importable module,
# so that cloudpickle ships it by value: loading it on the executor needs no spark_dl.
_PROBE_SOURCE = '''
def probe(_partition):
    import importlib, socket, sys
    problem = None
    for name in MODULES:
        try:
            importlib.import_module(name)
        except BaseException as exc:
            problem = f"{type(exc).__name__}: {exc}"
            break
    yield (socket.gethostname(), sys.executable, sys.version.split()[0], problem)
'''

# Checked (application id, executor Python) pairs: the check runs once for each.
_checked = set()
_lock = threading.Lock()


def _probe_function():
    namespace = {"__name__": "spark_dl_executor_probe", "MODULES": PROBE_MODULES}
    exec(compile(_PROBE_SOURCE, "<spark_dl executor probe>", "exec"), namespace)
    return namespace["probe"]


def same_interpreter(path: Optional[str]) -> bool:
    """Whether ``path`` runs this Python with this environment. A virtualenv's
    ``bin/python`` links to its base interpreter, so two venvs (or a venv and its base)
    share the link's target: the folder holding the program decides the environment."""
    if not path:
        return False
    if path == sys.executable:
        return True
    if not os.path.isabs(path):
        return False
    return (os.path.realpath(path) == os.path.realpath(sys.executable) and
            os.path.realpath(os.path.dirname(path)) ==
            os.path.realpath(os.path.dirname(sys.executable)))


def _executor_count(sc) -> int:
    try:  # registered block managers: the executors plus the driver's own
        return max(1, int(sc._jsc.sc().getExecutorMemoryStatus().size()) - 1)
    except Exception:
        return 1


def _run_probe(sc, tasks: int, timeout: float) -> Tuple[Optional[list], Optional[BaseException]]:
    """Runs the probe job; (rows, None), (None, the job's error), or (None, None) when it
    did not finish within ``timeout`` (then it is cancelled)."""
    from pyspark import InheritableThread

    group = f"spark_dl-probe-{secrets.token_hex(4)}"
    outcome: dict = {}
    done = threading.Event()
    probe = _probe_function()

    def job():
        try:
            sc.setJobGroup(group, "spark_dl: can the executors' Python import spark_dl?",
                           interruptOnCancel=True)
            outcome["rows"] = sc.parallelize(range(tasks), tasks).mapPartitions(probe).collect()
        except BaseException as exc:  # reported to the caller
            outcome["error"] = exc
        finally:
            done.set()

    InheritableThread(target=job, name="sdl-executor-probe", daemon=True).start()
    if not done.wait(timeout):
        try:
            sc.cancelJobGroup(group)
        except Exception:
            pass
        return None, None
    return outcome.get("rows"), outcome.get("error")


# The line of a failed probe job's error that says why, most specific first.
_CAUSES = (
    re.compile(r"Cannot run program \"[^\"]*\"[^\n]*"),
    re.compile(r"Python in worker has different version[^\n]*"),
    re.compile(r"(?:ModuleNotFoundError|ImportError): [^\n]*"),
    re.compile(r"\b\w+(?:Error|Exception): [^\n]*"),
)


def _cause(exc: BaseException) -> str:
    text = str(exc)
    for pattern in _CAUSES:
        found = pattern.search(text)
        if found:
            return found.group(0).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__


def _advice(python: str) -> str:
    return (
        "Point the executors at a Python that has spark_dl (and your framework):\n"
        f"  - executors on this machine, or the same paths on every node: set PYSPARK_PYTHON="
        f"{sys.executable} before the SparkContext starts (or "
        f"--conf spark.pyspark.python={sys.executable});\n"
        "  - a cluster: pip install spark_dl on the nodes, or ship a packed virtualenv: "
        "venv-pack -o env.tar.gz, then --archives env.tar.gz#env (spark.archives) with "
        "PYSPARK_PYTHON=./env/bin/python (spark.pyspark.python); see docs/install.md.\n"
        f"The executors ran {python!r}; the driver runs {sys.executable} "
        f"(Python {sys.version.split()[0]}).")


def check_executor_python(sc, timeout: float = 120.0) -> None:
    """Checks that the executors' Python can run spark_dl's tasks and workers.

    Skipped on local masters whose executors run this interpreter, and after a check
    that passed for the same application and executor Python. A probe that does not
    finish within ``timeout`` (no executor free yet) is cancelled and the check passes:
    the real job then waits, bounded by its own start timeout.

    Raises:
        ExecutorPythonError: an executor's Python cannot import spark_dl (or cloudpickle,
            or the native core), or cannot run a PySpark task at all; the message names
            its ``sys.executable``, version and host, and what to set.
    """
    python = getattr(sc, "pythonExec", None) or "python3"
    master = sc.master or ""
    if master.startswith("local") and same_interpreter(python):
        return
    key = (sc.applicationId, python)
    with _lock:
        if key in _checked:
            return
    rows, error = _run_probe(sc, _executor_count(sc), timeout)
    _judge(rows, error, python)
    if rows is None:
        return  # timed out: not known to be wrong
    with _lock:
        _checked.add(key)


# The same probe as a mapInArrow function (Spark Connect has no RDDs).
_ARROW_PROBE_SOURCE = _PROBE_SOURCE + '''

def arrow_probe(batches):
    import pyarrow as pa
    for _ in batches:
        pass
    for host, exe, version, problem in probe(None):
        yield pa.RecordBatch.from_pydict({"host": [host], "python": [exe],
                                          "version": [version], "problem": [problem]},
                                         schema=SCHEMA)
'''


def _arrow_probe_function():
    import pyarrow as pa

    schema = pa.schema([("host", pa.string()), ("python", pa.string()),
                        ("version", pa.string()), ("problem", pa.string())])
    namespace = {"__name__": "spark_dl_executor_probe", "MODULES": PROBE_MODULES,
                 "SCHEMA": schema}
    exec(compile(_ARROW_PROBE_SOURCE, "<spark_dl executor probe>", "exec"), namespace)
    return namespace["arrow_probe"]


def _run_connect_probe(spark, tasks: int, timeout: float):
    """:func:`_run_probe` through the DataFrame API (a Spark Connect session)."""
    from spark_dl.spark.launch.barrier import SparkJob

    probe = _arrow_probe_function()
    job = SparkJob(spark, lambda session: session.range(0, tasks, 1, tasks).mapInArrow(
        probe, "host string, python string, version string, problem string"),
        f"spark_dl-probe-{secrets.token_hex(4)}",
        "spark_dl: can the executors' Python import spark_dl?")
    job.start()
    if not job.join(timeout):
        job.cancel()
        return None, None
    if job.error is not None:
        return None, job.error
    return [tuple(r) for r in job.rows], None


def _check_connect(spark, timeout: float, tasks: int) -> None:
    """The check for a Spark Connect session: the executors' Python is the server's
    choice (PYSPARK_PYTHON where it started, or spark.pyspark.python), unknown here."""
    from spark_dl.spark.launch.network import is_local_master
    from spark_dl.spark.launch.session import conf_get, master_of

    python = conf_get(spark, "spark.pyspark.python") or os.environ.get("PYSPARK_PYTHON") \
        or "python3"
    if is_local_master(master_of(spark)) and same_interpreter(python):
        return  # a server in this process (builder.remote("local[N]")) with our Python
    key = (getattr(spark, "session_id", None) or id(spark), python)
    with _lock:
        if key in _checked:
            return
    rows, error = _run_connect_probe(spark, max(1, tasks), timeout)
    _judge(rows, error, python)
    if rows is None:
        return  # timed out: not known to be wrong, nor right
    with _lock:
        _checked.add(key)


def _judge(rows, error, python: str) -> None:
    """Raises ExecutorPythonError for a probe that failed or found a bad Python."""
    if error is not None:
        raise ExecutorPythonError(
            f"the Spark executors could not run a Python task with {python!r}: "
            f"{_cause(error)}\n{_advice(python)}", python=python) from None
    if rows is None:
        return  # timed out: not known to be wrong
    bad = sorted({tuple(row) for row in rows if row[3] is not None})
    if bad:
        where: List[str] = [f"on {host}: {exe} (Python {version}) raised {problem}"
                            for host, exe, version, problem in bad]
        raise ExecutorPythonError(
            "the Spark executors' Python cannot run spark_dl:\n  " + "\n  ".join(where)
            + "\n" + _advice(bad[0][1]), python=bad[0][1])


def check_executor_python_for_session(spark, timeout: float = 120.0, tasks: int = 1) -> None:
    """:func:`check_executor_python` for a SparkSession, classic or Spark Connect (where
    the probe is a ``mapInArrow`` of ``tasks`` tasks, once per session and Python)."""
    from spark_dl.spark.launch.session import is_connect

    if is_connect(spark):
        _check_connect(spark, timeout, tasks)
        return
    sc = getattr(spark, "sparkContext", None)
    if sc is not None:
        check_executor_python(sc, timeout)
