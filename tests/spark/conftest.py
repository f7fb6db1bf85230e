"""Shared Spark fixture for tests/spark: one small local session per test module.

The machine is shared and small, so sessions are lean: ``local[2]``, two shuffle partitions,
no UI, small Arrow batches. Python workers run this interpreter (PYSPARK_PYTHON) with the
source tree importable (PYTHONPATH), since prepare_data's writer runs inside them.
"""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _worker_env() -> None:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if ROOT not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in paths if p])


@pytest.fixture(scope="module")
def spark():
    pyspark = pytest.importorskip("pyspark")
    _worker_env()
    from pyspark.sql import SparkSession

    session = (SparkSession.builder.master("local[2]")
               .appName(f"spark_dl-tests-{os.getpid()}")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", "2")
               .config("spark.default.parallelism", "2")
               .config("spark.driver.memory", "1g")
               .config("spark.sql.execution.arrow.maxRecordsPerBatch", "1000")
               .config("spark.python.worker.reuse", "true")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    del pyspark
    yield session
    session.stop()
