"""On local masters, executors run the driver's interpreter unless the user chose one."""

import io
import sys

from spark_dl.spark.launch.executor_python import use_driver_python


class FakeConf(dict):
    def get(self, key, default=None):
        return super().get(key, default)


class FakeContext:
    def __init__(self, master, conf=None):
        self.master, self.pythonExec, self._conf = master, "python3", FakeConf(conf or {})

    def getConf(self):
        return self._conf


def test_local_master_gets_this_interpreter_and_a_note(monkeypatch):
    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    sc, out = FakeContext("local[2]"), io.StringIO()
    assert use_driver_python(sc, out) is True
    assert sc.pythonExec == sys.executable
    assert "run this driver's Python" in out.getvalue() and "'python3'" in out.getvalue()
    # The note promises the driver's Python for spark_dl's jobs only, not the user's UDFs.
    assert "spark_dl's jobs on master 'local[2]'" in out.getvalue()
    assert "your own UDFs may still run on 'python3'" in out.getvalue()
    assert use_driver_python(sc, out) is False  # already this interpreter


def test_a_choice_or_a_cluster_master_is_left_alone(monkeypatch):
    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    for sc in (FakeContext("spark://host:7077"), FakeContext("yarn")):
        assert use_driver_python(sc, io.StringIO()) is False
        assert sc.pythonExec == "python3"
    # spark.pyspark.python chose: PySpark alone would ignore the conf in a program started
    # as `python` (it reads PYSPARK_PYTHON), so spark_dl's jobs take the choice, never the
    # driver's interpreter (a packed venv's ./env/bin/python: docs/install.md).
    for master in ("local[2]", "yarn"):
        sc = FakeContext(master, {"spark.pyspark.python": "./env/bin/python"})
        assert use_driver_python(sc, io.StringIO()) is True
        assert sc.pythonExec == "./env/bin/python"
        assert use_driver_python(sc, io.StringIO()) is False
    monkeypatch.setenv("PYSPARK_PYTHON", "/usr/bin/python3")
    sc = FakeContext("local-cluster[2,1,1024]")
    assert use_driver_python(sc, io.StringIO()) is False and sc.pythonExec == "python3"
