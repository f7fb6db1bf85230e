"""Worker output, from a task service to the driver (and an MPI daemon's, to its agent).

The runner's :class:`~spark_dl.runner.output.OutputForwarder` reads the worker's pipes and
writes whole, rank-prefixed lines to two binary sinks; here those sinks queue the bytes
for a sender thread that ships them to the driver service's ``output`` method, batching
what accumulated meanwhile. The queue is bounded: a slow driver slows the forwarder, which
stops reading the pipes, which blocks the worker's writes (nothing is held unbounded).
Once the driver is unreachable, output is dropped rather than blocking the worker.

An MPI daemon (``orted``) writes little of its own (its ranks' output travels to
``mpirun`` over MPI's own channel): a :class:`DaemonOutput` keeps it for the rsh agent,
which fetches it and writes it to ``mpirun``, as ssh would.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Dict, Optional, Tuple

from spark_dl.runner.output import OutputForwarder

__all__ = ["StreamSink", "DriverOutput", "TaskOutputForwarder", "DaemonOutput"]

_BATCH_BYTES = 1 << 20
# Bytes of daemon output kept per stream while its agent does not fetch them.
_DAEMON_KEEP = 1 << 20
_QUEUE_ITEMS = 256
_END = ("", b"")


class StreamSink:
    """A binary stream (``write``/``flush``) passing what it gets to ``put(name, data)``."""

    def __init__(self, put: Callable[[str, bytes], None], name: str):
        self._put = put
        self._name = name

    def write(self, data: bytes) -> int:
        self._put(self._name, bytes(data))
        return len(data)

    def flush(self) -> None:
        pass


class DriverOutput:
    """Ships ``(stream, bytes)`` to the driver, in order, from one sender thread.

    Args:
        send: ``send(stream, data)``, e.g. a driver client's ``output`` call; raising
            marks the driver unreachable (later output is dropped).
    """

    def __init__(self, send: Callable[[str, bytes], None]):
        self._send = send
        self._queue: "queue.Queue[Tuple[str, bytes]]" = queue.Queue(_QUEUE_ITEMS)
        self._broken = False
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="sdl-task-output", daemon=True)
        self._thread.start()
        self.stdout = StreamSink(self.put, "stdout")
        self.stderr = StreamSink(self.put, "stderr")

    def put(self, stream: str, data: bytes) -> None:
        if data and not self._broken and not self._closed:
            self._queue.put((stream, data))

    def close(self, timeout: float = 10.0) -> None:
        """Sends what is queued (bounded by ``timeout``), then stops the sender."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(_END, timeout=timeout)
        except queue.Full:
            self._broken = True
        self._thread.join(timeout)

    def _loop(self) -> None:
        pending: Optional[Tuple[str, bytes]] = None
        while True:
            item = pending or self._queue.get()
            pending = None
            if item is _END:
                return
            stream, data = item
            chunks = [data]
            size = len(data)
            while size < _BATCH_BYTES:  # coalesce what waits, same stream only
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is _END or nxt[0] != stream:
                    pending = nxt
                    break
                chunks.append(nxt[1])
                size += len(nxt[1])
            if self._broken:
                continue  # keep draining so that writers never block
            try:
                self._send(stream, b"".join(chunks))
            except Exception:
                self._broken = True


class TaskOutputForwarder(OutputForwarder):
    """The runner's forwarder, minus its ``sdlrun:`` messages: the driver reports worker
    failures itself, with rank and host (shown with ``verbose >= 2`` for diagnosis, as
    ``<label>: ...``)."""

    def __init__(self, *args, show_launcher_messages: bool = False,
                 label: str = "spark_dl task service", **kwargs):
        super().__init__(*args, **kwargs)
        self._show = show_launcher_messages
        self._label = label

    def log(self, name: str, text: str) -> None:
        if self._show:
            super().log(name, text.replace("sdlrun: ", f"{self._label}: ", 1))


class DaemonOutput:
    """An MPI daemon's output and exit code, waiting for its agent to fetch them.

    Bounded: past :data:`_DAEMON_KEEP` unfetched bytes a stream keeps its newest bytes
    (an agent that went away must not make the daemon block on its pipes).
    """

    def __init__(self):
        self._cond = threading.Condition()
        self._data: Dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        self.exit_code: Optional[int] = None
        self.end_fetched = threading.Event()  # the agent has the exit code
        self.stdout = StreamSink(self.put, "stdout")
        self.stderr = StreamSink(self.put, "stderr")

    def put(self, stream: str, data: bytes) -> None:
        with self._cond:
            buf = self._data[stream]
            buf += data
            del buf[:-_DAEMON_KEEP]
            self._cond.notify_all()

    def finish(self, code: int) -> None:
        """The daemon ended with ``code`` (its output is complete)."""
        with self._cond:
            self.exit_code = code
            self._cond.notify_all()

    def fetch(self, wait_s: float) -> dict:
        """Waits up to ``wait_s`` for output or the end; returns and forgets what came:
        ``{"stdout": bytes, "stderr": bytes, "exit_code": int or None}``. Once the exit
        code is set, the output returned with it is the last."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while not any(self._data.values()) and self.exit_code is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            answer = {name: bytes(buf) for name, buf in self._data.items()}
            for buf in self._data.values():
                buf.clear()
            answer["exit_code"] = self.exit_code
            if self.exit_code is not None:
                self.end_fetched.set()
            return answer
