"""Forwarding of worker output: one thread multiplexes every worker's pipes.

Each complete line is written to the launcher's stdout (worker stdout) or stderr (worker
stderr) as one write under a lock, prefixed ``[<rank>]<stdout>:``, so lines of different
ranks never interleave mid-line. Raw bytes also go to per-rank files when an output
directory is given. A line longer than :data:`MAX_LINE` is forwarded in pieces rather
than buffered without bound.

A pipe carries either one rank's stream (:meth:`OutputForwarder.add`) or the output of
many ranks that another launcher already tagged, such as ``mpirun --tag-output``
(:meth:`OutputForwarder.add_tagged`); a :class:`TagDemux` then splits it back into
per-rank streams, so both kinds end up with the same prefixes and files.
"""

from __future__ import annotations

import os
import re
import selectors
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import BinaryIO, Dict, Iterable, List, Optional, Tuple, Union

MAX_LINE = 64 * 1024
# Bytes of a tagging launcher's own (untagged) output kept for diagnosis.
UNTAGGED_TAIL = 64 * 1024


def _timestamp() -> bytes:
    now = time.time()
    return (time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now))
            + f".{int(now % 1 * 1000):03d} ").encode()


@dataclass
class _Lines:
    """Line assembly for one stream of one rank (rank None: a launcher's own text)."""

    rank: Optional[int]
    name: str  # "stdout" or "stderr"
    sink: BinaryIO
    file: Optional[BinaryIO]
    pending: bytearray = field(default_factory=bytearray)


@dataclass
class _Source:
    """One pipe: a single stream (``lines``) or tagged output of many ranks (``demux``)."""

    pipe: BinaryIO
    name: str
    lines: Optional[_Lines] = None
    demux: Optional["TagDemux"] = None
    fed: set = field(default_factory=set)  # keys of the _Lines a demux fed


class TagDemux:
    """Splits output in which a launcher tagged each piece with its rank.

    The tagging contract (Open MPI's ``--tag-output``): every piece the launcher read from
    a rank starts with a tag, and a tag follows every newline inside a piece; a piece may
    end mid-line, and pieces of different ranks interleave. So text up to the next tag
    belongs to the last tag's rank, except text after a newline that no tag follows: that
    is the launcher's own output (its error reports), returned with rank None.

    Args:
        tag: a regular expression (bytes) with groups ``rank`` and ``stream``; a stream
            other than ``stdout`` counts as ``stderr``.
        max_tag: the longest possible tag, in bytes; a possible tag cut by a read is held
            back at most this long.
    """

    def __init__(self, tag: Union[bytes, "re.Pattern[bytes]"], max_tag: int = 64):
        self._tag = re.compile(tag) if isinstance(tag, bytes) else tag
        self._max_tag = max_tag
        self._owner: Optional[Tuple[int, str]] = None
        self._held = b""
        self.untagged_tail = bytearray()  # the last UNTAGGED_TAIL bytes without a rank

    def feed(self, data: bytes, final: bool = False
             ) -> List[Tuple[Optional[int], Optional[str], bytes]]:
        """Returns ``(rank, stream, bytes)`` pieces in order; ``final`` at end of input."""
        data = self._held + data
        self._held = b""
        if not final:
            cut = self._partial_tag_start(data)
            data, self._held = data[:cut], data[cut:]
        pieces: List[Tuple[Optional[int], Optional[str], bytes]] = []
        pos = 0
        for match in self._tag.finditer(data):
            self._text(data[pos:match.start()], pieces)
            stream = match.group("stream").decode()
            self._owner = (int(match.group("rank")), "stdout" if stream == "stdout" else "stderr")
            pos = match.end()
        self._text(data[pos:], pieces)
        return pieces

    def _partial_tag_start(self, data: bytes) -> int:
        """Where a tag that the next read may complete could begin (len(data) if nowhere)."""
        start = data.rfind(b"[", max(0, len(data) - self._max_tag))
        if start < 0 or b"\n" in data[start:] or self._tag.match(data, start):
            return len(data)
        return start

    def _text(self, text: bytes, pieces) -> None:
        if not text:
            return
        if self._owner is not None:
            newline = text.find(b"\n")
            if newline < 0:
                pieces.append((*self._owner, text))
                return
            pieces.append((*self._owner, text[:newline + 1]))
            self._owner = None
            text = text[newline + 1:]
            if not text:
                return
        pieces.append((None, None, text))
        self.untagged_tail += text
        del self.untagged_tail[:-UNTAGGED_TAIL]


def forwarder_for(options) -> "OutputForwarder":
    """The forwarder a launcher uses for ``options`` (a
    :class:`~spark_dl.runner.options.LaunchOptions`): its streams (default: this
    process's stdout/stderr), prefix, timestamp and output directory."""
    return OutputForwarder(options.stdout or sys.stdout.buffer,
                           options.stderr or sys.stderr.buffer,
                           prefix=options.prefix_output, timestamp=options.prefix_timestamp,
                           output_dir=options.output_dir)


class OutputForwarder:
    """Copies worker pipes to the launcher's streams with rank prefixes.

    Args:
        stdout, stderr: binary sinks for the workers' stdout and stderr lines.
        prefix: add ``[<rank>]<stream>:`` to every line.
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
        self._sources: Dict[int, _Source] = {}
        self._lines: Dict[Tuple[Optional[int], str], _Lines] = {}
        self._files: List[BinaryIO] = []
        self._lock = threading.Lock()  # one write at a time per sink, shared with log()
        self._broken = set()  # sinks whose reader went away (e.g. a closed pipe)
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self._held = False

    def add(self, rank: int, name: str, pipe: BinaryIO) -> None:
        """Registers a worker pipe (before :meth:`start`, or after it while
        :meth:`hold` keeps the forwarder running); it is closed at EOF."""
        self._register(_Source(pipe, name, lines=self._lines_for(rank, name)))

    def add_tagged(self, name: str, pipe: BinaryIO, demux: TagDemux,
                   ranks: Iterable[int] = ()) -> None:
        """Registers a pipe carrying tagged output of many ranks (call before :meth:`start`).

        Args:
            name: the stream the pipe is (``stdout``/``stderr``): where untagged text goes.
            pipe: closed at EOF.
            demux: splits the pipe's bytes by rank; keep it to read ``untagged_tail``.
            ranks: ranks expected on this stream: their output files exist even if a rank
                writes nothing, as with :meth:`add`.
        """
        for rank in ranks:
            self._lines_for(rank, name)
        self._register(_Source(pipe, name, demux=demux))

    def _register(self, source: _Source) -> None:
        fd = source.pipe.fileno()
        os.set_blocking(fd, False)
        self._sources[fd] = source
        self._selector.register(fd, selectors.EVENT_READ)

    def _lines_for(self, rank: Optional[int], name: str) -> _Lines:
        key = (rank, name)
        lines = self._lines.get(key)
        if lines is None:
            file = None
            if self._output_dir and rank is not None:
                rank_dir = os.path.join(self._output_dir, f"rank.{rank}")
                os.makedirs(rank_dir, exist_ok=True)
                file = open(os.path.join(rank_dir, name), "wb")
                self._files.append(file)
            lines = self._lines[key] = _Lines(rank, name, self._sinks[name], file)
        return lines

    def hold(self, on: bool) -> None:
        """While on, the forwarder keeps running when every pipe so far has ended, so
        that workers started later are forwarded too (the elastic launcher)."""
        self._held = on

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
        for fd in list(self._sources):
            self._finish(fd)
        for lines in self._lines.values():
            self._flush(lines)
        self._selector.close()
        for f in self._files:
            f.close()

    def log(self, name: str, text: str) -> None:
        """Writes a launcher message (not prefixed with a rank) to a sink."""
        self._write(self._sinks[name], text.encode(errors="replace"))

    def _loop(self) -> None:
        while (self._sources or self._held) and not self._stopping:
            for key, _ in self._selector.select(timeout=0.2):
                fd = key.fd
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                if chunk:
                    self._dispatch(self._sources[fd], chunk)
                else:
                    self._finish(fd)

    def _dispatch(self, source: _Source, chunk: bytes, final: bool = False) -> None:
        if source.lines is not None:
            self._feed(source.lines, chunk)
            return
        for rank, stream, data in source.demux.feed(chunk, final):
            lines = self._lines_for(rank, stream or source.name)
            source.fed.add((lines.rank, lines.name))
            self._feed(lines, data)

    def _feed(self, lines: _Lines, chunk: bytes) -> None:
        if lines.file is not None:
            lines.file.write(chunk)
            lines.file.flush()
        lines.pending += chunk
        cut = lines.pending.rfind(b"\n") + 1
        if cut == 0 and len(lines.pending) >= MAX_LINE:
            cut = len(lines.pending)  # forward an overlong line in pieces
        if cut:
            text = bytes(lines.pending[:cut])
            del lines.pending[:cut]
            self._emit(lines, text)

    def _flush(self, lines: _Lines) -> None:
        if lines.pending:
            self._emit(lines, bytes(lines.pending))
            lines.pending.clear()

    def _emit(self, lines: _Lines, text: bytes) -> None:
        if not text.endswith(b"\n"):
            text += b"\n"
        prefix = (f"[{lines.rank}]<{lines.name}>:".encode()
                  if self._prefix and lines.rank is not None else b"")
        if prefix or self._timestamp:
            stamp = _timestamp() if self._timestamp else b""
            text = b"".join(stamp + prefix + line + b"\n" for line in text[:-1].split(b"\n"))
        self._write(lines.sink, text)

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
        source = self._sources.pop(fd, None)
        if source is None:
            return
        try:
            self._selector.unregister(fd)
        except (KeyError, ValueError):
            pass
        if source.lines is not None:
            self._flush(source.lines)
        else:
            self._dispatch(source, b"", final=True)
            for key in source.fed:
                self._flush(self._lines[key])
        source.pipe.close()
