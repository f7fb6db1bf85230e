"""A model class defined in the user's own module, which only the driver can import (a
folder on the driver's sys.path, not on the executors' PYTHONPATH), trains and transforms
on local Spark: it travels by value (spark_dl.spark.common.shipping; issue 33). Before, every
worker failed with ModuleNotFoundError after the data was prepared."""

import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pyspark")

from spark_dl.spark.common.store import Store  # noqa: E402
from spark_dl.spark.torch import TorchEstimator  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

MODULE = '''
import torch


class TinyNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.lin(x)
'''


def test_a_model_class_only_the_driver_can_import_trains_and_transforms(spark, tmp_path,
                                                                       monkeypatch):
    folder = tmp_path / "driver_only"
    folder.mkdir()
    name = f"sdl_driver_only_models_{os.getpid()}"
    (folder / f"{name}.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(folder))  # sys.path only: executors never see it
    assert str(folder) not in os.environ.get("PYTHONPATH", "")
    user_models = __import__(name)
    try:
        rng = np.random.default_rng(0)
        x = rng.normal(size=(64, 3))
        y = x @ np.array([1.0, -1.0, 0.5])
        df = spark.createDataFrame([([float(v) for v in r], float(t)) for r, t in zip(x, y)],
                                   ["x", "y"])
        torch.manual_seed(0)
        model = user_models.TinyNet()
        est = TorchEstimator(num_proc=2, model=model, optimizer=torch.optim.SGD(
            model.parameters(), lr=0.05), loss=torch.nn.functional.mse_loss,
            feature_cols=["x"], label_cols=["y"], batch_size=16, epochs=1,
            store=Store.create(str(tmp_path / "store")), use_gpu=False, verbose=0)
        fitted = est.fit(df)
        pred = fitted.transform(df).toPandas()
        with torch.no_grad():
            expected = fitted.getModel()(torch.tensor(x, dtype=torch.float32)).numpy()
        np.testing.assert_allclose(pred["y__output"].to_numpy(), expected.reshape(-1),
                                   rtol=1e-5, atol=1e-6)
    finally:
        sys.modules.pop(name, None)
