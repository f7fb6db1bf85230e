"""A fork server: worker processes started from a Python that has already imported the
frameworks, so a later job on the same executor skips the imports (seconds for torch).

A Spark executor's Python worker (the process running a barrier task) lives across jobs:
Spark reuses it. The task service keeps one :class:`ForkServer` per such process, a child
process started on the first job that imports the modules asked for (``torch``,
``spark_dl.torch`` ...) once and then forks one worker per request. The worker is the same
program the task would otherwise start with ``python -m spark_dl.spark.launch.task.worker``,
run with ``runpy`` in the forked child after it took the request's stdin, stdout, stderr,
working directory and environment; it leads its own session, as a ``Popen(...,
start_new_session=True)`` child does, so the supervision (:class:`~spark_dl.runner.workers.
WorkerGroup`: process-group signals, the watchdog, the stdin that ends the worker when the
task dies) is unchanged. :class:`WarmProcess` is the ``Popen``-like handle it supervises.

What is safe to share, and what is not:

- The server is single-purpose and private: it talks only over a socket pair inherited from
  its parent (nobody else can connect), in JSON, and exits when the parent closes it (the
  parent died) or after ``idle_s`` without a worker running.
- Only modules the request names are preloaded; TensorFlow is refused (it starts thread
  pools at import, and TensorFlow does not support fork after that).
- A server is reused only for an environment that equals the one it was started with, but
  for the per-job variables (``SDL_*``, ``HOROVOD_*``): anything a module might have read at
  import time (``PYTHONPATH``, ``OMP_NUM_THREADS``, ``CUDA_VISIBLE_DEVICES`` ...) matches.
  Otherwise a new server replaces it.
- The child re-seeds NumPy's global generator (Python's ``random`` re-seeds itself at
  fork), so workers do not share a random stream with each other.
- CUDA is never initialized in the server (importing torch does not): each worker
  initializes its own, with its own ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = ["ForkServer", "ForkServerError", "WarmProcess", "shared_server", "close_shared",
           "REFUSED_MODULES"]

# Never preloaded: TensorFlow starts threads at import and does not support fork after it.
REFUSED_MODULES = ("tensorflow", "keras", "tf_keras", "jax")
# Variables that differ between jobs and that no module reads at import time: a server is
# reused for any values of these.
_PER_JOB_PREFIXES = ("SDL_", "HOROVOD_")
_HEADER = struct.Struct("!I")
# Bytes the server's command line reserves, so that a forked worker can show its own
# (``ps``, /proc/PID/cmdline: what operators and the launcher's tests look for).
_TITLE_ROOM = 256
_MAX_MESSAGE = 64 << 20
_START_TIMEOUT_S = 300.0  # the preload itself (torch on a loaded host: seconds)
_SPAWN_TIMEOUT_S = 30.0


class ForkServerError(RuntimeError):
    """The server could not start or could not fork a worker (the caller starts the worker
    the ordinary way instead)."""


def _send(sock: socket.socket, message: dict, fds: Sequence[int] = ()) -> None:
    data = json.dumps(message).encode()
    header = _HEADER.pack(len(data))
    if fds:
        socket.send_fds(sock, [header], list(fds))
    else:
        sock.sendall(header)
    sock.sendall(data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < n:
        chunk = sock.recv(n - len(chunks))
        if not chunk:
            raise EOFError("the fork server's peer closed the connection")
        chunks += chunk
    return bytes(chunks)


def _recv(sock: socket.socket, maxfds: int = 0) -> Tuple[dict, List[int]]:
    if maxfds:
        header, fds, _, _ = socket.recv_fds(sock, _HEADER.size, maxfds)
        if not header:
            raise EOFError("the fork server's peer closed the connection")
        if len(header) < _HEADER.size:
            header += _recv_exact(sock, _HEADER.size - len(header))
    else:
        header, fds = _recv_exact(sock, _HEADER.size), []
    (size,) = _HEADER.unpack(header)
    if size > _MAX_MESSAGE:
        raise ValueError(f"fork server message of {size} bytes")
    return json.loads(_recv_exact(sock, size)), list(fds)


def environment_key(env: Mapping[str, str]) -> Tuple[Tuple[str, str], ...]:
    """What must be equal for a server to serve ``env``: all but the per-job variables."""
    return tuple(sorted((k, v) for k, v in env.items() if not k.startswith(_PER_JOB_PREFIXES)))


class WarmProcess:
    """A worker forked by the server, as :class:`subprocess.Popen` shows a child to its
    supervisor: ``pid`` (it leads its own process group, which the supervisor signals),
    ``stdin``/``stdout``/``stderr`` (the parent's ends of its pipes, or None), ``wait()``
    and ``returncode`` (negative: the signal that ended it)."""

    def __init__(self, pid: int, stdin, stdout, stderr):
        self.pid = pid
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: Optional[int] = None
        self._ended = threading.Event()

    def _set_status(self, returncode: int) -> None:
        self.returncode = returncode
        self._ended.set()

    def wait(self, timeout: Optional[float] = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
        return self.returncode


class ForkServer:
    """The parent's handle of one server process (see the module docstring).

    Args:
        env: the server's environment (the first worker's); workers whose environment has
            the same :func:`environment_key` may be forked from it.
        modules: modules the server imports before it serves.
        idle_s: the server exits after this long without a request or a running worker.
    """

    def __init__(self, env: Mapping[str, str], modules: Sequence[str], idle_s: float = 600.0):
        refused = [m for m in modules if m.split(".")[0] in REFUSED_MODULES]
        if refused:
            raise ForkServerError(f"not preloaded in a fork server: {', '.join(refused)} "
                                  "(TensorFlow does not support fork after its import)")
        self.key = environment_key(env)
        self.modules = tuple(modules)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "spark_dl.runner.forkserver", str(theirs.fileno()),
                 repr(float(idle_s)), " " * _TITLE_ROOM],
                env=dict(env), pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, start_new_session=True)
        finally:
            theirs.close()
        self._sock = ours
        self._lock = threading.Lock()  # one spawn at a time
        self._replies: "list[dict]" = []
        self._reply_ready = threading.Condition()
        self._procs: Dict[int, WarmProcess] = {}
        self._early: Dict[int, int] = {}  # exits reported before the pid was registered
        self._closed = False
        self._sock.settimeout(_START_TIMEOUT_S)
        try:
            # The modules go over the socket, not on the command line: process listings
            # that look for a module's name (the worker's) must not find the server.
            _send(self._sock, {"modules": list(self.modules)})
            hello, _ = _recv(self._sock)
        except (OSError, EOFError, ValueError) as exc:
            self.close()
            raise ForkServerError(f"the fork server did not start ({exc})") from None
        self._sock.settimeout(None)
        if hello.get("error"):
            self.close()
            raise ForkServerError(hello["error"])
        self.pid = self._proc.pid
        self.preload_s: float = hello.get("preload_s", 0.0)
        threading.Thread(target=self._read, name="sdl-forkserver-reader", daemon=True).start()

    @property
    def alive(self) -> bool:
        return not self._closed and self._proc.poll() is None

    def _read(self) -> None:
        try:
            while True:
                message, _ = _recv(self._sock)
                if "exit" in message:
                    pid, code = message["exit"], message["code"]
                    with self._reply_ready:
                        proc = self._procs.pop(pid, None)
                        if proc is None:
                            self._early[pid] = code
                    if proc is not None:
                        proc._set_status(code)
                else:
                    with self._reply_ready:
                        self._replies.append(message)
                        self._reply_ready.notify_all()
        except (OSError, EOFError, ValueError):
            pass
        self._closed = True
        with self._reply_ready:
            self._reply_ready.notify_all()
            orphans = list(self._procs.values())
            self._procs.clear()
        # The server is gone (killed): its workers' exit codes went with it. Each is
        # reported as failed once it is gone, so that nothing waits forever.
        for proc in orphans:
            threading.Thread(target=_await_orphan, args=(proc,), daemon=True).start()

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: Optional[str],
              stdin: bool) -> WarmProcess:
        """Forks ``argv`` (``[python, "-m", module, args...]`` only) with pipes like
        ``Popen(stdin=PIPE or DEVNULL, stdout=PIPE, stderr=PIPE, start_new_session=True)``.

        Raises:
            ForkServerError: the command is not a module run, or the server is gone.
        """
        argv = list(argv)
        if len(argv) < 3 or argv[1] != "-m" or os.path.realpath(argv[0]) != os.path.realpath(
                sys.executable):
            raise ForkServerError(f"a fork server runs `{sys.executable} -m module` only")
        if environment_key(env) != self.key:
            raise ForkServerError("the environment differs from the fork server's")
        pipes = [os.pipe() for _ in range(3 if stdin else 2)]
        if stdin:
            child_fds = [pipes[0][0], pipes[1][1], pipes[2][1]]
            parent_fds = [pipes[0][1], pipes[1][0], pipes[2][0]]
        else:
            child_fds = [pipes[0][1], pipes[1][1]]
            parent_fds = [None, pipes[0][0], pipes[1][0]]
        try:
            with self._lock:
                if not self.alive:
                    raise ForkServerError("the fork server has exited")
                try:
                    _send(self._sock, {"module": argv[2], "args": argv[3:], "env": dict(env),
                                       "cwd": cwd, "stdin": stdin}, child_fds)
                    reply = self._await_reply()
                except (OSError, ForkServerError) as exc:
                    # A half-sent request or a silent server: never use it again (the
                    # next job starts a new one).
                    self._closed = True
                    raise ForkServerError(f"the fork server failed ({exc})") from None
        except BaseException:
            for fd in parent_fds:
                if fd is not None:
                    os.close(fd)
            raise
        finally:
            for fd in child_fds:
                os.close(fd)
        if "pid" not in reply:
            for fd in parent_fds:
                if fd is not None:
                    os.close(fd)
            raise ForkServerError(reply.get("error", "the fork server refused the worker"))
        stdin_file = os.fdopen(parent_fds[0], "wb") if parent_fds[0] is not None else None
        proc = WarmProcess(reply["pid"], stdin_file, os.fdopen(parent_fds[1], "rb"),
                           os.fdopen(parent_fds[2], "rb"))
        with self._reply_ready:
            code = self._early.pop(proc.pid, None)
            if code is None:
                self._procs[proc.pid] = proc
        if code is not None:
            proc._set_status(code)
        return proc

    def _await_reply(self) -> dict:
        deadline = time.monotonic() + _SPAWN_TIMEOUT_S
        with self._reply_ready:
            while not self._replies:
                left = deadline - time.monotonic()
                if self._closed or left <= 0:
                    raise ForkServerError("the fork server did not answer")
                self._reply_ready.wait(left)
            return self._replies.pop(0)

    def close(self) -> None:
        """Ends the server (its running workers go on; they are supervised elsewhere)."""
        self._closed = True
        try:
            # shutdown, not only close: it also ends the reader thread's blocked recv, and
            # the server sees the end of its input at once.
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def _await_orphan(proc: WarmProcess) -> None:
    while True:
        try:
            os.kill(proc.pid, 0)
        except ProcessLookupError:
            break
        except PermissionError:
            pass
        time.sleep(0.2)
    proc._set_status(1)


# --- the parent's shared servers --------------------------------------------------------------

_shared: Dict[Tuple[str, ...], ForkServer] = {}
_shared_lock = threading.Lock()


def shared_server(env: Mapping[str, str], modules: Sequence[str],
                  idle_s: float = 600.0) -> Tuple[ForkServer, bool]:
    """This process's server for ``modules`` and ``env`` (see :func:`environment_key`),
    started when there is none yet or the one there cannot serve them (it is then closed:
    one server per module list). Returns ``(server, started_now)``."""
    modules = tuple(modules)
    with _shared_lock:
        server = _shared.get(modules)
        if server is not None and server.alive and server.key == environment_key(env):
            return server, False
        if server is not None:
            server.close()
            del _shared[modules]
        server = ForkServer(env, modules, idle_s)
        _shared[modules] = server
        return server, True


def close_shared() -> None:
    """Ends every server this process started."""
    with _shared_lock:
        for server in _shared.values():
            server.close()
        _shared.clear()


# --- the server process ----------------------------------------------------------------------

def _serve(sock: socket.socket, idle_s: float) -> None:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children = set()
    idle_since = time.monotonic()
    while True:
        timeout = None if children else max(0.0, idle_since + idle_s - time.monotonic())
        readable, _, _ = select.select([sock, wake_r], [], [], timeout)
        if not readable and not children and time.monotonic() >= idle_since + idle_s:
            return
        if wake_r in readable:
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})
            if not children:
                idle_since = time.monotonic()
        if sock in readable:
            try:
                request, fds = _recv(sock, maxfds=3)
            except (EOFError, OSError):
                return  # the parent is gone
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(request, fds, sock, (wake_r, wake_w))  # never returns
            for fd in fds:
                os.close(fd)
            children.add(pid)
            _send(sock, {"pid": pid})


def _child(request: dict, fds: List[int], sock: socket.socket, wake: Tuple[int, int]) -> None:
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sock.close()
        for fd in wake:
            os.close(fd)
        os.setsid()
        if request["stdin"]:
            targets = [0, 1, 2]
        else:
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.close(devnull)
            targets = [1, 2]
        for fd, target in zip(fds, targets):
            os.dup2(fd, target)
        for fd in fds:
            if fd not in targets:
                os.close(fd)
        _show_command_line([sys.executable, "-m", request["module"]] + list(request["args"]))
        if request.get("cwd"):
            os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        import runpy

        # runpy warns about a module imported before it runs as __main__ (the worker's
        # bootstrap is preloaded): its copy in sys.modules is not the one that runs.
        sys.modules.pop(request["module"], None)
        sys.argv = [request["module"]] + list(request["args"])
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if not isinstance(exc.code, (int, type(None))):
                print(exc.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code & 0xFF)


def _show_command_line(argv: List[str]) -> None:
    """Writes ``argv`` over this process's original command line (the server's, inherited
    through fork, with room reserved), so that ``ps`` and /proc/PID/cmdline show the
    worker's command; Python keeps its own copy of the arguments, so nothing reads the old
    bytes. Too long a command is cut; on any error the server's line stays."""
    try:
        import ctypes

        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48, 49)
        room = end - start
        data = b"\0".join(a.encode() for a in argv)[:room - 1]
        ctypes.memmove(start, data + b"\0" * (room - len(data)), room)
    except Exception:
        pass


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    sock = socket.socket(fileno=int(argv[0]))
    idle_s = float(argv[1])
    try:
        modules = [str(m) for m in _recv(sock)[0]["modules"]]
    except (EOFError, OSError, ValueError, KeyError, TypeError):
        return  # the parent is gone or confused: nothing to serve
    started = time.monotonic()
    import importlib

    try:
        for name in modules:
            importlib.import_module(name)
    except BaseException as exc:  # the parent starts its workers the ordinary way
        _send(sock, {"error": f"the fork server could not import {name}: "
                              f"{type(exc).__name__}: {exc}"})
        return
    _send(sock, {"ready": True, "preload_s": time.monotonic() - started})
    _serve(sock, idle_s)


if __name__ == "__main__":
    main()
