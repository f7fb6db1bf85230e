"""Attacks on the launch services by a peer without the secret, against real services on
loopback: memory before authentication, connection floods, trickled frames, and
authentic frames over their method's limit."""

import os
import pickle
import socket
import struct
import subprocess
import sys
import textwrap
import time

import pytest

from spark_dl.rendezvous.frames import HEADER_BYTES, read_frame, seal_frame
from spark_dl.rendezvous.secret import make_secret
from spark_dl.spark.launch.driver.service import DriverService
from spark_dl.spark.launch.service import (RemoteCallError, ServiceClient, ServiceError,
                                           ServiceServer, request_context,
                                           response_context)
from spark_dl.spark.launch.task.service import TaskService

pytestmark = pytest.mark.timeout(90)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECRET = make_secret()
GIB = 1 << 30


def _forged_header(length):
    """A header announcing ``length`` bytes with a tag made without the secret."""
    frame = bytearray(seal_frame(make_secret(), request_context("driver"), "result", b""))
    frame[28:36] = struct.pack(">Q", length)
    return bytes(frame[:HEADER_BYTES])


_DRIVER = textwrap.dedent("""
    import sys
    from spark_dl.spark.launch.driver.service import DriverService
    driver = DriverService(bytes.fromhex(sys.argv[1]), 2, b"code", ["127.0.0.1"],
                           lambda s, d: None)
    host, port = driver.start()[0]
    print(port, flush=True)
    sys.stdin.readline()
""")


def _rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_unauthenticated_frames_cost_the_driver_no_memory():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", _DRIVER, SECRET.hex()], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    socks = []
    try:
        port = int(proc.stdout.readline())
        time.sleep(0.3)
        before = _rss_mib(proc.pid)
        # Headers announcing 1 GiB each, without a valid tag: three followed by 64 MiB
        # of body (before the fix: +3 GiB of RSS), then 40 that stop inside the header.
        for i in range(43):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            header = _forged_header(GIB)
            try:
                sock.sendall(header + bytes(64 << 20) if i < 3 else header[:40])
            except OSError:
                pass  # closed by the server while we were still sending: fine
            socks.append(sock)
        time.sleep(1.0)
        after = _rss_mib(proc.pid)
        # The service still answers its tasks.
        with ServiceClient("driver", SECRET, [("127.0.0.1", port)], timeout=5) as client:
            assert client.call("ping", index=0) == {"stop": False}
        assert after - before < 16, f"RSS grew from {before:.0f} to {after:.0f} MiB"
    finally:
        for sock in socks:
            sock.close()
        proc.stdin.close()
        proc.wait(10)
        proc.stdout.close()


def _driver():
    driver = DriverService(SECRET, 2, b"code", ["127.0.0.1"], lambda s, d: None)
    driver.start()
    return driver.server, "ping", {"index": 0}, driver.stop


def _task():
    dead = ServiceClient("driver", SECRET, [("127.0.0.1", 9)], timeout=1.0)
    task = TaskService(SECRET, "job", 0, [], dead, hosts=["127.0.0.1"])
    task.start()
    return task.server, "status", {}, lambda: task.stop(1.0)


@pytest.fixture(params=["driver", "task"])
def service(request):
    server, method, kwargs, close = {"driver": _driver, "task": _task}[request.param]()
    yield server, method, kwargs
    close()


def test_idle_connection_flood_does_not_lock_out_callers(service):
    server, method, kwargs = service
    flood = []
    try:
        for _ in range(300):
            sock = socket.create_connection(server.endpoints[0], timeout=5)
            sock.sendall(b"S")  # one byte, then nothing
            flood.append(sock)
        time.sleep(0.3)
        start = time.monotonic()
        for _ in range(3):  # fresh connections each time, as tasks reconnect
            with ServiceClient(server.name, SECRET, server.endpoints, timeout=5) as client:
                client.call(method, **kwargs)
        assert time.monotonic() - start < 3
        assert server.pending.evicted > 0
    finally:
        for sock in flood:
            sock.close()


def test_authenticated_connections_are_never_evicted():
    with ServiceServer("svc", SECRET, {"one": lambda: 1}, max_pending=8,
                       max_pending_per_peer=4) as server:
        with ServiceClient("svc", SECRET, server.endpoints, timeout=5) as kept:
            assert kept.call("one") == 1
            flood = [socket.create_connection(server.endpoints[0]) for _ in range(40)]
            try:
                time.sleep(0.3)
                sock = kept._sock
                assert kept.call("one") == 1
                assert kept._sock is sock  # the same connection served it
            finally:
                for s in flood:
                    s.close()


def _trickle(endpoint, data, every, limit):
    """Sends one byte every ``every`` s; returns seconds until the server closed."""
    start = time.monotonic()
    with socket.create_connection(endpoint, timeout=5) as sock:
        for i, byte in enumerate(data):
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                return time.monotonic() - start
            if time.monotonic() - start > limit:
                break
            time.sleep(every)
            sock.settimeout(0.001)
            try:
                if sock.recv(1) == b"":
                    return time.monotonic() - start
            except (socket.timeout, BlockingIOError):
                pass
            except OSError:
                return time.monotonic() - start
    return None


def test_a_trickled_frame_is_closed_at_its_deadline():
    """A deadline per frame, not per read: one byte every 0.2 s with a 1 s limit."""
    with ServiceServer("svc", SECRET, {"one": lambda: 1}, read_timeout=1.0) as server:
        frame = seal_frame(SECRET, request_context("svc"), "one", pickle.dumps(("one", {})))
        took = _trickle(server.endpoints[0], frame[:HEADER_BYTES], 0.2, 6)
        assert took is not None and took < 3
        # The same once authenticated: a valid first request, then a trickled second one.
        start = time.monotonic()
        with socket.create_connection(server.endpoints[0], timeout=5) as sock:
            sock.sendall(frame)
            assert sock.recv(65536)
            second = seal_frame(SECRET, request_context("svc"), "one",
                                pickle.dumps(("one", {})))
            closed = None
            for byte in second:
                try:
                    sock.sendall(bytes([byte]))
                    time.sleep(0.2)
                    sock.settimeout(0.001)
                    if sock.recv(1) == b"":
                        closed = time.monotonic() - start
                        break
                except socket.timeout:
                    continue
                except OSError:
                    closed = time.monotonic() - start
                    break
                if time.monotonic() - start > 6:
                    break
            assert closed is not None and closed < 3
        assert server.rejected == 2


def test_authentic_frame_over_its_method_limit_is_refused_unread():
    driver = DriverService(SECRET, 1, b"", ["127.0.0.1"], lambda s, d: None)
    driver.start()
    try:
        big = pickle.dumps(("ping", {"index": 0, "pad": bytes(100_000)}))
        frame = seal_frame(SECRET, request_context("driver"), "ping", big)
        start = time.monotonic()
        with socket.create_connection(driver.server.endpoints[0], timeout=5) as sock:
            sock.sendall(frame[:HEADER_BYTES])
            assert sock.recv(65536) == b""
        assert time.monotonic() - start < 2 and driver.server.rejected == 1
        with ServiceClient("driver", SECRET, driver.server.endpoints, timeout=10) as client:
            client.call("result", rank=0, value=bytes(8 << 20))  # results may be large
            with pytest.raises(ServiceError):
                client.call("ping", index=0, pad=bytes(100_000))
    finally:
        driver.stop()


def test_payload_must_match_the_framed_method():
    with ServiceServer("svc", SECRET, {"small": lambda: 1, "big": lambda **k: 2},
                       limits={"big": 1 << 20}, max_request=1024) as server:
        frame = seal_frame(SECRET, request_context("svc"), "big",
                           pickle.dumps(("small", {"pad": bytes(4096)})))
        with socket.create_connection(server.endpoints[0], timeout=5) as sock:
            sock.sendall(frame)
            _, answer = read_frame(sock, SECRET, response_context("svc", frame[4:20]), None,
                                   lambda _k: 1 << 20, frame_s=5)
        status, text = pickle.loads(answer)  # an error, not executed as "small"
        assert status == "error" and "framed as 'big'" in text
        with ServiceClient("svc", SECRET, server.endpoints, timeout=5) as client:
            assert client.call("big", pad=bytes(4096)) == 2
            with pytest.raises(RemoteCallError, match="unknown method"):
                client.call("missing")
