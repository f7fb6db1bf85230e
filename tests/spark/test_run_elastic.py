"""``spark_dl.spark.run_elastic`` on local Spark (docs/elastic.md): a worker dies, the
others finish the training, and the result equals a one-process replay of the committed
steps (tests/parallel/elastic_training.py)."""

import io
import re
import os
import sys
import time

import cloudpickle
import pytest

pytest.importorskip("pyspark")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "parallel"))
import elastic_training  # noqa: E402
from test_run_cases import spark_session  # noqa: E402

from spark_dl.spark import run_elastic  # noqa: E402
from spark_dl.spark.launch.errors import RunError  # noqa: E402

cloudpickle.register_pickle_by_value(elastic_training)
pytestmark = [pytest.mark.spark, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def spark():
    session = spark_session("local[3]")
    yield session
    session.stop()


def test_a_killed_worker_leaves_the_others_training(spark):
    out = io.StringIO()
    err = io.StringIO()
    start = time.monotonic()
    results = run_elastic(elastic_training.run_training, kwargs={"die": ["2.0:step:10"]},
                          num_proc=3, min_num_proc=2, stdout=out, stderr=err)
    assert time.monotonic() - start < 120
    assert len(results) == 2 and results[1] is None, results
    res = results[0]
    assert res["sizes"][:10] == [3] * 10 and set(res["sizes"][10:]) == {2}, res["sizes"]
    elastic_training.check_training(res)
    log = err.getvalue()
    assert "worker 2.0 on" in log and "the others go on" in log, log
    assert "generation 1: 2 workers" in log, log
    assert re.search(r"^\[\d\.0\]:worker \d\.0 done as rank 0 of 2$", out.getvalue(), re.M), \
        out.getvalue()
    assert_no_workers_left()


def assert_no_workers_left():
    deadline = time.monotonic() + 30
    while elastic_workers() and time.monotonic() < deadline:
        time.sleep(0.2)
    left = elastic_workers()
    assert left == [], [open(f"/proc/{p}/status").read() for p in left]


def elastic_workers():
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"spark_dl.spark.launch.elastic_worker" in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def test_below_min_num_proc_for_the_elastic_timeout_raises(spark):
    start = time.monotonic()
    with pytest.raises(RunError, match=r"fewer than --min-np=2, for 2 s"):
        run_elastic(elastic_training.run_training, kwargs={"die": ["1.0:step:3"]},
                    num_proc=2, min_num_proc=2, elastic_timeout=2, stderr=io.StringIO(),
                    stdout=io.StringIO())
    assert time.monotonic() - start < 60
    assert_no_workers_left()
