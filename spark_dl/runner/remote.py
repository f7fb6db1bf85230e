"""Starting a worker on a remote host through ssh, without the secret on a command line.

Launcher side: :func:`build_ssh_command` makes an ssh command line whose remote part only
runs this module (``python -m spark_dl.runner.remote``) in the launcher's working
directory; :func:`encode_payload` makes one JSON line carrying the worker's command and
environment, secret included, which the launcher writes to ssh's stdin. ssh encrypts it;
no ``ps`` listing on either host ever shows it.

Remote side (:func:`main`): read the payload line, register with the rendezvous server
(which proves the secret and the server's address work from this host, and tells the
launcher the worker started), start the command in its own session, and supervise it:
SIGTERM/SIGINT/SIGHUP are forwarded to it, and when stdin reaches end of file (the
launcher closed it, or ssh died with the launcher) the command is stopped: SIGTERM, then
SIGKILL after a grace period. The exit code is the command's.

As with Horovod, every host must have the same Python environment (the path of the
launcher's interpreter is used remotely) and the working directory should exist there.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, Mapping, Optional, Sequence

MAX_PAYLOAD = 16 * 1024 * 1024
REGISTER_SCOPE = "sdlrun"
STOP_GRACE_S = 3.0

# Variables that describe the launcher's own session or host, not the job.
_NOT_FORWARDED = {"HOSTNAME", "HOME", "USER", "LOGNAME", "SHELL", "PWD", "OLDPWD", "SHLVL",
                  "_", "TERM", "DISPLAY", "MAIL", "TMPDIR", "LS_COLORS"}
_NOT_FORWARDED_PREFIXES = ("SSH_", "XDG_", "BASH_FUNC_")


def register_key(rank) -> str:
    """The rendezvous key a remote bootstrap sets once its worker is about to start: its
    rank, or for an elastic worker (which has no rank yet) ``w<worker id>``."""
    return f"started/{rank}"


def _worker_key(env: Mapping[str, str]) -> str:
    return env.get("SDL_RANK") or "w" + env.get("SDL_ELASTIC_WORKER_ID", "?")


def forwarded_environment(environ: Mapping[str, str]) -> Dict[str, str]:
    """The part of the launcher's environment that remote workers inherit."""
    return {k: v for k, v in environ.items()
            if k not in _NOT_FORWARDED and not k.startswith(_NOT_FORWARDED_PREFIXES)}


def build_ssh_command(host: str, ssh_command: Sequence[str] = ("ssh",),
                      port: Optional[int] = None, identity_file: Optional[str] = None,
                      connect_timeout: Optional[float] = None,
                      python: str = sys.executable, cwd: Optional[str] = None,
                      pythonpath: Optional[str] = None) -> list:
    """The argv that starts the remote bootstrap on ``host``; it holds no secret.

    ``BatchMode`` forbids password prompts (stdin carries the payload); ``-T`` asks for no
    terminal, so output stays separable into stdout and stderr.
    """
    argv = list(ssh_command) + ["-T", "-o", "BatchMode=yes"]
    if connect_timeout is not None:
        argv += ["-o", f"ConnectTimeout={max(1, int(connect_timeout))}"]
    if port is not None:
        argv += ["-p", str(port)]
    if identity_file is not None:
        argv += ["-i", identity_file]
    cwd = os.getcwd() if cwd is None else cwd
    run = ["exec", "env"]
    if pythonpath:
        run.append(f"PYTHONPATH={pythonpath}")
    run += [python, "-m", "spark_dl.runner.remote"]
    # A missing directory is not fatal, as with Horovod: the command may not need it.
    remote = f"cd {shlex.quote(cwd)} >/dev/null 2>&1; " + " ".join(shlex.quote(a) for a in run)
    return argv + [host, remote]


def encode_payload(command: Sequence[str], env: Mapping[str, str],
                   cwd: Optional[str] = None, network: Optional[Mapping] = None) -> bytes:
    """One JSON line: the command, its environment (secret included) and directory, and
    the job's network (:meth:`~spark_dl.runner.network.JobNetwork.payload`), from which
    the bootstrap picks the address its worker advertises."""
    data = {"command": list(command), "env": dict(env), "cwd": cwd}
    if network is not None:
        data["network"] = dict(network)
    return json.dumps(data, separators=(",", ":")).encode() + b"\n"


def _fail(message: str, code: int) -> int:
    sys.stderr.write(f"sdlrun remote ({socket.gethostname()}): {message}\n")
    sys.stderr.flush()
    return code


def _register(env: Mapping[str, str]) -> Optional[str]:
    """Sets the start key; returns an error message or None."""
    from spark_dl.rendezvous.client import client_from_env  # not needed before the payload

    try:
        client = client_from_env(env)
        if client is None:
            return "the payload has no rendezvous settings"
        with client:
            client.set(REGISTER_SCOPE, register_key(_worker_key(env)),
                       socket.gethostname().encode())
    except Exception as exc:  # any failure here means the worker cannot rendezvous
        return (f"worker {_worker_key(env)} cannot reach the rendezvous server at "
                f"{env.get('SDL_RENDEZVOUS_ADDR')}:{env.get('SDL_RENDEZVOUS_PORT')}: {exc}")
    return None


def _read_line(fd: int, limit: int) -> bytes:
    """Reads the payload line, unbuffered. The launcher writes nothing after it: the rest
    of stdin is only its end of file, which the watcher waits for."""
    data = bytearray()
    while not data.endswith(b"\n") and len(data) <= limit:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        data += chunk
    return bytes(data)


def main() -> int:
    """Remote-side entry point: see the module docstring."""
    line = _read_line(0, MAX_PAYLOAD)
    if not line.endswith(b"\n"):
        return _fail("no launch payload on stdin (this module is started by sdlrun)", 2)
    try:
        payload = json.loads(line)
        command = [str(a) for a in payload["command"]]
        env = dict(os.environ)
        env.update({str(k): str(v) for k, v in payload["env"].items()})
        cwd = payload.get("cwd")
        job_network = payload.get("network")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return _fail(f"malformed launch payload: {exc}", 2)
    if job_network:
        from spark_dl.runner.network import pick_address

        try:
            address, _ = pick_address(job_network, env.get("SDL_RENDEZVOUS_ADDR", ""))
        except (ValueError, KeyError, TypeError) as exc:
            return _fail(str(exc), 1)
        env["SDL_HOSTNAME"] = address
    if cwd and os.path.isdir(cwd):
        os.chdir(cwd)
    problem = _register(env)
    if problem is not None:
        return _fail(problem, 1)
    try:
        proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    except OSError as exc:
        return _fail(f"cannot start {command[0]!r}: {exc}",
                     127 if isinstance(exc, FileNotFoundError) else 126)

    def signal_child(signum: int) -> None:
        try:
            os.killpg(proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def stop_child() -> None:
        signal_child(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        signal_child(signal.SIGKILL)

    def watch_stdin() -> None:
        # Raw reads: a daemon thread blocked inside sys.stdin's buffered reader would
        # abort the interpreter at exit.
        while os.read(0, 65536):
            pass
        if proc.poll() is None:
            stop_child()

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda s, _frame: signal_child(s))
    threading.Thread(target=watch_stdin, daemon=True).start()
    rc = proc.wait()
    return 128 - rc if rc < 0 else rc


if __name__ == "__main__":
    sys.exit(main())
