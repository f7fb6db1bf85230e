"""PyTorch Lightning on Spark DataFrames: :class:`LightningEstimator` and
:class:`LightningModel`, also exported under Horovod's names ``TorchEstimator`` and
``TorchModel`` (the same classes).

Switching from Horovod is a change of import::

    import spark_dl.spark.lightning as hvd        # was: import horovod.spark.lightning as hvd
    est = hvd.TorchEstimator(...)                  # LightningEstimator

See docs/lightning.md. The classes are imported on first use, so that a worker that
imports :mod:`spark_dl.spark.lightning.adapter` does not load pyspark.ml.
"""

__all__ = ["LightningEstimator", "LightningModel", "TorchEstimator", "TorchModel"]

_WHERE = {
    "LightningEstimator": "spark_dl.spark.lightning.estimator",
    "LightningModel": "spark_dl.spark.lightning.model",
    # Horovod's names (horovod.spark.lightning): aliases of the two above.
    "TorchEstimator": "spark_dl.spark.lightning.estimator",
    "TorchModel": "spark_dl.spark.lightning.model",
}


def __getattr__(name):
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
