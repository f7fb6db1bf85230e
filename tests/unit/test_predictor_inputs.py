"""The torch and Lightning predictors against their input arrays, without Spark.

``transform`` hands a predictor views of Arrow's read-only buffers, and those columns may
pass through to the output. A module that writes into its input in place must therefore
not change them, and torch must not warn about read-only arrays on every worker. Training
batches (writable loader arrays) still reach the module without a copy.
"""

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")


class InPlace(torch.nn.Module):
    """Doubles its input in place, then sums each row."""

    def forward(self, x):
        x.mul_(2)
        return x.sum(dim=1, keepdim=True)


def _lightning_module():
    pl = pytest.importorskip("lightning.pytorch")

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.inner = InPlace()

        def forward(self, x):
            return self.inner(x)

    return Module()


def _predictor(kind):
    if kind == "torch":
        from spark_dl.spark.torch.adapter import TorchPredictor

        return TorchPredictor(InPlace(), ["x"], [[-1, 3]], 2)
    from spark_dl.spark.lightning.adapter import LightningPredictor

    return LightningPredictor(_lightning_module(), ["x"], [[-1, 3]], 2)


@pytest.mark.parametrize("kind", ["torch", "lightning"])
def test_a_module_writing_its_input_leaves_read_only_arrays_alone(kind):
    predictor = _predictor(kind)
    predictor.prepare()
    x = np.arange(15, dtype=np.float32).reshape(5, 3)
    x.flags.writeable = False  # as Arrow's buffers arrive in transform
    before = x.copy()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "not writable" warning would fail here
        (out,) = predictor.predict({"x": x})
    np.testing.assert_array_equal(x, before)
    np.testing.assert_array_equal(out, 2 * before.sum(axis=1, keepdims=True))


def test_lightning_training_batches_share_the_loaders_arrays():
    from spark_dl.spark.lightning import util

    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    batch = util.to_batch({"x": x, "y": np.zeros(2)}, ["x"], [[-1, 3]], torch.float32)
    assert batch["x"].data_ptr() == x.__array_interface__["data"][0]  # no copy
    assert batch["y"].dtype == torch.float32  # floating columns take the module's dtype


def test_integer_features_stay_integers_for_lightning_and_take_the_dtype_for_torch():
    """Lightning's training batches keep integer columns (indices for an embedding), and
    transform converts as training does; TorchModel casts every feature to the model's
    dtype, in fit and transform alike."""
    pl = pytest.importorskip("lightning.pytorch")
    from spark_dl.spark.lightning.adapter import LightningPredictor
    from spark_dl.spark.torch.adapter import TorchPredictor

    class Embed(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Embedding(5, 2)

        def forward(self, ids):
            return self.table(ids.reshape(-1))

    seen = []

    class Dtypes(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1, dtype=torch.float64))

        def forward(self, x):
            seen.append(x.dtype)
            return x * self.w

    ids = np.array([[0], [3], [4]], dtype=np.int64)
    module = Embed()
    (out,) = LightningPredictor(module, ["ids"], [[-1, 1]], 2).predict({"ids": ids})
    np.testing.assert_array_equal(out, module.table.weight.detach().numpy()[[0, 3, 4]])
    (out,) = TorchPredictor(Dtypes(), ["x"], [[-1, 1]], 2).predict({"x": ids})
    assert seen == [torch.float64, torch.float64] and out.dtype == np.float64
    np.testing.assert_array_equal(out, ids.astype(np.float64))
