"""Apache Spark integration, in two layers.

Estimators (above):

- :mod:`spark_dl.spark.common`: the framework-neutral estimator layer: the Store (where
  data, checkpoints and logs live), ``prepare_data`` (DataFrame -> Parquet + metadata),
  the Arrow-native data loaders used on workers, params, and the fit/transform
  machinery a framework plugs into;
- :mod:`spark_dl.spark.torch`: the PyTorch estimator (later ``keras/``, ``lightning/``).

Launch (below): :mod:`spark_dl.spark.launch` runs a function on workers hosted by Spark
executors (:func:`run`): the driver side, the task side, the authenticated services and
the MPI path. It never imports the estimators.

``spark_dl.spark.run`` is that function, and :mod:`spark_dl.spark.task` keeps Horovod's
name for ``get_available_devices``.
"""


def __getattr__(name):
    # ``run`` (the launch layer, docs/spark.md) is imported on first use, so that
    # importing a submodule (e.g. in a worker) does not load the launcher.
    if name == "run":
        from spark_dl.spark.launch.spark_run import run

        return run
    if name == "run_elastic":
        from spark_dl.spark.launch.elastic_run import run_elastic

        return run_elastic
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
