"""The rendezvous key-value store: an authenticated HTTP server and its client.

Workers meet here at start-up: each publishes what its peers need (addresses, ports) under
a scope and reads theirs, blocking until they appear. The launcher runs the server; the
core's rendezvous calls :class:`KVStoreClient` (``set``/``get``), built from the worker's
environment by :func:`client_from_env`.

Protocol (``/v1/kv/<scope>/<key>``, both segments percent-encoded, so keys may hold any
character including ``/``):

- ``PUT``     stores the request body as the value;
- ``GET``     returns the value, or 404; ``?wait_ms=N`` long-polls up to N ms (capped);
- ``DELETE``  removes the key (404 if absent).

Every request carries ``X-SDL-Nonce`` (hex), ``X-SDL-Time`` (ms) and ``X-SDL-MAC``: the
HMAC-SHA256 (see :mod:`spark_dl.runner.secret`) over method, raw path, nonce, timestamp and
body. The server refuses a body over its limit with 413 before reading it, a missing or
malformed tag with 401, a wrong tag with 403, a replayed or stale request with 403, and
parses the path only after all checks pass. Responses to authenticated requests carry the
server time and a tag bound to the request nonce, so a client also knows that the answer
came from a holder of the secret and is not a replayed answer; the client corrects its
clock offset from these authenticated timestamps.
"""

from __future__ import annotations

import http.client
import http.server
import os
import socket
import sys
import threading
import time
import urllib.parse
from typing import Dict, List, Mapping, NamedTuple, Optional, Tuple

from spark_dl.runner.secret import (AuthenticationError, ReplayError, ReplayGuard,
                                    compute_mac, new_nonce, now_ms, secret_from_hex,
                                    verify_mac)

__all__ = ["KVStoreServer", "KVStoreClient", "KVStoreError", "client_from_env",
           "sign_request"]

DEFAULT_MAX_BODY = 16 * 1024 * 1024
# Longest a single long-poll GET holds its server thread; clients poll again after it.
MAX_WAIT_S = 5.0
_PREFIX = "/v1/kv/"
_REQUEST_CONTEXT = b"sdl-kv-request-v1"
_RESPONSE_CONTEXT = b"sdl-kv-response-v1"
_H_NONCE, _H_TIME, _H_MAC, _H_ERROR = "X-SDL-Nonce", "X-SDL-Time", "X-SDL-MAC", "X-SDL-Error"
# An over-limit body up to this size is read and dropped so that the connection stays
# usable; a larger one closes the connection unread.
_DRAIN_LIMIT = 1024 * 1024


class KVStoreError(RuntimeError):
    """The rendezvous server refused a request or could not be reached."""


def _ts_bytes(ts: int) -> bytes:
    return str(ts).encode()


def sign_request(secret: bytes, method: str, path: str, body: bytes = b"",
                 nonce: Optional[bytes] = None,
                 timestamp_ms: Optional[int] = None) -> Dict[str, str]:
    """Returns the authentication headers for one request.

    Args:
        secret: the job secret.
        method: HTTP method, upper case.
        path: the request target exactly as sent (already percent-encoded, with query).
        body: the request body.
        nonce, timestamp_ms: fresh values by default (tests pass their own).
    """
    nonce = new_nonce() if nonce is None else nonce
    ts = now_ms() if timestamp_ms is None else timestamp_ms
    tag = compute_mac(secret, _REQUEST_CONTEXT, method.encode(), path.encode("latin-1"),
                      nonce, _ts_bytes(ts), body)
    return {_H_NONCE: nonce.hex(), _H_TIME: str(ts), _H_MAC: tag.hex()}


def _response_tag(secret: bytes, nonce: bytes, status: int, ts: int, body: bytes) -> bytes:
    return compute_mac(secret, _RESPONSE_CONTEXT, nonce, str(status).encode(),
                       _ts_bytes(ts), body)


def _kv_path(scope: str, key: str) -> str:
    return (_PREFIX + urllib.parse.quote(scope, safe="") + "/"
            + urllib.parse.quote(key, safe=""))


class _Table:
    """The stored values, with a condition that wakes long-polling readers."""

    def __init__(self):
        self.values: Dict[Tuple[str, str], bytes] = {}
        self.cond = threading.Condition()
        self.closed = False

    def put(self, scope: str, key: str, value: bytes) -> None:
        with self.cond:
            self.values[(scope, key)] = bytes(value)
            self.cond.notify_all()

    def get(self, scope: str, key: str, wait_s: float = 0.0) -> Optional[bytes]:
        deadline = time.monotonic() + wait_s
        with self.cond:
            while True:
                value = self.values.get((scope, key))
                remaining = deadline - time.monotonic()
                if value is not None or remaining <= 0 or self.closed:
                    return value
                self.cond.wait(remaining)

    def delete(self, scope: str, key: str) -> bool:
        with self.cond:
            return self.values.pop((scope, key), None) is not None

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the core issues many small requests
    # Headers and body go out in separate writes; with Nagle's algorithm the second waits
    # for the peer's delayed ACK (~40 ms per request).
    disable_nagle_algorithm = True
    timeout = 600  # an idle connection is closed after this; clients reconnect
    server: "_HTTPServer"

    def setup(self):
        super().setup()
        self.server.track(self.connection, True)

    def finish(self):
        try:
            super().finish()
        finally:
            self.server.track(self.connection, False)

    def log_message(self, fmt, *args):
        if self.server.verbose:
            sys.stderr.write(f"sdlrun: rendezvous: {self.client_address[0]} {fmt % args}\n")

    def do_GET(self):
        self._handle("GET")

    def do_PUT(self):
        self._handle("PUT")

    def do_DELETE(self):
        self._handle("DELETE")

    def _handle(self, method: str) -> None:
        srv = self.server
        # 1. Size, before reading anything.
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            length = -1
        if length < 0:
            return self._refuse(400, "bad-request", "invalid Content-Length", close=True)
        if length > srv.max_body:
            drain = length <= srv.max_body + _DRAIN_LIMIT
            if drain:
                self._discard(length)
            return self._refuse(413, "too-large",
                                f"body of {length} bytes exceeds the limit of {srv.max_body}",
                                close=not drain)
        body = self.rfile.read(length) if length else b""
        if len(body) != length:
            self.close_connection = True
            return
        # 2. Presence and form of the authentication headers.
        try:
            nonce = bytes.fromhex(self.headers[_H_NONCE])
            ts = int(self.headers[_H_TIME])
            tag = bytes.fromhex(self.headers[_H_MAC])
        except (TypeError, ValueError):
            return self._refuse(401, "unauthenticated", "missing or malformed authentication")
        # 3. The tag, in constant time.
        if not verify_mac(srv.secret, tag, _REQUEST_CONTEXT, method.encode(),
                          self.path.encode("latin-1", "replace"), nonce, _ts_bytes(ts), body):
            return self._refuse(403, "bad-mac", "authentication failed (wrong secret key?)")
        # 4. Freshness; an authentic refusal is signed so the client can trust its clock.
        try:
            srv.guard.check(nonce, ts)
        except ReplayError as exc:
            return self._reply(403, nonce, str(exc).encode(),
                               error="stale" if exc.stale else "replay")
        # 5. Only now parse the request.
        parsed = self._parse_target()
        if parsed is None:
            return self._reply(400, nonce, b"bad path: expected /v1/kv/<scope>/<key>",
                               error="bad-request")
        scope, key, query = parsed
        if method == "PUT":
            srv.table.put(scope, key, body)
            return self._reply(200, nonce, b"")
        if method == "DELETE":
            found = srv.table.delete(scope, key)
            return self._reply(200 if found else 404, nonce, b"")
        try:
            wait_s = min(max(int(query.get("wait_ms", ["0"])[0]), 0) / 1000.0, MAX_WAIT_S)
        except ValueError:
            return self._reply(400, nonce, b"bad wait_ms", error="bad-request")
        value = srv.table.get(scope, key, wait_s)
        if value is None:
            return self._reply(404, nonce, b"")
        return self._reply(200, nonce, value)

    def _parse_target(self):
        target, _, query = self.path.partition("?")
        if not target.startswith(_PREFIX):
            return None
        segments = target[len(_PREFIX):].split("/")
        if len(segments) != 2:
            return None
        try:
            scope, key = (urllib.parse.unquote(s, errors="strict") for s in segments)
        except UnicodeDecodeError:
            return None
        if not scope or not key:
            return None
        return scope, key, urllib.parse.parse_qs(query)

    def _discard(self, length: int) -> None:
        while length > 0:
            chunk = self.rfile.read(min(length, 65536))
            if not chunk:
                break
            length -= len(chunk)

    def _refuse(self, status: int, error: str, text: str, close: bool = False) -> None:
        body = text.encode()
        self.send_response(status)
        self.send_header(_H_ERROR, error)
        self.send_header("Content-Length", str(len(body)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def _reply(self, status: int, nonce: bytes, body: bytes, error: str = "") -> None:
        ts = now_ms()
        self.send_response(status)
        self.send_header(_H_TIME, str(ts))
        self.send_header(_H_MAC, _response_tag(self.server.secret, nonce, status, ts,
                                               body).hex())
        if error:
            self.send_header(_H_ERROR, error)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _HTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # every worker connects at once at start-up

    def __init__(self, addr, secret, max_body, verbose, window_s):
        self.secret = secret
        self.max_body = max_body
        self.verbose = verbose
        self.guard = ReplayGuard(window_s)
        self.table = _Table()
        self._conns = set()
        self._conns_lock = threading.Lock()
        super().__init__(addr, _Handler)

    def track(self, conn, alive: bool) -> None:
        with self._conns_lock:
            (self._conns.add if alive else self._conns.discard)(conn)

    def close_connections(self) -> None:
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class KVStoreServer:
    """The rendezvous server, serving on a daemon thread.

    Args:
        secret: the job secret; every request must be authenticated with it.
        host: address to bind; ``"0.0.0.0"`` (all interfaces) for multi-host jobs,
            ``"127.0.0.1"`` for single-host ones. An address with ``:`` binds IPv6.
        port: 0 picks a free port.
        max_body: largest accepted value in bytes.
        window_s: accepted clock difference for request timestamps (replay window).
        verbose: log every request to stderr.
    """

    def __init__(self, secret: bytes, host: str = "0.0.0.0", port: int = 0,
                 max_body: int = DEFAULT_MAX_BODY, window_s: float = 300.0,
                 verbose: bool = False):
        self._secret = bytes(secret)
        self._host = host
        self._port = port
        self._max_body = max_body
        self._window_s = window_s
        self._verbose = verbose
        self._httpd: Optional[_HTTPServer] = None
        self._thread: Optional[threading.Thread] = None

    def start(self) -> int:
        """Binds, starts serving on a daemon thread and returns the bound port."""
        if self._httpd is not None:
            raise RuntimeError("KVStoreServer already started")

        class _Server(_HTTPServer):
            address_family = socket.AF_INET6 if ":" in self._host else socket.AF_INET

        self._httpd = _Server((self._host, self._port), self._secret, self._max_body,
                              self._verbose, self._window_s)
        self._port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        kwargs={"poll_interval": 0.1},
                                        name="sdl-kvstore", daemon=True)
        self._thread.start()
        return self._port

    def stop(self) -> None:
        """Stops serving and closes open connections; safe to call twice."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.table.close()
        httpd.shutdown()
        httpd.server_close()
        httpd.close_connections()
        if self._thread is not None:
            self._thread.join(timeout=5)

    @property
    def port(self) -> int:
        return self._port

    def _table(self) -> _Table:
        if self._httpd is None:
            raise RuntimeError("KVStoreServer is not running")
        return self._httpd.table

    def put(self, scope: str, key: str, value: bytes) -> None:
        """Stores a value directly (launcher side, no HTTP)."""
        self._table().put(scope, key, value)

    def get(self, scope: str, key: str, timeout: float = 0.0) -> Optional[bytes]:
        """Returns a value directly, waiting up to ``timeout`` seconds; None if absent."""
        return self._table().get(scope, key, timeout)

    def delete(self, scope: str, key: str) -> bool:
        """Removes a key directly; True if it existed."""
        return self._table().delete(scope, key)

    def __enter__(self) -> "KVStoreServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class KVStoreClient:
    """Client of :class:`KVStoreServer` over keep-alive connections.

    Sequential calls reuse one connection; concurrent calls from several threads each
    take their own (so a ``set`` never waits behind another thread's blocking ``get``).
    A dropped connection or a refused connect is retried with a fresh nonce until the
    call's deadline, so a worker may start before the server accepts connections.

    Args:
        addr, port: the server (``SDL_RENDEZVOUS_ADDR``, ``SDL_RENDEZVOUS_PORT``).
        secret: the job secret (raw bytes).
        timeout: default deadline in seconds of ``set`` and of ``get`` without timeout.
    """

    def __init__(self, addr: str, port: int, secret: bytes, timeout: float = 30.0):
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
        status, _ = self._request("PUT", _kv_path(scope, key), bytes(value),
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
        path = _kv_path(scope, key)
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
        status, _ = self._request("DELETE", _kv_path(scope, key), b"",
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
        return _Response(resp.status, data, nonce, resp.getheader(_H_ERROR, ""),
                         resp.getheader(_H_TIME), resp.getheader(_H_MAC))

    def _check_response(self, resp: "_Response") -> None:
        try:
            ts = int(resp.ts_text)
            ok = verify_mac(self._secret, bytes.fromhex(resp.mac_hex), _RESPONSE_CONTEXT,
                            resp.nonce, str(resp.status).encode(), _ts_bytes(ts), resp.body)
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
    The default timeout is ``SDL_START_TIMEOUT`` when set, else 30 s.

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
        timeout = float(environ.get("SDL_START_TIMEOUT") or 30.0)
    return KVStoreClient(addr, port, secret_from_hex(key_hex), timeout=timeout)
