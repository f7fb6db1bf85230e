"""Apache Spark integration: estimators, the Store, ``prepare_data`` and the data loaders.

The Spark-independent data pieces live in :mod:`spark_dl.spark.common`:
:mod:`~spark_dl.spark.common.store` (where data, checkpoints and logs live),
:mod:`~spark_dl.spark.common.util` (``prepare_data``: DataFrame -> Parquet + metadata) and
:mod:`~spark_dl.spark.common.data_loader` (the Arrow-native loader used on workers).
"""
