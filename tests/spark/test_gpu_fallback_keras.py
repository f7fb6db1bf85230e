"""``KerasEstimator(use_gpu=True)`` (asked for explicitly; the default says it in an info
line instead, test_gpu_fallback.py) on a host where the Keras backend sees no
GPU: the fit trains on the CPU and says so in one warning (rank 0's), not one per rank, as
the torch estimator does (test_gpu_fallback.py); the trained model carries ``use_gpu`` and
its ``transform`` predicts on the CPU, silently.
"""

import os
import sys

import cloudpickle
import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
keras = pytest.importorskip("keras")
pytest.importorskip("pyspark")

from spark_dl.spark.common.store import Store  # noqa: E402
from spark_dl.spark.keras import KerasEstimator  # noqa: E402
from spark_dl.spark.keras.adapter import _gpu_count  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300),
              pytest.mark.skipif(_gpu_count(keras.backend.backend()) > 0,
                                 reason="checks the fallback of a host without a GPU")]


def test_keras_use_gpu_without_a_gpu_trains_on_cpu_with_one_warning(spark, tmp_path, capfd):
    from pyspark.ml.linalg import Vectors

    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 3))
    y = x @ np.array([1.0, -1.0, 0.5])
    df = spark.createDataFrame([(Vectors.dense(r), float(t)) for r, t in zip(x, y)],
                               ["features", "y"])
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    est = KerasEstimator(num_proc=2, model=model, optimizer=keras.optimizers.SGD(0.05),
                         loss="mse", feature_cols=["features"], label_cols=["y"],
                         batch_size=20, epochs=2, store=Store.create(str(tmp_path)),
                         use_gpu=True, verbose=1)
    fitted = est.fit(df)
    out, err = capfd.readouterr()
    text = out + err
    assert text.count("no CUDA device is available here: training runs on the CPU") == 1, text
    assert fitted.getUseGpu() is True
    pred = fitted.transform(df).toPandas()
    out, err = capfd.readouterr()
    assert "GpuFallbackWarning" not in out + err  # transform falls back silently
    expected = fitted.getModel().predict_on_batch(x.astype(np.float32)).reshape(-1)
    np.testing.assert_allclose(pred["y__output"].to_numpy(), expected, rtol=1e-5, atol=1e-5)
