"""Forwarding of worker output: one thread multiplexes every worker's pipes.

Each complete line is written to the launcher's stdout (worker stdout) or stderr (worker
stderr) as one write under a lock, prefixed ``[<rank>]<stdout>: ``, so lines of different
ranks never interleave mid-line. Raw bytes also go to per-rank files when an output
directory is given. A line longer than :data:`MAX_LINE` is forwarded in pieces rather
than buffered without bound.
"""

from __future__ import annotations

import os
import selectors
import threading
import time
from dataclasses import dataclass, field
from typing import BinaryIO, Dict, List, Optional

MAX_LINE = 64 * 1024


def _timestamp() -> bytes:
    now = time.time()
    return (time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now))
            + f".{int(now % 1 * 1000):03d} ").encode()


@dataclass
class _Stream:
    rank: int
    name: str  # "stdout" or "stderr"
    sink: BinaryIO
    file: Optional[BinaryIO]
    pipe: BinaryIO
    pending: bytearray = field(default_factory=bytearray)


class OutputForwarder:
    """Copies worker pipes to the launcher's streams with rank prefixes.

    Args:
        stdout, stderr: binary sinks for the workers' stdout and stderr lines.
        prefix: add ``[<rank>]<stream>: `` to every line.
        timestamp: put a timestamp before the prefix.
        output_dir: when set, also write raw output to ``DIR/rank.<r>/<stream>``.
    """

    def __init__(self, stdout: BinaryIO, stderr: BinaryIO, prefix: bool = True,
                 timestamp: bool = False, output_dir: Optional[str] = None):
        self._sinks = {"stdout": stdout, "stderr": stderr}
        self._prefix = prefix
        self._timestamp = timestamp
        self._output_dir = output_dir
        self._selector = selectors.DefaultSelector()
        self._streams: Dict[int, _Stream] = {}
        self._files: List[BinaryIO] = []
        self._lock = threading.Lock()  # one write at a time per sink, shared with log()
        self._broken = set()  # sinks whose reader went away (e.g. a closed pipe)
        self._thread: Optional[threading.Thread] = None
        self._stopping = False

    def add(self, rank: int, name: str, pipe: BinaryIO) -> None:
        """Registers a worker pipe (call before :meth:`start`); it is closed at EOF."""
        file = None
        if self._output_dir:
            rank_dir = os.path.join(self._output_dir, f"rank.{rank}")
            os.makedirs(rank_dir, exist_ok=True)
            file = open(os.path.join(rank_dir, name), "wb")
            self._files.append(file)
        fd = pipe.fileno()
        os.set_blocking(fd, False)
        self._streams[fd] = _Stream(rank, name, self._sinks[name], file, pipe)
        self._selector.register(fd, selectors.EVENT_READ)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="sdlrun-output", daemon=True)
        self._thread.start()

    def join(self, timeout: float) -> bool:
        """Waits until every pipe reached end of file; False on timeout."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def close(self) -> None:
        """Stops forwarding (pending partial lines are flushed) and closes the files."""
        self._stopping = True
        if self._thread is not None:
            self._thread.join(2.0)
        for fd in list(self._streams):
            self._finish(fd)
        self._selector.close()
        for f in self._files:
            f.close()

    def log(self, name: str, text: str) -> None:
        """Writes a launcher message (not prefixed with a rank) to a sink."""
        self._write(self._sinks[name], text.encode(errors="replace"))

    def _loop(self) -> None:
        while self._streams and not self._stopping:
            for key, _ in self._selector.select(timeout=0.2):
                fd = key.fd
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                if chunk:
                    self._feed(self._streams[fd], chunk)
                else:
                    self._finish(fd)

    def _feed(self, stream: _Stream, chunk: bytes) -> None:
        if stream.file is not None:
            stream.file.write(chunk)
            stream.file.flush()
        stream.pending += chunk
        cut = stream.pending.rfind(b"\n") + 1
        if cut == 0 and len(stream.pending) >= MAX_LINE:
            cut = len(stream.pending)  # forward an overlong line in pieces
        if cut:
            lines = bytes(stream.pending[:cut])
            del stream.pending[:cut]
            self._emit(stream, lines)

    def _emit(self, stream: _Stream, lines: bytes) -> None:
        if not lines.endswith(b"\n"):
            lines += b"\n"
        if self._prefix or self._timestamp:
            prefix = f"[{stream.rank}]<{stream.name}>: ".encode() if self._prefix else b""
            stamp = _timestamp() if self._timestamp else b""
            lines = b"".join(stamp + prefix + line + b"\n"
                             for line in lines[:-1].split(b"\n"))
        self._write(stream.sink, lines)

    def _write(self, sink: BinaryIO, data: bytes) -> None:
        with self._lock:
            if id(sink) in self._broken:
                return
            try:
                sink.write(data)
                sink.flush()
            except (BrokenPipeError, ValueError, OSError):
                # Keep draining the workers' pipes so they never block on a full pipe.
                self._broken.add(id(sink))

    def _finish(self, fd: int) -> None:
        stream = self._streams.pop(fd, None)
        if stream is None:
            return
        try:
            self._selector.unregister(fd)
        except (KeyError, ValueError):
            pass
        if stream.pending:
            self._emit(stream, bytes(stream.pending))
            stream.pending.clear()
        stream.pipe.close()
