"""Authenticated request/response services: the wire protocol of the Spark launch layer.

The driver service (in the Spark driver) and the task services (one per barrier task)
are instances of :class:`ServiceServer`; workers, task services and the driver talk to
them through :class:`ServiceClient`. A connection carries requests one after the other.

Wire format. A request is one frame made by :func:`spark_dl.rendezvous.secret.seal`: magic,
nonce, timestamp, payload length, HMAC-SHA256 tag, payload. The tag covers a context
naming the service and the direction (``sdl-spark/<service>/request``), so a frame made
for one service or direction never passes as another. The payload is the pickled pair
``(method, kwargs)``. The answer is a frame sealed under the context
``sdl-spark/<service>/response`` followed by the request's nonce, so an answer is bound to
the request it answers (an old answer cannot be replayed to a new request); its payload
is the pickled pair ``(status, value)``.

The server checks every request, in this order, before anything in it is deserialized:

1. the magic and the announced length (over ``max_request``: refused unread);
2. the tag, in constant time;
3. freshness: timestamp inside the replay window and nonce never seen before.

A frame failing 1 or 2, a replayed frame, or a connection that stalls inside a frame is
answered with nothing: the connection is closed, and the service keeps serving every
other connection. Only an authentic request whose timestamp is outside the window gets an
(authenticated) ``stale`` answer carrying the server's clock, from which the client
corrects its offset and retries once.

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
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

from spark_dl.rendezvous.secret import (NONCE_BYTES, SEAL_HEADER_BYTES, AuthenticationError,
                                        ReplayError, ReplayGuard, now_ms, seal, unseal_from)

__all__ = ["ServiceServer", "ServiceClient", "ServiceError", "RemoteCallError",
           "Endpoint", "request_context", "response_context"]

Endpoint = Tuple[str, int]

DEFAULT_MAX_REQUEST = 64 * 1024 * 1024
DEFAULT_MAX_RESPONSE = 1024 * 1024 * 1024
DEFAULT_WINDOW_S = 300.0
# The nonce sits right after the 4-byte magic in a sealed frame's header.
_NONCE_AT = 4


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


class _Closed(EOFError):
    """The peer closed the connection between two frames (a clean end)."""


def _recv_exact(sock: socket.socket, n: int, first: bool = False) -> bytes:
    """Reads exactly n bytes. ``first``: at a frame boundary, where a close or an idle
    timeout before any byte ends the connection cleanly (:class:`_Closed`)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got)
        except socket.timeout:
            if first and got == 0:
                raise _Closed() from None  # an idle kept-alive connection
            raise
        if k == 0:
            if first and got == 0:
                raise _Closed()
            raise EOFError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def _read_frame(sock: socket.socket, secret: bytes, context_of: Callable[[bytes], bytes],
                guard: Optional[ReplayGuard], max_payload: int) -> Tuple[bytes, bytes]:
    """Reads one sealed frame; returns (nonce, payload). ``context_of(nonce)`` gives the
    MAC context (requests: fixed; responses: bound to the request nonce)."""
    header = _recv_exact(sock, SEAL_HEADER_BYTES, first=True)
    nonce = header[_NONCE_AT:_NONCE_AT + NONCE_BYTES]
    served = [header]

    def read_exact(n: int) -> bytes:
        if served:
            return served.pop()  # the header, already read to learn the nonce
        return _recv_exact(sock, n)

    try:
        return nonce, unseal_from(read_exact, secret, context_of(nonce), guard, max_payload)
    except ReplayError as exc:
        exc.nonce = nonce  # an authentic stale request is answered, bound to its nonce
        raise


class ServiceServer:
    """Serves authenticated requests on the given addresses, one thread per connection.

    Args:
        name: the service name, part of every MAC context (``"driver"``, ``"task"``).
        secret: the job secret.
        handlers: ``method -> callable(**kwargs)``; its return value is the answer. A
            handler that raises answers a :class:`RemoteCallError` to the caller.
        hosts: addresses to bind, each on its own free port (see :attr:`endpoints`).
        max_request: largest accepted request payload, in bytes.
        window_s: replay window (accepted clock difference) in seconds.
        read_timeout: a connection idle or stalled this long inside a frame is closed.
        max_connections: further connections are closed at once while this many are open.
        log: receives diagnostics (refused frames); None: silent.
    """

    def __init__(self, name: str, secret: bytes, handlers: Mapping[str, Callable[..., Any]],
                 hosts: Sequence[str] = ("127.0.0.1",), max_request: int = DEFAULT_MAX_REQUEST,
                 window_s: float = DEFAULT_WINDOW_S, read_timeout: float = 60.0,
                 max_connections: int = 256, log: Optional[Callable[[str], None]] = None):
        self.name = name
        self._secret = bytes(secret)
        self._handlers = dict(handlers)
        self._hosts = list(hosts)
        self._max_request = max_request
        self._guard = ReplayGuard(window_s)
        self._read_timeout = read_timeout
        self._max_connections = max_connections
        self._log = log
        self._context = request_context(name)
        self._listeners: List[socket.socket] = []
        self._conns: set = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.endpoints: List[Endpoint] = []
        self.rejected = 0  # frames refused (bad length/tag, replay, truncation)

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
        self._thread = threading.Thread(target=self._accept_loop,
                                        name=f"sdl-{self.name}-service", daemon=True)
        self._thread.start()
        return list(self.endpoints)

    def stop(self) -> None:
        """Stops accepting, closes open connections; safe to call twice."""
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
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

    def _accept_loop(self) -> None:
        with selectors.DefaultSelector() as selector:
            for sock in self._listeners:
                selector.register(sock, selectors.EVENT_READ)
            while not self._stopping.is_set():
                for key, _ in selector.select(timeout=0.1):
                    try:
                        conn, _addr = key.fileobj.accept()
                    except BlockingIOError:
                        continue
                    except OSError:  # e.g. out of file descriptors: do not spin
                        time.sleep(0.05)
                        continue
                    with self._lock:
                        full = len(self._conns) >= self._max_connections
                        if not full:
                            self._conns.add(conn)
                    if full:
                        conn.close()
                        continue
                    threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                     name=f"sdl-{self.name}-conn").start()

    def _refuse(self, why: str) -> None:
        with self._lock:
            self.rejected += 1
        if self._log is not None:
            self._log(f"{self.name} service: refused a request: {why}")

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setblocking(True)
            conn.settimeout(self._read_timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while not self._stopping.is_set():
                try:
                    nonce, payload = _read_frame(conn, self._secret, lambda _n: self._context,
                                                 self._guard, self._max_request)
                except _Closed:
                    return
                except EOFError as exc:
                    self._refuse(f"truncated frame ({exc})")
                    return
                except socket.timeout:
                    self._refuse("connection stalled inside a frame past the read timeout")
                    return
                except ReplayError as exc:
                    if exc.stale:
                        # Authentic (the tag passed): tell the client our clock.
                        self._reply(conn, exc.nonce, ("stale", now_ms()))
                        continue
                    self._refuse(str(exc))
                    return
                except AuthenticationError as exc:
                    self._refuse(str(exc))
                    return
                self._reply(conn, nonce, self._dispatch(payload))
        except OSError:
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _dispatch(self, payload: bytes) -> Tuple[str, Any]:
        try:
            method, kwargs = pickle.loads(payload)
            handler = self._handlers.get(method)
            if handler is None:
                return "error", f"unknown method {method!r} of the {self.name} service"
            return "ok", handler(**kwargs)
        except Exception as exc:  # the caller gets the reason, the service keeps serving
            return "error", f"{type(exc).__name__}: {exc}"

    def _reply(self, conn: socket.socket, nonce: bytes, answer: Tuple[str, Any]) -> None:
        conn.sendall(seal(self._secret, pickle.dumps(answer, protocol=4),
                          response_context(self.name, nonce)))


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
            status, value = self._exchange(payload, self.timeout if timeout is None else timeout)
            if status == "stale":
                # The tag passed but our clock is off: learn the offset and retry once.
                self._clock_offset_ms = int(value) - now_ms()
                status, value = self._exchange(payload, self.timeout)
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

    def _exchange(self, payload: bytes, timeout: float) -> Tuple[str, Any]:
        deadline = time.monotonic() + timeout
        for attempt in (0, 1):
            reused = self._sock is not None
            if not reused:
                self._sock = self._connect(deadline)
            sock = self._sock
            frame = seal(self._secret, payload, request_context(self.name),
                         timestamp_ms=now_ms() + self._clock_offset_ms)
            sent_nonce = frame[_NONCE_AT:_NONCE_AT + NONCE_BYTES]
            try:
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                sock.sendall(frame)
                nonce, answer = _read_frame(
                    sock, self._secret, lambda n: response_context(self.name, sent_nonce),
                    None, self._max_response)
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
