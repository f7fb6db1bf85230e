"""``TorchEstimator(use_gpu=True)`` end to end on the GPU: fit and transform with Spark's GPU
scheduling, two tasks sharing each GPU (``spark.task.resource.gpu.amount=0.5``) found by
conf/gpu_discovery.sh.

Spark's local mode schedules no task resources, so a ``local-cluster[1,2,...]`` (one
worker, two cores, every GPU of the host) stands in for ``local[2]``. Skipped without
pyspark or Java (the GPU machine's image has neither unless they are carried).
"""

import os
import shutil
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pyspark", reason="pyspark is not installed here: the Spark GPU test "
                                      "needs it (and pyarrow, pandas, Java)")
if not (shutil.which("java") or os.environ.get("JAVA_HOME")):
    pytest.skip("no Java here (java on PATH or JAVA_HOME): Spark cannot start",
                allow_module_level=True)

import cloudpickle  # noqa: E402

from spark_dl.spark.common.store import Store  # noqa: E402
from spark_dl.spark.torch import TorchEstimator, TorchModel  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.timeout(600)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DISCOVERY = os.path.join(REPO, "conf", "gpu_discovery.sh")


@pytest.fixture(scope="module")
def spark():
    sys.path.insert(0, os.path.join(REPO, "tests", "spark"))
    from test_run_cases import spark_session

    gpus = torch.cuda.device_count()
    session = spark_session(
        "local-cluster[1,2,2048]",
        **{"spark.executor.memory": "1g",
           "spark.worker.resource.gpu.amount": str(gpus),
           "spark.worker.resource.gpu.discoveryScript": DISCOVERY,
           "spark.executor.resource.gpu.amount": str(gpus),
           "spark.task.resource.gpu.amount": "0.5"})
    yield session
    session.stop()


class OnCuda:
    """Fails the fit unless the workers' model is on CUDA at every epoch."""

    def on_epoch_end(self, epoch, logs=None):
        device = next(self.model.parameters()).device
        if device.type != "cuda":
            raise AssertionError(f"rank {self.rank} trains on {device}, not on a GPU")


class DeviceFlag(torch.nn.Module):
    """Outputs 1.0 per row when its input is on CUDA, else 0.0."""

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return torch.full((x.shape[0], 1), float(x.is_cuda), device=x.device) + self.anchor


def test_fit_and_transform_on_gpus(spark, tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 3))
    y = x @ np.array([1.0, -2.0, 0.5]) + 0.1
    df = spark.createDataFrame([([float(v) for v in r], float(t)) for r, t in zip(x, y)],
                               ["x", "y"])
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    est = TorchEstimator(num_proc=2, model=model, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.05), loss=torch.nn.functional.mse_loss, feature_cols=["x"],
        label_cols=["y"], batch_size=20, epochs=3, store=Store.create(str(tmp_path)),
        callbacks=[OnCuda()], use_gpu=True, verbose=1)
    fitted = est.fit(df)
    losses = fitted.getHistory()["loss"]
    assert losses[-1] < losses[0] / 4, losses
    pred = fitted.transform(df).toPandas()
    with torch.no_grad():
        expected = fitted.getModel().cpu()(torch.tensor(x, dtype=torch.float32)).numpy()
    np.testing.assert_allclose(pred["y__output"].to_numpy(), expected.reshape(-1), rtol=1e-4,
                               atol=1e-5)
    # transform ran on the executors' GPU (and on the CPU with use_gpu=False).
    flag = TorchModel(model=DeviceFlag(), feature_columns=["x"], output_cols=["flag"],
                      input_shapes=[[-1, 3]], use_gpu=True)
    assert set(flag.transform(df).toPandas()["flag"]) == {1.0}
    assert set(flag.setUseGpu(False).transform(df).toPandas()["flag"]) == {0.0}


def test_lightning_model_transform_on_gpus(spark):
    """LightningModel.transform follows the same rule as TorchModel's (issue 12)."""
    pytest.importorskip("lightning", reason="lightning is not installed here")
    from spark_dl.spark.lightning import LightningModel

    df = spark.createDataFrame([([float(i), 0.0, 1.0], float(i)) for i in range(40)],
                               ["x", "y"])
    flag = LightningModel(model=DeviceFlag(), feature_columns=["x"], output_cols=["flag"],
                          input_shapes=[[-1, 3]], use_gpu=True)
    assert set(flag.transform(df).toPandas()["flag"]) == {1.0}
    assert set(flag.setUseGpu(False).transform(df).toPandas()["flag"]) == {0.0}


def test_keras_model_transform_on_gpus(spark):
    """KerasModel.transform with use_gpu on a host where the Keras backend sees a GPU: the
    predictions match the model's own (the device itself is checked by the unit tests'
    fakes; Keras hides it inside its compiled predict function)."""
    keras = pytest.importorskip("keras", reason="keras is not installed here")
    from spark_dl.spark.keras import KerasModel
    from spark_dl.spark.keras.adapter import _gpu_count

    if _gpu_count(keras.backend.backend()) == 0:
        pytest.skip(f"Keras' backend ({keras.backend.backend()}) sees no GPU here")
    from pyspark.ml.linalg import Vectors

    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    x = np.random.default_rng(0).normal(size=(40, 3)).astype(np.float32)
    df = spark.createDataFrame([(Vectors.dense(r),) for r in x], ["x"])
    model = KerasModel(model=net, feature_columns=["x"], output_cols=["out"], use_gpu=True)
    got = np.stack([v.toArray() for v in model.transform(df).toPandas()["out"]])
    np.testing.assert_allclose(got, net.predict_on_batch(x), rtol=1e-4, atol=1e-5)
