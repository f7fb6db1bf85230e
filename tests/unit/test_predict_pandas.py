"""``ModelBase.predict_pandas`` and the MLflow pyfunc wrapper around it, without Spark (no
session, no JVM): scalar, list, NumPy and Spark ML vector cells, the pyspark.ml columns,
and the errors. That the values equal ``transform``'s: tests/spark/test_mlflow.py and the
Connect estimator tests."""

import numpy as np
import pandas as pd
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pyspark")

from pyspark.ml.linalg import SparseVector, Vectors  # noqa: E402

from spark_dl.spark.common.mlflow_model import SparkDLPyfunc  # noqa: E402
from spark_dl.spark.torch import TorchModel  # noqa: E402


def _model(**kwargs):
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2).double()
    return net, TorchModel(model=net, feature_columns=["x"], output_cols=["out"],
                           input_shapes=[[-1, 3]], use_gpu=False, **kwargs)


def test_cells_of_every_form_give_the_model_outputs():
    net, model = _model()
    rows = np.arange(12, dtype=np.float64).reshape(4, 3)
    want = net(torch.from_numpy(rows)).detach().numpy()
    cells = [list(rows[0]), rows[1], Vectors.dense(rows[2]),
             SparseVector(3, {i: v for i, v in enumerate(rows[3]) if v})]
    out = model.predict_pandas(pd.DataFrame({"x": cells}, index=[10, 11, 12, 13]))
    assert list(out.index) == [10, 11, 12, 13]
    assert list(out.columns) == ["out"]
    np.testing.assert_allclose(np.stack(out["out"]), want, rtol=1e-12)
    pyfunc = SparkDLPyfunc(model)
    np.testing.assert_allclose(np.stack(pyfunc.predict(pd.DataFrame({"x": list(rows)}))),
                               want, rtol=1e-12)
    assert len(model.predict_pandas(pd.DataFrame({"x": []}))) == 0


def test_prediction_columns_and_what_pyfunc_returns():
    net, model = _model(prediction_kind="logits")
    rows = np.random.default_rng(0).normal(size=(5, 3))
    logits = net(torch.from_numpy(rows)).detach().numpy()
    pdf = pd.DataFrame({"x": list(rows)})
    out = model.predict_pandas(pdf)
    assert list(out.columns)[1:] == ["prediction", "probability", "rawPrediction"]
    np.testing.assert_array_equal(out["prediction"], logits.argmax(axis=1).astype(float))
    prob = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(np.stack(out["probability"]), prob, rtol=1e-12)
    pyfunc = SparkDLPyfunc(model)
    pd.testing.assert_series_equal(pyfunc.predict(pdf), out["prediction"])
    assert list(pyfunc.predict(pdf, params={"outputs": "all"}).columns) == list(out.columns)
    with pytest.raises(ValueError, match="'default' .* and 'all'"):
        pyfunc.predict(pdf, params={"outputs": "some"})
    with pytest.raises(TypeError, match="predicts on a pandas DataFrame holding its feature "
                                        r"columns \['x'\]"):
        pyfunc.predict(rows)


def test_bad_input_is_named():
    _, model = _model()
    with pytest.raises(KeyError, match=r"feature columns \['x'\] are not in"):
        model.predict_pandas(pd.DataFrame({"y": [1.0]}))
    with pytest.raises(ValueError, match=r"feature columns \['x'\] are each in the "
                                         "DataFrame more than once"):
        model.predict_pandas(pd.DataFrame([[[1.0, 2.0], [3.0, 4.0]]], columns=["x", "x"]))
    with pytest.raises(ValueError, match="feature column 'x' has null values"):
        model.predict_pandas(pd.DataFrame({"x": [[1.0, 2.0, 3.0], None]}))
    with pytest.raises(ValueError, match=r"feature column 'x' has rows of \[2, 3\] values"):
        model.predict_pandas(pd.DataFrame({"x": [[1.0, 2.0, 3.0], [1.0, 2.0]]}))


class _Reduces(torch.nn.Module):
    def forward(self, x):
        return x.mean()


class _Transposes(torch.nn.Module):
    def forward(self, x):
        return x.t()


class _Squeezes(torch.nn.Module):
    def forward(self, x):
        return x.sum(dim=1, keepdim=True).squeeze()  # () for a batch of one row


@pytest.mark.parametrize("net,shape", [(_Reduces(), r"\[\]"), (_Transposes(), r"\[3, 2\]")])
def test_outputs_without_one_row_per_input_row_are_refused(net, shape):
    """A transposed output reshaped into rows would mix the values of different rows; a
    batch-reduced one would fail inside Spark's tasks. Both are named before any work."""
    model = TorchModel(model=net, feature_columns=["x"], output_cols=["out"],
                       input_shapes=[[-1, 3]], use_gpu=False)
    pdf = pd.DataFrame({"x": [np.arange(3.0)] * 5})
    with pytest.raises(ValueError, match=rf"output 0 has shape {shape} for a batch of 2 rows"):
        model.predict_pandas(pdf)


def test_a_squeezed_output_of_one_row_is_that_row():
    model = TorchModel(model=_Squeezes(), feature_columns=["x"], output_cols=["out"],
                       input_shapes=[[-1, 3]], use_gpu=False)
    for rows in (1, 4):
        pdf = pd.DataFrame({"x": [np.arange(3.0) + i for i in range(rows)]})
        out = model.predict_pandas(pdf)
        np.testing.assert_allclose(out["out"], [3.0 + 3 * i for i in range(rows)])
