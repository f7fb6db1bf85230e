"""Which kind of Spark session spark_dl is handed: classic (py4j) or Spark Connect.

A classic session lives in this process with its JVM: ``sparkContext``, ``df.rdd``,
broadcasts and the ``_jsc``/``_jdf``/``_jvm`` handles. A Spark Connect session (Databricks
notebooks on standard or serverless compute, any ``SparkSession.builder.remote(...)``) is a
gRPC client: DataFrames are plans sent to a server, and only the DataFrame API and the
session's ``conf`` exist. Code that needs the classic handles asks :func:`is_connect` first
and keeps a DataFrame-API path for Connect.

The test is by class, not by pyspark's process-wide ``is_remote()`` (an environment variable
that says what new sessions will be), so it answers for the object at hand.
"""

from typing import Optional

__all__ = ["is_connect", "session_of", "master_of", "connect_host", "is_local_master"]


def is_connect(spark_or_df) -> bool:
    """Whether ``spark_or_df`` (a SparkSession, DataFrame or Column) belongs to Spark Connect.

    Works with every pyspark that has Connect (3.4+) and costs no round trip.
    """
    return type(spark_or_df).__module__.startswith("pyspark.sql.connect.")


def session_of(spark_or_df):
    """The SparkSession of a DataFrame, or the session itself."""
    session = getattr(spark_or_df, "sparkSession", None)
    return spark_or_df if session is None else session


def master_of(spark_or_df) -> Optional[str]:
    """The session's ``spark.master`` (e.g. ``local[2]``, ``yarn``), or None where the
    server does not say (some Connect servers refuse to show cluster confs).

    Reads the session conf, which answers on classic and Connect sessions alike (one round
    trip on Connect).
    """
    try:
        master = session_of(spark_or_df).conf.get("spark.master", None)
    except Exception:  # a Connect server may refuse the key (CONFIG_NOT_AVAILABLE)
        return None
    return master or None


def connect_host(spark_or_df) -> Optional[str]:
    """The host of a Connect session's server (``localhost`` for ``remote("local")``);
    None for a classic session or where the client does not say."""
    if not is_connect(spark_or_df):
        return None
    try:
        return session_of(spark_or_df).client._builder.host
    except Exception:
        return None


_LOOPBACK = ("localhost", "127.0.0.1", "::1", "[::1]")


def is_local_master(spark_or_df) -> bool:
    """Whether the executors run on this machine: a local master (``local``, ``local[N]``,
    ``local-cluster[...]``) and, for Spark Connect, a server on this host (a local master
    on a remote server runs its executors there). False where either is unknown."""
    master = master_of(spark_or_df)
    if not (master or "").startswith("local"):
        return False
    if not is_connect(spark_or_df):
        return True
    host = connect_host(spark_or_df)
    if host is None:
        return False
    import socket

    return host in _LOOPBACK or host in (socket.gethostname(), socket.getfqdn())
