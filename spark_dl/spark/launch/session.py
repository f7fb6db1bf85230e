"""The Spark session a job runs in: classic (a SparkContext in this process) or Spark Connect.

A Spark Connect session (Databricks notebooks on standard or serverless compute, any
``SparkSession.builder.remote(...)`` client, ``spark.api.mode=connect``) has no
``SparkContext``, no ``df.rdd`` and no JVM in the caller's process, and the caller may be
unreachable from the executors. Everything spark_dl submits therefore goes through the
DataFrame API, which both kinds of session have; this module answers the few questions
whose answer differs between them, in one place:

- :func:`active_session`: the session to submit to (classic or Connect);
- :func:`is_connect`: whether a session (or a DataFrame's) is a Connect session;
- :func:`master_of`, :func:`conf_of`: the master URL and the settings, read through
  ``spark.conf`` (the server's, under Connect);
- :func:`spark_context`: the SparkContext of a classic session, else None;
- :func:`connect_host`, :func:`runs_here`: where a Connect server runs, and whether the
  executors run on this machine.

The test is by class, not by pyspark's process-wide ``is_remote()`` (an environment
variable that says what new sessions will be), so it answers for the object at hand.
"""

from __future__ import annotations

import re
from typing import Dict, Optional

__all__ = ["active_session", "is_connect", "session_of", "master_of", "conf_of", "conf_get",
           "spark_context", "connect_host", "runs_here", "check_server_version", "MIN_SPARK"]

#: The oldest Spark whose DataFrame API has barrier ``mapInArrow`` (``barrier=True``).
MIN_SPARK = (3, 5)


def is_connect(spark_or_df) -> bool:
    """Whether ``spark_or_df`` (a SparkSession, DataFrame or Column) belongs to Spark
    Connect; costs no round trip."""
    return type(spark_or_df).__module__.startswith("pyspark.sql.connect")


def session_of(spark_or_df):
    """The SparkSession of a DataFrame, or the session itself."""
    session = getattr(spark_or_df, "sparkSession", None)
    return spark_or_df if session is None else session


def active_session():
    """The active SparkSession, classic or Connect.

    Raises:
        RuntimeError: there is none; says how to make one.
    """
    from pyspark.sql import SparkSession

    try:
        session = SparkSession.getActiveSession()
    except Exception:  # pyspark without Connect's client packages, or no JVM yet
        session = None
    if session is None:
        try:  # a Connect session made in another thread or by builder.remote(...)
            from pyspark.sql.connect.session import SparkSession as ConnectSession

            session = ConnectSession.getActiveSession() or getattr(
                ConnectSession, "_default_session", None)
        except Exception:
            session = None
    if session is None:
        try:  # a classic SparkContext without a session object yet
            from pyspark import SparkContext

            sc = SparkContext._active_spark_context
            if sc is not None:
                session = SparkSession(sc)
        except Exception:
            session = None
    if session is None:
        raise RuntimeError("spark_dl.spark.run needs an active SparkSession: create one "
                           "first (SparkSession.builder.getOrCreate(), or "
                           "SparkSession.builder.remote(...) for Spark Connect)")
    return session


def spark_context(spark):
    """The classic session's SparkContext; None under Spark Connect."""
    if is_connect(spark):
        return None
    return getattr(spark, "sparkContext", None)


def conf_get(spark, key: str, default: Optional[str] = None) -> Optional[str]:
    """One setting of the session (the server's under Connect), else ``default``."""
    sc = spark_context(spark)
    if sc is not None:
        return sc.getConf().get(key, default)
    try:
        return spark.conf.get(key, default)
    except Exception:  # a setting the server refuses to show (e.g. on serverless)
        return default


def conf_of(spark) -> Dict[str, str]:
    """Every setting the session shows (the server's under Connect)."""
    sc = spark_context(spark)
    if sc is not None:
        return dict(sc.getConf().getAll())
    try:
        conf = spark.conf.getAll
        return dict(conf() if callable(conf) else conf)
    except Exception:
        return {}


def master_of(spark) -> str:
    """The master URL (``local[2]``, ``spark://...``, ``yarn``) of a session or a
    DataFrame's; ``""`` when the server does not say (e.g. Databricks serverless)."""
    spark = session_of(spark)
    sc = spark_context(spark)
    if sc is not None:
        return sc.master or ""
    return conf_get(spark, "spark.master", "") or ""


def connect_host(spark) -> Optional[str]:
    """The host of a Connect session's server (``localhost`` for ``remote("local")``);
    None for a classic session or where the client does not say."""
    spark = session_of(spark)
    if not is_connect(spark):
        return None
    try:
        host = spark.client._builder.host
        return str(host) if host else None
    except Exception:
        return None


_LOOPBACK = ("localhost", "127.0.0.1", "::1", "[::1]")


def runs_here(spark) -> bool:
    """Whether the executors run on this machine: a local master (``local``, ``local[N]``,
    ``local-cluster[...]``) and, for Spark Connect, a server on this host (a local master
    on a remote server runs its executors there). False where either is unknown."""
    import socket

    if not master_of(spark).startswith("local"):
        return False
    if not is_connect(session_of(spark)):
        return True
    host = connect_host(spark)
    if host is None:
        return False
    return host in _LOOPBACK or host.startswith("127.") or host in (socket.gethostname(),
                                                                      socket.getfqdn())


def check_server_version(spark) -> str:
    """Returns the Spark version the session runs on.

    Raises:
        RuntimeError: older than :data:`MIN_SPARK` (no barrier ``mapInArrow``); names the
            version and what to do.
    """
    version = str(getattr(spark, "version", "") or "")
    match = re.match(r"(\d+)\.(\d+)", version)
    if match and (int(match.group(1)), int(match.group(2))) < MIN_SPARK:
        where = "the Spark Connect server" if is_connect(spark) else "this Spark"
        raise RuntimeError(
            f"spark_dl needs Spark >= {MIN_SPARK[0]}.{MIN_SPARK[1]} (barrier mapInArrow), "
            f"but {where} runs Spark {version}: use a cluster with Spark "
            f"{MIN_SPARK[0]}.{MIN_SPARK[1]} or newer (Databricks Runtime 14 or newer)")
    return version
