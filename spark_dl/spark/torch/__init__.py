"""PyTorch on Spark DataFrames: :class:`TorchEstimator` and :class:`TorchModel`.

Switching from Horovod is a change of import::

    from spark_dl.spark.torch import TorchEstimator     # was horovod.spark.torch

See docs/estimators.md. The classes are imported on first use, so that a worker that
imports :mod:`spark_dl.spark.torch.adapter` does not load pyspark.ml.
"""

__all__ = ["TorchEstimator", "TorchModel", "Callback", "EarlyStopping"]

_WHERE = {
    "TorchEstimator": "spark_dl.spark.torch.estimator",
    "TorchModel": "spark_dl.spark.torch.model",
    "Callback": "spark_dl.spark.common.callbacks",
    "EarlyStopping": "spark_dl.spark.common.callbacks",
}


def __getattr__(name):
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
