"""KerasPredictor (what ``KerasModel.transform`` runs) without Spark: a process that loads
a model for each of many transforms, as an executor's Python worker and the driver's dry
run do, is not told that Keras's predict function retraced."""

import logging

import numpy as np
import pytest

keras = pytest.importorskip("keras")
pytest.importorskip("tensorflow")

from spark_dl.spark.keras import util  # noqa: E402
from spark_dl.spark.keras.adapter import KerasPredictor  # noqa: E402


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_many_transforms_in_one_process_do_not_warn_of_retracing():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    data = util.model_to_bytes(model)
    logger = logging.getLogger("tensorflow")
    records = _Records()
    logger.addHandler(records)
    try:
        for _ in range(7):  # TensorFlow warns from the fifth trace on
            predictor = KerasPredictor(data, None, ["x"], [("x", [3], "float32")], 16)
            predictor.prepare()
            (out,) = predictor.predict({"x": np.ones((5, 3), np.float32)})
            assert out.shape == (5, 2)
    finally:
        logger.removeHandler(records)
    assert not [m for m in records.messages if "retracing" in m]

    @__import__("tensorflow").function
    def own(x):  # the user's own functions still warn
        return x + 1

    logger.addHandler(records)
    try:
        for n in range(1, 8):
            own(np.ones(n))
    finally:
        logger.removeHandler(records)
    assert [m for m in records.messages if "retracing" in m]
