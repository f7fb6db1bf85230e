"""``spark_dl.spark.run`` on ``local-cluster[2,1,1024]``: two executor JVMs, fake GPUs.

Each standalone worker discovers one GPU (address "0") through a discovery script and
every task asks for one, so Spark's resource scheduling assigns a GPU to each task; the
workers must see it through ``get_available_devices()`` and ``CUDA_VISIBLE_DEVICES``.
"""

import io
import time

import pytest

pytest.importorskip("pyspark")

from spark_dl.spark import run  # noqa: E402
from spark_dl.spark.launch.errors import NotEnoughSlotsError, WorkerFailedError  # noqa: E402
from test_run_cases import sigkill_rank_1, spark_session, topology, worker_processes  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.timeout(180)]

_DISCOVERY = '#!/bin/sh\necho \'{"name": "gpu", "addresses": ["0"]}\'\n'


@pytest.fixture(scope="module")
def spark(tmp_path_factory):
    script = tmp_path_factory.mktemp("gpu") / "discover_gpus.sh"
    script.write_text(_DISCOVERY)
    script.chmod(0o755)
    session = spark_session(
        "local-cluster[2,1,1024]",
        **{"spark.executor.memory": "512m",
           "spark.worker.resource.gpu.amount": "1",
           "spark.worker.resource.gpu.discoveryScript": str(script),
           "spark.executor.resource.gpu.amount": "1",
           "spark.task.resource.gpu.amount": "1"})
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
    assert "[1]<stdout>: hello from rank 1\n" in out.getvalue()


def test_killed_worker_in_another_executor_ends_run(spark):
    start = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        run(sigkill_rank_1, num_proc=2, stderr=io.StringIO())
    assert time.monotonic() - start < 30
    assert info.value.rank == 1 and "SIGKILL" in str(info.value)
    assert worker_processes(info.value.job_id) == []


def test_more_workers_than_configured_slots_fails_fast(spark):
    start = time.monotonic()
    with pytest.raises(NotEnoughSlotsError, match="num_proc=3 exceeds the 2 task slots"):
        run(topology, args=("x",), num_proc=3)
    assert time.monotonic() - start < 5
