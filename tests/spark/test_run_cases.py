"""Shared pieces of the ``spark_dl.spark.run`` tests (no tests here).

- :func:`spark_session`: one lean session per test module (local[2] or local-cluster);
- the functions the workers run (shipped by value, so executors need not import this
  module);
- :func:`worker_processes` / :func:`processes_with`: processes still alive here;
- :func:`expect_worker_failure`, :func:`check_two_ranks_one_host`: checks that every
  controller's tests share.
"""

import os
import re
import sys
import time

import cloudpickle

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
cloudpickle.register_pickle_by_value(sys.modules[__name__])

# The bound for a failing worker to end run(); ours is far below it.
FAILURE_BOUND_S = 30.0


def spark_session(master, **conf):
    """Creates a session for one test module; the caller stops it."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if ROOT not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([ROOT] + paths)
    from pyspark.sql import SparkSession

    builder = (SparkSession.builder.master(master)
               .appName(f"spark_dl-run-tests-{os.getpid()}")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", "2")
               .config("spark.driver.memory", "1g"))
    for key, value in conf.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    assert session.sparkContext.master == master, "another module left a session running"
    session.sparkContext.setLogLevel("ERROR")
    return session


_FAKE_GPU_DISCOVERY = '#!/bin/sh\necho \'{"name": "gpu", "addresses": ["0"]}\'\n'


def fake_gpu_cluster_session(tmp_dir, master, executor_memory, task_gpu_amount):
    """A ``local-cluster`` session whose workers each announce one GPU ("0") through a
    discovery script written into ``tmp_dir``: Spark schedules GPU resources without a GPU.
    The caller stops it."""
    script = tmp_dir / "discover_gpus.sh"
    script.write_text(_FAKE_GPU_DISCOVERY)
    script.chmod(0o755)
    return spark_session(
        master,
        **{"spark.executor.memory": executor_memory,
           "spark.worker.resource.gpu.amount": "1",
           "spark.worker.resource.gpu.discoveryScript": str(script),
           "spark.executor.resource.gpu.amount": "1",
           "spark.task.resource.gpu.amount": task_gpu_amount})


def processes_with(*needles):
    """(pid, command line) of live processes whose command line holds every needle."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:  # gone meanwhile
            continue
        if cmd and all(n.encode() in cmd for n in needles):  # zombies have no cmdline
            found.append((int(pid), cmd.replace(b"\0", b" ").decode(errors="replace")))
    return found


def worker_processes(job_id):
    """Live worker bootstraps of job ``job_id``."""
    return processes_with("spark_dl.spark.launch.task.worker", job_id)


def _visible(pid, secret):
    """Whether ``secret`` shows in the command line or start-up environment of ``pid``."""
    for name in ("cmdline", "environ"):
        try:
            with open(f"/proc/{pid}/{name}", "rb") as f:
                if secret.encode() in f.read():
                    return True
        except OSError:
            pass
    return False


def _job_secret():
    """The job secret, as this worker's bootstrap got it (read before ``init()``, which
    takes it out of ``os.environ``; MPI workers never put it there)."""
    if "SDL_SECRET_KEY" in os.environ:
        return os.environ["SDL_SECRET_KEY"]
    from spark_dl.spark.launch.handover import HANDOVER_VAR, fetch_handover

    return fetch_handover(os.environ[HANDOVER_VAR])["secret"]


def _job_processes():
    """This machine's processes of the running job: workers (their command lines hold
    the job id), and any mpirun, orted and rsh agent."""
    found = {}
    for needle in (os.environ["SDL_JOB_ID"], "orted", "mpirun", "spark_dl.spark.launch.rsh_agent"):
        found.update(processes_with(needle))
    return found


def topology(tag, scale=1):
    """Rank facts, an allreduce, output on both streams, and where the secret shows."""
    import numpy as np

    import spark_dl.numpy as sdl
    from spark_dl.spark.launch.task import get_available_devices

    secret = _job_secret()
    sdl.init()
    rank = sdl.rank()
    total = sdl.allreduce(np.array([rank + 1.0]), op=sdl.Sum)
    print(f"hello from rank {rank}")
    print(f"note from rank {rank}", file=sys.stderr)
    task_pid = os.getppid()
    if b"spark_dl.runner.forkserver" in _cmdline(task_pid):
        task_pid = _parent(task_pid)  # forked by the task's warm server: the task is above
    job = _job_processes()
    return {
        "rank": rank, "size": sdl.size(), "local_rank": sdl.local_rank(),
        "local_size": sdl.local_size(), "cross_rank": sdl.cross_rank(),
        "cross_size": sdl.cross_size(), "sum": float(total[0]) * scale, "tag": tag,
        "env": os.environ.get("SDL_TEST_FLAG"), "devices": get_available_devices(),
        "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "secret_visible": _visible(os.getpid(), secret) or _visible(task_pid, secret),
        "secret_visible_in_job": [cmd for pid, cmd in job.items() if _visible(pid, secret)],
        "job_processes": len(job), "job_id": os.environ["SDL_JOB_ID"],
        "mpi": sdl.mpi_enabled(),
        "task_parent": _parent(task_pid),
    }


def _cmdline(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


def _parent(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(re.sub(r"^.*\) ", "", f.read()).split()[1])


FAILURE_STAMP = "failing at wall time "


def stamp_failure():
    """Writes the wall time of the failure to stderr, so a test bounds the time from the
    failure to the end of ``run()`` (not the job's start-up, which a loaded CI machine
    stretches)."""
    import sys

    print(f"{FAILURE_STAMP}{time.time():.3f}", file=sys.stderr, flush=True)


def assert_ended_soon_after_failure(err_text, bound_s=None):
    """The failure stamped by :func:`stamp_failure` ended ``run()`` within ``bound_s``."""
    bound_s = FAILURE_BOUND_S if bound_s is None else bound_s
    stamps = re.findall(re.escape(FAILURE_STAMP) + r"([\d.]+)", err_text)
    assert stamps, f"the failing rank stamped no failure time on stderr:\n{err_text[-2000:]}"
    took = time.time() - float(stamps[0])
    assert took < bound_s, f"run() ended {took:.1f} s after the failure (bound {bound_s} s)"


def raise_on_rank_1():
    import time

    import spark_dl.numpy as sdl

    sdl.init()
    if sdl.rank() == 1:
        stamp_failure()
        raise ValueError("boom from rank 1")
    time.sleep(120)  # stopped by run(), long before this ends


def sigkill_rank_1():
    import signal
    import time

    import numpy as np

    import spark_dl.numpy as sdl

    sdl.init()
    if sdl.rank() == 1:
        stamp_failure()
        os.kill(os.getpid(), signal.SIGKILL)
    sdl.allreduce(np.ones(4), op=sdl.Sum)  # fails: rank 1 is gone
    time.sleep(120)


def stall_rank_1(folder):
    """Rank 1 stays alive but never submits 'grad.w' (the stall inspector's case): with
    SDL_STALL_SHUTDOWN_TIME set, both ranks raise; returns (error, flight-recorder dump)."""
    import json
    import time

    import numpy as np

    import spark_dl.numpy as sdl

    sdl.init()
    sdl.allreduce(np.ones(2), name="step.0", op=sdl.Sum)
    try:
        if sdl.rank() == 1:
            time.sleep(4)
            sdl.allreduce(np.ones(2), name="late", op=sdl.Sum)
        else:
            sdl.allreduce(np.ones(2), name="grad.w", op=sdl.Sum)
        error = None
    except Exception as e:  # noqa: BLE001 - returned to the test
        error = f"{type(e).__name__}: {e}"
    with open(os.path.join(folder, f"flight_recorder.rank{sdl.rank()}.json")) as f:
        return error, json.load(f)


# ---- checks shared by the Gloo and MPI tests (run on the driver) ---------------------

def expect_worker_failure(fn, **run_kwargs):
    """Runs ``fn`` (a function that calls :func:`stamp_failure`) through
    ``spark_dl.spark.run``; returns the WorkerFailedError it must raise within
    :data:`FAILURE_BOUND_S` of the failure."""
    import pytest

    from spark_dl.spark import run
    from spark_dl.spark.launch.errors import WorkerFailedError

    import io

    err = run_kwargs.setdefault("stderr", io.StringIO())
    with pytest.raises(WorkerFailedError) as info:
        run(fn, **run_kwargs)
    assert_ended_soon_after_failure(err.getvalue())
    return info.value


def check_two_ranks_one_host(results, out, err, total, tag):
    """Two ranks of :func:`topology` on one host: topology, allreduce ``total``, output,
    and the secret nowhere in the job's command lines and start-up environments."""
    assert [r["rank"] for r in results] == [0, 1], err
    for rank, r in enumerate(results):
        assert (r["size"], r["local_rank"], r["local_size"]) == (2, rank, 2)
        assert (r["cross_rank"], r["cross_size"]) == (0, 1)
        assert r["sum"] == total and r["tag"] == tag
        assert r["secret_visible"] is False and r["secret_visible_in_job"] == []
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:hello from rank {rank}\n" in out
        if err is not None:
            assert f"[{rank}]<stderr>:note from rank {rank}\n" in err


def warm_probe():
    """Where the worker came from: its parent (a fork server, or the task's Python) and
    whether the server's preload (colorsys) was there before the function ran."""
    return {"parent": os.getppid(), "preloaded": "colorsys" in sys.modules,
            "session_leader": os.getsid(0) == os.getpid()}
