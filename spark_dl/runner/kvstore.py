"""The rendezvous server: an authenticated key-value store over HTTP.

Workers meet here at start-up: each publishes what its peers need (addresses, ports) under
a scope and reads theirs, blocking until they appear. The launcher (``sdlrun``,
``spark_dl.spark.run``) runs :class:`KVStoreServer`; workers use the client,
:class:`spark_dl.rendezvous.client.KVStoreClient`. The wire protocol (paths, headers,
tags) is :mod:`spark_dl.rendezvous.protocol`.

The server refuses a body over its limit with 413 before reading it, a missing or
malformed tag with 401, a wrong tag with 403, a replayed or stale request with 403, and
parses the path only after all checks pass. Responses to authenticated requests carry the
server time and a tag bound to the request nonce.

Connections follow the rules of :mod:`spark_dl.rendezvous.admission`, as the Spark launch
services do: until its first authenticated request a connection is *pending*; it must
authenticate within ``auth_deadline_s`` of its accept, and a flood of pending connections
evicts the oldest ones (per peer and overall) instead of refusing new ones, so callers with
the secret are always served. Before authentication a request may hold only a small head
(:data:`MAX_HEAD_BYTES`) and a body read in chunks as it arrives; bodies over
:data:`FREE_BODY_BYTES` on pending connections share one budget
(:data:`PREAUTH_BODY_BUDGET`), past which they get 503. Every request must be complete
within ``request_timeout`` of its first byte (plus its length at 1 MiB/s), whatever
the pace of single reads, and an idle connection is closed after ``idle_timeout``
(clients reconnect).
"""

from __future__ import annotations

import http.server
import socket
import sys
import threading
import time
import urllib.parse
from typing import Dict, List, Optional, Tuple

from spark_dl.rendezvous.admission import (DEFAULT_AUTH_DEADLINE_S, DEFAULT_PER_PEER,
                                           DEFAULT_TOTAL, PendingConnections)
from spark_dl.rendezvous.protocol import (H_ERROR, H_MAC, H_NONCE, H_TIME, MAX_WAIT_S, PREFIX,
                                          REQUEST_CONTEXT, response_tag, ts_bytes)
from spark_dl.rendezvous.secret import ReplayError, ReplayGuard, now_ms, verify_mac

__all__ = ["KVStoreServer"]

DEFAULT_MAX_BODY = 16 * 1024 * 1024
# An over-limit body up to this size is read and dropped so that the connection stays
# usable; a larger one closes the connection unread.
_DRAIN_LIMIT = 1024 * 1024
# Request line and headers together, before the request is authenticated.
MAX_HEAD_BYTES = 8 * 1024
# A pending connection's body up to this size is read freely; larger ones draw on the
# shared budget (real values are addresses: a few hundred bytes).
FREE_BODY_BYTES = 4 * 1024
PREAUTH_BODY_BUDGET = 16 * 1024 * 1024
DEFAULT_IDLE_S = 60.0
DEFAULT_REQUEST_S = 60.0
_MIN_BODY_RATE = 1 << 20  # bytes per second a request's deadline allows for its body
_CHUNK = 64 * 1024


class _HeadTooLarge(Exception):
    """A request's head exceeded MAX_HEAD_BYTES before authentication."""


class _HeadLimit:
    """The handler's ``rfile``: counts the head's bytes (request line and headers) of
    each request and refuses more than :data:`MAX_HEAD_BYTES`."""

    def __init__(self, raw):
        self._raw = raw
        self.left = MAX_HEAD_BYTES

    def readline(self, size: int = -1) -> bytes:
        want = self.left + 1 if size is None or size < 0 else min(size, self.left + 1)
        line = self._raw.readline(want)
        self.left -= len(line)
        if self.left < 0:
            raise _HeadTooLarge()
        return line

    def read(self, size: int = -1) -> bytes:
        return self._raw.read(size)

    def peek(self, size: int = 1) -> bytes:
        return self._raw.peek(size)

    def close(self) -> None:
        self._raw.close()

    @property
    def closed(self) -> bool:
        return self._raw.closed


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
    server: "_HTTPServer"

    def setup(self):
        self.timeout = self.server.idle_s
        super().setup()
        self.rfile = _HeadLimit(self.rfile)
        self.server.track(self.connection, True)

    def finish(self):
        try:
            super().finish()
        finally:
            self.server.track(self.connection, False)

    def handle_one_request(self):
        srv = self.server
        try:
            # Idle between requests: wait for the next one's first byte.
            if not self.rfile.peek(1):
                self.close_connection = True
                return
        except (OSError, ValueError):  # idle past idle_s, reset, or closed by a sweep
            self.close_connection = True
            return
        self.rfile.left = MAX_HEAD_BYTES
        srv.begin_request(self.connection)
        try:
            super().handle_one_request()
        except _HeadTooLarge:
            self.close_connection = True
            srv.note_refusal("request head over its limit before authentication")
        except OSError:  # a stalled request closed at its deadline, or a reset
            self.close_connection = True
        finally:
            srv.end_request(self.connection)

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
        authenticated = srv.is_authenticated(self.connection)
        budget = 0 if authenticated or length <= FREE_BODY_BYTES else length
        if budget and not srv.take_budget(budget):
            return self._refuse(503, "busy", "too many unauthenticated request bodies in "
                                "flight; retry", close=True)
        try:
            srv.extend_request(self.connection, length / _MIN_BODY_RATE)
            body = self._read_body(length)
        finally:
            if budget:
                srv.return_budget(budget)
        if body is None:
            self.close_connection = True
            return
        # 2. Presence and form of the authentication headers.
        try:
            nonce = bytes.fromhex(self.headers[H_NONCE])
            ts = int(self.headers[H_TIME])
            tag = bytes.fromhex(self.headers[H_MAC])
        except (TypeError, ValueError):
            return self._refuse(401, "unauthenticated", "missing or malformed authentication")
        # 3. The tag, in constant time.
        if not verify_mac(srv.secret, tag, REQUEST_CONTEXT, method.encode(),
                          self.path.encode("latin-1", "replace"), nonce, ts_bytes(ts), body):
            return self._refuse(403, "bad-mac", "authentication failed (wrong secret key?)")
        # 4. Freshness; an authentic refusal is signed so the client can trust its clock.
        try:
            srv.guard.check(nonce, ts)
        except ReplayError as exc:
            return self._reply(403, nonce, str(exc).encode(),
                               error="stale" if exc.stale else "replay")
        srv.authenticated(self.connection)
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
        if not target.startswith(PREFIX):
            return None
        segments = target[len(PREFIX):].split("/")
        if len(segments) != 2:
            return None
        try:
            scope, key = (urllib.parse.unquote(s, errors="strict") for s in segments)
        except UnicodeDecodeError:
            return None
        if not scope or not key:
            return None
        return scope, key, urllib.parse.parse_qs(query)

    def _read_body(self, length: int) -> Optional[bytes]:
        """The body, read in chunks as it arrives (never allocated from the announced
        length alone); None if the connection ended first."""
        parts = []
        while length > 0:
            chunk = self.rfile.read(min(length, _CHUNK))
            if not chunk:
                return None
            parts.append(chunk)
            length -= len(chunk)
        return b"".join(parts)

    def _discard(self, length: int) -> None:
        while length > 0:
            chunk = self.rfile.read(min(length, 65536))
            if not chunk:
                break
            length -= len(chunk)

    def _refuse(self, status: int, error: str, text: str, close: bool = False) -> None:
        body = text.encode()
        self.send_response(status)
        self.send_header(H_ERROR, error)
        self.send_header("Content-Length", str(len(body)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def _reply(self, status: int, nonce: bytes, body: bytes, error: str = "") -> None:
        ts = now_ms()
        self.send_response(status)
        self.send_header(H_TIME, str(ts))
        self.send_header(H_MAC, response_tag(self.server.secret, nonce, status, ts,
                                               body).hex())
        if error:
            self.send_header(H_ERROR, error)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _HTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # every worker connects at once at start-up

    def __init__(self, addr, secret, max_body, verbose, window_s, pending: PendingConnections,
                 idle_s: float, request_s: float):
        self.secret = secret
        self.max_body = max_body
        self.verbose = verbose
        self.guard = ReplayGuard(window_s)
        self.table = _Table()
        self.pending = pending
        self.idle_s = idle_s
        self.request_s = request_s
        self.refused = 0  # requests closed unanswered (head too large, stalled, evicted)
        self._conns = set()
        self._conns_lock = threading.Lock()
        self._busy: Dict[socket.socket, float] = {}  # request in progress -> deadline
        self._authed: set = set()  # connections that made an authenticated request
        self._budget = PREAUTH_BODY_BUDGET
        super().__init__(addr, _Handler)

    # ---- admission: the accept thread and its periodic sweep ----------------------------

    def process_request(self, request, client_address):
        for victim in self.pending.admit(request, client_address[0]):
            _close_socket(victim)
        super().process_request(request, client_address)

    def service_actions(self):
        """Called by serve_forever every poll: closes pending connections past their
        deadline and requests not complete by theirs."""
        victims: List[socket.socket] = list(self.pending.expired())
        now = time.monotonic()
        with self._conns_lock:
            late = [c for c, deadline in self._busy.items() if deadline < now]
            for conn in late:
                del self._busy[conn]
        self.refused += len(late)
        for conn in victims + late:
            _close_socket(conn)

    def handle_error(self, request, client_address):
        if self.verbose:
            super().handle_error(request, client_address)

    def is_authenticated(self, conn) -> bool:
        with self._conns_lock:
            return conn in self._authed

    def authenticated(self, conn) -> None:
        self.pending.authenticated(conn)
        with self._conns_lock:
            self._authed.add(conn)

    def begin_request(self, conn) -> None:
        with self._conns_lock:
            self._busy[conn] = time.monotonic() + self.request_s

    def extend_request(self, conn, seconds: float) -> None:
        with self._conns_lock:
            if conn in self._busy:
                self._busy[conn] += seconds

    def end_request(self, conn) -> None:
        with self._conns_lock:
            self._busy.pop(conn, None)

    def take_budget(self, n: int) -> bool:
        with self._conns_lock:
            if n > self._budget:
                return False
            self._budget -= n
            return True

    def return_budget(self, n: int) -> None:
        with self._conns_lock:
            self._budget += n

    def note_refusal(self, why: str) -> None:
        self.refused += 1
        if self.verbose:
            sys.stderr.write(f"sdlrun: rendezvous: refused a request: {why}\n")

    def track(self, conn, alive: bool) -> None:
        with self._conns_lock:
            (self._conns.add if alive else self._conns.discard)(conn)
            if not alive:
                self._authed.discard(conn)
        if not alive:
            self.pending.discard(conn)

    def close_connections(self) -> None:
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _close_socket(conn: socket.socket) -> None:
    """Ends a connection its handler thread is blocked on (the thread then finishes)."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class KVStoreServer:
    """The rendezvous server, serving on a daemon thread.

    Args:
        secret: the job secret; every request must be authenticated with it.
        host: address to bind: ``"127.0.0.1"`` for single-host jobs, else the
            launcher's address on the job's network (:mod:`spark_dl.runner.network`);
            ``"0.0.0.0"`` (all interfaces, the default) only where a caller wants it. An
            address with ``:`` binds IPv6.
        port: 0 picks a free port.
        max_body: largest accepted value in bytes.
        window_s: accepted clock difference for request timestamps (replay window).
        verbose: log every request to stderr.
        idle_timeout: seconds an idle connection is kept between requests.
        request_timeout: seconds one request may take from its first byte (plus its body
            length at 1 MiB/s).
        auth_deadline_s: seconds a new connection has to make an authenticated request.
        max_pending, max_pending_per_peer: bounds on connections that did not
            authenticate yet; the oldest are evicted past them.
    """

    def __init__(self, secret: bytes, host: str = "0.0.0.0", port: int = 0,
                 max_body: int = DEFAULT_MAX_BODY, window_s: float = 300.0,
                 verbose: bool = False, idle_timeout: float = DEFAULT_IDLE_S,
                 request_timeout: float = DEFAULT_REQUEST_S,
                 auth_deadline_s: float = DEFAULT_AUTH_DEADLINE_S,
                 max_pending: int = DEFAULT_TOTAL,
                 max_pending_per_peer: int = DEFAULT_PER_PEER):
        self._idle_s = idle_timeout
        self._request_s = request_timeout
        self._pending_args = (max_pending_per_peer, max_pending, auth_deadline_s)
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
                              self._verbose, self._window_s,
                              PendingConnections(*self._pending_args), self._idle_s,
                              self._request_s)
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

    @property
    def pending(self) -> PendingConnections:
        """The connections that did not authenticate yet (counters for diagnostics)."""
        if self._httpd is None:
            raise RuntimeError("KVStoreServer is not running")
        return self._httpd.pending

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
