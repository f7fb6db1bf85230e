"""Fixtures shared by every test folder."""

import logging
import os
import socket

import pytest

S3_KEY, S3_SECRET, S3_REGION, S3_BUCKET = "testing", "testing", "us-east-1", "spark-dl-test"

# Every JVM the tests start (sessions, executors, subprocess programs) reads its defaults
# from tests/spark_conf: the quick JIT compiler only, which cuts the suite's CPU time by a
# fifth to a third on Spark tests (see the file). A SPARK_CONF_DIR set by the caller wins;
# tests that run the shipped conf/ set their own.
os.environ.setdefault("SPARK_CONF_DIR",
                      os.path.join(os.path.dirname(os.path.abspath(__file__)), "spark_conf"))


@pytest.fixture(scope="module")
def s3_endpoint():
    """A moto S3 server on 127.0.0.1 for this module (bucket 'spark-dl-test'); yields its URL."""
    server_mod = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        with socket.create_connection((host, port), timeout=5):
            pass
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=S3_KEY,
                     aws_secret_access_key=S3_SECRET, region_name=S3_REGION) \
            .create_bucket(Bucket=S3_BUCKET)
        yield endpoint
    finally:
        server.stop()


@pytest.fixture(scope="module", autouse=True)
def _no_spark_settings_from_earlier_modules():
    """Clears the ``spark.*`` JVM system properties a stopped session left behind.

    pyspark hands a session's settings to its JVM as system properties, and every later
    SparkConf in that JVM loads them: a module that used GPU task resources on
    ``local-cluster`` made a later module's ``local[2]`` session wait forever for GPUs
    (--dist loadfile runs many modules in one process). No-op where no JVM was started or
    a session still runs."""
    import sys

    pyspark = sys.modules.get("pyspark")
    if pyspark is not None:
        from pyspark import SparkContext

        gateway = SparkContext._gateway
        if gateway is not None and SparkContext._active_spark_context is None:
            props = gateway.jvm.java.lang.System.getProperties()
            for key in list(props.stringPropertyNames().toArray()):
                if str(key).startswith("spark."):
                    props.remove(key)
    yield


# --- pytest-xdist (scripts/test.sh runs `pytest -n 2 --dist loadfile`) ----------------------
# With --dist loadfile a whole scheduling group runs on one worker, in order; the groups here:
# - a module: its module-scoped fixtures (a Spark session, hosts, a rank world) and its
#   per-module result caches (tests/parallel/harness.run_once) are made once, as in a serial
#   run;
# - tests/cluster: its modules create network namespaces and each checks after itself that
#   none of ours is left, so two of them may not run at once;
# - tests/install with tests/unit/test_native_cpp.py: both build in the editable install's
#   build folder (build/<wheel tag>: scripts/build_wheel.sh and the C++ unit tests' target).
# (xdist's own --dist loadgroup marks do not work with pytest 9, whose node ids xdist cannot
# suffix, hence this scheduler.) Without -n nothing here changes a run.
_SHARED_GROUPS = {
    "tests/cluster/": "tests/cluster",
    "tests/install/": "native-build-dir",
    "tests/unit/test_native_cpp.py": "native-build-dir",
}
# Groups are handed out in collection order (scripts/test.sh passes --no-loadscope-reorder),
# which workers sort so that the long groups go first and the many short unit modules last,
# where they fill the time while the other worker ends its last long group.
_GROUP_ORDER = ("tests/cluster", "native-build-dir", "tests/unit/test_docs_snippets.py",
                "tests/spark/", "tests/parallel/", "tests/gpu/", "tests/unit/")


def _xdist_group(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    for prefix, group in _SHARED_GROUPS.items():
        if path.startswith(prefix):
            return group
    return path


def _group_rank(nodeid: str) -> int:
    group = _xdist_group(nodeid)
    return next((i for i, p in enumerate(_GROUP_ORDER) if group.startswith(p)),
                len(_GROUP_ORDER))


@pytest.hookimpl(optionalhook=True)  # a hook of xdist's: absent under -p no:xdist
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, with the shared groups above (in the controller)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ModuleGroupScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _xdist_group(nodeid)

    return ModuleGroupScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Stable, so every worker collects the same order (xdist checks that they agree).
        items.sort(key=lambda item: _group_rank(item.nodeid))


# --- executor folders of local-cluster applications --------------------------------------------
# Spark's local-cluster workers keep each application's executor folders (their logs, the
# files and archives shipped to them: an unpacked venv is 230 MB) under SPARK_HOME/work, which
# for pip's pyspark is inside the virtualenv, and never delete them. The run removes the
# folders its own applications made: in the controller (under xdist, after every worker has
# ended), and only names that were not there when the run began.
def _spark_work_folder():
    import importlib.util

    home = os.environ.get("SPARK_HOME")
    if not home:
        spec = importlib.util.find_spec("pyspark")
        if spec is None or not spec.origin:
            return None
        home = os.path.dirname(spec.origin)
    return os.path.join(home, "work")


def _app_folders(work):
    try:
        return {name for name in os.listdir(work) if name.startswith("app-")}
    except OSError:
        return set()


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):
        work = _spark_work_folder()
        session.config._sdl_spark_work = (work, _app_folders(work) if work else set())


def pytest_sessionfinish(session):
    work, before = getattr(session.config, "_sdl_spark_work", (None, set()))
    if work:
        import shutil

        for name in _app_folders(work) - before:
            shutil.rmtree(os.path.join(work, name), ignore_errors=True)
