"""The fork server behind warm Spark workers (spark_dl.runner.forkserver): a forked worker
looks to its supervisor like a ``Popen(start_new_session=True)`` child (pipes, exit codes,
signals, its own session), sees the request's environment, arguments and directory, shares
the preloaded modules, and the server never outlives its parent or its idle time."""

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from spark_dl.runner import forkserver
from spark_dl.runner.forkserver import ForkServer, ForkServerError
from spark_dl.runner.output import OutputForwarder
from spark_dl.runner.workers import WorkerGroup, WorkerSpec

PROBE = textwrap.dedent("""
    import json, os, sys
    line = sys.stdin.readline().strip() if os.environ.get("SDL_PROBE_STDIN") else ""
    if os.environ.get("SDL_PROBE_SIGNAL"):
        os.kill(os.getpid(), int(os.environ["SDL_PROBE_SIGNAL"]))
    import numpy
    print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0),
                      "x": os.environ.get("SDL_X"), "preloaded": "colorsys" in sys.modules,
                      "argv": sys.argv[1:], "cwd": os.getcwd(), "line": line,
                      "name": __name__, "random": float(numpy.random.rand())}))
    print("on stderr", file=sys.stderr)
    sys.exit(int(os.environ.get("SDL_PROBE_CODE", "0")))
""")


@pytest.fixture
def env(tmp_path):
    (tmp_path / "sdl_fs_probe.py").write_text(PROBE)
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path)] + sys.path))


@pytest.fixture
def server(env):
    s = ForkServer(env, ["colorsys", "numpy"], idle_s=60)
    yield s
    s.close()


def probe(server, env, stdin=b"", args=(), cwd=None, **variables):
    proc = server.spawn([sys.executable, "-m", "sdl_fs_probe", *args],
                        dict(env, **variables), cwd, stdin is not None)
    if stdin is not None:
        proc.stdin.write(stdin)
        proc.stdin.close()
    code = proc.wait(30)
    out, err = proc.stdout.read(), proc.stderr.read()
    proc.stdout.close()
    proc.stderr.close()
    return code, (json.loads(out) if out else None), err


def test_a_forked_worker_gets_the_request_and_shares_the_preload(server, env, tmp_path):
    with open(f"/proc/{server.pid}/cmdline", "rb") as f:  # the modules are not on it
        assert b"colorsys" not in f.read()
    code, seen, err = probe(server, env, b"hello\n", ("a", "b"), str(tmp_path),
                            SDL_X="job 1", SDL_PROBE_STDIN="1", SDL_PROBE_CODE="3")
    assert code == 3 and err == b"on stderr\n"
    assert seen["ppid"] == server.pid and seen["sid"] == seen["pid"]  # its own session
    assert seen["x"] == "job 1" and seen["argv"] == ["a", "b"] and seen["line"] == "hello"
    assert seen["cwd"] == str(tmp_path) and seen["name"] == "__main__"
    assert seen["preloaded"]
    # A per-job variable may differ: the same server serves the next job.
    code2, seen2, _ = probe(server, env, SDL_X="job 2")
    assert code2 == 0 and seen2["x"] == "job 2" and seen2["ppid"] == server.pid
    assert seen2["random"] != seen["random"]  # NumPy's global generator re-seeded


def test_exit_by_signal_and_without_stdin(server, env):
    code, seen, _ = probe(server, env, None, SDL_PROBE_SIGNAL=str(int(signal.SIGTERM)))
    assert code == -signal.SIGTERM and seen is None


def test_the_supervisor_signals_a_forked_worker_like_any_other(server, env, tmp_path):
    (tmp_path / "sdl_fs_sleep.py").write_text("import time\nprint('up', flush=True)\n"
                                               "time.sleep(60)\n")
    proc = server.spawn([sys.executable, "-m", "sdl_fs_sleep", "--job", "j1"], env, None, False)
    assert proc.stdout.readline() == b"up\n"
    with open(f"/proc/{proc.pid}/cmdline", "rb") as f:  # ps shows the worker's command
        assert f.read().rstrip(b"\0").split(b"\0") == [
            sys.executable.encode(), b"-m", b"sdl_fs_sleep", b"--job", b"j1"]
    os.killpg(proc.pid, signal.SIGKILL)  # as WorkerGroup stops a worker
    assert proc.wait(30) == -signal.SIGKILL


def test_what_a_server_refuses(server, env):
    with pytest.raises(ForkServerError, match="environment differs"):
        server.spawn([sys.executable, "-m", "sdl_fs_probe"], dict(env, OMP_NUM_THREADS="7"),
                     None, False)
    with pytest.raises(ForkServerError, match="-m module"):
        server.spawn(["/bin/true"], env, None, False)
    with pytest.raises(ForkServerError, match="TensorFlow"):
        ForkServer(env, ["tensorflow"])
    with pytest.raises(ForkServerError, match="could not import sdl_no_such_module"):
        ForkServer(env, ["sdl_no_such_module"])


def test_shared_servers_are_reused_per_modules_and_environment(env):
    try:
        first, started = forkserver.shared_server(env, ["colorsys"], 60)
        assert started
        again, started = forkserver.shared_server(dict(env, SDL_RANK="1"), ["colorsys"], 60)
        assert again is first and not started
        other, started = forkserver.shared_server(dict(env, OMP_NUM_THREADS="7"),
                                                  ["colorsys"], 60)
        assert started and other is not first and not first.alive
    finally:
        forkserver.close_shared()


def test_an_idle_server_exits_and_a_busy_one_waits(env, tmp_path):
    (tmp_path / "sdl_fs_nap.py").write_text("import time\ntime.sleep(1.5)\n")
    s = ForkServer(env, ["colorsys"], idle_s=0.5)
    try:
        proc = s.spawn([sys.executable, "-m", "sdl_fs_nap"], env, None, False)
        time.sleep(1.0)
        assert s.alive  # a running worker keeps it
        assert proc.wait(30) == 0
        deadline = time.monotonic() + 20
        while s.alive and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not s.alive
        with pytest.raises(ForkServerError):
            s.spawn([sys.executable, "-m", "sdl_fs_nap"], env, None, False)
    finally:
        s.close()


def test_the_server_ends_with_its_parent(env):
    code = ("import os, sys, time\n"
            "from spark_dl.runner.forkserver import ForkServer\n"
            "s = ForkServer(dict(os.environ), ['colorsys'], idle_s=600)\n"
            "print(s.pid, flush=True)\n"
            "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE)
    try:
        pid = int(parent.stdout.readline())
        os.kill(pid, 0)
        parent.kill()
        parent.wait(30)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the fork server outlived its parent")
    finally:
        parent.kill()
        parent.wait(30)


def test_a_worker_group_supervises_forked_workers(server, env):
    out, err = io.BytesIO(), io.BytesIO()
    spec = WorkerSpec(0, "here", [sys.executable, "-m", "sdl_fs_probe"],
                      dict(env, SDL_PROBE_CODE="4"),
                      starter=lambda s: server.spawn(s.argv, s.env, s.cwd, False))
    group = WorkerGroup([spec], OutputForwarder(out, err), kill_grace=1.0)
    assert group.run() == 4
    assert b'"preloaded": true' in out.getvalue() and out.getvalue().startswith(b"[0]")
    assert b"on stderr" in err.getvalue()
    assert b"rank 0 on here failed with exit code 4" in err.getvalue()
