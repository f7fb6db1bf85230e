"""Keras 3 on Spark: :class:`KerasEstimator` trains a Keras model on a DataFrame with
spark_dl workers and returns a :class:`KerasModel`, a Spark ML Transformer (see
docs/keras.md). Parameter names follow ``horovod.spark.keras``.
"""

from spark_dl.spark.keras.estimator import KerasEstimator
from spark_dl.spark.keras.model import KerasModel

__all__ = ["KerasEstimator", "KerasModel"]
