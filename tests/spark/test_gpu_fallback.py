"""``TorchEstimator(use_gpu=True)`` (asked for explicitly, Horovod's meaning) on a host
without CUDA: the fit trains on the CPU and says so in one warning (rank 0's), not one per
rank; the trained model's ``transform`` (``use_gpu`` copied from the estimator) predicts on
the CPU. With ``use_gpu`` left at its default the fit says so in one info line, no warning.
"""

import sys

import cloudpickle
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pyspark")

from spark_dl.spark.common.store import Store  # noqa: E402
from spark_dl.spark.torch import TorchEstimator  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.spark, pytest.mark.timeout(240),
              pytest.mark.skipif(torch.cuda.is_available(),
                                 reason="checks the fallback of a host without CUDA")]


def test_use_gpu_without_cuda_trains_on_cpu_with_one_warning(spark, tmp_path, capfd):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 3))
    y = x @ np.array([1.0, -1.0, 0.5])
    df = spark.createDataFrame([([float(v) for v in r], float(t)) for r, t in zip(x, y)],
                               ["x", "y"])
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    est = TorchEstimator(num_proc=2, model=model, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.05), loss=torch.nn.functional.mse_loss, feature_cols=["x"],
        label_cols=["y"], batch_size=20, epochs=2, store=Store.create(str(tmp_path)),
        use_gpu=True, verbose=1)
    fitted = est.fit(df)
    out, err = capfd.readouterr()
    text = out + err
    assert text.count("no CUDA device is available here: training runs on the CPU") == 1, text
    assert "GpuFallbackWarning" in text
    assert fitted.getUseGpu() is True
    pred = fitted.transform(df).toPandas()
    with torch.no_grad():
        expected = fitted.getModel()(torch.tensor(x, dtype=torch.float32)).numpy().reshape(-1)
    np.testing.assert_allclose(pred["y__output"].to_numpy(), expected, rtol=1e-5, atol=1e-6)


def test_default_use_gpu_without_cuda_is_one_info_line_not_a_warning(spark, tmp_path, capfd):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(40, 3))
    df = spark.createDataFrame([([float(v) for v in r], float(r.sum())) for r in x],
                               ["x", "y"])
    model = torch.nn.Linear(3, 1)
    est = TorchEstimator(num_proc=2, model=model, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.05), loss=torch.nn.functional.mse_loss, feature_cols=["x"],
        label_cols=["y"], batch_size=20, epochs=1, store=Store.create(str(tmp_path)),
        verbose=1)
    fitted = est.fit(df)
    out, err = capfd.readouterr()
    text = out + err
    assert text.count("spark_dl: no CUDA device here: training runs on the CPU") == 1, text
    assert "GpuFallbackWarning" not in text and "no CUDA device is available" not in text
    assert fitted.getUseGpu() is True  # Horovod's default, as before
