"""Framed messages whose header is authenticated before anything else is read.

The Spark launch services (:mod:`spark_dl.spark.launch.service`) exchange these frames on
raw TCP streams. A frame is

    header  = magic "SDL2" | nonce (16) | timestamp ms (int64) | payload length (uint64)
              | kind (16 bytes, ASCII, NUL-padded) | header tag (32)
    payload = ``length`` bytes
    trailer = body tag (32)

The header tag is the HMAC (see :mod:`spark_dl.rendezvous.secret`) over the context,
``b"header"``, the nonce, the timestamp, the length and the kind; the body tag covers the
context, ``b"body"``, the header tag and the payload (so a body cannot be moved under
another header). A receiver reads the fixed-size header (:data:`HEADER_BYTES` bytes),
checks its tag, its freshness and the announced length against the limit of that
``kind`` (for a request, the method called) *before* it reads or allocates anything for
the body. So a peer without the secret can make a receiver hold at most one header's
bytes, and an authentic sender can announce no more than the kind allows.

Each frame has one deadline (:class:`Deadline`), not a timeout per read: a peer trickling
one byte at a time cannot keep a frame open past it.
"""

from __future__ import annotations

import socket
import struct
import time
from dataclasses import dataclass
from typing import Callable, Optional

from spark_dl.rendezvous.secret import (MAC_BYTES, NONCE_BYTES, AuthenticationError,
                                        ReplayGuard, compute_mac, new_nonce, now_ms,
                                        verify_mac)

__all__ = ["HEADER_BYTES", "KIND_BYTES", "FrameHeader", "Deadline", "FrameClosed",
           "FrameTimeout", "header_nonce", "seal_frame", "open_header", "read_body", "read_frame",
           "recv_exact", "wait_first_byte"]

MAGIC = b"SDL2"
KIND_BYTES = 16
_HEADER = struct.Struct(f">4s{NONCE_BYTES}sqQ{KIND_BYTES}s{MAC_BYTES}s")
HEADER_BYTES = _HEADER.size
_Q = struct.Struct(">Q")
# Largest single read. Nothing is allocated from an announced length before the header
# that announces it has authenticated.
_CHUNK = 1 << 20
# Slowest body transfer a frame deadline allows for (bytes per second) on top of its
# fixed part; a 2 GiB result then has about 35 minutes.
MIN_BODY_RATE = 1 << 20


class FrameClosed(EOFError):
    """The peer closed, or stayed idle past the idle limit, between two frames."""


class FrameTimeout(TimeoutError):
    """A frame was not complete by its deadline (a stalled or trickling peer)."""


@dataclass(frozen=True)
class FrameHeader:
    """An authenticated header: the body is not read yet."""

    nonce: bytes
    timestamp_ms: int
    length: int
    kind: str
    tag: bytes


class Deadline:
    """One absolute deadline on the monotonic clock."""

    def __init__(self, seconds: float):
        self.at = time.monotonic() + seconds

    def extend(self, seconds: float) -> None:
        self.at += seconds

    def left(self) -> float:
        return self.at - time.monotonic()


def _encode_kind(kind: str) -> bytes:
    raw = kind.encode("ascii")
    if len(raw) > KIND_BYTES:
        raise ValueError(f"frame kind {kind!r} is longer than {KIND_BYTES} bytes")
    return raw.ljust(KIND_BYTES, b"\0")


def seal_frame(secret: bytes, context: bytes, kind: str, payload: bytes,
               nonce: Optional[bytes] = None, timestamp_ms: Optional[int] = None) -> bytes:
    """Returns the whole frame for ``payload``.

    Args:
        secret: the job secret.
        context: names the protocol and direction (domain separation).
        kind: up to :data:`KIND_BYTES` ASCII characters; the receiver's size limit for
            the payload depends on it (a request's method name).
        payload: opaque bytes.
        nonce, timestamp_ms: fresh values by default (tests pass their own).
    """
    nonce = new_nonce() if nonce is None else nonce
    ts = now_ms() if timestamp_ms is None else timestamp_ms
    kind_raw = _encode_kind(kind)
    head_tag = compute_mac(secret, context, b"header", nonce, _Q.pack(ts & (2**64 - 1)),
                           _Q.pack(len(payload)), kind_raw)
    body_tag = compute_mac(secret, context, b"body", head_tag, payload)
    return (_HEADER.pack(MAGIC, nonce, ts, len(payload), kind_raw, head_tag) + payload
            + body_tag)


def header_nonce(raw: bytes) -> bytes:
    """The nonce of a header (not authenticated by this call)."""
    return _HEADER.unpack(raw)[1]


def open_header(raw: bytes, secret: bytes, context: bytes,
                guard: Optional[ReplayGuard], limit_of: Callable[[str], int]) -> FrameHeader:
    """Authenticates a header of :data:`HEADER_BYTES` bytes; nothing of the body is read.

    Args:
        raw: the header bytes.
        secret, context: as given to :func:`seal_frame`.
        guard: replay protection (checked only once the tag passed); None skips it (a
            response bound to its request's nonce by its context).
        limit_of: the largest payload accepted for a kind.

    Raises:
        AuthenticationError: bad magic, wrong tag, or a length over the kind's limit.
        ReplayError: replayed or stale (authentic) header.
    """
    magic, nonce, ts, length, kind_raw, tag = _HEADER.unpack(raw)
    if magic != MAGIC:
        raise AuthenticationError("not a spark_dl frame")
    if not verify_mac(secret, tag, context, b"header", nonce, _Q.pack(ts & (2**64 - 1)),
                      _Q.pack(length), kind_raw):
        raise AuthenticationError("frame header failed authentication (wrong secret key?)")
    kind = kind_raw.rstrip(b"\0").decode("ascii", "replace")
    if guard is not None:
        guard.check(nonce, ts)
    limit = limit_of(kind)
    if length > limit:
        raise AuthenticationError(
            f"a {kind!r} frame announces {length} bytes, over its limit of {limit}")
    return FrameHeader(nonce, ts, length, kind, tag)


def wait_first_byte(sock: socket.socket, idle_s: float) -> bytes:
    """At a frame boundary, waits up to ``idle_s`` for the next frame's first byte.

    Raises:
        FrameClosed: the peer closed, or said nothing for ``idle_s`` (a clean end).
    """
    sock.settimeout(idle_s)
    try:
        first = sock.recv(1)
    except socket.timeout:
        raise FrameClosed() from None
    if not first:
        raise FrameClosed()
    return first


def recv_exact(sock: socket.socket, n: int, deadline: Deadline) -> bytes:
    """Reads exactly ``n`` bytes before ``deadline``, in chunks as they arrive.

    Raises:
        FrameTimeout: the deadline passed.
        EOFError: the peer closed first.
    """
    parts = []
    got = 0
    while got < n:
        left = deadline.left()
        if left <= 0:
            raise FrameTimeout(f"frame not complete by its deadline ({got} of {n} bytes)")
        sock.settimeout(left)
        try:
            chunk = sock.recv(min(n - got, _CHUNK))
        except socket.timeout:
            raise FrameTimeout(f"frame not complete by its deadline ({got} of {n} bytes)") \
                from None
        if not chunk:
            raise EOFError(f"connection closed after {got} of {n} bytes")
        parts.append(chunk)
        got += len(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _recv_buffer(sock: socket.socket, n: int, deadline: Deadline) -> bytearray:
    """Reads exactly ``n`` bytes into one buffer (no second copy of a large body). Only
    for an authenticated header: the buffer is allocated from the announced length."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        left = deadline.left()
        if left <= 0:
            raise FrameTimeout(f"frame not complete by its deadline ({got} of {n} bytes)")
        sock.settimeout(left)
        try:
            k = sock.recv_into(view[got:], min(n - got, _CHUNK))
        except socket.timeout:
            raise FrameTimeout(f"frame not complete by its deadline ({got} of {n} bytes)") \
                from None
        if k == 0:
            raise EOFError(f"connection closed after {got} of {n} bytes")
        got += k
    return buf


def read_body(sock: socket.socket, header: FrameHeader, secret: bytes, context: bytes,
              deadline: Deadline) -> bytearray:
    """Reads the payload and trailer of an authenticated header and checks the body tag.

    The deadline is extended by the time the announced length needs at
    :data:`MIN_BODY_RATE`.
    """
    deadline.extend(header.length / MIN_BODY_RATE)
    payload = _recv_buffer(sock, header.length, deadline)
    tag = recv_exact(sock, MAC_BYTES, deadline)
    if not verify_mac(secret, tag, context, b"body", header.tag, payload):
        raise AuthenticationError("frame body failed authentication")
    return payload


def read_frame(sock: socket.socket, secret: bytes, context: bytes,
               guard: Optional[ReplayGuard], limit_of: Callable[[str], int],
               frame_s: float, idle_s: Optional[float] = None):
    """Reads one whole frame; returns ``(header, payload)``.

    Args:
        frame_s: the frame's deadline in seconds (from its first byte when ``idle_s`` is
            given, else from now), extended for the body by its length at
            :data:`MIN_BODY_RATE`.
        idle_s: at a frame boundary: see :func:`wait_first_byte`.
    """
    first = b"" if idle_s is None else wait_first_byte(sock, idle_s)
    deadline = Deadline(frame_s)  # from the first byte, not from the idle wait
    raw = first + recv_exact(sock, HEADER_BYTES - len(first), deadline)
    header = open_header(raw, secret, context, guard, limit_of)
    return header, read_body(sock, header, secret, context, deadline)
