"""Executors whose Python cannot import spark_dl: one clear error before the barrier job.

On ``local-cluster[1,1,1024]`` (an executor JVM of its own) the executors are pointed at
the system ``python3``, which has no spark_dl environment (no cloudpickle, no native
core): ``spark.run`` must fail with one short :class:`ExecutorPythonError` naming that
Python and what to set, instead of a page of Java and Python traces (issue 17). A
working interpreter under another path is probed once, then not again.
"""

import logging
import os
import subprocess
import sys
import time

import cloudpickle
import pytest

pytest.importorskip("pyspark")

from spark_dl.spark import run  # noqa: E402
from spark_dl.spark.launch.errors import ExecutorPythonError  # noqa: E402
from spark_dl.spark.launch.executor_python import use_driver_python_for_session  # noqa: E402
from test_run_cases import spark_session  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.timeout(240)]
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # executors cannot import it

SYSTEM_PYTHON = "/usr/bin/python3"


def _lacks_spark_dl(python):
    if not os.path.exists(python):
        return False
    probe = subprocess.run([python, "-c", "import cloudpickle, spark_dl._core"],
                           capture_output=True, env={"PATH": os.environ.get("PATH", "")})
    return probe.returncode != 0


@pytest.fixture(scope="module")
def spark():
    session = spark_session("local-cluster[1,1,1024]", **{"spark.executor.memory": "512m"})
    yield session
    session.stop()


class _Phases(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        if hasattr(record, "phases"):
            self.records.append(record.phases)


def one():
    return 1


@pytest.mark.skipif(not _lacks_spark_dl(SYSTEM_PYTHON),
                    reason=f"needs a {SYSTEM_PYTHON} without spark_dl's environment")
def test_executors_without_spark_dl_get_one_clear_error(spark):
    sc = spark.sparkContext
    sc.pythonExec = SYSTEM_PYTHON  # as PYSPARK_PYTHON=/usr/bin/python3 would
    try:
        start = time.monotonic()
        with pytest.raises(ExecutorPythonError) as info:
            run(one, num_proc=1, start_timeout=60)
        elapsed = time.monotonic() - start
        text = str(info.value)
        assert "/usr/bin/python3" in text or "python3.11" in text, text
        assert "PYSPARK_PYTHON" in text and "spark.pyspark.python" in text, text
        assert "spark.archives" in text and sys.executable in text, text
        assert "Traceback" not in text and "org.apache" not in text, text
        assert len(text.splitlines()) <= 8, text
        assert elapsed < 60, elapsed
        print(f"{elapsed:.1f} s:\n{text}")
        # prepare_data and transform make the same check before their first job.
        with pytest.raises(ExecutorPythonError):
            use_driver_python_for_session(spark)
    finally:
        sc.pythonExec = sys.executable
    assert run(one, num_proc=1) == [1]


def test_a_good_python_elsewhere_is_probed_once(spark, tmp_path):
    sc = spark.sparkContext
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    handler = _Phases()
    logger = logging.getLogger("spark_dl.spark.run")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    sc.pythonExec = str(wrapper)  # not this interpreter's path: the probe runs
    try:
        assert run(one, num_proc=1) == [1]
        assert run(one, num_proc=1) == [1]
    finally:
        sc.pythonExec = sys.executable
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    first, second = [p["probed"] - p["checked"] for p in handler.records[-2:]]
    print(f"executor probe: {first:.2f} s, then {second:.3f} s")
    assert second < 0.05 < first  # a job the first time, none the second
