"""``spark_dl.spark.run`` on ``local-cluster[2,1,1024]``: two executor JVMs, fake GPUs.

Each standalone worker discovers one GPU (address "0") through a discovery script and
every task asks for one, so Spark's resource scheduling assigns a GPU to each task; the
workers must see it through ``get_available_devices()`` and ``CUDA_VISIBLE_DEVICES``.
"""

import io
import sys
import time

import cloudpickle
import pytest

pytest.importorskip("pyspark")

from spark_dl.spark import run  # noqa: E402
from spark_dl.spark.launch.errors import NotEnoughSlotsError, WorkerFailedError  # noqa: E402
from test_run_cases import (assert_ended_soon_after_failure,  # noqa: E402
                            fake_gpu_cluster_session, sigkill_rank_1, topology,
                            worker_processes)

pytestmark = [pytest.mark.spark, pytest.mark.timeout(180)]
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # executors cannot import it


@pytest.fixture(scope="module")
def spark(tmp_path_factory):
    session = fake_gpu_cluster_session(tmp_path_factory.mktemp("gpu"), "local-cluster[2,1,1024]",
                                       executor_memory="512m", task_gpu_amount="1")
    yield session
    session.stop()


def test_ranks_allreduce_gpus_across_executors(spark):
    out = io.StringIO()
    results = run(topology, args=("c",), num_proc=2, stdout=out, stderr=io.StringIO())
    assert [r["rank"] for r in results] == [0, 1]
    for rank, r in enumerate(results):
        # Both executors run on this machine: one host, two local ranks.
        assert (r["size"], r["local_rank"], r["local_size"], r["cross_size"]) == (2, rank, 2, 1)
        assert r["sum"] == 3.0 and r["tag"] == "c"
        assert r["devices"] == ["0"] and r["cuda"] == "0"
        assert r["secret_visible"] is False
    # Separate executor JVMs, hence separate pyspark daemons hosting the tasks.
    assert results[0]["task_parent"] != results[1]["task_parent"]
    assert "[1]<stdout>:hello from rank 1\n" in out.getvalue()


def test_killed_worker_in_another_executor_ends_run(spark):
    err = io.StringIO()
    with pytest.raises(WorkerFailedError) as info:
        run(sigkill_rank_1, num_proc=2, stderr=err)
    assert_ended_soon_after_failure(err.getvalue())
    assert info.value.rank == 1 and "SIGKILL" in str(info.value)
    assert worker_processes(info.value.job_id) == []


def test_more_workers_than_configured_slots_fails_fast(spark):
    start = time.monotonic()
    with pytest.raises(NotEnoughSlotsError, match="num_proc=3 exceeds the 2 task slots"):
        run(topology, args=("x",), num_proc=3)
    assert time.monotonic() - start < 5


def kill_executor_of_rank_1(stamp):
    """Rank 1 SIGKILLs the executor JVM hosting its task (writing the time to ``stamp``
    first); rank 0 waits in a collective."""
    import os
    import signal
    import time

    import numpy as np

    import spark_dl.numpy as sdl

    sdl.init()
    if sdl.rank() == 1:
        pid = os.getppid()  # the task's Python process, under the executor's JVM
        while pid > 1:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"CoarseGrainedExecutorBackend" in f.read():
                    with open(stamp, "w") as out:
                        out.write(repr(time.time()))
                    os.kill(pid, signal.SIGKILL)
                    break
            with open(f"/proc/{pid}/stat", "rb") as f:
                pid = int(f.read().rsplit(b")", 1)[1].split()[1])
        time.sleep(120)
    time.sleep(1.0)
    sdl.allreduce(np.ones(4), op=sdl.Sum)  # fails: rank 1 is gone with its executor
    time.sleep(120)


def test_lost_executor_blames_its_rank(spark, tmp_path):
    """Last: it kills one of the module's executors (the standalone worker replaces it)."""
    stamp = tmp_path / "killed_at"
    with pytest.raises(WorkerFailedError) as info:
        run(kill_executor_of_rank_1, args=(str(stamp),), num_proc=2, stderr=io.StringIO())
    took = time.time() - float(stamp.read_text())
    print(f"executor killed -> WorkerFailedError in {took:.1f} s:\n{info.value}")
    assert info.value.rank == 1
    assert "rank 1 was lost: its Spark task 1 on " in str(info.value)
    assert took < 8  # about 3 s on an idle machine (TASK_LOST_S is 2 s)
    assert worker_processes(info.value.job_id) == []
