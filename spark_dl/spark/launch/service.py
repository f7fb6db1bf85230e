"""Authenticated request/response services: the wire protocol of the Spark launch layer.

The driver service (in the Spark driver) and the task services (one per barrier task)
are instances of :class:`ServiceServer`; workers, task services and the driver talk to
them through :class:`ServiceClient`. A connection carries requests one after the other.

Wire format: frames of :mod:`spark_dl.rendezvous.frames`, whose fixed-size header (nonce,
timestamp, payload length, kind, tag) is authenticated before the body is read. A
request's kind is the method called, its context ``sdl-spark/<service>/request`` (so a
frame made for one service or direction never passes as another), its payload the pickled
pair ``(method, kwargs)``. The answer is a frame of kind ``response`` sealed under the
context ``sdl-spark/<service>/response`` followed by the request's nonce, so an answer is
bound to the request it answers; its payload is the pickled pair ``(status, value)``.

The server checks every request, in this order, before it reads the body:

1. the header's magic and tag (constant time);
2. freshness: timestamp inside the replay window and nonce never seen before;
3. the announced length against the limit of the method (``limits``; ``max_request``
   for the others);

then reads the body (allocated as it arrives) and checks its tag. Only then is the
payload unpickled. A frame failing a check, a replayed frame, or a frame not complete by
its deadline is answered with nothing: the connection is closed, and the service keeps
serving every other connection. Only an authentic request whose timestamp is outside the
window gets an (authenticated) ``stale`` answer carrying the server's clock, from which the
client corrects its offset and retries once.

Connections (see :mod:`spark_dl.rendezvous.admission`). Until its first request header
authenticates, a connection is *pending*: it is read by the accept thread alone, without
a thread of its own, into a buffer of one header (under 100 bytes); it must authenticate
within ``auth_deadline_s`` of its accept, and a flood of pending connections evicts the
oldest ones (per peer and overall) rather than refusing new ones. Authenticated
connections get a thread each and are never refused. Every frame has one deadline,
``read_timeout`` from its first byte plus its length at
:data:`~spark_dl.rendezvous.frames.MIN_BODY_RATE`: a peer trickling bytes cannot hold a
frame open past it. An authenticated connection idle for ``read_timeout`` between frames
is closed (clients reconnect).

Pickle is used only after authentication: only holders of the job's secret can make the
server unpickle anything, which is the same trust every worker already has (it runs the
job's pickled function).
"""

from __future__ import annotations

import pickle
import selectors
import socket
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from spark_dl.rendezvous.admission import (DEFAULT_AUTH_DEADLINE_S, DEFAULT_PER_PEER,
                                           DEFAULT_TOTAL, PendingConnections)
from spark_dl.rendezvous.frames import (HEADER_BYTES, Deadline, FrameClosed, FrameHeader,
                                        FrameTimeout, header_nonce, open_header, read_body,
                                        read_frame, seal_frame)
from spark_dl.rendezvous.secret import (AuthenticationError, ReplayError, ReplayGuard,
                                        new_nonce, now_ms)

__all__ = ["ServiceServer", "ServiceClient", "ServiceError", "RemoteCallError",
           "Endpoint", "request_context", "response_context"]

Endpoint = Tuple[str, int]

DEFAULT_MAX_REQUEST = 64 * 1024
DEFAULT_MAX_RESPONSE = 1024 * 1024 * 1024
DEFAULT_WINDOW_S = 300.0
RESPONSE_KIND = "response"


def request_context(service: str) -> bytes:
    """The MAC context of requests to ``service`` (e.g. ``"driver"``)."""
    return f"sdl-spark/{service}/request".encode()


def response_context(service: str, request_nonce: bytes) -> bytes:
    """The MAC context of the answer to the request that carried ``request_nonce``."""
    return f"sdl-spark/{service}/response/".encode() + request_nonce


class ServiceError(ConnectionError):
    """A service could not be reached, or its answer failed authentication."""


class RemoteCallError(RuntimeError):
    """The service received the request and its handler raised; the message says why."""


class _Pending:
    """A pending connection's header bytes so far, read by the accept thread."""

    __slots__ = ("conn", "buf", "deadline")

    def __init__(self, conn: socket.socket, deadline: Deadline):
        self.conn = conn
        self.buf = b""
        self.deadline = deadline  # of the first frame (its body extends it)


_WAKE = object()  # selector data of the stop() wake-up socket


class ServiceServer:
    """Serves authenticated requests on the given addresses.

    Args:
        name: the service name, part of every MAC context (``"driver"``, ``"task"``).
        secret: the job secret.
        handlers: ``method -> callable(**kwargs)``; its return value is the answer. A
            handler that raises answers a :class:`RemoteCallError` to the caller.
        hosts: addresses to bind, each on its own free port (see :attr:`endpoints`).
        max_request: largest accepted request payload, in bytes, of a method without
            an entry in ``limits``.
        limits: ``method -> largest accepted payload`` in bytes.
        window_s: replay window (accepted clock difference) in seconds.
        read_timeout: deadline of one frame from its first byte (plus its length at
            :data:`~spark_dl.rendezvous.frames.MIN_BODY_RATE`); also how long an
            authenticated connection may stay idle between frames.
        auth_deadline_s: a new connection must send an authentic request header within
            this long (default: the smaller of 10 s and ``read_timeout``).
        max_pending, max_pending_per_peer: bounds on connections that did not
            authenticate yet; the oldest are evicted past them.
        log: receives diagnostics (refused frames); None: silent.
        on_disconnect: called with a connection's tags (see :meth:`tag`) when a tagged
            connection ends, for whatever reason (the peer closed it or died).
    """

    def __init__(self, name: str, secret: bytes, handlers: Mapping[str, Callable[..., Any]],
                 hosts: Sequence[str] = ("127.0.0.1",), max_request: int = DEFAULT_MAX_REQUEST,
                 limits: Optional[Mapping[str, int]] = None,
                 window_s: float = DEFAULT_WINDOW_S, read_timeout: float = 60.0,
                 auth_deadline_s: Optional[float] = None,
                 max_pending: int = DEFAULT_TOTAL, max_pending_per_peer: int = DEFAULT_PER_PEER,
                 log: Optional[Callable[[str], None]] = None,
                 on_disconnect: Optional[Callable[[Dict[str, Any]], None]] = None):
        self.name = name
        self._on_disconnect = on_disconnect
        self._local = threading.local()  # the tags of the connection a thread serves
        self._secret = bytes(secret)
        self._handlers = dict(handlers)
        self._hosts = list(hosts)
        self._max_request = max_request
        self._limits: Dict[str, int] = dict(limits or {})
        self._guard = ReplayGuard(window_s)
        self._read_timeout = read_timeout
        if auth_deadline_s is None:
            auth_deadline_s = min(DEFAULT_AUTH_DEADLINE_S, read_timeout)
        self._pending = PendingConnections(max_pending_per_peer, max_pending, auth_deadline_s)
        self._log = log
        self._context = request_context(name)
        self._listeners: List[socket.socket] = []
        self._conns: set = set()  # authenticated connections (served by threads)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: Optional[threading.Thread] = None
        # stop() writes a byte here so that the accept loop leaves select() at once
        # (its timeout only paces the expiry of unauthenticated connections).
        self._wake: Optional[Tuple[socket.socket, socket.socket]] = None
        self.endpoints: List[Endpoint] = []
        self.rejected = 0  # frames refused (bad header/tag, replay, truncation, stall)

    @property
    def pending(self) -> PendingConnections:
        """The connections that did not authenticate yet (counters for diagnostics)."""
        return self._pending

    def tag(self, key: str, value: Any) -> None:
        """From a handler: attaches ``key=value`` to the connection it is serving, so
        that ``on_disconnect`` learns whose connection ended (e.g. a task's)."""
        tags = getattr(self._local, "tags", None)
        if tags is not None:
            tags[key] = value

    def _limit_of(self, kind: str) -> int:
        return self._limits.get(kind, self._max_request)

    def start(self) -> List[Endpoint]:
        """Binds every host and starts serving; returns the bound ``(host, port)`` list."""
        for host in self._hosts:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, 0))
                sock.listen(128)
            except OSError as exc:
                sock.close()
                self.stop()
                raise OSError(f"{self.name} service cannot listen on {host}: {exc}") from exc
            sock.setblocking(False)
            self._listeners.append(sock)
            self.endpoints.append((host, sock.getsockname()[1]))
        self._wake = socket.socketpair()
        for end in self._wake:
            end.setblocking(False)
        self._thread = threading.Thread(target=self._accept_loop,
                                        name=f"sdl-{self.name}-service", daemon=True)
        self._thread.start()
        return list(self.endpoints)

    def stop(self) -> None:
        """Stops accepting, closes open connections; safe to call twice."""
        self._stopping.set()
        wake, self._wake = self._wake, None
        if wake is not None:
            try:
                wake[1].send(b"x")
            except OSError:
                pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if wake is not None:
            for end in wake:
                end.close()
        for sock in self._listeners:
            sock.close()
        self._listeners = []
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def __enter__(self) -> "ServiceServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- the accept thread: listeners and pending connections ---------------------------

    def _accept_loop(self) -> None:
        pending: Dict[socket.socket, _Pending] = {}
        with selectors.DefaultSelector() as selector:
            def drop(conn: socket.socket, why: Optional[str]) -> None:
                state = pending.pop(conn, None)
                if state is None:
                    return
                if why is not None:
                    self._refuse(why)  # counted before the peer can see the close
                self._pending.discard(conn)
                selector.unregister(conn)
                conn.close()

            for sock in self._listeners:
                selector.register(sock, selectors.EVENT_READ, None)
            wake = self._wake
            if wake is not None:
                selector.register(wake[0], selectors.EVENT_READ, _WAKE)
            while not self._stopping.is_set():
                for key, _ in selector.select(timeout=0.1):
                    if key.data is _WAKE:
                        continue  # stop() woke us: the loop condition ends it
                    if key.data is None:
                        self._accept(key.fileobj, selector, pending, drop)
                    else:
                        self._read_pending(key.data, selector, pending, drop)
                for conn in self._pending.expired():
                    state = pending.get(conn)
                    drop(conn, None if state is None or not state.buf else
                         "connection stalled inside its first frame header past the deadline")
            for conn in list(pending):
                drop(conn, None)

    def _accept(self, listener, selector, pending, drop) -> None:
        try:
            conn, addr = listener.accept()
        except BlockingIOError:
            return
        except OSError:
            # Out of file descriptors: make room by closing the oldest pending connection.
            victims = self._pending.expired() or list(pending)[:1]
            for victim in victims:
                drop(victim, None)
            time.sleep(0.01)
            return
        conn.setblocking(False)
        for victim in self._pending.admit(conn, addr[0]):
            drop(victim, None)
        state = _Pending(conn, Deadline(self._read_timeout))
        pending[conn] = state
        selector.register(conn, selectors.EVENT_READ, state)

    def _read_pending(self, state: _Pending, selector, pending, drop) -> None:
        conn = state.conn
        try:
            data = conn.recv(HEADER_BYTES - len(state.buf))
        except BlockingIOError:
            return
        except OSError:
            drop(conn, None)
            return
        if not data:
            drop(conn, f"truncated frame ({len(state.buf)} of {HEADER_BYTES} header bytes)"
                 if state.buf else None)
            return
        state.buf += data
        if len(state.buf) < HEADER_BYTES:
            return
        try:
            header = open_header(state.buf, self._secret, self._context, self._guard,
                                 self._limit_of)
        except ReplayError as exc:
            if exc.stale:
                self._answer_stale(conn, state.buf)
                drop(conn, None)
            else:
                drop(conn, str(exc))
            return
        except AuthenticationError as exc:
            drop(conn, str(exc))
            return
        # Authentic: the connection leaves the pending set for a thread of its own.
        pending.pop(conn)
        selector.unregister(conn)
        if not self._pending.authenticated(conn):
            conn.close()
            return
        with self._lock:
            self._conns.add(conn)
        threading.Thread(target=self._serve, args=(conn, header, state.deadline), daemon=True,
                         name=f"sdl-{self.name}-conn").start()

    def _answer_stale(self, conn: socket.socket, raw_header: bytes) -> None:
        # Authentic (the tag passed) but outside the window: tell the client our clock,
        # bound to its nonce; the body stays unread and the connection is closed.
        nonce = header_nonce(raw_header)
        try:
            conn.setblocking(True)
            conn.settimeout(1.0)
            self._reply(conn, nonce, ("stale", now_ms()))
        except OSError:
            pass

    def _refuse(self, why: str) -> None:
        with self._lock:
            self.rejected += 1
        if self._log is not None:
            self._log(f"{self.name} service: refused a request: {why}")

    # ---- authenticated connections: one thread each ------------------------------------

    def _serve(self, conn: socket.socket, header: FrameHeader, deadline: Deadline) -> None:
        self._local.tags = tags = {}
        try:
            conn.setblocking(True)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while not self._stopping.is_set():
                try:
                    if header is None:
                        header, payload = read_frame(
                            conn, self._secret, self._context, self._guard, self._limit_of,
                            frame_s=self._read_timeout, idle_s=self._read_timeout)
                    else:
                        payload = read_body(conn, header, self._secret, self._context,
                                            deadline)
                except FrameClosed:
                    return
                except FrameTimeout as exc:
                    self._refuse(f"connection stalled inside a frame past its deadline ({exc})")
                    return
                except EOFError as exc:
                    self._refuse(f"truncated frame ({exc})")
                    return
                except ReplayError as exc:
                    if not exc.stale:
                        self._refuse(str(exc))
                    # A stale frame on a kept-alive connection: the client retries on a
                    # fresh one, whose first header is answered with our clock.
                    return
                except AuthenticationError as exc:
                    self._refuse(str(exc))
                    return
                self._reply(conn, header.nonce, self._dispatch(header.kind, payload))
                header = None
        except OSError:
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()
            if tags and self._on_disconnect is not None and not self._stopping.is_set():
                try:
                    self._on_disconnect(dict(tags))
                except Exception:  # a diagnostic hook must not break the service
                    pass

    def _dispatch(self, kind: str, payload: bytes) -> Tuple[str, Any]:
        try:
            method, kwargs = pickle.loads(payload)
            if method != kind:
                return "error", (f"request for {method!r} framed as {kind!r} (a client of "
                                 "another spark_dl version?)")
            handler = self._handlers.get(method)
            if handler is None:
                return "error", f"unknown method {method!r} of the {self.name} service"
            return "ok", handler(**kwargs)
        except Exception as exc:  # the caller gets the reason, the service keeps serving
            return "error", f"{type(exc).__name__}: {exc}"

    def _reply(self, conn: socket.socket, nonce: bytes, answer: Tuple[str, Any]) -> None:
        conn.sendall(seal_frame(self._secret, response_context(self.name, nonce),
                                RESPONSE_KIND, pickle.dumps(answer, protocol=4)))


class ServiceClient:
    """Calls one service; thread-safe (calls are serialized on one kept-alive connection).

    Args:
        name: the service's name (as given to its :class:`ServiceServer`).
        secret: the job secret.
        endpoints: ``(host, port)`` pairs of the service, tried in order on connect.
        timeout: seconds one call may take (connect, send and answer).
        connect_timeout: seconds per connection attempt.
        max_response: larger answers are refused unread.
    """

    def __init__(self, name: str, secret: bytes, endpoints: Sequence[Endpoint],
                 timeout: float = 30.0, connect_timeout: float = 5.0,
                 max_response: int = DEFAULT_MAX_RESPONSE):
        if not endpoints:
            raise ValueError(f"no endpoints for the {name} service")
        self.name = name
        self.endpoints = [(str(h), int(p)) for h, p in endpoints]
        self.timeout = timeout
        self._connect_timeout = connect_timeout
        self._secret = bytes(secret)
        self._max_response = max_response
        self._sock: Optional[socket.socket] = None
        self._lock = threading.Lock()
        self._clock_offset_ms = 0

    def call(self, method: str, timeout: Optional[float] = None, **kwargs) -> Any:
        """Sends one request and returns the handler's answer.

        Raises:
            ServiceError: unreachable, connection lost, or an answer that failed
                authentication.
            RemoteCallError: the handler raised.
        """
        payload = pickle.dumps((method, kwargs), protocol=4)
        with self._lock:
            status, value = self._exchange(method, payload,
                                           self.timeout if timeout is None else timeout)
            if status == "stale":
                # The tag passed but our clock is off: learn the offset and retry once.
                self._clock_offset_ms = int(value) - now_ms()
                status, value = self._exchange(method, payload, self.timeout)
        if status == "ok":
            return value
        if status == "error":
            raise RemoteCallError(f"{self.name} service: {method}: {value}")
        raise ServiceError(f"{self.name} service refused {method}: clocks differ too much")

    def close(self) -> None:
        with self._lock:
            self._drop()

    def __enter__(self) -> "ServiceClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _connect(self, deadline: float) -> socket.socket:
        errors = []
        for host, port in self.endpoints:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                sock = socket.create_connection((host, port),
                                                timeout=min(self._connect_timeout, left))
            except OSError as exc:
                errors.append(f"{host}:{port}: {exc}")
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        raise ServiceError(f"cannot reach the {self.name} service at "
                           + ", ".join(errors or [f"{h}:{p}" for h, p in self.endpoints]))

    def _exchange(self, method: str, payload: bytes, timeout: float) -> Tuple[str, Any]:
        deadline = time.monotonic() + timeout
        for attempt in (0, 1):
            reused = self._sock is not None
            if not reused:
                self._sock = self._connect(deadline)
            sock = self._sock
            nonce = new_nonce()
            frame = seal_frame(self._secret, request_context(self.name), method, payload,
                               nonce=nonce, timestamp_ms=now_ms() + self._clock_offset_ms)
            try:
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                sock.sendall(frame)
                _header, answer = read_frame(
                    sock, self._secret, response_context(self.name, nonce), None,
                    lambda _kind: self._max_response,
                    frame_s=max(0.001, deadline - time.monotonic()))
            except (EOFError, ConnectionError) as exc:
                self._drop()
                # A kept-alive connection may have been closed by the server while idle
                # (it reads nothing before closing): retry once on a fresh one.
                if reused and attempt == 0:
                    continue
                raise ServiceError(f"connection to the {self.name} service lost: {exc}") from exc
            except (OSError, AuthenticationError) as exc:
                self._drop()
                raise ServiceError(f"{self.name} service call failed: {exc}") from exc
            return pickle.loads(answer)
        raise AssertionError("unreachable")  # pragma: no cover


def log_to_stderr(prefix: str) -> Callable[[str], None]:
    """A ``log`` callable for :class:`ServiceServer` writing ``prefix: text`` lines."""
    def log(text: str) -> None:
        sys.stderr.write(f"{prefix}: {text}\n")
        sys.stderr.flush()
    return log
