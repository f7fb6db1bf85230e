"""Apache Spark integration: estimators, the Store, ``prepare_data`` and the data loaders.

The Spark-independent data pieces live in :mod:`spark_dl.spark.common`:
:mod:`~spark_dl.spark.common.store` (where data, checkpoints and logs live),
:mod:`~spark_dl.spark.common.util` (``prepare_data``: DataFrame -> Parquet + metadata) and
:mod:`~spark_dl.spark.common.data_loader` (the Arrow-native loader used on workers).
"""


def __getattr__(name):
    # ``run`` (the launch layer, docs/spark.md) is imported on first use, so that
    # importing a submodule (e.g. in a worker) does not load the launcher.
    if name == "run":
        from spark_dl.spark.launch.spark_run import run

        return run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
