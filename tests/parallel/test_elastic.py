"""Elastic jobs on sdlrun end to end (docs/elastic.md): workers die, leave and join while
a PyTorch model trains, and the result equals a one-process replay of the committed steps.

Each job runs tests/parallel/elastic_workers.py (the training of elastic_training.py); its
state records which rows every rank used in every committed step, and check_training
replays exactly those steps on one process and compares the final weights.
"""

import json
import os
import subprocess
import sys
import time

import pytest

from elastic_training import check_training

pytestmark = pytest.mark.timeout(150)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "elastic_workers.py")
PY = sys.executable


def sdlrun(sdlrun_args, worker_args, out, timeout=120):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [PY, "-m", "spark_dl.runner", *sdlrun_args, PY, WORKER, "--out", str(out),
           *worker_args]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=str(out))
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def result(out):
    with open(os.path.join(out, "result.json")) as f:
        return json.load(f)


def test_a_killed_worker_leaves_the_others_training(tmp_path):
    rc, log, seconds = sdlrun(["-np", "3", "--min-np", "2"], ["--die", "2:step:10"], tmp_path)
    assert rc == 0, log
    assert "worker 2 on localhost failed with signal 9; the others go on" in log
    res = result(tmp_path)
    assert res["sizes"][:10] == [3] * 10 and set(res["sizes"][10:]) == {2}, res["sizes"]
    check_training(res)


def test_deaths_inside_an_object_broadcast_and_inside_sync_are_recovered(tmp_path):
    # Worker 3 dies between the two broadcasts of broadcast_object; in the sync that
    # follows, worker 2 dies after the model's broadcast: two re-formations, then 2 go on.
    rc, log, _ = sdlrun(["-np", "4", "--min-np", "2"],
                        ["--die", "3:broadcast_object:6", "--die", "2:sync:6"], tmp_path)
    assert rc == 0, log
    res = result(tmp_path)
    assert res["resets"] == [3, 2], res["resets"]
    assert res["sizes"][:6] == [4] * 6 and set(res["sizes"][6:]) == {2}, res["sizes"]
    check_training(res)


def test_discovered_host_joins_and_training_goes_on_with_it(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    rc, log, _ = sdlrun(
        ["--min-np", "2", "--max-np", "3", "--host-discovery-script", f"cat {hosts}"],
        ["--grow-at", "4", "--grow-to", "localhost:3", "--grow-size", "3",
         "--hosts-file", str(hosts), "--probe"], tmp_path)
    assert rc == 0, log
    res = result(tmp_path)
    sizes = res["sizes"]
    assert sizes[0] == 2 and sizes[-1] == 3 and sorted(sizes) == sizes, sizes
    assert res["resets"] == [3], res["resets"]
    check_training(res)


def test_graceful_removal_below_min_np_then_newcomers_do_not_deadlock(tmp_path):
    # Horovod's #3494: workers removed gracefully (their host shrank below --min-np), then
    # new ones arrive; every member syncs from the survivor, nobody skips the broadcast.
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:3\n")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [PY, "-m", "spark_dl.runner", "--min-np", "2", "--max-np", "3",
           "--host-discovery-script", f"cat {hosts}", PY, WORKER, "--out", str(tmp_path),
           "--grow-at", "4", "--grow-to", "localhost:1", "--hosts-file", str(hosts),
           "--step-sleep", "0.05"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=str(tmp_path))
    lines = []
    try:
        deadline = time.monotonic() + 100
        for line in proc.stdout:
            lines.append(line)
            if "leaves at the next re-formation" in line and hosts.read_text() != "localhost:3\n":
                time.sleep(1.5)  # the survivor waits alone, below --min-np
                hosts.write_text("localhost:3\n")
            assert time.monotonic() < deadline, "".join(lines)
        rc = proc.wait(timeout=30)
    finally:
        proc.kill()
    log = "".join(lines)
    assert rc == 0, log
    res = result(tmp_path)
    assert res["sizes"][:4] == [3] * 4 and res["sizes"][-1] == 3, res["sizes"]
    # The survivor re-formed with the newcomers (with the first one alone when it was
    # ready before the second: --min-np was met then).
    assert res["resets"] in ([3], [2, 3]), res["resets"]
    check_training(res)


def test_below_min_np_for_the_elastic_timeout_ends_the_job(tmp_path):
    start = time.monotonic()
    rc, log, _ = sdlrun(["-np", "2", "--min-np", "2", "--elastic-timeout", "3"],
                        ["--die", "1:step:3"], tmp_path)
    assert rc == 1, log
    assert "fewer than --min-np=2, for 3 s" in log, log
    assert time.monotonic() - start < 60


def test_elastic_refuses_mpi_and_impossible_sizes(tmp_path):
    rc, log, _ = sdlrun(["-np", "2", "--min-np", "2", "--mpi"], [], tmp_path)
    assert rc == 2 and "an elastic job runs on Gloo" in log, log
    rc, log, _ = sdlrun(["-np", "2", "--min-np", "3"], [], tmp_path)
    assert rc == 2 and "--min-np 3 exceeds the 2 slots of localhost:2" in log, log
    rc, log, _ = sdlrun(["--min-np", "3", "--max-np", "2"], [], tmp_path)
    assert rc == 2 and "--max-np 2 is below --min-np 3" in log, log


def test_a_blacklisted_host_comes_back_after_its_cooldown(tmp_path):
    # The dead worker's host takes no new worker for 1 s; then a replacement starts there
    # and joins, and the job is back to 3.
    rc, log, _ = sdlrun(["-np", "3", "--min-np", "2", "--blacklist-cooldown-range", "1", "1"],
                        ["--die", "2:step:5", "--grow-at", "5", "--grow-size", "3"], tmp_path)
    assert rc == 0, log
    assert "no new worker on localhost for 1 s" in log, log
    res = result(tmp_path)
    sizes = res["sizes"]
    assert sizes[:5] == [3] * 5 and 2 in sizes and sizes[-1] == 3, sizes
    check_training(res)
