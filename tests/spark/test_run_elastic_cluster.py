"""``spark_dl.spark.run_elastic`` on ``local-cluster[3,1,1024]``: an executor's JVM is
killed mid-training; Spark retries its task on the executor that replaces it, and that
new worker joins the job (docs/elastic.md)."""

import io
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
from test_run_elastic import assert_no_workers_left  # noqa: E402

from spark_dl.spark import run_elastic  # noqa: E402

cloudpickle.register_pickle_by_value(elastic_training)
pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def spark():
    session = spark_session("local-cluster[3,1,1024]", **{"spark.executor.memory": "700m"})
    yield session
    session.stop()


def test_lost_executor_is_replaced_and_its_new_worker_joins(spark):
    err = io.StringIO()
    start = time.monotonic()
    results = run_elastic(
        elastic_training.run_training,
        kwargs={"die": ["1.0:executor:5"], "grow_at": 5, "grow_size": 3, "grow_sleep": 1.0},
        num_proc=3, min_num_proc=2, stdout=io.StringIO(), stderr=err)
    assert time.monotonic() - start < 240
    log = err.getvalue()
    assert "worker 1.0 on" in log and "is lost" in log, log
    res = next(r for r in results if r is not None)
    sizes = res["sizes"]
    assert sizes[:5] == [3] * 5 and 2 in sizes and sizes[-1] == 3, sizes
    assert len(results) == 3
    elastic_training.check_training(res)
    assert_no_workers_left()
