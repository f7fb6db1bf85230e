"""What the installed Spark can run, for tests that need more than pyspark's Python side.

Spark Connect's server is a jar (``spark-connect_<scala>-<version>.jar``) that pip's pyspark
4.x ships in its ``jars/`` and pyspark 3.5 does not (3.5 fetches it from Maven with
``--packages``, which this machine cannot reach). The Connect tests therefore skip where
the jar is missing, and Spark Connect is verified on Spark 4.x only.
"""

import glob
import os

import pytest


def connect_server_jar():
    """The path of the Spark Connect server's jar in the Spark that pyspark runs, or None."""
    from pyspark.find_spark_home import _find_spark_home

    jars = glob.glob(os.path.join(_find_spark_home(), "jars", "spark-connect_*.jar"))
    return jars[0] if jars else None


def require_connect_server() -> None:
    """Skips the calling test module (or fixture) where a Spark Connect server cannot start
    here: no pyspark, no grpc, or no Connect server jar."""
    pyspark = pytest.importorskip("pyspark")
    pytest.importorskip("grpc")
    if connect_server_jar() is None:
        pytest.skip(f"pyspark {pyspark.__version__} ships no Spark Connect server jar (pip's "
                    "pyspark 4.x does, 3.5 does not): Spark Connect is verified on 4.x only",
                    allow_module_level=True)
