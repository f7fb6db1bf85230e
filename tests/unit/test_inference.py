"""The executor side of ``transform`` (spark_dl.spark.common.inference) on Arrow arrays,
without Spark: the check that every model output has one row per input row, on batches of
any size (the driver's dry run sees only two rows)."""

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")

from spark_dl.spark.common.inference import ArrowPredict  # noqa: E402


class _Fixed:
    """A predictor whose output has three rows whatever the batch (as a model that
    returned a per-class summary would)."""

    def predict(self, arrays):
        return [np.zeros((3, 2))]


class _Squeezed:
    """A predictor that drops the batch dimension of one-row batches, as ``squeeze()``
    does."""

    def predict(self, arrays):
        return [np.squeeze(arrays["x"] * 2)]


def _predict(kind):
    spec = {"x": {"kind": "scalar", "dtype": "float64", "shape": []}}
    return ArrowPredict("key", None, ["x"], [0], spec, "float32", keep=[], names=["_0"],
                        kinds=[kind], elements=[np.float32 if kind == "array" else None])


def test_an_output_without_a_row_per_input_row_is_refused_on_any_batch():
    with pytest.raises(ValueError, match=r"output 0 has shape \[3, 2\] for a batch of 5 rows"):
        _predict("array")._outputs(_Fixed(), [pa.array(np.arange(5.0))], 5)


def test_a_squeezed_batch_of_one_row_is_that_row():
    fn = _predict("scalar")
    (one,) = fn._outputs(_Squeezed(), [pa.array([1.5])], 1)
    assert one.to_pylist() == [3.0]
    (three,) = fn._outputs(_Squeezed(), [pa.array([1.0, 2.0, 3.0])], 3)
    assert three.to_pylist() == [2.0, 4.0, 6.0]
