"""Which Python the executors run, on local masters.

PySpark starts its Python workers with ``PYSPARK_PYTHON`` (or ``spark.pyspark.python``),
else ``python3`` from the PATH, chosen once when the SparkContext is created. A driver
started as ``.venv/bin/python train.py``, with no activated virtualenv, then gets executors
on the system's ``python3``, which cannot import spark_dl (or pyarrow, or the framework):
the first job dies with a page of Java and Python traces.

On a local master (``local``, ``local[N]``, ``local-cluster``) the executors run on this
machine, so the driver's own interpreter is reachable: when nobody chose the executors'
Python, :func:`use_driver_python` points the context at ``sys.executable`` for the jobs
spark_dl submits (PySpark reads ``SparkContext.pythonExec`` whenever it wraps a function)
and says so once, for spark_dl's jobs only (functions PySpark wrapped before keep their
Python, so the note does not promise it for the user's own UDFs). An explicit choice is
never overridden.
"""

import os
import sys

__all__ = ["use_driver_python", "use_driver_python_for_session"]

_noted = set()


def _chosen(sc) -> bool:
    """Whether the user chose the executors' Python (environment or Spark conf)."""
    if os.environ.get("PYSPARK_PYTHON"):
        return True
    conf = sc.getConf()
    return bool(conf.get("spark.pyspark.python", None) or
                conf.get("spark.executorEnv.PYSPARK_PYTHON", None))


def _conf_python(sc) -> bool:
    """``spark.pyspark.python`` set in the Spark conf of a program started as ``python``:
    PySpark takes its workers' Python from ``PYSPARK_PYTHON`` only (``spark-submit`` turns
    the conf into that variable), so the conf would be ignored; spark_dl's jobs use it, as
    Spark documents it (``./env/bin/python`` of a packed venv in ``spark.archives``)."""
    wanted = sc.getConf().get("spark.pyspark.python", None)
    if not wanted or os.environ.get("PYSPARK_PYTHON") or sc.pythonExec == wanted:
        return False
    sc.pythonExec = wanted
    return True


def use_driver_python(sc, out=None) -> bool:
    """On a local master with no chosen executor Python, run the executors' Python workers
    on this interpreter (see the module doc); where ``spark.pyspark.python`` chose one that
    PySpark ignored, that one. Returns whether it changed anything."""
    if _conf_python(sc):
        return True
    master = sc.master or ""
    if not master.startswith("local") or _chosen(sc):
        return False
    from spark_dl.spark.launch.executor_probe import same_interpreter

    current = sc.pythonExec
    if same_interpreter(current):
        return False
    sc.pythonExec = sys.executable
    key = (id(sc), current)
    if key not in _noted:
        _noted.add(key)
        # Only spark_dl's jobs are sure to get it: functions PySpark wrapped before (a UDF
        # already used or registered) keep the Python they were wrapped with.
        print(f"spark_dl: spark_dl's jobs on master {master!r} run this driver's Python "
              f"({sys.executable}) instead of {current!r}, which PYSPARK_PYTHON did not "
              f"choose; your own UDFs may still run on {current!r}: set PYSPARK_PYTHON "
              "(or spark.pyspark.python) before the session starts to choose for every job",
              file=out or sys.stderr, flush=True)
    return True


def use_driver_python_for_session(spark) -> bool:
    """:func:`use_driver_python` for a SparkSession, then, before the caller's first job,
    the check that the executors' Python can run spark_dl
    (:func:`~spark_dl.spark.launch.executor_probe.check_executor_python_for_session`: no
    job where the answer is known, else once per application, or Spark Connect session,
    and executor Python). A Spark Connect session has no SparkContext here: its
    executors' Python is the server's choice, so only the check applies.

    Raises:
        ExecutorPythonError: it cannot; the message says what to set.
    """
    from spark_dl.config import knobs
    from spark_dl.spark.launch.executor_probe import check_executor_python_for_session
    from spark_dl.spark.launch.session import spark_context

    sc = spark_context(spark)
    changed = use_driver_python(sc) if sc is not None else False
    check_executor_python_for_session(spark, timeout=float(knobs.value("spark_start_timeout_s")))
    return changed
