"""A Spark standalone cluster on namespace hosts (netns.py), and a driver on its own host.

:class:`Standalone` starts a Spark standalone master on one host and one Worker per worker
host (``spark-class org.apache.spark.deploy.master.Master`` / ``...worker.Worker`` of the
pyspark install in ``.venv``), each bound to its host's ``eth0`` address, and waits
(bounded) until the workers registered. :meth:`Standalone.driver` starts a Spark
application's driver on a client host: a Python process (this file run as a script) that
builds a ``SparkSession`` on ``spark://<master>:7077`` with ``spark.driver.host`` the
client's address, waits until every worker runs one of its executors, and then runs the
functions the test sends it (:meth:`Driver.call`), so one application serves a whole
test module.

The protocol between the test and the driver is two pipes: the test writes cloudpickled
``(fn, args, kwargs)`` frames on the driver's stdin; the driver runs ``fn(spark, *args,
**kwargs)`` and answers on its original stdout (moved to another descriptor at start, so
that Spark and print() cannot write into it) with a pickled ``("ok", value)`` or
``("error", exception, traceback text)``. Every wait is bounded (:meth:`Driver.call` takes
a timeout, the cluster's start and stop too).

:meth:`Standalone.stop` stops the drivers, workers and master (SIGTERM to their process
groups, SIGKILL after a grace) and checks that no process is left on any host.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PYTHON = os.path.join(ROOT, ".venv", "bin", "python")
MASTER_PORT = 7077
MASTER_UI_PORT = 8080
# Every JVM of the cluster starts on a small, shared machine: C1 only and the serial
# collector cut the CPU of their start by about half.
JAVA_OPTS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -XX:CICompilerCount=1"


def spark_home() -> str:
    import pyspark

    return os.path.dirname(pyspark.__file__)


def _conf_dir(tmp: str) -> str:
    """Spark's conf dir for every process of the cluster: warnings-only JVM logs."""
    path = os.path.join(tmp, "conf")
    os.makedirs(path, exist_ok=True)
    shutil.copy(os.path.join(ROOT, "conf", "log4j2.properties"), path)
    return path


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _stop_group(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM to the process's group, SIGKILL after ``grace``; reaps it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


class Driver:
    """A Spark application's driver process on a client host (see the module doc)."""

    def __init__(self, host, master_url: str, conf: Dict[str, str], executors: int,
                 log_path: str, env: Dict[str, str], start_timeout: float = 120.0):
        self.host = host
        self.log_path = log_path
        self._log = open(log_path, "ab")
        config = {"master": master_url, "conf": conf, "executors": executors,
                  "timeout": start_timeout}
        self.proc = host.popen([PYTHON, os.path.abspath(__file__), "--driver",
                                json.dumps(config)], env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=self._log)
        try:
            self.info = self._reply(start_timeout + 30.0, "start")
        except BaseException:
            self.stop()
            raise

    def call(self, fn, *args, timeout: float = 120.0, **kwargs):
        """Runs ``fn(spark, *args, **kwargs)`` in the driver; returns its value or raises
        its exception (``TimeoutError`` after ``timeout`` s: the driver is then useless)."""
        self.submit(fn, *args, **kwargs)
        return self.result(timeout)

    def submit(self, fn, *args, **kwargs) -> None:
        """Starts ``fn(spark, *args, **kwargs)`` in the driver; :meth:`result` waits for it
        (one call at a time)."""
        import cloudpickle

        data = cloudpickle.dumps((fn, args, kwargs))
        self._pending = getattr(fn, "__name__", "call")
        self.proc.stdin.write(struct.pack("!Q", len(data)) + data)
        self.proc.stdin.flush()

    def result(self, timeout: float = 120.0):
        """The value of the call :meth:`submit` started, or its exception."""
        return self._reply(timeout, self._pending)

    def _read(self, n: int, deadline: float, what: str) -> bytes:
        out = b""
        fd = self.proc.stdout.fileno()
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the driver on {self.host.name} did not answer {what} in "
                                   f"time (log: {self.log_path}):\n{self.log_tail()}")
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(fd, n - len(out))
                if not chunk:
                    raise RuntimeError(f"the driver on {self.host.name} exited "
                                       f"({self.proc.poll()}) during {what}:\n"
                                       f"{self.log_tail()}")
                out += chunk
        return out

    def _reply(self, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        size, = struct.unpack("!Q", self._read(8, deadline, what))
        status, *rest = pickle.loads(self._read(size, deadline, what))
        if status == "ok":
            return rest[0]
        exc, text = rest
        if isinstance(exc, BaseException):
            raise exc
        raise RuntimeError(f"{what} failed in the driver:\n{text}")

    def log_tail(self, lines: int = 60) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> None:
        """Stops the session (closing stdin ends the driver's loop), then the process."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        _stop_group(self.proc)
        self._log.close()


class Standalone:
    """A Spark standalone cluster: master on ``master``, one Worker per ``workers`` host.

    Args:
        master: the :class:`netns.Host` running the master (port 7077, UI 8080).
        workers: the hosts running a Worker each (``cores`` cores, ``memory`` each).
        tmp: where the logs, work dirs and Spark's conf go (default: a fresh temporary
            folder, removed by a clean :meth:`stop`).
    """

    def __init__(self, master, workers: Sequence, cores: int = 2, memory: str = "1g",
                 tmp: Optional[str] = None):
        self.master = master
        self.workers = list(workers)
        self.cores = cores
        self.memory = memory
        self.tmp = tmp or tempfile.mkdtemp(prefix="sdl-standalone-")
        self.conf_dir = _conf_dir(self.tmp)
        self.url = f"spark://{master.address}:{MASTER_PORT}"
        self.procs: Dict[str, subprocess.Popen] = {}
        self.drivers: List[Driver] = []
        self._logs = []

    # -- environment ---------------------------------------------------------------------
    def env(self, host, **extra) -> Dict[str, str]:
        """The environment of every Spark process on ``host``."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SPARK_", "PYSPARK_", "SDL_", "HOROVOD_"))}
        paths = [ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env.update(SPARK_HOME=spark_home(), SPARK_CONF_DIR=self.conf_dir,
                   SPARK_LOCAL_IP=host.address, SPARK_LOCAL_HOSTNAME=host.name,
                   SPARK_DAEMON_MEMORY="256m", SPARK_DAEMON_JAVA_OPTS=JAVA_OPTS,
                   PYSPARK_PYTHON=PYTHON,
                   PYSPARK_DRIVER_PYTHON=PYTHON, PYTHONPATH=os.pathsep.join(paths),
                   PATH=os.path.dirname(PYTHON) + os.pathsep + env.get("PATH", ""))
        env.update(extra)
        return env

    def _spawn(self, key: str, host, argv: List[str]) -> subprocess.Popen:
        log = open(os.path.join(self.tmp, f"{key}.log"), "ab")
        self._logs.append(log)
        proc = host.popen(argv, env=self.env(host), stdout=log, stderr=subprocess.STDOUT,
                          stdin=subprocess.DEVNULL)
        self.procs[key] = proc
        return proc

    def log(self, key: str, lines: int = 40) -> str:
        try:
            with open(os.path.join(self.tmp, f"{key}.log"), errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    # -- start ----------------------------------------------------------------------------
    def start(self, timeout: float = 120.0) -> "Standalone":
        """Starts the master and the workers; returns once all workers registered."""
        spark_class = os.path.join(spark_home(), "bin", "spark-class")
        self._spawn("master", self.master, [
            spark_class, "org.apache.spark.deploy.master.Master", "--host",
            self.master.address, "--port", MASTER_PORT, "--webui-port", MASTER_UI_PORT])
        for host in self.workers:
            self.start_worker(host)
        self.wait_workers(len(self.workers), timeout)
        return self

    def start_worker(self, host) -> None:
        spark_class = os.path.join(spark_home(), "bin", "spark-class")
        work = os.path.join(self.tmp, f"work-{host.name}")
        os.makedirs(work, exist_ok=True)
        self._spawn(f"worker-{host.name}", host, [
            spark_class, "org.apache.spark.deploy.worker.Worker", "--host", host.address,
            "--cores", self.cores, "--memory", self.memory, "--work-dir", work,
            "--webui-port", 8081, self.url])

    def alive_workers(self) -> List[str]:
        """The hosts (addresses) of the workers the master lists ALIVE."""
        code = ("import json, urllib.request\n"
                f"u = 'http://{self.master.address}:{MASTER_UI_PORT}/json/'\n"
                "print(json.dumps([w['host'] for w in json.load(urllib.request.urlopen(u, "
                "timeout=5))['workers'] if w['state'] == 'ALIVE']))")
        proc = self.master.python(code, timeout=20, check=False)
        if proc.returncode != 0:
            return []
        return json.loads(proc.stdout)

    def wait_workers(self, count: int, timeout: float) -> List[str]:
        deadline = time.monotonic() + timeout
        while True:
            alive = self.alive_workers()
            if len(alive) >= count:
                return alive
            for key, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{key} exited with {proc.returncode}:\n{self.log(key)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(alive)} of {count} workers registered within "
                                   f"{timeout:g} s:\n{self.log('master')}")
            time.sleep(1.0)

    def driver(self, client, conf: Optional[Dict[str, str]] = None,
               executors: Optional[int] = None, timeout: float = 120.0,
               master: Optional[str] = None) -> Driver:
        """Starts an application's driver on ``client`` (``master``: another master URL,
        e.g. ``local[2]``, for a comparison run on the client host alone)."""
        full = {"spark.driver.host": client.address, "spark.driver.bindAddress": client.address,
                "spark.driver.memory": "512m", "spark.executor.memory": "512m",
                "spark.driver.extraJavaOptions": JAVA_OPTS,
                "spark.executor.extraJavaOptions": JAVA_OPTS,
                "spark.executor.cores": str(self.cores),
                "spark.cores.max": str(self.cores * len(self.workers)),
                "spark.pyspark.python": PYTHON, "spark.executorEnv.PYTHONPATH": ROOT,
                "spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false",
                "spark.sql.shuffle.partitions": "2", "spark.python.worker.reuse": "true",
                "spark.dynamicAllocation.enabled": "false"}
        full.update(conf or {})
        log = os.path.join(self.tmp, f"driver-{len(self.drivers)}.log")
        driver = Driver(client, master or self.url, full,
                        0 if master else (len(self.workers) if executors is None else executors),
                        log, self.env(client), timeout)
        self.drivers.append(driver)
        return driver

    # -- stop -----------------------------------------------------------------------------
    def stop_worker(self, host) -> None:
        proc = self.procs.pop(f"worker-{host.name}", None)
        if proc is not None:
            _stop_group(proc)

    def stop(self, hosts: Sequence = (), timeout: float = 20.0) -> None:
        """Stops the drivers, the workers and the master, then checks (bounded) that no
        process is left on ``hosts`` (default: the master's and the workers').

        Raises:
            AssertionError: processes left; they are killed first and named.
        """
        for driver in self.drivers:
            driver.stop()
        self.drivers.clear()
        for key in [k for k in self.procs if k != "master"] + ["master"]:
            proc = self.procs.pop(key, None)
            if proc is not None:
                _stop_group(proc)
        for log in self._logs:
            log.close()
        self._logs.clear()
        hosts = list(hosts) or [self.master] + self.workers
        deadline = time.monotonic() + timeout
        left = {}
        while True:
            left = {h.name: {p: _cmdline(p) for p in h.processes()} for h in hosts}
            left = {name: procs for name, procs in left.items() if procs}
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if left:
            for host in hosts:
                host.kill_all()
            raise AssertionError(f"processes left after the cluster stopped: {left} (logs: "
                                 f"{self.tmp})")
        shutil.rmtree(self.tmp, ignore_errors=True)  # kept (with the logs) on failures


@contextlib.contextmanager
def client_and_two_workers(netns, timeout: float = 240.0):
    """Hosts client, host0 and host1; the master and one driver (``cluster.app``) on the
    client, a Worker on each of the others. Yields ``(hosts, cluster)``; at exit the links
    are up again, everything stopped and checked gone (:meth:`Standalone.stop`)."""
    with netns.Cluster(3, names=["client", "host0", "host1"]) as hosts:
        client, h0, h1 = hosts.hosts
        cluster = Standalone(client, [h0, h1])
        try:
            cluster.start(timeout=timeout)
            cluster.app = cluster.driver(client, timeout=timeout)
            yield hosts, cluster
        finally:
            for host in hosts.hosts:
                host.link(up=True)
            cluster.stop(hosts=hosts.hosts)


# ---------------------------------------------------------------------------- the driver


def _serve(config: dict) -> None:
    """The driver process: a session on the master, then calls from stdin (module doc)."""
    reply = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # Spark, the JVM and print() write to stderr from now on
    sys.stdout = sys.stderr
    requests = sys.stdin.buffer

    def answer(*message) -> None:
        try:
            data = pickle.dumps(message)
        except Exception as exc:  # a value or exception that does not pickle
            data = pickle.dumps(("error", None, f"the answer {message[1]!r:.500} does not "
                                 f"pickle ({exc})\n{message[-1] if message[0] == 'error' else ''}"))
        reply.write(struct.pack("!Q", len(data)) + data)
        reply.flush()

    try:
        from pyspark.sql import SparkSession

        builder = SparkSession.builder.master(config["master"]).appName("spark_dl-hosts")
        for key, value in config["conf"].items():
            builder = builder.config(key, value)
        spark = builder.getOrCreate()
        spark.sparkContext.setLogLevel("WARN")
        deadline = time.monotonic() + config["timeout"]
        sc = spark.sparkContext
        while config["executors"]:
            # The driver itself is one of the "executors" Spark lists.
            registered = sc._jsc.sc().getExecutorMemoryStatus().size() - 1
            if registered >= config["executors"]:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{registered} of {config['executors']} executors "
                                   f"registered within {config['timeout']} s")
            time.sleep(0.5)
        answer("ok", {"master": sc.master, "app": sc.applicationId})
    except BaseException as exc:
        answer("error", None, "".join(traceback.format_exception(type(exc), exc,
                                                                 exc.__traceback__)))
        return
    try:
        while True:
            head = requests.read(8)
            if len(head) < 8:
                break  # the test closed stdin: stop
            size, = struct.unpack("!Q", head)
            fn, args, kwargs = pickle.loads(requests.read(size))
            try:
                answer("ok", fn(spark, *args, **kwargs))
            except BaseException as exc:
                answer("error", exc, "".join(traceback.format_exception(
                    type(exc), exc, exc.__traceback__)))
    finally:
        spark.stop()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--driver":
        _serve(json.loads(sys.argv[2]))
    else:
        sys.exit("usage: spark_standalone.py --driver CONFIG_JSON (started by Standalone)")
