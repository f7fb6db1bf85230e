"""Frames whose header authenticates before the body is read, and the admission rules
for connections that have not authenticated yet."""

import socket
import threading
import time

import pytest

from spark_dl.rendezvous.admission import PendingConnections
from spark_dl.rendezvous.frames import (HEADER_BYTES, FrameTimeout, open_header, read_frame,
                                        seal_frame)
from spark_dl.rendezvous.secret import AuthenticationError, ReplayError, ReplayGuard, make_secret

KEY = make_secret()
CTX = b"test/request"


def _pair(data):
    a, b = socket.socketpair()
    threading.Thread(target=lambda: (a.sendall(data), a.close()), daemon=True).start()
    return b


def test_round_trip_and_limits_by_kind():
    frame = seal_frame(KEY, CTX, "small", b"x" * 100)
    with _pair(frame) as sock:
        header, payload = read_frame(sock, KEY, CTX, ReplayGuard(), lambda k: 100, frame_s=5)
    assert (header.kind, bytes(payload)) == ("small", b"x" * 100)
    with pytest.raises(AuthenticationError, match="'small' frame announces 100 bytes"):
        open_header(frame[:HEADER_BYTES], KEY, CTX, None, lambda k: 99)
    with pytest.raises(ValueError, match="longer than 16"):
        seal_frame(KEY, CTX, "k" * 17, b"")


def test_header_and_body_are_each_authenticated():
    frame = bytearray(seal_frame(KEY, CTX, "m", b"payload"))
    with pytest.raises(AuthenticationError, match="header failed"):
        open_header(bytes(frame[:HEADER_BYTES]), make_secret(), CTX, None, lambda k: 1 << 20)
    with pytest.raises(AuthenticationError, match="header failed"):
        open_header(bytes(frame[:HEADER_BYTES]), KEY, b"other", None, lambda k: 1 << 20)
    tampered = bytes(frame)
    tampered = tampered[:HEADER_BYTES] + b"PAYLOAD" + tampered[HEADER_BYTES + 7:]
    with _pair(tampered) as sock, pytest.raises(AuthenticationError, match="body failed"):
        read_frame(sock, KEY, CTX, None, lambda k: 1 << 20, frame_s=5)
    guard = ReplayGuard()
    open_header(bytes(frame[:HEADER_BYTES]), KEY, CTX, guard, lambda k: 1 << 20)
    with pytest.raises(ReplayError):
        open_header(bytes(frame[:HEADER_BYTES]), KEY, CTX, guard, lambda k: 1 << 20)


def test_one_deadline_per_frame_not_per_read():
    a, b = socket.socketpair()
    frame = seal_frame(KEY, CTX, "m", b"p" * 10)

    def trickle():
        for byte in frame:
            try:
                a.sendall(bytes([byte]))
            except OSError:
                return
            time.sleep(0.05)

    threading.Thread(target=trickle, daemon=True).start()
    start = time.monotonic()
    with pytest.raises(FrameTimeout):
        read_frame(b, KEY, CTX, None, lambda k: 100, frame_s=0.5)
    assert time.monotonic() - start < 1.5  # every single read was quick
    a.close()
    b.close()


def test_pending_connections_evict_the_oldest():
    gate = PendingConnections(per_peer=2, total=3, deadline_s=0.2)
    assert gate.admit("a1", "A") == [] and gate.admit("a2", "A") == []
    assert gate.admit("a3", "A") == ["a1"]  # per peer: the oldest of that peer goes
    assert gate.admit("b1", "B") == []
    assert gate.admit("c1", "C") == ["a2"]  # overall: the oldest goes
    assert gate.authenticated("b1") and "b1" not in gate
    assert not gate.authenticated("a1")  # evicted earlier: the caller closes it
    time.sleep(0.25)
    assert sorted(gate.expired()) == ["a3", "c1"] and len(gate) == 0
    assert gate.evicted == 2 and gate.expired_count == 2
