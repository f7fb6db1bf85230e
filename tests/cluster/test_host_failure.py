"""A whole host lost while spark_dl runs on a Spark standalone cluster (issue 31).

Hosts (netns.py): ``client`` (master, driver), ``host0`` and ``host1`` (a Worker each, 2
slots). Four ranks run, two per host; the host *not* holding rank 0 (task 0, the job's
coordinator, runs on rank 0's host) is lost, unless said otherwise:

- mid-run, as a crash: every process on it is killed (``Host.kill_all``: Worker,
  executor, task and worker processes at once); and the same for the host holding rank 0
  and task 0, the job's coordinator;
- mid-fit, as a network loss: its interface goes down (``Host.link(up=False)``); nothing
  on it dies, no connection closes; and the same for the host holding task 0, which must
  tell its own isolation from the other host's (it asks the caller), mid-fit and mid-run
  (``spark.run`` has no spool: the caller itself notices task 0's silence).

Either way the caller's call must end in bounded time with an error naming the lost host
and its ranks, leave no spark_dl worker process on the surviving host, and (for the fit)
leave the Store's user files as they were.
"""

import hashlib
import os
import sys
import time

import cloudpickle
import pytest

import netns
from spark_standalone import client_and_two_workers

pytest.importorskip("pyspark")
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the driver cannot import it

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]

WORKER_MODULE = "spark_dl.spark.launch.task.worker"
# From the loss to the caller's error: the kill ends connections at once (Spark and task 0
# see it within seconds); a link down is seen by silence only.
KILL_BOUND_S = 30.0
LINK_BOUND_S = 60.0


@pytest.fixture(scope="module")
def setup():
    with client_and_two_workers(netns) as both:
        yield both


@pytest.fixture(scope="module")
def hosts(setup):
    return setup[0]


@pytest.fixture(scope="module")
def standalone(setup):
    return setup[1]


# --------------------------------------------------------------------------- helpers


def _worker_pids(host):
    pids = []
    for pid in host.processes():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if WORKER_MODULE.encode() in f.read():
                    pids.append(pid)
        except OSError:
            pass
    return pids


def _wait_no_workers(host, timeout):
    deadline = time.monotonic() + timeout
    while _worker_pids(host) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _worker_pids(host)


def _placement(marker, ranks, timeout):
    """rank -> host name, from the files the ranks write once they compute."""
    deadline = time.monotonic() + timeout
    found = {}
    while len(found) < ranks:
        for rank in range(ranks):
            path = f"{marker}.{rank}"
            if rank not in found and os.path.exists(path):
                with open(path) as f:
                    name = f.read().strip()
                if name:
                    found[rank] = name
        if len(found) < ranks:
            assert time.monotonic() < deadline, f"ranks did not start in time: {found}"
            time.sleep(0.2)
    return found


def _victim(hosts, placement, task0_host=False):
    """The host without rank 0 (task 0 coordinates from rank 0's host), or with it when
    ``task0_host``, and its ranks."""
    names = {h.name: h for h in hosts.hosts}
    lost = placement[0] if task0_host else \
        next(name for name in placement.values() if name != placement[0])
    return names[lost], sorted(r for r, name in placement.items() if name == lost)


def _check_error(error, lost, lost_ranks, lost_at, bound):
    assert error is not None, "the call returned although a host was lost"
    took = error["ended"] - lost_at
    print(f"\n{lost.name} lost -> {error['class']} after {took:.1f} s:\n"
          f"{error['message'][:1500]}")
    assert error["class"] in ("WorkerFailedError", "RunError"), error
    assert lost.name in error["message"], error["message"]
    assert any(f"rank {r}" in error["message"] or f"ranks {r}" in error["message"]
               for r in lost_ranks), error["message"]
    assert took < bound, took


def _snapshot(root):
    out = {}
    for base, _, files in os.walk(root):
        for name in files:
            path = os.path.join(base, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


# ------------------------------------------------------------ run in the driver/ranks


def busy(marker, seconds):
    """Allreduces until ``seconds`` pass; writes ``marker.<rank>`` (its host) once up."""
    import socket
    import time

    import numpy as np

    import spark_dl.numpy as sdl

    sdl.init()
    x = np.ones(1024, dtype=np.float32)
    sdl.allreduce(x, op=sdl.Sum)
    with open(f"{marker}.{sdl.rank()}", "w") as f:
        f.write(socket.gethostname())
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sdl.allreduce(x, op=sdl.Sum)
        time.sleep(0.05)
    return sdl.rank()


def _outcome(call):
    import time

    try:
        call()
        return None
    except Exception as exc:
        return {"class": type(exc).__name__, "message": str(exc), "ended": time.time(),
                "rank": getattr(exc, "rank", None)}


def run_busy(spark, marker, seconds, use_mpi=False):
    import io

    from spark_dl.spark import run

    return _outcome(lambda: run(busy, args=(marker, seconds), num_proc=4, use_mpi=use_mpi,
                                use_gloo=not use_mpi, stdout=io.StringIO(),
                                stderr=io.StringIO(), start_timeout=120))


def executors(spark, count, timeout):
    """Waits until the application has ``count`` executors again."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        have = spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() - 1
        if have >= count or time.monotonic() > deadline:
            return have
        time.sleep(0.5)


def marking_loss(marker):
    """MSE that writes ``marker.<rank>`` (the rank's host) on its first call."""
    def loss(output, target):
        import os
        import socket

        import torch

        path = f"{marker}.{os.environ.get('SDL_RANK')}"
        if not os.path.exists(path):
            with open(path, "w") as f:
                f.write(socket.gethostname())
        return torch.nn.functional.mse_loss(output, target)

    return loss


def long_fit(spark, store_path, marker):
    import numpy as np
    import torch
    from pyspark.ml.feature import VectorAssembler

    from spark_dl.spark.common.store import Store
    from spark_dl.spark.torch import TorchEstimator

    rng = np.random.default_rng(1)
    x = rng.normal(size=(400, 3))
    rows = [tuple(float(v) for v in r) + (float(r.sum()),) for r in x]
    df = VectorAssembler(inputCols=["a", "b", "c"], outputCol="features").transform(
        spark.sparkContext.parallelize(rows, 4).toDF(["a", "b", "c", "y"]))
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    est = TorchEstimator(num_proc=4, model=net,
                         optimizer=torch.optim.SGD(net.parameters(), lr=0.01),
                         loss=marking_loss(marker), feature_cols=["features"],
                         label_cols=["y"], batch_size=4, epochs=500,
                         store=Store.create(store_path), run_id="lost", verbose=0)
    return _outcome(lambda: est.fit(df))


# ----------------------------------------------------------------------------- tests


def _kill_mid_run(hosts, standalone, tmp_path, task0_host, use_mpi=False):
    marker = str(tmp_path / "up")
    app = standalone.app
    app.submit(run_busy, marker, 120, use_mpi)
    placement = _placement(marker, 4, 180)
    lost, lost_ranks = _victim(hosts, placement, task0_host)
    survivor = next(h for h in hosts.hosts[1:] if h is not lost)
    assert _worker_pids(survivor), "no worker process to check on the surviving host"
    lost_at = time.time()
    lost.kill_all()
    error = app.result(timeout=KILL_BOUND_S + 60)
    _check_error(error, lost, lost_ranks, lost_at, KILL_BOUND_S)
    assert _wait_no_workers(survivor, 15) == []
    # The host comes back: its Worker again, and the application's executor on it.
    standalone.start_worker(lost)
    standalone.wait_workers(2, 180)
    assert app.call(executors, 2, 180, timeout=200) == 2


def _cut_off_mid_job(hosts, app, placement, task0_host):
    """Takes the victim's link down until the application's call has failed (checked:
    bounded, naming the host and a rank; the surviving host's workers stopped); returns
    the lost host and the error."""
    lost, lost_ranks = _victim(hosts, placement, task0_host)
    survivor = next(h for h in hosts.hosts[1:] if h is not lost)
    lost_at = time.time()
    lost.link(up=False)
    try:
        error = app.result(timeout=LINK_BOUND_S + 90)
        _check_error(error, lost, lost_ranks, lost_at, LINK_BOUND_S)
        assert _wait_no_workers(survivor, 15) == []
    finally:
        lost.link(up=True)
    return lost, error


def test_host_killed_mid_run(hosts, standalone, tmp_path):
    _kill_mid_run(hosts, standalone, tmp_path, task0_host=False)


@pytest.mark.parametrize("use_mpi", [False, True], ids=["gloo", "mpi"])
def test_task0_host_killed_mid_run(hosts, standalone, tmp_path, use_mpi):
    # The coordinator's own host: task 0 and ranks 0-1 die with it; the driver loses its
    # link to task 0 and Spark its executor, and the other host's ranks their coordinator
    # (under MPI: mpirun, which task 0 runs, and the other host's orted).
    _kill_mid_run(hosts, standalone, tmp_path, task0_host=True, use_mpi=use_mpi)


def test_task0_host_unreachable_mid_run(hosts, standalone, tmp_path):
    # spark.run has no spool: task 0's verdict cannot reach the caller, which fails the
    # job itself once task 0 has been silent on the caller link (TASK0_SILENT_S), long
    # before Spark would notice the executor.
    marker = str(tmp_path / "up")
    app = standalone.app
    app.submit(run_busy, marker, 180)
    lost, error = _cut_off_mid_job(hosts, app, _placement(marker, 4, 180), task0_host=True)
    assert "has not been heard from" in error["message"], error["message"]
    assert _wait_no_workers(lost, 60) == []


@pytest.mark.parametrize("task0_host", [False, True], ids=["other", "task0"])
def test_host_unreachable_mid_fit(hosts, standalone, tmp_path, task0_host):
    # task0: the coordinator's host is cut off: the driver hears nothing more from task 0,
    # and the other host's ranks nothing from their coordinator and their peers.
    store = tmp_path / "store"
    (store / "user").mkdir(parents=True)
    (store / "user" / "notes.txt").write_text("mine\n")
    (store / "keep.bin").write_bytes(os.urandom(1000))
    before = _snapshot(str(store))
    marker = str(tmp_path / "up")
    app = standalone.app
    app.submit(long_fit, str(store), marker)
    lost, _ = _cut_off_mid_job(hosts, app, _placement(marker, 4, 240), task0_host)
    after = _snapshot(str(store))
    assert {k: v for k, v in after.items() if k in before} == before
    # Cut off, the lost host's tasks stop their workers by themselves (task 0 unreachable).
    assert _wait_no_workers(lost, 60) == []
