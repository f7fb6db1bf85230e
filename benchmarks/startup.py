"""Start-up cost of a trivial job: ``spark_dl.spark.run`` vs pyspark's TorchDistributor,
through a classic session and through Spark Connect.

    .venv/bin/python benchmarks/startup.py                  # local[2], 7 rounds
    .venv/bin/python benchmarks/startup.py --rounds 11 --json out.json
    .venv/bin/python benchmarks/startup.py --no-connect     # the classic rows only

Both run the same trivial function (it returns its process id) on 2 processes, in the same
Python process and Spark session, alternating (the order flips every round, so a noisy,
shared machine slows both alike):

* **spark_dl**: ``spark_dl.spark.run(fn, num_proc=2)``: a barrier Spark job of 2 tasks, a
  task service in each, one worker process per task (docs/spark.md);
* **TorchDistributor**: ``TorchDistributor(num_processes=2, local_mode=True,
  use_gpu=False).run(fn)``: ``torchrun`` with 2 processes on the driver (no Spark job).

With Spark Connect (pyspark >= 4 with its Connect client; the default when available), the
same Spark application also runs Spark's Connect plugin on a loopback port, and a Connect
client session in this process submits to it: the same executors, so the rows compare:

* **spark_dl (Connect)**: ``spark_dl.spark.run`` through the Connect session (no
  SparkContext: a barrier ``mapInArrow`` whose task 0 coordinates; docs/databricks.md);
* **TorchDistributor (Connect)**: ``TorchDistributor(..., local_mode=False)`` through the
  Connect session: its barrier job on the executors (its path on Databricks' shared and
  serverless compute, where nothing runs on the client).

The first call of each in the session is reported apart ("cold": spark_dl's pays the
session's first Python-worker job, TorchDistributor's its first torch import); the
table shows medians and min-max of the later ("warm") calls, and the ratio of the medians.
The split of spark_dl's calls comes from the ``phases`` spark_dl.spark.run logs at the end
of every run (seconds from the call to the end of each phase; see ``_Phases`` in
``spark_dl/spark/launch/spark_run.py``): per phase, the median duration.
"""

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def trivial():
    import os

    return os.getpid()


class _PhaseLog(logging.Handler):
    """Collects the ``phases`` dict of every spark_dl.spark.run."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        phases = getattr(record, "phases", None)
        if phases is not None:
            self.records.append(phases)


def run_spark_dl(num_proc):
    import spark_dl.spark

    started = time.perf_counter()
    results = spark_dl.spark.run(trivial, num_proc=num_proc)
    assert len(results) == num_proc
    return time.perf_counter() - started


def run_torch_distributor(num_proc):
    from pyspark.ml.torch.distributor import TorchDistributor

    started = time.perf_counter()
    TorchDistributor(num_processes=num_proc, local_mode=True, use_gpu=False).run(trivial)
    return time.perf_counter() - started


def run_torch_distributor_executors(num_proc):
    from pyspark.ml.torch.distributor import TorchDistributor

    started = time.perf_counter()
    TorchDistributor(num_processes=num_proc, local_mode=False, use_gpu=False).run(trivial)
    return time.perf_counter() - started


RUNNERS = {"spark_dl": run_spark_dl, "TorchDistributor": run_torch_distributor}
CONNECT_RUNNERS = {"spark_dl (Connect)": run_spark_dl,
                   "TorchDistributor (Connect)": run_torch_distributor_executors}


class _Sessions:
    """The classic session, and a Connect client of the same application; ``use(name)``
    makes the runner's kind the active one (pyspark picks Connect's implementation of
    ``getActiveSession`` and of TorchDistributor by ``SPARK_CONNECT_MODE_ENABLED``)."""

    def __init__(self, spark, connect):
        self.spark = spark
        self.connect = None
        if connect:
            jvm = spark._jvm
            service = getattr(jvm, "org.apache.spark.sql.connect.service.SparkConnectService$")
            port = getattr(service, "MODULE$").localPort()
            from pyspark.sql.connect.session import SparkSession as ConnectSession

            os.environ["SPARK_CONNECT_MODE_ENABLED"] = "1"
            self.connect = ConnectSession.builder.remote(f"sc://127.0.0.1:{port}") \
                .getOrCreate()
            os.environ.pop("SPARK_CONNECT_MODE_ENABLED")

    def use(self, name):
        if "(Connect)" in name:
            os.environ["SPARK_CONNECT_MODE_ENABLED"] = "1"
        else:
            os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)

    def stop(self):
        os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)
        if self.connect is not None:
            self.connect.stop()
        self.spark.stop()


def _connect_available():
    try:
        import grpc  # noqa: F401
        import pyspark

        return int(pyspark.__version__.split(".")[0]) >= 4
    except ImportError:
        return False


def durations(phases):
    """Phase end times (from the call) -> each phase's own duration, in order."""
    from spark_dl.spark.launch.spark_run import PHASES

    out, last = {}, 0.0
    for name in PHASES:
        if name in phases:
            out[name] = phases[name] - last
            last = phases[name]
    return out


def load_average():
    try:
        return os.getloadavg()
    except OSError:
        return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7, help="warm rounds after the first")
    parser.add_argument("--json", default=None, help="write the samples here")
    parser.add_argument("--no-connect", action="store_true",
                        help="leave out the Spark Connect rows")
    parser.add_argument("--only", default=None,
                        help="comma-separated runners to keep, e.g. 'spark_dl,spark_dl (Connect)'")
    args = parser.parse_args()

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    connect = not args.no_connect and _connect_available()
    builder = (SparkSession.builder.master(args.master).appName("spark_dl start-up benchmark")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false"))
    if connect:
        builder = (builder.config("spark.plugins",
                                  "org.apache.spark.sql.connect.SparkConnectPlugin")
                   .config("spark.connect.grpc.binding.address", "127.0.0.1")
                   .config("spark.connect.grpc.binding.port", "0"))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    sessions = _Sessions(spark, connect)
    runners = dict(RUNNERS, **(CONNECT_RUNNERS if connect else {}))
    if args.only:
        runners = {name: runners[name] for name in args.only.split(",")}
    log = _PhaseLog()
    logger = logging.getLogger("spark_dl.spark.run")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(log)
    samples = {name: [] for name in runners}
    phases = {name: [] for name in runners if name.startswith("spark_dl")}
    load_before = load_average()
    try:
        for r in range(args.rounds + 1):
            order = list(runners) if r % 2 == 0 else list(reversed(runners))
            for name in order:
                sessions.use(name)
                seconds = runners[name](args.num_proc)
                if name in phases:
                    phases[name].append(log.records[-1])
                samples[name].append(seconds)
                print(f"{'cold' if r == 0 else f'round {r}'} {name}: {seconds:.2f} s",
                      flush=True)
    finally:
        sessions.stop()
    load_after = load_average()

    warm = {name: s[1:] for name, s in samples.items()}
    med = {name: statistics.median(s) for name, s in warm.items()}
    print(f"\ntrivial function on {args.num_proc} processes, {args.master}, one Spark "
          f"session; {args.rounds} warm rounds, alternating; load average "
          f"{load_before} -> {load_after} on {os.cpu_count()} CPUs\n")
    print("| | cold (first call) | warm median | warm min-max |")
    print("| --- | --- | --- | --- |")
    for name, s in samples.items():
        print(f"| {name} | {s[0]:.2f} s | {med[name]:.2f} s | "
              f"{min(warm[name]):.2f}-{max(warm[name]):.2f} s |")
    print()
    for a, b, target in (("spark_dl", "TorchDistributor", 1.0),
                         ("spark_dl (Connect)", "TorchDistributor (Connect)", 0.5),
                         ("spark_dl (Connect)", "spark_dl", 1.5)):
        if a in med and b in med:
            print(f"{a} / {b} (warm medians): {med[a] / med[b]:.2f} (target <= {target:.2f})")

    for runner, runs in phases.items():
        split = [durations(p) for p in runs]
        print(f"\n{runner}: spark_dl.spark.run split (median seconds per phase; cold call "
              "apart):")
        print("| phase | cold | warm median | warm min-max |")
        print("| --- | --- | --- | --- |")
        for name in split[0]:
            values = [d[name] for d in split[1:] if name in d]
            if values:
                print(f"| {name} | {split[0][name]:.3f} | {statistics.median(values):.3f} | "
                      f"{min(values):.3f}-{max(values):.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": platform.platform(),
                       "cpus": os.cpu_count(), "load": [load_before, load_after],
                       "samples": samples, "phases": phases, "medians": med}, f, indent=1)


if __name__ == "__main__":
    main()
