"""``spark_dl.spark.run`` on ``local[2]``: results, failures, fail-fast slot check."""

import io
import re
import time

import pytest

pytest.importorskip("pyspark")

from spark_dl.spark import run  # noqa: E402
from spark_dl.spark.launch.errors import NotEnoughSlotsError, WorkerFailedError  # noqa: E402
from test_run_cases import (assert_ended_soon_after_failure, raise_on_rank_1,  # noqa: E402
                            sigkill_rank_1, spark_session, stall_rank_1, topology, warm_probe,
                            worker_processes)

pytestmark = [pytest.mark.spark, pytest.mark.timeout(120)]

@pytest.fixture(scope="module")
def spark():
    session = spark_session("local[2]")
    yield session
    session.stop()


def test_worker_exception_ends_run_with_rank_and_traceback(spark):
    err = io.StringIO()
    with pytest.raises(WorkerFailedError) as info:
        run(raise_on_rank_1, num_proc=2, stderr=err, prefix_output_with_timestamp=True)
    assert_ended_soon_after_failure(err.getvalue())
    e = info.value
    assert e.rank == 1
    assert "rank 1 raised ValueError: boom from rank 1" in str(e)
    assert "raise_on_rank_1" in e.remote_traceback and "boom from rank 1" in e.remote_traceback
    assert isinstance(e.__cause__, ValueError)
    assert worker_processes(e.job_id) == []
    # The worker's own traceback reached the driver's stderr, timestamped and prefixed.
    assert re.search(r"^\d{4}-\d\d-\d\dT[\d:.]+ \[1\]<stderr>:ValueError: boom from rank 1$",
                     err.getvalue(), re.M)


def test_worker_killed_by_sigkill_ends_run(spark):
    err = io.StringIO()
    with pytest.raises(WorkerFailedError) as info:
        run(sigkill_rank_1, num_proc=2, stderr=err)
    assert_ended_soon_after_failure(err.getvalue())
    e = info.value
    assert e.rank == 1 and e.exit_code == 137 and "SIGKILL" in str(e)
    assert e.remote_traceback is None
    assert worker_processes(e.job_id) == []


def test_stall_shutdown_names_tensor_rank_and_host_and_dumps(spark, tmp_path):
    """The stall inspector and the flight recorder on Spark (docs/observability.md)."""
    import socket

    err = io.StringIO()
    start = time.monotonic()
    results = run(stall_rank_1, args=(str(tmp_path),), num_proc=2, stderr=err,
                  env={"SDL_STALL_CHECK_TIME": "1", "SDL_STALL_SHUTDOWN_TIME": "2",
                       "SDL_FLIGHT_RECORDER_DIR": str(tmp_path)})
    assert time.monotonic() - start < 60
    for rank, (error, dump) in enumerate(results):
        assert error.startswith("PeerFailureError: Stalled for more than 2 s"), error
        assert "allreduce 'grad.w'" in error and "missing rank 1" in error, error
        assert f"(host {socket.gethostname()})" in error, error
        assert dump["rank"] == rank and dump["records"][0]["name"] == "step.0", dump
    # Rank 0's warning came first, with the workers' output.
    assert "stall inspector: 1 tensor of process set 0" in err.getvalue(), err.getvalue()


def test_more_workers_than_slots_fails_fast(spark):
    start = time.monotonic()
    with pytest.raises(NotEnoughSlotsError, match=r"num_proc=3 exceeds the 2 task slots"):
        run(topology, args=("x",), num_proc=3)
    assert time.monotonic() - start < 5


def test_ranks_allreduce_output_and_results_by_rank(spark):
    out, err = io.StringIO(), io.StringIO()
    results = run(topology, args=("t",), kwargs={"scale": 2}, env={"SDL_TEST_FLAG": "on"},
                  stdout=out, stderr=err)  # num_proc: the default parallelism, 2
    assert [r["rank"] for r in results] == [0, 1]
    for rank, r in enumerate(results):
        assert (r["size"], r["local_rank"], r["local_size"]) == (2, rank, 2)
        assert (r["cross_rank"], r["cross_size"]) == (0, 1)
        assert r["sum"] == 6.0 and r["tag"] == "t" and r["env"] == "on"
        assert r["devices"] == [] and r["cuda"] is None
        assert r["secret_visible"] is False
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:hello from rank {rank}\n" in out.getvalue()
        assert f"[{rank}]<stderr>:note from rank {rank}\n" in err.getvalue()


def test_workers_fork_from_a_warm_server_that_later_jobs_reuse(spark):
    import os

    env = {"SDL_SPARK_WARM_MODULES": "colorsys"}
    first = run(warm_probe, env=env)
    second = run(warm_probe, env=env)
    for r in first + second:
        assert r["preloaded"] and r["session_leader"]
        assert r["parent"] != os.getpid()
    # Spark reuses its Python workers, and with them their fork servers.
    assert {r["parent"] for r in second} <= {r["parent"] for r in first}
    cold = run(warm_probe, env=dict(env, SDL_SPARK_WARM_WORKERS="0"))
    assert not any(r["preloaded"] for r in cold)
    assert not {r["parent"] for r in cold} & {r["parent"] for r in first}


def test_a_bad_warm_worker_setting_fails_before_any_job(spark):
    with pytest.raises(ValueError, match="SDL_SPARK_WARM_WORKERS=sometimes: expected a boolean"):
        run(warm_probe, env={"SDL_SPARK_WARM_WORKERS": "sometimes"})
