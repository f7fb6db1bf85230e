"""The rendezvous server under a peer without the secret: idle and trickling
connections, connection floods, and large unauthenticated bodies."""

import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from spark_dl.rendezvous.client import KVStoreClient
from spark_dl.rendezvous.secret import make_secret
from spark_dl.runner.kvstore import KVStoreServer

pytestmark = pytest.mark.timeout(60)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECRET = make_secret()


def _closed_within(sock, limit):
    """Seconds until the server closed ``sock`` (None if still open after ``limit``)."""
    start = time.monotonic()
    sock.settimeout(limit)
    try:
        while sock.recv(65536):
            pass
    except socket.timeout:
        return None
    except OSError:
        pass
    return time.monotonic() - start


def test_idle_and_trickling_connections_are_closed():
    with KVStoreServer(SECRET, host="127.0.0.1", auth_deadline_s=1.0, request_timeout=1.0,
                       idle_timeout=2.0) as server:
        with socket.create_connection(("127.0.0.1", server.port)) as idle:
            took = _closed_within(idle, 5)
            assert took is not None and took < 2.5
        # One byte every 0.2 s: every read is quick, the request never completes.
        start = time.monotonic()
        with socket.create_connection(("127.0.0.1", server.port)) as slow:
            closed = None
            for byte in b"PUT /v1/kv/a/b HTTP/1.1\r\nContent-Length: 1\r\n":
                try:
                    slow.sendall(bytes([byte]))
                except OSError:
                    closed = time.monotonic() - start
                    break
                time.sleep(0.2)
                if _closed_within(slow, 0.001) is not None:
                    closed = time.monotonic() - start
                    break
            assert closed is not None and closed < 3
        with KVStoreClient("127.0.0.1", server.port, SECRET, timeout=5) as client:
            client.set("s", "k", b"v")
            time.sleep(2.5)  # past the idle timeout: the client reconnects
            assert client.get("s", "k") == b"v"


def test_connection_flood_does_not_lock_out_workers():
    with KVStoreServer(SECRET, host="127.0.0.1") as server:
        flood = []
        try:
            for _ in range(300):
                sock = socket.create_connection(("127.0.0.1", server.port))
                sock.sendall(b"G")
                flood.append(sock)
            time.sleep(0.3)
            start = time.monotonic()
            with KVStoreClient("127.0.0.1", server.port, SECRET, timeout=5) as client:
                client.set("s", "k", b"v")
                assert client.get("s", "k") == b"v"
            assert time.monotonic() - start < 3
            assert server.pending.evicted > 0
        finally:
            for sock in flood:
                sock.close()


_SERVER = textwrap.dedent("""
    import sys
    from spark_dl.runner.kvstore import KVStoreServer
    server = KVStoreServer(bytes.fromhex(sys.argv[1]), host="127.0.0.1")
    print(server.start(), flush=True)
    sys.stdin.readline()
""")


def _rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_unauthenticated_bodies_are_bounded():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, SECRET.hex()], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    socks = []
    try:
        port = int(proc.stdout.readline())
        time.sleep(0.3)
        before = _rss_mib(proc.pid)
        head = (b"PUT /v1/kv/a/b HTTP/1.1\r\nHost: x\r\nContent-Length: 16777215\r\n"
                b"X-SDL-Nonce: 00\r\nX-SDL-Time: 0\r\nX-SDL-MAC: 00\r\n\r\n")
        for _ in range(12):  # each sends 8 MiB of a 16 MiB body, then stalls
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            try:
                sock.sendall(head + bytes(8 << 20))
            except OSError:
                pass  # refused (503, closed) while we were sending
            socks.append(sock)
        time.sleep(1.0)
        after = _rss_mib(proc.pid)
        assert after - before < 40, f"RSS grew from {before:.0f} to {after:.0f} MiB"
        with KVStoreClient("127.0.0.1", port, SECRET, timeout=5) as client:
            client.set("s", "k", b"v")
    finally:
        for sock in socks:
            sock.close()
        proc.stdin.close()
        proc.wait(10)
        proc.stdout.close()
