"""``spark_dl.spark.run`` through a Spark Connect session (``local[2]`` behind an in-process
Connect server): no SparkContext, no ``df.rdd``, task 0 coordinates.

The caller link (output live, task 0's address) and its fallbacks: the job's result
(``SDL_SPARK_CALLER_LINK=off``, no spool) and a spool (the Store path the estimators use).
"""

import io
import sys
import time

import cloudpickle
import pytest

from spark_support import require_connect_server

require_connect_server()  # the server jar ships with pyspark 4.x only

from spark_dl.spark import run  # noqa: E402
from spark_dl.spark.launch.errors import NotEnoughSlotsError, WorkerFailedError  # noqa: E402
from test_run_cases import (FAILURE_BOUND_S, assert_ended_soon_after_failure,  # noqa: E402
                            check_two_ranks_one_host, expect_worker_failure,
                            raise_on_rank_1, topology, worker_processes)

pytestmark = [pytest.mark.spark, pytest.mark.timeout(180)]
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_the_session_is_a_connect_one(connect_spark):
    from spark_dl.spark.launch.session import active_session, is_connect, spark_context

    assert is_connect(connect_spark)
    assert is_connect(active_session()) and spark_context(connect_spark) is None


def test_gloo_ranks_allreduce_output_and_results(connect_spark):
    out, err = io.StringIO(), io.StringIO()
    results = run(topology, args=("c",), num_proc=2, env={"SDL_TEST_FLAG": "on"},
                  stdout=out, stderr=err)
    check_two_ranks_one_host(results, out.getvalue(), err.getvalue(), 3.0, "c")
    assert [r["env"] for r in results] == ["on", "on"]
    assert results[0]["job_processes"] >= 2


def test_mpi_through_connect(connect_spark):
    from spark_dl import _core

    if not _core.build_info().get("mpi"):
        pytest.skip("spark_dl built without MPI")
    out = io.StringIO()
    results = run(topology, args=("m",), num_proc=2, use_mpi=True, stdout=out,
                  stderr=io.StringIO())
    check_two_ranks_one_host(results, out.getvalue(), None, 3.0, "m")
    assert all(r["mpi"] for r in results)


def test_a_raising_worker_names_its_rank(connect_spark):
    err = io.StringIO()
    e = expect_worker_failure(raise_on_rank_1, num_proc=2, stderr=err)
    assert e.rank == 1 and "rank 1 raised ValueError: boom from rank 1" in str(e)
    assert "boom from rank 1" in e.remote_traceback
    assert isinstance(e.__cause__, ValueError)
    assert worker_processes(e.job_id) == []
    assert "[1]<stderr>:ValueError: boom from rank 1" in err.getvalue()


def test_too_few_slots_fails_before_any_job(connect_spark):
    start = time.monotonic()
    with pytest.raises(NotEnoughSlotsError, match=r"num_proc=3 exceeds the 2 task slots"):
        run(topology, args=("x",), num_proc=3)
    assert time.monotonic() - start < 5


def _say(n):
    import spark_dl.numpy as sdl

    sdl.init()
    for i in range(n):
        print(f"line {i} of rank {sdl.rank()}", flush=True)
    return sdl.rank()


def test_without_the_link_output_arrives_with_the_result(connect_spark, monkeypatch):
    monkeypatch.setenv("SDL_SPARK_CALLER_LINK", "off")
    out = io.StringIO()
    assert run(_say, args=(3,), num_proc=2, stdout=out, stderr=io.StringIO()) == [0, 1]
    for rank in (0, 1):
        for i in range(3):
            assert f"[{rank}]<stdout>:line {i} of rank {rank}\n" in out.getvalue()


def test_without_the_link_output_follows_the_spool(connect_spark, monkeypatch, tmp_path):
    from spark_dl.spark.common.output_spool import StoreSpool
    from spark_dl.spark.common.store import Store

    monkeypatch.setenv("SDL_SPARK_CALLER_LINK", "off")
    spool = StoreSpool.for_run(Store.create(str(tmp_path)), "r1")
    out = io.StringIO()
    assert run(_say, args=(2,), num_proc=2, stdout=out, stderr=io.StringIO(),
               output_spool=spool) == [0, 1]
    assert "[1]<stdout>:line 1 of rank 1\n" in out.getvalue()
    names = spool.names()
    assert any(n.endswith(".started") for n in names) and any(n.endswith(".stdout")
                                                               for n in names)


def test_a_failure_without_the_link_still_names_the_rank(connect_spark, monkeypatch):
    monkeypatch.setenv("SDL_SPARK_CALLER_LINK", "off")
    err = io.StringIO()
    with pytest.raises(WorkerFailedError) as info:
        run(raise_on_rank_1, num_proc=2, stderr=err)
    # allGather's one-second ticks
    assert_ended_soon_after_failure(err.getvalue(), FAILURE_BOUND_S + 5)
    assert info.value.rank == 1


def test_the_executor_probe_runs_through_connect(connect_spark, monkeypatch):
    from spark_dl.spark.launch import executor_probe
    from spark_dl.spark.launch.errors import ExecutorPythonError

    rows, error = executor_probe._run_connect_probe(connect_spark, 2, timeout=120)
    assert error is None and len(rows) == 2 and all(r[3] is None for r in rows)
    monkeypatch.setattr(executor_probe, "PROBE_MODULES", ("no_such_module_here",))
    monkeypatch.setenv("PYSPARK_PYTHON", "/elsewhere/python3")  # not known to be ours
    with pytest.raises(ExecutorPythonError, match="No module named 'no_such_module_here'"):
        executor_probe.check_executor_python_for_session(connect_spark, 120, tasks=2)


def test_run_elastic_through_connect(connect_spark):
    """``run_elastic`` under Spark Connect (a mapInArrow of ordinary tasks; the caller,
    reachable here, is the membership authority): a worker dies, the other finishes."""
    import os

    from spark_dl.spark import run_elastic

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "parallel"))
    import elastic_training

    cloudpickle.register_pickle_by_value(elastic_training)
    err = io.StringIO()
    results = run_elastic(elastic_training.run_training, kwargs={"die": ["1.0:step:4"]},
                          num_proc=2, min_num_proc=1, stdout=io.StringIO(), stderr=err)
    assert len(results) == 1, results
    res = results[0]
    assert res["sizes"][:4] == [2] * 4 and set(res["sizes"][4:]) == {1}, res["sizes"]
    elastic_training.check_training(res)
    assert "generation 1: 1 workers" in err.getvalue(), err.getvalue()
