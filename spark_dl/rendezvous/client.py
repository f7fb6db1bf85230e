"""The rendezvous client: what a worker uses to meet its peers at start-up.

Workers publish what their peers need (addresses, ports) under a scope and read theirs,
blocking until they appear. The core's rendezvous calls :class:`KVStoreClient`
(``set``/``get``), built from the worker's environment by :func:`client_from_env`. The
server is :class:`spark_dl.runner.kvstore.KVStoreServer` (run by ``sdlrun`` and by
``spark_dl.spark.run``); the wire protocol is :mod:`spark_dl.rendezvous.protocol`. The
client checks the tag of every answer, so it knows the answer came from this job's
server, and corrects its clock offset from the authenticated timestamps.
"""

from __future__ import annotations

import http.client
import os
import socket
import threading
import time
from typing import List, Mapping, NamedTuple, Optional, Tuple

from spark_dl.config import knobs
from spark_dl.rendezvous.protocol import (H_ERROR, H_MAC, H_TIME, MAX_WAIT_S, RESPONSE_CONTEXT,
                                          kv_path, sign_request, ts_bytes)
from spark_dl.rendezvous.secret import (AuthenticationError, new_nonce, now_ms, secret_from_hex,
                                        verify_mac)

__all__ = ["KVStoreClient", "KVStoreError", "client_from_env"]


class KVStoreError(RuntimeError):
    """The rendezvous server refused a request or could not be reached."""


class KVStoreClient:
    """Client of :class:`KVStoreServer` over keep-alive connections.

    Sequential calls reuse one connection; concurrent calls from several threads each
    take their own (so a ``set`` never waits behind another thread's blocking ``get``).
    A dropped connection or a refused connect is retried with a fresh nonce until the
    call's deadline, so a worker may start before the server accepts connections.

    Args:
        addr, port: the server (``SDL_RENDEZVOUS_ADDR``, ``SDL_RENDEZVOUS_PORT``).
        secret: the job secret (raw bytes).
        timeout: default deadline in seconds of ``set`` and of ``get`` without timeout
            (default: the ``start_timeout_s`` knob's default).
    """

    def __init__(self, addr: str, port: int, secret: bytes,
                 timeout: float = knobs.table()["start_timeout_s"].default):
        self.addr = addr
        self.port = int(port)
        self.timeout = float(timeout)
        self._secret = bytes(secret)
        self._idle: List[http.client.HTTPConnection] = []  # connections not in use
        self._lock = threading.Lock()
        self._closed = False
        self._clock_offset_ms = 0  # server clock minus ours, learnt from signed replies

    def set(self, scope: str, key: str, value: bytes) -> None:
        """Stores ``value`` under ``scope``/``key``, replacing any previous value."""
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError(f"value must be bytes, not {type(value).__name__}")
        status, _ = self._request("PUT", kv_path(scope, key), bytes(value),
                                  time.monotonic() + self.timeout, scope, key)
        if status != 200:
            raise KVStoreError(f"set {scope!r}/{key!r} failed with HTTP {status}")

    def get(self, scope: str, key: str, timeout: Optional[float] = None) -> bytes:
        """Returns the value of ``scope``/``key``, waiting until it is set.

        Args:
            timeout: seconds to wait; None means the client's default timeout.

        Raises:
            TimeoutError: the key did not appear in time (the message names it).
        """
        timeout = self.timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + timeout
        path = kv_path(scope, key)
        while True:
            wait_ms = int(max(0.0, min(deadline - time.monotonic(), MAX_WAIT_S)) * 1000)
            status, body = self._request("GET", f"{path}?wait_ms={wait_ms}", b"",
                                         deadline, scope, key)
            if status == 200:
                return body
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"timed out after {timeout:g} s waiting for rendezvous key {key!r} in "
                    f"scope {scope!r} at {self.addr}:{self.port}")

    def delete(self, scope: str, key: str) -> bool:
        """Removes ``scope``/``key``; True if it existed."""
        status, _ = self._request("DELETE", kv_path(scope, key), b"",
                                  time.monotonic() + self.timeout, scope, key)
        return status == 200

    def close(self) -> None:
        """Closes the idle connections; one in use by another thread closes when done."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def __enter__(self) -> "KVStoreClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _checkout(self) -> http.client.HTTPConnection:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        # The socket timeout must outlast the longest server-side long-poll.
        conn = http.client.HTTPConnection(self.addr, self.port,
                                          timeout=max(self.timeout, MAX_WAIT_S + 10.0))
        conn.connect()
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def _checkin(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(conn)
                return
        conn.close()

    def _request(self, method: str, path: str, body: bytes, deadline: float,
                 scope: str, key: str) -> Tuple[int, bytes]:
        """Sends one authenticated request; returns (status, body) for 200/404."""
        what = f"{method} {scope!r}/{key!r}"
        delay = 0.02
        clock_fixed = False
        while True:
            try:
                resp = self._exchange(method, path, body)
            except (OSError, http.client.HTTPException) as exc:
                # Connect refused, connection dropped: retry with a fresh nonce (every
                # operation is idempotent) until the deadline.
                if time.monotonic() + delay >= deadline:
                    raise KVStoreError(f"cannot reach the rendezvous server at "
                                       f"{self.addr}:{self.port} ({what}): {exc}") from exc
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
                continue
            if resp.status in (200, 404) or resp.mac_hex is not None:
                self._check_response(resp)
            if resp.status in (200, 404):
                return resp.status, resp.body
            if (resp.status == 403 and resp.error == "stale" and resp.mac_hex is not None
                    and not clock_fixed):
                clock_fixed = True  # the offset was just learnt from the signed reply
                continue
            text = resp.body.decode(errors="replace")
            if resp.status == 413:
                raise KVStoreError(f"value for {scope!r}/{key!r} refused as too large: {text}")
            if resp.status in (401, 403):
                raise AuthenticationError(f"rendezvous server at {self.addr}:{self.port} "
                                          f"refused {what}: {text}")
            raise KVStoreError(f"rendezvous server answered HTTP {resp.status} to {what}: "
                               f"{text}")

    def _exchange(self, method: str, path: str, body: bytes) -> "_Response":
        conn = self._checkout()
        try:
            nonce = new_nonce()
            headers = sign_request(self._secret, method, path, body, nonce,
                                   now_ms() + self._clock_offset_ms)
            headers["Content-Length"] = str(len(body))
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        except BaseException:
            conn.close()
            raise
        if resp.will_close:
            conn.close()
        else:
            self._checkin(conn)
        return _Response(resp.status, data, nonce, resp.getheader(H_ERROR, ""),
                         resp.getheader(H_TIME), resp.getheader(H_MAC))

    def _check_response(self, resp: "_Response") -> None:
        try:
            ts = int(resp.ts_text)
            ok = verify_mac(self._secret, bytes.fromhex(resp.mac_hex), RESPONSE_CONTEXT,
                            resp.nonce, str(resp.status).encode(), ts_bytes(ts), resp.body)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise AuthenticationError(
                f"the answer from {self.addr}:{self.port} failed authentication: it does not "
                "come from this job's rendezvous server (wrong secret key or address?)")
        self._clock_offset_ms = ts - now_ms()


class _Response(NamedTuple):
    status: int
    body: bytes
    nonce: bytes
    error: str
    ts_text: Optional[str]
    mac_hex: Optional[str]


def client_from_env(environ: Mapping[str, str] = os.environ,
                    timeout: Optional[float] = None) -> Optional[KVStoreClient]:
    """Builds a client from the variables ``sdlrun`` gives each worker.

    Reads ``SDL_RENDEZVOUS_ADDR``, ``SDL_RENDEZVOUS_PORT`` and ``SDL_SECRET_KEY`` (hex).
    The default timeout is the ``start_timeout_s`` knob (``SDL_START_TIMEOUT`` in
    ``environ``, else its default).

    Returns:
        None when none of the three is set (not launched by sdlrun).

    Raises:
        ValueError: only some of them are set, or one is malformed.
    """
    names = ("SDL_RENDEZVOUS_ADDR", "SDL_RENDEZVOUS_PORT", "SDL_SECRET_KEY")
    values = [environ.get(n) for n in names]
    if not any(values):
        return None
    missing = [n for n, v in zip(names, values) if not v]
    if missing:
        raise ValueError(f"incomplete rendezvous environment: {', '.join(missing)} not set")
    addr, port_text, key_hex = values
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"SDL_RENDEZVOUS_PORT is not a port number: {port_text!r}") from None
    if timeout is None:
        timeout = knobs.value("start_timeout_s", environ)
    return KVStoreClient(addr, port, secret_from_hex(key_hex), timeout=timeout)
