"""The estimators' worker loop calls each callback's batch hooks by the name it overrides:
Keras 3 callbacks override ``on_train_batch_begin``/``on_train_batch_end`` (Keras' base class
forwards those to the legacy ``on_batch_*``), spark_dl's own and older ones ``on_batch_*``.
The Keras estimator fit with such a callback: tests/spark/test_keras_estimator.py."""

import pytest

pytest.importorskip("pyspark")

from spark_dl.spark.common.callbacks import Callback  # noqa: E402
from spark_dl.spark.common.worker import callbacks_call  # noqa: E402


class Legacy(Callback):
    def __init__(self):
        self.calls = []

    def on_batch_begin(self, batch, logs=None):
        self.calls.append(("begin", batch))

    def on_batch_end(self, batch, logs=None):
        self.calls.append(("end", batch, logs))


class KerasStyle:
    """What a keras.callbacks.Callback subclass looks like to the loop."""

    def __init__(self):
        self.calls = []

    def on_batch_begin(self, batch, logs=None):  # Keras' base: the legacy alias
        self.calls.append(("legacy begin", batch))

    def on_batch_end(self, batch, logs=None):
        self.calls.append(("legacy end", batch))

    def on_train_batch_begin(self, batch, logs=None):
        self.calls.append(("begin", batch))

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append(("end", batch, logs))


def test_batch_hooks_reach_the_name_each_callback_overrides():
    legacy, modern, plain = Legacy(), KerasStyle(), Callback()
    for step in range(2):
        callbacks_call([legacy, modern, plain], "on_batch_begin", step, {})
        callbacks_call([legacy, modern, plain], "on_batch_end", step, {"loss": 1.0})
    expected = [("begin", 0), ("end", 0, {"loss": 1.0}), ("begin", 1), ("end", 1, {"loss": 1.0})]
    assert legacy.calls == expected and modern.calls == expected


def test_keras_callbacks_forward_to_their_legacy_hooks():
    keras = pytest.importorskip("keras")

    class Old(keras.callbacks.Callback):  # written for Keras 2: the legacy names only
        def __init__(self):
            super().__init__()
            self.calls = []

        def on_batch_end(self, batch, logs=None):
            self.calls.append(batch)

    class New(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.calls = []

        def on_train_batch_end(self, batch, logs=None):
            self.calls.append(batch)

    old, new = Old(), New()
    for step in range(3):
        callbacks_call([old, new], "on_batch_end", step, {"loss": 0.5})
    assert old.calls == new.calls == [0, 1, 2]
