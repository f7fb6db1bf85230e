"""Worker output, from a task service to the driver.

The runner's :class:`~spark_dl.runner.output.OutputForwarder` reads the worker's pipes and
writes whole, rank-prefixed lines to two binary sinks; here those sinks queue the bytes
for a sender thread that ships them to the driver service's ``output`` method, batching
what accumulated meanwhile. The queue is bounded: a slow driver slows the forwarder, which
stops reading the pipes, which blocks the worker's writes (nothing is held unbounded).
Once the driver is unreachable, output is dropped rather than blocking the worker.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Optional, Tuple

from spark_dl.runner.output import OutputForwarder

__all__ = ["DriverOutput", "TaskOutputForwarder"]

_BATCH_BYTES = 1 << 20
_QUEUE_ITEMS = 256
_END = ("", b"")


class _Sink:
    """A binary stream (``write``/``flush``) feeding one named stream of a DriverOutput."""

    def __init__(self, owner: "DriverOutput", name: str):
        self._owner = owner
        self._name = name

    def write(self, data: bytes) -> int:
        self._owner.put(self._name, bytes(data))
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
        self.stdout = _Sink(self, "stdout")
        self.stderr = _Sink(self, "stderr")

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
    failures itself, with rank and host (shown with ``verbose >= 2`` for diagnosis)."""

    def __init__(self, *args, show_launcher_messages: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self._show = show_launcher_messages

    def log(self, name: str, text: str) -> None:
        if self._show:
            super().log(name, text.replace("sdlrun: ", "spark_dl task service: ", 1))
