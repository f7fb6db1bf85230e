"""Which kind of Spark session spark_dl is handed: classic (py4j) or Spark Connect.

A classic session lives in this process with its JVM: ``sparkContext``, ``df.rdd``,
broadcasts and the ``_jsc``/``_jdf``/``_jvm`` handles. A Spark Connect session (Databricks
notebooks on standard or serverless compute, any ``SparkSession.builder.remote(...)``) is a
gRPC client: DataFrames are plans sent to a server, and only the DataFrame API and the
session's ``conf`` exist. Code that needs the classic handles asks :func:`is_connect` first
and keeps a DataFrame-API path for Connect.

The answers live in :mod:`spark_dl.spark.launch.session` (the launch layer asks the same
questions); this module gives the estimator layer its names for them.
"""

from typing import Optional

from spark_dl.spark.launch.session import connect_host, is_connect, runs_here, session_of
from spark_dl.spark.launch.session import master_of as _master_of

__all__ = ["is_connect", "session_of", "master_of", "connect_host", "is_local_master"]


def master_of(spark_or_df) -> Optional[str]:
    """The session's ``spark.master`` (e.g. ``local[2]``, ``yarn``), or None where the
    server does not say (some Connect servers refuse to show cluster confs)."""
    return _master_of(spark_or_df) or None


#: Whether the executors run on this machine (see
#: :func:`spark_dl.spark.launch.session.runs_here`).
is_local_master = runs_here
