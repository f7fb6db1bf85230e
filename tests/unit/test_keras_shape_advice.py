"""Keras shape errors in the driver's dry run name the likely fix, without terminal codes
(issue 33)."""

import types

import numpy as np
import pytest

pytest.importorskip("keras")
pytest.importorskip("pyspark")

import keras  # noqa: E402

from spark_dl.spark.keras import KerasEstimator, util  # noqa: E402


def _dry_run_error(model, loss, batch, features=("x",), labels=("y",)):
    """The ValueError the driver's dry run raises for ``model`` on ``batch``."""
    est = KerasEstimator(model=model, optimizer=keras.optimizers.SGD(0.1), loss=loss,
                         feature_cols=list(features), label_cols=list(labels), batch_size=2)
    est._sample_batch = lambda store, dataset, rows=None: batch
    dataset = types.SimpleNamespace(columns={c: {"shape": list(np.shape(batch[c])[1:])}
                                             for c in batch})
    with pytest.raises(ValueError) as info:
        est._framework_spec(None, dataset)
    return str(info.value)


def test_integer_labels_against_softmax_suggest_sparse_categorical_crossentropy():
    inp = keras.Input((4,))
    model = keras.Model(inp, keras.layers.Dense(3, activation="softmax")(inp))
    text = _dry_run_error(model, "categorical_crossentropy",
                          {"x": np.zeros((2, 4), np.float32), "y": np.array([0, 2])})
    assert "loss='sparse_categorical_crossentropy'" in text
    assert "label_shapes" not in text and "\x1b" not in text


def test_one_output_unit_per_label_column_is_suggested():
    inp = keras.Input((4,))
    model = keras.Model(inp, keras.layers.Dense(3, activation="sigmoid")(inp))
    text = _dry_run_error(model, "binary_crossentropy",
                          {"x": np.zeros((2, 4), np.float32), "y": np.array([0.0, 1.0])})
    assert "keras.layers.Dense(1)" in text and "one output per label column" in text
    assert "label_shapes" not in text


def test_a_vector_label_that_does_not_fit_its_output_suggests_its_size():
    inp = keras.Input((4,))
    model = keras.Model(inp, keras.layers.Dense(3)(inp))
    text = _dry_run_error(model, "mse", {"x": np.zeros((2, 4), np.float32),
                                         "y": np.zeros((2, 5), np.float32)})
    assert "keras.layers.Dense(5)" in text and "label_shapes" not in text


def test_a_feature_column_that_does_not_fit_its_input_names_both_sizes():
    inp = keras.Input((4,))
    model = keras.Model(inp, keras.layers.Dense(1)(inp))
    text = _dry_run_error(model, "mse", {"x": np.zeros((2, 5), np.float32),
                                         "y": np.zeros((2,), np.float32)})
    assert "feature column 'x' has 5 values per row" in text
    assert "keras.Input(shape=(5,))" in text


def test_a_sequential_models_bolded_error_comes_without_terminal_codes():
    # Keras bolds the message of an error raised inside a layer's call with ANSI codes.
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    text = _dry_run_error(model, "mse", {"x": np.zeros((2, 4), np.float32),
                                         "y": np.zeros((2,), np.float32)})
    assert "Exception encountered when calling" in text and "\x1b" not in text
    assert "feature column 'x' has 4 values per row" in text


def test_terminal_codes_are_stripped():
    assert util.strip_ansi("\x1b[1mInput 0 is incompatible\x1b[0m\x1b[31m!\x1b[0m") == \
        "Input 0 is incompatible!"
