"""``spark_dl.spark.run(use_mpi=True)``: mpirun on the driver, orted started inside the
executors through the task services (``local[2]`` and ``local-cluster[2,1,1024]``), and
the pieces of that path that need no Spark (launcher choice, secret handover, agent
arguments, how the driver service reads mpirun's end)."""

import io
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("pyspark")

from spark_dl.spark import run  # noqa: E402
from spark_dl.spark.launch.driver.service import DriverService, Failure  # noqa: E402
from spark_dl.spark.launch.errors import MpiNotBuiltError, NotEnoughSlotsError  # noqa: E402
from spark_dl.spark.launch.handover import SecretHandover, fetch_handover, is_descendant  # noqa: E402
from spark_dl.spark.launch.rsh_agent import split_argv  # noqa: E402
from spark_dl.spark.launch.spark_run import select_launcher  # noqa: E402
from test_run_cases import (ROOT, check_two_ranks_one_host,  # noqa: E402
                            expect_worker_failure, processes_with, raise_on_rank_1,
                            sigkill_rank_1, spark_session, topology, worker_processes)


def _mpi_missing():
    if shutil.which("mpirun") is None or shutil.which("orted") is None:
        return "Open MPI's mpirun/orted are not on PATH"
    try:
        from spark_dl import _core
    except ImportError as exc:
        return f"the core is not built: {exc}"
    if not _core.build_info().get("mpi"):
        return "this spark_dl build has no MPI"
    return None


needs_mpi = pytest.mark.skipif(_mpi_missing() is not None, reason=str(_mpi_missing()))
pytestmark = [pytest.mark.spark, pytest.mark.timeout(120)]

# Open MPI's mpirun refuses root without these: test environment only (as in
# tests/parallel/harness.py); run() passes the driver's environment on to mpirun.
MPI_TEST_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
_DISCOVERY = '#!/bin/sh\necho \'{"name": "gpu", "addresses": ["0"]}\'\n'


def _session(master, **conf):
    saved = {k: os.environ.get(k) for k in MPI_TEST_ENV}
    os.environ.update(MPI_TEST_ENV)
    session = spark_session(master, **conf)
    try:
        yield session
    finally:
        session.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _leftovers(job_id, wait_s=5.0):
    """Processes of job ``job_id`` still alive after up to ``wait_s``: its workers, and
    any mpirun, orted or rsh agent this test process started (the machine is shared)."""
    deadline = time.monotonic() + wait_s
    while True:
        left = worker_processes(job_id) + [
            (pid, cmd) for needle in ("orted", "mpirun", "spark_dl.spark.launch.rsh_agent")
            for pid, cmd in processes_with(needle) if is_descendant(pid, os.getpid())]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


# ---- local[2] -----------------------------------------------------------------------

@pytest.fixture(scope="class")
def local_spark():
    yield from _session("local[2]")


@pytest.mark.usefixtures("local_spark")
@needs_mpi
class TestLocal:

    def test_ranks_allreduce_output_and_results_by_rank(self):
        out, err = io.StringIO(), io.StringIO()
        results = run(topology, args=("m",), kwargs={"scale": 2}, env={"SDL_TEST_FLAG": "on"},
                      stdout=out, stderr=err, use_mpi=True)
        check_two_ranks_one_host(results, out.getvalue(), err.getvalue(), 6.0, "m")
        for r in results:
            assert r["mpi"] is True and r["env"] == "on"
            assert r["devices"] == [] and r["cuda"] is None
            # mpirun, its rsh agent, orted (and its shell), two workers: none shows it.
            assert r["job_processes"] >= 5
        assert _leftovers(results[0]["job_id"]) == []

    def test_worker_exception_ends_run_with_rank_and_traceback(self):
        err = io.StringIO()
        e = expect_worker_failure(raise_on_rank_1, num_proc=2, stderr=err, use_mpi=True,
                                  prefix_output_with_timestamp=True)
        assert e.rank == 1
        assert "rank 1 raised ValueError: boom from rank 1" in str(e)
        assert "raise_on_rank_1" in e.remote_traceback
        assert isinstance(e.__cause__, ValueError)
        assert _leftovers(e.job_id) == []
        assert re.search(r"^\d{4}-\d\d-\d\dT[\d:.]+ \[1\]<stderr>:ValueError: boom from rank 1$",
                         err.getvalue(), re.M)

    def test_worker_killed_by_sigkill_ends_run(self):
        e = expect_worker_failure(sigkill_rank_1, num_proc=2, stderr=io.StringIO(),
                                  use_mpi=True)
        assert e.rank == 1 and e.exit_code == 137 and "SIGKILL" in str(e), str(e)
        assert e.remote_traceback is None
        assert _leftovers(e.job_id) == []

    def test_more_workers_than_slots_fails_fast(self):
        start = time.monotonic()
        with pytest.raises(NotEnoughSlotsError, match=r"num_proc=3 exceeds the 2 task slots"):
            run(topology, args=("x",), num_proc=3, use_mpi=True)
        assert time.monotonic() - start < 5

    @pytest.mark.skipif(os.getuid() != 0, reason="mpirun refuses root only")
    def test_runs_as_root_like_horovod(self, monkeypatch):
        # Executors often run as root (Databricks): the Spark path allows it without being
        # asked (mpirun's and orted's environment), as Horovod does; sdlrun still refuses.
        for key in MPI_TEST_ENV:
            monkeypatch.delenv(key)
        assert len(run(topology, args=("x",), use_mpi=True)) == 2


# ---- local-cluster: two executor JVMs, one (fake) GPU each ----------------------------

@pytest.fixture(scope="class")
def cluster_spark(tmp_path_factory):
    script = tmp_path_factory.mktemp("gpu") / "discover_gpus.sh"
    script.write_text(_DISCOVERY)
    script.chmod(0o755)
    yield from _session(
        "local-cluster[2,1,1024]",
        **{"spark.executor.memory": "512m",
           "spark.worker.resource.gpu.amount": "1",
           "spark.worker.resource.gpu.discoveryScript": str(script),
           "spark.executor.resource.gpu.amount": "1",
           "spark.task.resource.gpu.amount": "1"})


@pytest.mark.usefixtures("cluster_spark")
@needs_mpi
class TestCluster:

    def test_ranks_allreduce_gpus_across_executors(self):
        out = io.StringIO()
        results = run(topology, args=("c",), num_proc=2, stdout=out, stderr=io.StringIO(),
                      use_mpi=True)
        check_two_ranks_one_host(results, out.getvalue(), None, 3.0, "c")
        for r in results:
            # One host: one orted runs both ranks; each still gets its own task's GPU.
            assert r["mpi"] is True and r["devices"] == ["0"] and r["cuda"] == "0"
        assert _leftovers(results[0]["job_id"]) == []


# ---- without Spark --------------------------------------------------------------------

@needs_mpi
def test_launcher_choice_and_refused_flags():
    assert select_launcher(True, None).name == "mpi"
    assert select_launcher(None, False).name == "mpi"
    assert select_launcher(None, None).name == "gloo"
    for args in ("-np 4", "-H a:2", "--map-by node", "--mca plm_rsh_agent ssh",
                 "--tag-output"):
        with pytest.raises(ValueError, match="set by spark_dl.spark.run itself"):
            select_launcher(True, None, args)
    assert select_launcher(True, None, "--mca btl_tcp_if_include lo").name == "mpi"


def test_without_mpirun_mpi_is_refused_clearly(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(MpiNotBuiltError, match="needs Open MPI's mpirun on the PATH"):
        select_launcher(True, None)


_HANDOVER_CHILD = textwrap.dedent("""
    import os, sys
    from spark_dl.spark.launch.handover import fetch_handover
    print(fetch_handover(os.environ["ADDR"])["secret"])
""")

_HANDOVER_SERVER = textwrap.dedent("""
    import sys, time
    from spark_dl.spark.launch.handover import SecretHandover
    h = SecretHandover({"secret": "s3cr3t"}, label="test")
    print(h.address, flush=True)
    time.sleep(30)
""")


def test_secret_handover_answers_descendants_only():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    with SecretHandover({"secret": "s3cr3t"}, label="test") as handover:
        child = subprocess.run([sys.executable, "-c", _HANDOVER_CHILD],
                               env=dict(env, ADDR=handover.address), capture_output=True,
                               text=True, timeout=30)
        assert child.stdout.strip() == "s3cr3t", child.stderr
        assert handover.refused == 0
    # The other way round: this process does not descend from the server's.
    server = subprocess.Popen([sys.executable, "-c", _HANDOVER_SERVER], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        address = server.stdout.readline().strip()
        with pytest.raises(PermissionError, match="refused this process"):
            fetch_handover(address, timeout=5)
    finally:
        server.kill()
        server.wait()
        server.stdout.close()
    with pytest.raises(OSError):  # gone with its process: nothing left behind
        fetch_handover(address, timeout=5)


def test_rsh_agent_arguments():
    argv = ["-p", "sdl-ab12", " orted", "-mca", "ess", '"env"', "-mca", "orte_hnp_uri",
            '"1.0;tcp://10.0.0.1:5"']
    host, command = split_argv(argv)
    assert host == "sdl-ab12"
    assert command == ' orted -mca ess "env" -mca orte_hnp_uri "1.0;tcp://10.0.0.1:5"'
    with pytest.raises(ValueError, match="usage"):
        split_argv(["sdl-ab12"])


def test_driver_reads_the_end_of_an_mpi_job():
    def driver():
        d = DriverService(b"k" * 32, 2, b"", ["127.0.0.1"], lambda s, b: None)
        d.set_ranks({0: 0, 1: 1})
        return d

    # A killed rank named by mpirun wins over its peer's PeerFailureError.
    d = driver()
    d._error(0, "spark_dl.common.exceptions.PeerFailureError", "rank 0 raised ...", "tb", None)
    d.job_ended(137, Failure(1, "rank 1 ended with SIGKILL", rank=1, exit_code=137))
    failures = d.wait_for_outcome(lambda: None)
    assert [f.rank for f in failures] == [1, 0] and failures[0].exit_code == 137
    assert d._ping(0) == {"stop": True}
    # mpirun naming a rank that reported its own exception adds nothing.
    d = driver()
    d._error(1, "builtins.ValueError", "rank 1 raised ValueError", "tb", None)
    d.job_ended(1, Failure(1, "rank 1 ended with exit code 1", rank=1, exit_code=1))
    assert [f.priority for f in d.wait_for_outcome(lambda: None)] == [0]
    # A clean end with every result is a success; without one, a failure naming it.
    d = driver()
    d._result(0, b"a")
    d._result(1, b"b")
    d.job_ended(0)
    assert d.wait_for_outcome(lambda: None) == [] and d.wait_for_exits([0, 1], 0) == []
    d = driver()
    d._result(0, b"a")
    d.job_ended(0)
    assert d.wait_for_outcome(lambda: None)[0].rank == 1


def _daemon_run(client, command, timeout=20.0):
    """Starts the daemon ``command`` as the agent does; returns (stdout, stderr, code)."""
    client.call("daemon", command=command)
    out, err = b"", b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        answer = client.call("daemon_output", wait_s=1.0)
        out, err = out + answer["stdout"], err + answer["stderr"]
        if answer["exit_code"] is not None:
            return out, err, answer["exit_code"]
    raise AssertionError(f"the daemon did not end: {out!r} {err!r}")


def test_task_service_hosts_reaps_and_serves_the_mpi_daemon():
    from spark_dl.rendezvous.secret import make_secret
    from spark_dl.spark.launch.service import ServiceClient
    from spark_dl.spark.launch.task.service import TaskService

    secret = make_secret()
    dead_driver = ServiceClient("driver", secret, [("127.0.0.1", 9)], timeout=1.0)
    tasks = [TaskService(secret, "job", i, [], dead_driver, kill_grace=1.0,
                         hosts=["127.0.0.1"]) for i in range(3)]
    clients = [ServiceClient("task", secret, t.start(), timeout=10.0) for t in tasks]
    token = f"sdl-test-orted-{os.getpid()}"
    try:
        with pytest.raises(Exception, match="hosts no MPI daemon"):
            clients[0].call("daemon", command="true")
        # The daemon runs through a shell with the driver's environment; what it starts
        # gets the secret from the task's handover, which nothing outside hands out.
        clients[0].call("host_daemon", env={"SDL_X": "x1"})
        fetch = ("from spark_dl.spark.launch.handover import fetch_handover as f; import os; "
                 "print(len(f(os.environ['SDL_SPARK_HANDOVER'])['secret']))")
        out, err, code = _daemon_run(
            clients[0], f'echo "out $SDL_X" && "$SDL_SPARK_PYTHON" -c "{fetch}" '
                        '&& echo err >&2; exit 3')
        assert (out, err, code) == (b"out x1\n64\n", b"err\n", 3)
        assert tasks[0].done.is_set()
        # A daemon stopped by terminate() is reaped with what it started.
        clients[1].call("host_daemon", env={})
        sleeper = '"$SDL_SPARK_PYTHON" -c "import time; time.sleep(60)"'
        clients[1].call("daemon", command=f"{sleeper} {token}-child & exec {sleeper} {token}")
        deadline = time.monotonic() + 10
        while len(processes_with(token)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(processes_with(token)) == 2
        clients[1].call("terminate")
        assert tasks[1].done.wait(10)
        assert clients[1].call("daemon_output", wait_s=1.0)["exit_code"] == 143  # SIGTERM
        assert not processes_with(token)
        # An attached task only waits: stopping it ends it.
        clients[2].call("attach", rank=2)
        assert tasks[2].launched and not tasks[2].done.is_set()
        clients[2].call("terminate")
        assert tasks[2].done.is_set()
    finally:
        for client in clients:
            client.close()
        for task in tasks:
            task.stop(5)
