"""The sdlrun launcher end to end: environments, output, exit codes, signals, remote start.

Workers here are plain Python scripts (tests/parallel/sdlrun_workers/): they must not need
the native core. Remote hosts are simulated by a fake ssh that runs the remote command
locally in a separate session, so that only its stdin ties it to the launcher, as over ssh.
"""

import io
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from spark_dl.runner.launch import make_parser, run_command

pytestmark = pytest.mark.timeout(60)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sdlrun_workers")
PY = sys.executable
REMOTE = "192.0.2.1"  # TEST-NET-1: never this machine, so sdlrun treats it as remote


def worker(name):
    return os.path.join(WORKERS, name)


def sdlrun_env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def sdlrun(*args, timeout=30, **extra_env):
    """Runs ``python -m spark_dl.runner ARGS``; returns (rc, stdout, stderr, seconds)."""
    start = time.monotonic()
    proc = subprocess.run([PY, "-m", "spark_dl.runner", *args], capture_output=True,
                          text=True, timeout=timeout, env=sdlrun_env(**extra_env))
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start


def alive(pid):
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_dead(pids, timeout=10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def reported_pids(text):
    return [int(p) for line in re.findall(r"pids (\d+) (\d+)", text) for p in line]


def json_lines(stdout):
    """{rank: report} from lines ``[<rank>]<stdout>:{...}``."""
    reports = {}
    for line in stdout.splitlines():
        match = re.match(r"^\[(\d+)\]<stdout>:(\{.*\})$", line)
        if match:
            reports[int(match.group(1))] = json.loads(match.group(2))
    return reports


def test_rank_environment(tmp_path):
    rc, out, err, _ = sdlrun("-np", "2", PY, worker("env_report.py"))
    assert rc == 0, err
    reports = json_lines(out)
    assert sorted(reports) == [0, 1]
    for rank, env in reports.items():
        for prefix in ("SDL_", "HOROVOD_"):
            assert env[prefix + "RANK"] == str(rank)
            assert env[prefix + "SIZE"] == "2"
            assert env[prefix + "LOCAL_RANK"] == str(rank)
            assert env[prefix + "LOCAL_SIZE"] == "2"
            assert env[prefix + "CROSS_RANK"] == "0"
            assert env[prefix + "CROSS_SIZE"] == "1"
        assert env["SDL_HOSTNAME"] == "127.0.0.1"
        assert env["SDL_RENDEZVOUS_ADDR"] == "127.0.0.1"
        assert int(env["SDL_RENDEZVOUS_PORT"]) > 0
        assert re.fullmatch(r"[0-9a-f]{64}", env["SDL_SECRET_KEY"])
        assert re.fullmatch(r"[0-9a-f]+", env["SDL_JOB_ID"])
        assert env["secret_on_cmdline"] is False
    for name in ("SDL_RENDEZVOUS_PORT", "SDL_SECRET_KEY", "SDL_JOB_ID"):
        assert reports[0][name] == reports[1][name]
    # A new job gets a new secret and job id.
    rc, out2, _, _ = sdlrun("-np", "1", PY, worker("env_report.py"))
    again = json_lines(out2)[0]
    assert again["SDL_SECRET_KEY"] != reports[0]["SDL_SECRET_KEY"]
    assert again["SDL_JOB_ID"] != reports[0]["SDL_JOB_ID"]


def test_hosts_flag_with_local_aliases():
    rc, out, err, _ = sdlrun("-np", "2", "-H", "localhost:1,127.0.0.1:1", PY,
                             worker("env_report.py"))
    assert rc == 0, err
    reports = json_lines(out)
    # Both names are this machine: one host with two local ranks.
    assert [reports[r]["SDL_LOCAL_RANK"] for r in (0, 1)] == ["0", "1"]
    assert {reports[r]["SDL_LOCAL_SIZE"] for r in (0, 1)} == {"2"}


def test_output_prefixes_and_files(tmp_path):
    code = ("import os, sys; r = os.environ['SDL_RANK']; "
            "print(f'out {r} a'); print(f'out {r} b'); sys.stdout.flush(); "
            "sys.stderr.write(f'err {r}\\nno newline {r}')")
    rc, out, err, _ = sdlrun("-np", "2", "--output-filename", str(tmp_path / "logs"),
                             PY, "-c", code)
    assert rc == 0, err
    for r in (0, 1):
        # Each rank's lines in order; the ranks' lines may interleave (a worker's prints can
        # reach its pipe one by one, and the other rank's between them).
        mine = [line for line in out.splitlines(keepends=True)
                if line.startswith(f"[{r}]<stdout>:")]
        assert mine == [f"[{r}]<stdout>:out {r} a\n", f"[{r}]<stdout>:out {r} b\n"], out
        assert f"[{r}]<stderr>:err {r}\n" in err
        assert f"[{r}]<stderr>:no newline {r}\n" in err
        rank_dir = tmp_path / "logs" / f"rank.{r}"
        assert (rank_dir / "stdout").read_text() == f"out {r} a\nout {r} b\n"
        assert (rank_dir / "stderr").read_text() == f"err {r}\nno newline {r}"


def test_output_options():
    code = "print('plain')"
    rc, out, _, _ = sdlrun("-np", "1", "--disable-output-prefix", PY, "-c", code)
    assert (rc, out) == (0, "plain\n")
    rc, out, _, _ = sdlrun("-np", "1", "--prefix-output-with-timestamp", PY, "-c", code)
    assert rc == 0
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3} \[0\]<stdout>:plain\n", out)


def test_failing_worker_exit_code_and_others_killed(tmp_path):
    start = time.monotonic()
    rc, out, err, elapsed = sdlrun("-np", "2", PY, worker("sleeper.py"),
                                   READY_DIR=str(tmp_path), FAIL_CODE="7")
    assert rc == 7, err
    assert "rank 0 on localhost failed with exit code 7" in err
    pids = reported_pids(out)
    assert len(pids) == 2  # rank 1 and its grandchild (the worker's process group)
    assert elapsed < 15, f"took {time.monotonic() - start:.1f} s"
    assert wait_dead(pids, timeout=5)


def test_worker_ignoring_sigterm_is_killed_after_grace(tmp_path, monkeypatch):
    monkeypatch.setenv("READY_DIR", str(tmp_path))
    out, err = io.BytesIO(), io.BytesIO()
    start = time.monotonic()
    rc = run_command([PY, worker("sleeper.py")], 3,
                     env={"FAIL_CODE": "5", "IGNORE_TERM": "1"},
                     kill_grace=0.5, stdout=out, stderr=err)
    elapsed = time.monotonic() - start
    assert rc == 5, err.getvalue().decode()
    pids = reported_pids(out.getvalue().decode())
    assert len(pids) == 4
    assert elapsed < 15
    assert wait_dead(pids, timeout=5)


def test_worker_killed_by_signal_gives_128_plus_signal():
    rc, _, err, _ = sdlrun("-np", "1", PY, "-c",
                           "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert rc == 128 + signal.SIGKILL
    assert "signal 9" in err


def start_sdlrun_and_wait_ready(tmp_path, np):
    proc = subprocess.Popen([PY, "-m", "spark_dl.runner", "-np", str(np), PY,
                             worker("sleeper.py")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=sdlrun_env(READY_DIR=str(tmp_path), FAIL_CODE=""))
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout],
                     daemon=True).start()
    pids = []
    deadline = time.monotonic() + 30
    while len(pids) < 2 * np and time.monotonic() < deadline:
        try:
            pids += reported_pids(lines.get(timeout=1))
        except queue.Empty:
            pass
    assert len(pids) == 2 * np, "workers did not report in time"
    return proc, pids


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_sdlrun_stops_workers(tmp_path, signum):
    proc, pids = start_sdlrun_and_wait_ready(tmp_path, 2)
    try:
        proc.send_signal(signum)
        rc = proc.wait(timeout=15)
    finally:
        proc.kill()
    assert rc == 128 + signum
    assert wait_dead(pids, timeout=5)


def test_workers_stopped_when_sdlrun_is_killed(tmp_path):
    """SIGKILL leaves the launcher no chance: its watchdog ends the workers."""
    proc, pids = start_sdlrun_and_wait_ready(tmp_path, 2)
    proc.kill()
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert wait_dead(pids, timeout=10)


def test_workers_meet_through_kvstore_client():
    rc, out, err, _ = sdlrun("-np", "2", PY, worker("kv_worker.py"))
    assert rc == 0, err
    assert "[0]<stdout>:got 'hello from 1'" in out
    assert "[1]<stdout>:got 'hello from 0'" in out


@pytest.mark.parametrize("args, message", [
    (["-np", "3", "-H", "localhost:2", "true"], "exceeds the 2 slots"),
    (["-np", "2", "--gloo", "--mpi-args=-x A", "true"], "--mpi-args needs --mpi"),
    (["-np", "2"], "no command"),
    (["-np", "1", "-H", "a:x", "true"], "cannot parse host"),
])
def test_usage_errors(args, message):
    rc, _, err, _ = sdlrun(*args)
    assert rc == 2
    assert message in err


def test_command_not_found():
    rc, _, err, _ = sdlrun("-np", "2", "/nonexistent/program")
    assert rc == 127
    assert "cannot start rank 0" in err


def test_parser_keeps_command_arguments():
    args = make_parser().parse_args(["-np", "2", "python", "train.py", "-np", "--lr", "1"])
    assert args.np == 2 and args.command == ["python", "train.py", "-np", "--lr", "1"]


# --- remote hosts, through a fake ssh ------------------------------------------------------

def run_remote(np, hosts, tmp_path, monkeypatch, command, mode="", **options):
    log = tmp_path / "ssh.log"
    monkeypatch.setenv("FAKE_SSH_LOG", str(log))
    monkeypatch.setenv("FAKE_SSH_MODE", mode)
    monkeypatch.setenv("PYTHONPATH", REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out, err = io.BytesIO(), io.BytesIO()
    start = time.monotonic()
    rc = run_command(command, np, hosts=hosts, rendezvous_addr="127.0.0.1",
                     ssh_command=[PY, worker("fake_ssh.py")], ssh_port=2222,
                     ssh_identity_file="/keys/id", stdout=out, stderr=err, **options)
    ssh_argvs = ([json.loads(line) for line in log.read_text().splitlines()]
                 if log.exists() else [])
    return (rc, out.getvalue().decode(), err.getvalue().decode(),
            time.monotonic() - start, ssh_argvs)


def test_remote_worker_gets_environment_not_on_command_line(tmp_path, monkeypatch):
    rc, out, err, _, ssh_argvs = run_remote(
        2, f"localhost:1,{REMOTE}:1", tmp_path, monkeypatch,
        [PY, worker("env_report.py")], env={"EXTRA_VAR": "x"})
    assert rc == 0, err
    reports = json_lines(out)
    local, remote = reports[0], reports[1]
    assert remote["SDL_RANK"] == "1" and remote["SDL_CROSS_RANK"] == "1"
    assert remote["SDL_CROSS_SIZE"] == "2" and remote["SDL_LOCAL_SIZE"] == "1"
    assert remote["SDL_HOSTNAME"] == REMOTE
    assert remote["SDL_RENDEZVOUS_ADDR"] == local["SDL_RENDEZVOUS_ADDR"] == "127.0.0.1"
    assert remote["SDL_SECRET_KEY"] == local["SDL_SECRET_KEY"]
    assert remote["EXTRA_VAR"] == local["EXTRA_VAR"] == "x"
    assert remote["cwd"] == os.getcwd()
    assert not remote["secret_on_cmdline"] and not local["secret_on_cmdline"]
    [argv] = ssh_argvs
    assert REMOTE in argv and "2222" in argv and "/keys/id" in argv
    assert "BatchMode=yes" in argv
    assert not any(local["SDL_SECRET_KEY"] in a for a in argv)


def test_remote_failure_propagates_and_local_worker_stopped(tmp_path, monkeypatch):
    code = ("import os, sys, time\n"
            "if os.environ['SDL_RANK'] == '1': time.sleep(0.5); sys.exit(9)\n"
            "print(f'pids {os.getpid()} {os.getpid()}', flush=True); time.sleep(60)")
    rc, out, err, elapsed, _ = run_remote(2, f"localhost:1,{REMOTE}:1", tmp_path,
                                          monkeypatch, [PY, "-c", code], kill_grace=1)
    assert rc == 9, err
    assert f"rank 1 on {REMOTE} failed with exit code 9" in err
    assert elapsed < 15
    assert wait_dead(reported_pids(out), timeout=5)


def test_remote_worker_stopped_when_launcher_gives_up(tmp_path, monkeypatch):
    """Closing ssh's stdin is what stops a remote worker (no signal crosses ssh)."""
    monkeypatch.setenv("READY_DIR", str(tmp_path))
    rc, out, err, elapsed, _ = run_remote(
        2, f"localhost:1,{REMOTE}:1", tmp_path, monkeypatch, [PY, worker("sleeper.py")],
        env={"FAIL_CODE": "4"}, kill_grace=1)
    assert rc == 4, err
    pids = reported_pids(out)
    assert len(pids) == 2  # the remote rank 1 and its grandchild
    assert elapsed < 15
    assert wait_dead(pids, timeout=8)


def test_remote_start_timeout(tmp_path, monkeypatch):
    rc, _, err, elapsed, _ = run_remote(1, f"{REMOTE}:1", tmp_path, monkeypatch, ["true"],
                                        mode="hang", start_timeout=1, kill_grace=0.5)
    assert rc == 1
    assert f"ranks 0 ({REMOTE}) did not start within 1 s" in err
    assert elapsed < 10


def test_remote_host_unreachable(tmp_path, monkeypatch):
    rc, _, err, _, _ = run_remote(1, f"{REMOTE}:1", tmp_path, monkeypatch, ["true"],
                                  mode="unreachable")
    assert rc == 255
    assert "Connection refused" in err and "exit code 255" in err
