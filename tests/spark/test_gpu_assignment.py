"""Spark's GPU assignment on ``local-cluster[1,2,1024]`` with one *fake* GPU (a discovery
script printing address "0", no CUDA behind it) shared by two tasks
(``spark.task.resource.gpu.amount=0.5``; Spark's local mode schedules no task resources,
so a local cluster stands in for local[2]).

- ``spark_dl.spark.run``: each worker sees Spark's GPU in ``SDL_AVAILABLE_DEVICES`` and
  pinned in ``CUDA_VISIBLE_DEVICES``; with Horovod's ``HOROVOD_SPARK_USE_LOCAL_RANK_GPU_INDEX``
  in the job's env the pin is left out, and the rule picks the local rank's GPU;
- ``TorchEstimator(use_gpu=True)``: a GPU Spark assigned but that no worker can see is a
  clear error before training; ``use_gpu=False`` trains on the CPU all the same;
- ``TorchModel.transform`` with ``use_gpu=True`` on such a task fails as clearly, and with
  ``use_gpu=False`` predicts on the CPU.
"""

import io
import sys

import cloudpickle
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pyspark")

from spark_dl.spark import run  # noqa: E402
from spark_dl.spark.common.store import Store  # noqa: E402
from spark_dl.spark.torch import TorchEstimator  # noqa: E402
from test_run_cases import fake_gpu_cluster_session  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.spark, pytest.mark.timeout(400),
              pytest.mark.skipif(torch.cuda.is_available(),
                                 reason="the fake GPU would hide this host's real ones")]


@pytest.fixture(scope="module")
def spark(tmp_path_factory):
    session = fake_gpu_cluster_session(tmp_path_factory.mktemp("gpu"), "local-cluster[1,2,1024]",
                                       executor_memory="768m", task_gpu_amount="0.5")
    yield session
    session.stop()


def gpu_view():
    """What a worker knows of its GPU, and what the rule picks with 4 GPUs visible."""
    import os

    import spark_dl.torch as hvd
    from spark_dl.spark.launch.task.devices import choose_gpu, get_available_devices

    hvd.init()
    try:
        return {"rank": hvd.rank(), "local_rank": hvd.local_rank(),
                "available": get_available_devices(),
                "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "choice_of_4": choose_gpu(True, hvd.local_rank(), 4)}
    finally:
        hvd.shutdown()


def test_workers_see_sparks_gpu_pinned(spark):
    results = run(gpu_view, num_proc=2, stdout=io.StringIO(), stderr=io.StringIO())
    for r in results:
        assert r["available"] == ["0"] and r["cuda_visible"] == "0"
        assert r["choice_of_4"] == 0  # Spark's address "0"


def test_horovod_local_rank_knob_leaves_gpus_unpinned(spark):
    results = run(gpu_view, num_proc=2, env={"HOROVOD_SPARK_USE_LOCAL_RANK_GPU_INDEX": "1"},
                  stdout=io.StringIO(), stderr=io.StringIO())
    assert sorted(r["local_rank"] for r in results) == [0, 1]
    for r in results:
        assert r["available"] == ["0"] and r["cuda_visible"] is None
        assert r["choice_of_4"] == r["local_rank"]


@pytest.fixture(scope="module")
def df(spark):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(120, 3))
    y = x @ np.array([0.5, 1.0, -1.0])
    return spark.createDataFrame([([float(v) for v in r], float(t)) for r, t in zip(x, y)],
                                 ["x", "y"])


def estimator(tmp_path, use_gpu):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    return TorchEstimator(num_proc=2, model=model, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.05), loss=torch.nn.functional.mse_loss, feature_cols=["x"],
        label_cols=["y"], batch_size=20, epochs=1, store=Store.create(str(tmp_path)),
        use_gpu=use_gpu, verbose=0)


def test_estimator_with_an_invisible_spark_gpu_fails_clearly(spark, df, tmp_path):
    with pytest.raises(Exception) as info:
        estimator(tmp_path, use_gpu=True).fit(df)
    text = str(info.value)
    assert "Spark assigned GPU(s) 0 to this task" in text, text
    assert "sees no CUDA device" in text and "use_gpu=False" in text


def test_cpu_training_and_transform_with_spark_gpus_assigned(spark, df, tmp_path):
    fitted = estimator(tmp_path, use_gpu=False).fit(df)
    assert fitted.getUseGpu() is False
    rows = fitted.transform(df).toPandas()
    assert rows["y__output"].notna().all() and len(rows) == 120
    with pytest.raises(Exception, match="Spark assigned GPU.*run transform on the CPU"):
        fitted.setUseGpu(True).transform(df).collect()
