"""Shared Spark fixtures for tests/spark: one small local session per test module.

The machine is shared and small, so sessions are lean: ``local[2]``, two shuffle partitions,
no UI, small Arrow batches. Python workers run this interpreter (PYSPARK_PYTHON) with the
source tree importable (PYTHONPATH), since prepare_data's writer runs inside them.

``spark`` is a classic session; ``connect_spark`` a Spark Connect client of an in-process
Connect server (``connect_server``), as ``SparkSession.builder.remote("local[2]")`` makes,
but on a free port: that builder always binds 15002, which another test run on the machine
may hold. Either kind stops at the end of its module, so the next module can start either
kind; one module cannot use both.
"""

import contextlib
import os
import sys
from typing import Optional

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _worker_env() -> None:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if ROOT not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in paths if p])


def _lean(builder):
    return (builder.master("local[2]")
            .appName(f"spark_dl-tests-{os.getpid()}")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", "2")
            .config("spark.default.parallelism", "2")
            .config("spark.driver.memory", "1g")
            .config("spark.sql.execution.arrow.maxRecordsPerBatch", "1000")
            .config("spark.python.worker.reuse", "true"))


@pytest.fixture(scope="module")
def spark():
    pyspark = pytest.importorskip("pyspark")
    _worker_env()
    from pyspark.sql import SparkSession

    session = _lean(SparkSession.builder).getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    del pyspark
    yield session
    session.stop()


@pytest.fixture(scope="module")
def connect_server():
    """The in-process Spark Connect server behind :func:`connect_spark`: a classic session
    on ``local[2]`` with Spark's Connect plugin on an ephemeral loopback port, started as
    pyspark's ``remote("local")`` starts one (artifact isolation on, so each client session
    has its own files). Tests may use it as the classic side of the same data, e.g. to
    read what a Connect session wrote; pyspark's process-wide ``is_remote()`` is true
    while ``connect_spark`` lives, so pass this session explicitly where pyspark would
    look for the active one."""
    from spark_support import require_connect_server

    require_connect_server()  # the server jar ships with pyspark 4.x only
    _worker_env()
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    if SparkContext._active_spark_context is not None:
        pytest.fail("the Connect server needs a process without a running SparkContext: a "
                    "module uses either the spark fixture or connect_spark, not both")
    server = (_lean(SparkSession.builder)
              .config("spark.plugins", "org.apache.spark.sql.connect.SparkConnectPlugin")
              .config("spark.connect.grpc.binding.address", "127.0.0.1")
              .config("spark.connect.grpc.binding.port", "0")
              .config("spark.sql.artifact.isolation.enabled", "true")
              .config("spark.sql.artifact.isolation.alwaysApplyClassloader", "true")
              .getOrCreate())
    server.sparkContext.setLogLevel("ERROR")
    yield server
    server.stop()


@contextlib.contextmanager
def _connect_client(url: str, conf: Optional[dict] = None):
    """A Spark Connect session on ``url`` for the block, stopped after it.

    ``SPARK_CONNECT_MODE_ENABLED`` makes pyspark's process-wide ``is_remote()`` true inside,
    as ``remote()`` does: pyspark.sql.functions and pyspark.ml pick their Connect
    implementations by it. It is restored afterwards, so a later module can start a
    classic session.
    """
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    before = os.environ.get("SPARK_CONNECT_MODE_ENABLED")
    os.environ["SPARK_CONNECT_MODE_ENABLED"] = "1"
    session = None
    try:
        builder = ConnectSession.builder.remote(url)
        for key, value in (conf or {}).items():
            builder = builder.config(key, value)
        session = builder.getOrCreate()
        yield session
    finally:
        if session is not None:
            session.stop()
        if before is None:
            os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)
        else:
            os.environ["SPARK_CONNECT_MODE_ENABLED"] = before


@pytest.fixture(scope="session")
def connect_client():
    """``with connect_client(url, conf) as session:`` -- a Spark Connect client of any
    server (see :func:`_connect_client`)."""
    return _connect_client


@pytest.fixture(scope="module")
def connect_spark(connect_server):
    """A Spark Connect session on ``local[2]`` (``connect_server``): no SparkContext, no
    ``df.rdd``, no py4j."""
    service = getattr(connect_server._jvm,
                      "org.apache.spark.sql.connect.service.SparkConnectService$")
    port = getattr(service, "MODULE$").localPort()
    with _connect_client(f"sc://127.0.0.1:{port}",
                         {"spark.sql.shuffle.partitions": "2",
                          "spark.sql.execution.arrow.maxRecordsPerBatch": "1000"}) as session:
        yield session
