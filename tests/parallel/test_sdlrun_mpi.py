"""``sdlrun --mpi`` end to end: spark_dl workers started through Open MPI's mpirun.

The jobs run real spark_dl workers (tests/parallel/sdlrun_workers/mpi_worker.py: init,
allreduce, a JSON report). Open MPI's root and oversubscribe permissions come from the
test harness (MPI_TEST_ENV), never from sdlrun's defaults. Usage errors need no MPI.
"""

import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from harness import MPI_TEST_ENV
from test_sdlrun import PY, REPO, json_lines, sdlrun, wait_dead, worker

pytestmark = pytest.mark.timeout(60)


def _mpi_skip_reason():
    if shutil.which("mpirun") is None:
        return "mpirun is not on PATH"
    try:
        from spark_dl import _core
    except ImportError:
        return "the spark_dl core is not built"
    if not _core.build_info()["mpi"]:
        return "spark_dl built without MPI"
    return None


needs_mpi = pytest.mark.skipif(_mpi_skip_reason() is not None,
                               reason=_mpi_skip_reason() or "")
MPI_WORKER = worker("mpi_worker.py")


def mpi_sdlrun(*args, timeout=45, **extra_env):
    return sdlrun("--mpi", *args, timeout=timeout, **MPI_TEST_ENV, **extra_env)


def check_reports(out, np_):
    reports = json_lines(out)
    assert sorted(reports) == list(range(np_)), out
    for rank, report in reports.items():
        assert report["rank"] == rank and report["size"] == np_
        assert report["sum"] == np_ * (np_ + 1) / 2
        assert report["mpi_enabled"] is True
        assert report["env"]["SDL_CONTROLLER"] == "mpi"
    return reports


@needs_mpi
def test_mpi_job_runs_collectives_with_prefixes_and_files(tmp_path):
    # Gloo-job variables in the launcher's environment must not reach MPI ranks.
    rc, out, err, _ = mpi_sdlrun("-np", "2", "--output-filename", str(tmp_path / "logs"),
                                 PY, MPI_WORKER, SDL_SECRET_KEY="ab" * 32, SDL_RANK="5",
                                 SDL_RENDEZVOUS_ADDR="10.9.9.9", TEST_EXTRA="x")
    assert rc == 0, err
    reports = check_reports(out, 2)
    for rank, report in reports.items():
        env = report["env"]
        assert not {"SDL_SECRET_KEY", "SDL_RANK", "SDL_RENDEZVOUS_ADDR"} & set(env)
        assert env["TEST_EXTRA"] == "x"
        assert f"[{rank}]<stderr>:rank {rank} to stderr\n" in err
        rank_dir = tmp_path / "logs" / f"rank.{rank}"
        assert (rank_dir / "stderr").read_text() == f"rank {rank} to stderr\n"
        assert (rank_dir / "stdout").read_text().startswith('{"rank": %d' % rank)
    assert reports[0]["env"]["SDL_JOB_ID"] == reports[1]["env"]["SDL_JOB_ID"]
    assert "[1," not in out + err  # every Open MPI tag was rewritten


@needs_mpi
def test_mpi_args_pass_through_and_verbose_says_which_launcher():
    rc, out, err, _ = mpi_sdlrun("--verbose", "--mpi-args=--report-bindings -x TEST_FOO=bar",
                                 "-np", "2", PY, MPI_WORKER)
    assert rc == 0, err
    for report in check_reports(out, 2).values():
        assert report["env"]["TEST_FOO"] == "bar"  # only -x in --mpi-args sets it
    assert "sdlrun: launching with MPI (mpirun): --mpi\n" in err
    assert "--report-bindings -x TEST_FOO=bar" in err  # the logged mpirun command
    assert "[0]<stderr>:" in err and "MCW rank 0 is not bound" in err


@needs_mpi
def test_failing_rank_exit_code_propagates():
    rc, out, err, elapsed = mpi_sdlrun("-np", "2", PY, MPI_WORKER,
                                       FAIL_RANK="1", FAIL_CODE="7")
    assert rc == 7, err
    assert "sdlrun: rank 1 failed with exit code 7; mpirun stopped the job" in err
    assert elapsed < 25
    assert wait_dead([r["pid"] for r in json_lines(out).values()], timeout=5)


@needs_mpi
def test_killed_rank_ends_the_job_in_bounded_time():
    rc, out, err, elapsed = mpi_sdlrun("-np", "3", PY, MPI_WORKER, KILL_RANK="1")
    assert rc == 128 + signal.SIGKILL, err
    assert elapsed < 45
    assert "sdlrun: rank 1 on " in err and "failed with signal 9" in err
    pids = [r["pid"] for r in json_lines(out).values()]
    assert len(pids) == 3 and wait_dead(pids, timeout=5)


def start_mpi_job(np_):
    env = dict(os.environ, **MPI_TEST_ENV, SLEEP_S="30")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen([PY, "-m", "spark_dl.runner", "--mpi", "-np", str(np_), PY,
                             MPI_WORKER], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=env)
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout],
                     daemon=True).start()
    reports = {}
    deadline = time.monotonic() + 30
    while len(reports) < np_ and time.monotonic() < deadline:
        try:
            reports.update(json_lines(lines.get(timeout=1)))
        except queue.Empty:
            pass
    assert len(reports) == np_, "ranks did not report in time"
    return proc, [r["pid"] for r in reports.values()]


@needs_mpi
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_sdlrun_stops_the_mpi_job(signum):
    proc, pids = start_mpi_job(2)
    try:
        proc.send_signal(signum)
        rc = proc.wait(timeout=15)
    finally:
        proc.kill()
    assert rc == 128 + signum
    assert wait_dead(pids, timeout=5)


@needs_mpi
def test_mpi_job_stopped_when_sdlrun_is_killed():
    proc, pids = start_mpi_job(2)
    proc.kill()
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert wait_dead(pids, timeout=15)


@needs_mpi
@pytest.mark.skipif(os.geteuid() != 0, reason="mpirun refuses only root")
def test_root_refusal_says_what_to_set():
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_")}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([PY, "-m", "spark_dl.runner", "--mpi", "-np", "1", "true"],
                          capture_output=True, text=True, timeout=30, env=env)
    assert proc.returncode != 0
    assert ("sdlrun: mpirun refuses to run as root: set OMPI_ALLOW_RUN_AS_ROOT=1 and "
            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1") in proc.stderr


# --- usage errors: no MPI needed --------------------------------------------------------

def test_mpirun_missing(tmp_path):
    rc, _, err, _ = sdlrun("--mpi", "-np", "1", "true", PATH=str(tmp_path))
    assert rc == 2
    assert "mpirun, which is not on PATH" in err and "--gloo" in err


def test_mpirun_not_open_mpi(tmp_path):
    fake = tmp_path / "mpirun"
    fake.write_text("#!/bin/sh\necho 'HYDRA build details:'\n")
    fake.chmod(0o755)
    rc, _, err, _ = sdlrun("--mpi", "-np", "1", "true",
                           PATH=f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    assert rc == 2
    assert "Open MPI's mpirun only" in err and "HYDRA" in err


@pytest.mark.parametrize("args, message", [
    (["--mpi", "--mpi-args=-np 4"], "-np is sdlrun's to set; use sdlrun -np"),
    (["--mpi", "--mpi-args=--hostfile h"], "use sdlrun --hostfile"),
    (["--mpi", "--mpi-args=--timestamp-output"], "--prefix-output-with-timestamp"),
    (["--gloo", "--mpi-args=-x A"], "--mpi-args needs --mpi"),
    (["--mpi", "-H", "[fe80::1]:1"], "no IPv6 address"),
])
def test_mpi_usage_errors(args, message):
    rc, _, err, _ = sdlrun(*args, "-np", "1", "true", **MPI_TEST_ENV)
    assert rc == 2, err
    assert message in err


def test_help_lists_mpi_flags():
    proc = subprocess.run([sys.executable, "-m", "spark_dl.runner", "--help"],
                          capture_output=True, text=True, timeout=30,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert "--mpi " in proc.stdout and "--mpi-args" in proc.stdout
