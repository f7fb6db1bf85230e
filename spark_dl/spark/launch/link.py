"""How the workers' output reaches the caller while a job runs, with or without a socket.

The job is coordinated by its task 0 (:mod:`~spark_dl.spark.launch.coordinator`), which
receives every worker's output. The caller (the process that called ``run``: a
``spark-submit`` driver, a notebook, a Spark Connect client) may or may not be reachable
from the executors, so task 0 routes that output (:class:`OutputRoute`), in order of
preference:

1. **live, over the caller link**: the caller runs a small :class:`CallerLink` service
   (authenticated with the job secret, like every service of the job) and ships its
   address inside the job; task 0 connects once at start (``hello``, a few seconds at
   most) and then sends output batches as they come. Classic sessions and Connect
   sessions whose server runs on the caller's machine always reach it.
2. **through a spool** (:class:`Spool`): when the link cannot be made (a Connect client
   the cluster cannot reach, ``SDL_SPARK_CALLER_LINK=off``) and the caller gave a spool,
   task 0 writes numbered pieces into it (the estimators' spool is a folder of the run
   in the Store), and the caller follows it (:class:`SpoolFollower`) every quarter second.
3. **in the result**: with neither, task 0 keeps the output (the last
   :data:`KEEP_BYTES`) and returns it in the job's rows; the caller prints it when the
   job ends. Nothing is lost short of that bound, and the executors' logs keep the rest.

Once the link breaks mid-job the route switches to the spool (or the result) for the
rest of the job, so output is never dropped because the caller went away.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

from spark_dl.spark.launch.service import Endpoint, ServiceClient, ServiceServer
from spark_dl.spark.launch.task.output import DriverOutput

__all__ = ["CallerLink", "OutputRoute", "Reports", "Spool", "SpoolFollower", "KEEP_BYTES",
           "coordinator_from_caller"]

#: Output kept for the job's result when it could not be sent while the job ran.
KEEP_BYTES = 8 << 20
# How long task 0 tries to reach the caller at start.
HELLO_TIMEOUT_S = 3.0
_LINK_LIMITS = {"output": 64 << 20, "report": 64 << 20}
# Task 0 tells the caller it is alive this often over the link (``beat``), so that the
# caller notices a task 0 whose host was cut off (see spark_run's TASK0_SILENT_S).
BEAT_S = 2.0
# A task gives up asking the caller link after this long without reaching it.
UNREACHABLE_S = 15.0
# Longest wait of one ``where`` call (the tasks' calls time out later than this).
MAX_WHERE_WAIT_S = 5.0
# The spool is written at most this often (pieces gather what came meanwhile).
_SPOOL_FLUSH_S = 0.5


class CallerLink:
    """The caller's end of the link: an authenticated service receiving output.

    Where the executors are sure to reach it (classic sessions, whose executors reach the
    driver anyway, and local masters) it also tells the tasks where task 0 listens
    (``coordinator`` from task 0, ``where`` from the others): faster than the barrier's
    ``allGather``, whose early callers wait for their next one-second tick.

    Args:
        secret: the job secret.
        hosts: addresses to bind.
        write: ``write(stream, data)``, the caller's output sink.
    """

    def __init__(self, secret: bytes, hosts: Sequence[str],
                 write: Callable[[str, bytes], None]):
        self._write = write
        self.contacted = threading.Event()
        # Task 0's connection (made by its hello) ended: its process is gone, or it closed
        # the link at its end. After a failed Spark job, the sign that task 0's process
        # (and so, through their stdin, its workers) ended.
        self.task0_gone = threading.Event()
        self._announced = threading.Event()
        # When task 0 last called (hello, output, report, coordinator, beat).
        self.last_heard: Optional[float] = None
        self._coordinator: dict = {}
        self.reports = Reports()
        self.server = ServiceServer("caller", secret, {"hello": self._hello,
                                                       "output": self._output,
                                                       "coordinator": self._set_coordinator,
                                                       "where": self._where,
                                                       "report": self._report,
                                                       "beat": self._heard},
                                    hosts=hosts, limits=_LINK_LIMITS,
                                    on_disconnect=self._disconnected)

    def start(self) -> List[Endpoint]:
        return self.server.start()

    def stop(self) -> None:
        self.server.stop()

    def _heard(self) -> None:
        self.last_heard = time.monotonic()

    def silent_s(self) -> float:
        """Seconds since task 0 last called; 0 before its hello."""
        return 0.0 if self.last_heard is None else time.monotonic() - self.last_heard

    def _hello(self) -> bool:
        self.server.tag("task0", True)
        self._heard()
        self.contacted.set()
        return True

    def _disconnected(self, tags: dict) -> None:
        if tags.get("task0"):
            self.task0_gone.set()

    def _output(self, stream: str, data: bytes) -> None:
        self._heard()
        self._write("stderr" if stream == "stderr" else "stdout", bytes(data))

    def _set_coordinator(self, endpoints=None, error: Optional[str] = None) -> None:
        self._heard()
        self.contacted.set()
        self._coordinator = {"endpoints": [(str(h), int(p)) for h, p in endpoints or ()]} \
            if error is None else {"error": str(error)}
        self._announced.set()

    def _report(self, kind: str, document: dict, cause: Optional[bytes] = None) -> None:
        self._heard()
        self.reports.add(kind, document, cause)

    def _where(self, wait_s: float) -> dict:
        """Long poll of a task: task 0's endpoints (or its error), else ``{}``."""
        self._announced.wait(min(max(float(wait_s), 0.0), MAX_WHERE_WAIT_S))
        return dict(self._coordinator)


class Reports:
    """What task 0 told the caller about the job while it ran, in case the Spark job
    fails before its rows arrive (an executor lost: Spark then kills task 0 too):
    ``plan`` (task index -> ``[rank, host]``) and ``outcome`` (the failure's document,
    :func:`~spark_dl.spark.launch.coordinator.error_document`, with the pickled cause)."""

    def __init__(self):
        self.plan: Dict[int, list] = {}
        self.outcome: Optional[dict] = None
        self.cause: Optional[bytes] = None

    def add(self, kind: str, document: dict, cause: Optional[bytes] = None) -> None:
        if kind == "plan":
            self.plan = {int(k): list(v) for k, v in dict(document).items()}
        elif kind == "outcome":
            self.outcome, self.cause = dict(document), cause


class Spool:
    """Numbered pieces of output that the coordinating task writes and the caller reads.

    A subclass stores named blobs somewhere both reach (the estimators: a folder of the
    run in the Store); it must pickle (it travels inside the job). Names sort in the
    order they were written; a blob appears whole or not at all.
    """

    def put(self, name: str, data: bytes) -> None:
        """Writes one blob (atomically)."""
        raise NotImplementedError

    def get(self, name: str) -> bytes:
        raise NotImplementedError

    def names(self) -> List[str]:
        """The names written so far (any order)."""
        raise NotImplementedError

    @staticmethod
    def piece_name(seq: int, stream: str) -> str:
        return f"{seq:08d}.{stream}"

    @staticmethod
    def parse_name(name: str) -> Optional[Tuple[int, str]]:
        seq, _, stream = name.partition(".")
        if not seq.isdigit() or stream not in ("stdout", "stderr", "started", "plan",
                                               "outcome"):
            return None
        return int(seq), stream


class SpoolFollower:
    """The caller's reader of a :class:`Spool`: new pieces, in order, each once."""

    def __init__(self, spool: Spool, write: Callable[[str, bytes], None]):
        self._spool = spool
        self._write = write
        self._next = 0
        self.started = False
        self.reports = Reports()

    def poll(self) -> None:
        """Writes the pieces that follow the last one written (stops at a gap: a piece
        still being written appears whole later)."""
        try:
            found = {}
            for name in self._spool.names():
                parsed = Spool.parse_name(name)
                if parsed is not None:
                    found[parsed[0]] = (name, parsed[1])
            while self._next in found:
                name, stream = found[self._next]
                if stream == "started":
                    self.started = True
                elif stream in ("plan", "outcome"):
                    self.reports.add(stream, json.loads(self._spool.get(name)))
                else:
                    self._write(stream, self._spool.get(name))
                self._next += 1
        except Exception:  # the store may be briefly unreachable: try again next time
            pass


class OutputRoute:
    """Task 0's side: sends output to the caller live, else spools or keeps it.

    Args:
        secret: the job secret.
        caller: the caller link's endpoints, or None (no link: ``off``, or no address).
        spool: where output goes when the link is down, or None.
        echo: also writes each batch here (the task's own stderr: the executor log).
    """

    def __init__(self, secret: bytes, caller: Optional[Sequence[Endpoint]],
                 spool: Optional[Spool], echo: Optional[Callable[[str, bytes], None]] = None):
        self._spool = spool
        self._echo = echo
        self._caller = list(caller or [])
        self._lock = threading.Lock()
        self._seq = 0
        self.kept: Deque[Tuple[int, str, bytes]] = collections.deque()
        self._kept_bytes = 0
        self.dropped_bytes = 0
        self._pending: List[Tuple[str, bytes]] = []
        self._client: Optional[ServiceClient] = None
        if caller:
            client = ServiceClient("caller", secret, caller, timeout=30.0,
                                   connect_timeout=HELLO_TIMEOUT_S)
            try:
                client.call("hello", timeout=HELLO_TIMEOUT_S)
                self._client = client
            except Exception:
                client.close()
        # Whether the link was ever up: only then does losing it say something about
        # this host's network (see caller_reachable).
        self._had_link = self._client is not None
        self._secret = secret
        self._sender = DriverOutput(self._send) if self._client is not None else None
        self._closed = threading.Event()
        if self._client is not None:
            threading.Thread(target=self._beat_loop, name="sdl-caller-beat",
                             daemon=True).start()
        if spool is not None:
            if self._client is None:
                self._put_piece("started", b"")
            threading.Thread(target=self._flush_loop, name="sdl-output-spool",
                             daemon=True).start()

    @property
    def live(self) -> bool:
        """Whether the caller link is up."""
        return self._client is not None

    def caller_reachable(self, timeout: float) -> Optional[bool]:
        """Whether the caller still answers (asked now on a connection of its own, within
        ``timeout``: the kept one may be held by a send that waits for its timeout); None
        when there never was a link to ask. After no answer the link is dropped: output and
        reports then take the spool (or the result) at once."""
        if not self._had_link:
            return None
        probe = ServiceClient("caller", self._secret, self._caller, timeout=timeout,
                              connect_timeout=timeout)
        try:
            probe.call("beat", timeout=timeout)
            return True
        except Exception:
            self._client = None  # a send still waiting on it fails by its own timeout
            return False
        finally:
            probe.close()

    def report(self, kind: str, document: dict, cause: Optional[bytes] = None) -> None:
        """Tells the caller ``plan`` or ``outcome`` (see :class:`Reports`), over the link
        or through the spool; best effort (the job's rows carry the outcome too)."""
        client = self._client
        if client is not None:
            try:
                client.call("report", kind=kind, document=document, cause=cause,
                            timeout=10.0)
                return
            except Exception:
                pass
        if self._spool is not None:
            with self._lock:
                self._flush_locked()
                self._put_piece(kind, json.dumps(document).encode())

    def announce(self, endpoints=None, error: Optional[str] = None) -> None:
        """Tells the caller link where task 0 listens (or why it could not start), for
        the other tasks' ``where``.

        Raises:
            ConnectionError: the link is down.
        """
        client = self._client
        if client is None:
            raise ConnectionError(
                f"task 0 cannot reach the caller's link at {self._caller} (a firewall "
                "between the executors and the Spark driver's host? choose the interface "
                "with nics=, or set SDL_SPARK_CALLER_LINK=off)")
        client.call("coordinator", endpoints=endpoints, error=error)

    def write(self, stream: str, data: bytes) -> None:
        """The driver service's output sink (any thread)."""
        if self._sender is not None:
            self._sender.put(stream, data)
        else:
            self._fallback(stream, data)

    def _send(self, stream: str, data: bytes) -> None:
        client = self._client
        if client is not None:
            try:
                client.call("output", stream=stream, data=data)
                return
            except Exception:
                self._client = None  # gone: the rest takes the fallback
                client.close()
        self._fallback(stream, data)

    def _fallback(self, stream: str, data: bytes) -> None:
        if self._echo is not None:
            self._echo(stream, data)
        with self._lock:
            if self._spool is not None:
                self._pending.append((stream, data))
                return
            self._seq += 1
            self.kept.append((self._seq, stream, data))
            self._kept_bytes += len(data)
            while self._kept_bytes > KEEP_BYTES and self.kept:
                _, _, old = self.kept.popleft()
                self._kept_bytes -= len(old)
                self.dropped_bytes += len(old)

    def _put_piece(self, stream: str, data: bytes) -> None:
        try:
            self._spool.put(Spool.piece_name(self._seq, stream), data)
        except Exception:  # the store failed: keep it for the result instead
            self.kept.append((self._seq, stream, data))
        self._seq += 1

    def _beat_loop(self) -> None:
        while not self._closed.wait(BEAT_S):
            client = self._client
            if client is None:
                return  # the link broke: the caller hears of it through its silence
            try:
                client.call("beat", timeout=BEAT_S * 2)
            except Exception:
                pass  # sends fail the same way and drop the link (see _send)

    def _flush_loop(self) -> None:
        while not self._closed.wait(_SPOOL_FLUSH_S):
            with self._lock:
                self._flush_locked()

    def _flush_locked(self) -> None:
        while self._pending:  # one piece per run of the same stream
            stream = self._pending[0][0]
            run = []
            while self._pending and self._pending[0][0] == stream:
                run.append(self._pending.pop(0)[1])
            self._put_piece(stream, b"".join(run))

    def close(self, timeout: float = 10.0) -> None:
        """Sends or spools what is pending (bounded), then closes the link."""
        if self._sender is not None:
            self._sender.close(timeout)
        self._closed.set()
        with self._lock:
            if self._spool is not None:
                self._flush_locked()
        if self._client is not None:
            self._client.close()


def coordinator_from_caller(secret: bytes, caller: Sequence[Endpoint], timeout: float,
                            unreachable_s: float = UNREACHABLE_S) -> dict:
    """A task's question to the caller link: where does task 0 listen? Returns
    ``{"endpoints": [...]}`` or ``{"error": text}``.

    Raises:
        TimeoutError: no answer within ``timeout`` seconds.
        ConnectionError: the link was unreachable for ``unreachable_s`` seconds.
    """
    deadline = time.monotonic() + timeout
    last_contact = time.monotonic()
    with ServiceClient("caller", secret, caller, timeout=MAX_WHERE_WAIT_S + 10.0) as client:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"task 0 did not say where it listens within {timeout:g} s")
            try:
                answer = client.call("where", wait_s=min(left, MAX_WHERE_WAIT_S))
                last_contact = time.monotonic()
            except ConnectionError as exc:
                if time.monotonic() - last_contact > unreachable_s:
                    raise ConnectionError(
                        f"the caller's link at {list(caller)} is unreachable from this "
                        f"executor ({exc}): a firewall between the executors and the "
                        "Spark driver's host? Choose the interface with nics=, or set "
                        "SDL_SPARK_CALLER_LINK=off") from None
                time.sleep(min(0.5, max(left, 0)))
                continue
            if answer:
                return answer
