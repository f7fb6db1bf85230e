"""How columns become Keras inputs and labels (spark_dl.spark.keras.util)."""

import numpy as np
import pytest

pytest.importorskip("keras")

from spark_dl.spark.keras import util  # noqa: E402


def test_features_take_the_input_shape_and_dtype():
    batch = {"v": np.arange(8, dtype=np.float64).reshape(2, 4), "c": np.array([3, 4])}
    x = util.feature_arrays(batch, ["v", "c"], [("v", [2, 2], "float32"), ("c", [1], "int32")])
    assert x[0].shape == (2, 2, 2) and x[0].dtype == np.float32
    assert x[1].shape == (2, 1) and x[1].dtype == np.int32


def test_labels_take_the_output_shape_and_float_type():
    batch = {"y": np.array([1.0, 2.0]), "k": np.array([0, 2])}
    y = util.label_arrays(batch, ["y", "k"], [[1], [3]], None, ["float32", "float32"])
    assert y[0].shape == (2, 1) and y[0].dtype == np.float32  # custom losses see float32
    assert y[1].shape == (2,) and y[1].dtype == np.int64      # class indices stay integers


@pytest.mark.parametrize("loss, kind", [
    ("mse", "regression"), ("sparse_categorical_crossentropy", "probabilities"),
    ("binary_crossentropy", "binary_probabilities"), ("hinge", None), (["mse", "mae"], None)])
def test_prediction_kind_from_the_loss(loss, kind):
    assert util.prediction_kind(loss) == kind


def test_prediction_kind_respects_from_logits():
    import keras

    assert util.prediction_kind(keras.losses.SparseCategoricalCrossentropy(from_logits=True)) \
        == "logits"
    assert util.prediction_kind(keras.losses.BinaryCrossentropy(from_logits=True)) == \
        "binary_logits"
    assert util.prediction_kind(keras.losses.MeanSquaredError()) == "regression"
