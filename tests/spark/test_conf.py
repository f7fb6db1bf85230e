"""conf/ ships working defaults: a Spark program started with SPARK_CONF_DIR=conf gets
conf/spark-defaults.conf and conf/log4j2.properties."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("pyspark")
pytestmark = [pytest.mark.spark, pytest.mark.timeout(180)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_spark_conf_dir_defaults_apply():
    program = textwrap.dedent("""
        from pyspark.sql import SparkSession
        spark = SparkSession.builder.master("local[1]").getOrCreate()
        conf = spark.sparkContext.getConf()
        print("progress=" + conf.get("spark.ui.showConsoleProgress"))
        print("reuse=" + conf.get("spark.python.worker.reuse"))
        bean = spark.sparkContext._jvm.java.lang.management.ManagementFactory
        print("jvm=" + " ".join(bean.getRuntimeMXBean().getInputArguments()))
        spark.stop()
    """)
    env = dict(os.environ, SPARK_CONF_DIR=os.path.join(ROOT, "conf"),
               PYSPARK_PYTHON=sys.executable)
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True,
                          text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "progress=false" in done.stdout and "reuse=true" in done.stdout
    # The driver's JVM was started with conf/'s options (the quick JIT compiler only).
    assert "-XX:TieredStopAtLevel=1" in done.stdout.split("jvm=", 1)[1], done.stdout
    # conf/log4j2.properties replaced Spark's default profile (which announces itself).
    assert "Using Spark's default log4j profile" not in done.stderr
