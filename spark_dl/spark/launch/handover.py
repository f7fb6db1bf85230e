"""Hands the job secret to processes this process started, indirectly, on the MPI path.

On the MPI path of :func:`spark_dl.spark.run` two kinds of process need the job secret but
are started by Open MPI rather than by spark_dl, so it cannot come on their stdin:

- the rsh agent, started by ``mpirun`` on the driver (it authenticates to task services);
- the worker bootstraps, started by ``orted`` inside an executor (they fetch the function
  from the driver service and post results).

Neither may find the secret on its command line, in its environment (``ps e``) or in a
file. Instead, the process that holds the secret (the driver; the task that started
``orted``) serves it on a Unix socket in the abstract namespace (Linux: no file, gone
with the process) and answers only a peer that the kernel says (``SO_PEERCRED``) runs as
the same user *and* descends from the serving process: ``mpirun`` and its agents on the
driver, ``orted`` and its ranks in the task. Any other peer is closed without a byte. The
socket's name travels in the environment (``SDL_SPARK_HANDOVER``); it is not a secret.

A peer that could pass the check could already read the serving process's memory (same
user, its own child), so the check grants nothing new.
"""

from __future__ import annotations

import json
import os
import secrets
import selectors
import socket
import struct
import threading
from typing import Any, Mapping, Optional

__all__ = ["SecretHandover", "fetch_handover", "HANDOVER_VAR", "is_descendant"]

HANDOVER_VAR = "SDL_SPARK_HANDOVER"
_MAX_ANSWER = 16 * 1024 * 1024
_MAX_DEPTH = 64  # ancestors walked before giving up (process trees here are shallow)
_UCRED = struct.Struct("3i")  # pid, uid, gid


def _parent_of(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def is_descendant(pid: int, ancestor: int) -> bool:
    """Whether process ``pid`` is ``ancestor`` or one of its descendants (Linux)."""
    for _ in range(_MAX_DEPTH):
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
        parent = _parent_of(pid)
        if parent is None:
            return False
        pid = parent
    return False


class SecretHandover:
    """Serves ``payload`` (JSON) to descendants of this process, on an abstract socket.

    Args:
        payload: what a peer receives (the secret and whatever goes with it).
        label: part of the socket's name, for diagnosis (``ss -xl``).
    """

    def __init__(self, payload: Mapping[str, Any], label: str = "job"):
        self._answer = json.dumps(dict(payload), separators=(",", ":")).encode()
        self._owner = os.getpid()
        self._uid = os.getuid()
        name = f"sdl-spark-{label}-{os.getpid()}-{secrets.token_hex(8)}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind("\0" + name)
        self._sock.listen(64)
        self._sock.setblocking(False)
        self.address = "@" + name
        self.refused = 0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"sdl-handover-{label}",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stops serving (idempotent)."""
        self._stopping.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
        self._sock.close()

    def __enter__(self) -> "SecretHandover":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _loop(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._sock, selectors.EVENT_READ)
            while not self._stopping.is_set():
                if not selector.select(timeout=0.1):
                    continue
                try:
                    conn, _ = self._sock.accept()
                except OSError:
                    continue
                with conn:
                    self._serve(conn)

    def _serve(self, conn: socket.socket) -> None:
        try:
            pid, uid, _ = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                        _UCRED.size))
            if uid != self._uid or not is_descendant(pid, self._owner):
                self.refused += 1
                return
            conn.settimeout(5.0)
            conn.sendall(self._answer)
        except OSError:
            pass


def fetch_handover(address: str, timeout: float = 10.0) -> dict:
    """Receives the payload of the :class:`SecretHandover` at ``address``.

    Raises:
        PermissionError: the server refused (this process does not descend from it).
        OSError: it cannot be reached (the serving process is gone).
    """
    if not address.startswith("@"):
        raise ValueError(f"not a handover address: {address!r}")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect("\0" + address[1:])
        data = bytearray()
        while len(data) <= _MAX_ANSWER:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    if not data:
        raise PermissionError(f"the secret handover at {address} refused this process "
                              f"(pid {os.getpid()}): only processes started under the "
                              "process that serves it are answered")
    return json.loads(bytes(data))
