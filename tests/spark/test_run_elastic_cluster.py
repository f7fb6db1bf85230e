"""``spark_dl.spark.run_elastic`` on ``local-cluster[4,1,1024]`` with dynamic allocation
between 3 and 4 executors (docs/elastic.md): an executor's JVM is killed mid-training and
Spark retries its task on the executor that replaces it, whose new worker joins; a job of
more tasks than executors grows when dynamic allocation adds the fourth."""

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
    session = spark_session("local-cluster[4,1,1024]", **{
        "spark.executor.memory": "700m", "spark.dynamicAllocation.enabled": "true",
        "spark.dynamicAllocation.shuffleTracking.enabled": "true",
        "spark.dynamicAllocation.minExecutors": "3",
        "spark.dynamicAllocation.initialExecutors": "3",
        "spark.dynamicAllocation.maxExecutors": "4",
        "spark.dynamicAllocation.schedulerBacklogTimeout": "1s"})
    yield session
    session.stop()


def test_an_executor_added_by_dynamic_allocation_is_used(spark):
    # 4 tasks, 3 executors: the fourth task waits until dynamic allocation adds an
    # executor; its worker then joins, and the job grows from 3 to 4.
    err = io.StringIO()
    results = run_elastic(
        elastic_training.run_training,
        kwargs={"grow_at": 0, "grow_size": 4, "grow_sleep": 0.5},
        num_proc=3, min_num_proc=2, max_num_proc=4, stdout=io.StringIO(), stderr=err)
    res = next(r for r in results if r is not None)
    sizes = res["sizes"]
    assert sizes[-1] == 4 and sorted(sizes) == sizes, sizes  # 3 first, unless it came soon
    assert len(results) == 4
    elastic_training.check_training(res)
    assert_no_workers_left()


def test_lost_executor_is_replaced_and_its_new_worker_joins(spark):
    err = io.StringIO()
    start = time.monotonic()
    results = run_elastic(
        elastic_training.run_training,
        kwargs={"die": ["1.0:executor:5"], "grow_at": 5, "grow_size": 3, "grow_sleep": 1.0},
        num_proc=3, min_num_proc=2, stdout=io.StringIO(), stderr=err, verbose=2)
    assert time.monotonic() - start < 240
    log = err.getvalue()
    assert "worker 1.0 on" in log and "is lost" in log, log
    # Spark's retry of task 1 on the replacement executor is the newcomer.
    assert "worker 1.1 started on" in log, log
    res = next(r for r in results if r is not None)
    sizes = res["sizes"]
    # The survivors train on as 2 until the newcomer joins, unless it registered before
    # they re-formed (a fast replacement executor): then the next generation is 3 at once.
    assert sizes[:5] == [3] * 5 and sizes[-1] == 3 and res["resets"], (sizes, res["resets"])
    assert len(results) == 3
    elastic_training.check_training(res)
    assert_no_workers_left()


def test_elastic_torch_estimator_survives_a_lost_executor(spark, tmp_path):
    import numpy as np
    import torch

    from spark_dl.spark.common.store import Store
    from spark_dl.spark.torch import TorchEstimator

    rng = np.random.default_rng(0)
    x = rng.normal(size=(1500, 4)).astype("float32")
    y = x @ np.array([1.0, -2.0, 0.5, 3.0], dtype="float32")
    df = spark.createDataFrame([(row.tolist(), float(v)) for row, v in zip(x, y)],
                               "features array<float>, label double")
    model = torch.nn.Linear(4, 1)
    err = io.StringIO()
    est = TorchEstimator(
        num_proc=3, elastic=True, min_num_proc=2, store=Store.create(str(tmp_path)),
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        loss=torch.nn.functional.mse_loss, feature_cols=["features"], label_cols=["label"],
        input_shapes=[[4]], batch_size=25, epochs=4, verbose=1, run_id="elastic_fit",
        callbacks=[elastic_training.KillExecutorAt("2.0", epoch=1, batch=5,
                                                   batch_sleep=0.02)])
    import contextlib

    out = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        fitted = est.fit(df)
    history = fitted.getHistory()
    assert history["epoch"] == [1, 2, 3, 4], history
    assert history["loss"][-1] < 0.05 * history["loss"][0], history["loss"]
    log = err.getvalue()
    assert "worker 2.0 on" in log and "is lost" in log, log
    assert "re-forming the job" in out.getvalue(), out.getvalue()
    assert "resuming run elastic_fit after epoch" in out.getvalue(), out.getvalue()
    assert_no_workers_left()

