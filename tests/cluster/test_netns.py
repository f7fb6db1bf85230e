"""The harness itself: hosts differ as real machines do, reach each other only on the test
subnet, share memory within a host only, can be shaped, lost and cleaned up."""

import socket
import sys
import time

import pytest

import netns

HASH = "from spark_dl.spark.launch.network import host_hash; print(host_hash())"


@pytest.fixture(scope="module")
def cluster():
    with netns.Cluster(3, second_interface=True) as c:
        yield c


def test_hosts_have_their_own_name_addresses_memory_and_host_hash(cluster):
    h0, h1, _ = cluster.hosts
    assert h0.run(["hostname"]).stdout.strip() == "host0"
    assert h1.run(["hostname"]).stdout.strip() == "host1"
    assert h0.python("import socket; print(socket.gethostbyname('host2'))").stdout.strip() \
        == cluster.hosts[2].address
    h0.run(["sh", "-c", "echo x > /dev/shm/sdl-netns-test"])
    assert h0.run(["cat", "/dev/shm/sdl-netns-test"]).stdout == "x\n"
    assert "sdl-netns-test" not in h1.run(["ls", "/dev/shm"]).stdout
    first, again = (h1.python(HASH).stdout for _ in range(2))
    assert first == again and first != h0.python(HASH).stdout
    addrs = h0.run(["ip", "-4", "-o", "addr"]).stdout
    assert h0.addresses[0] in addrs and h0.addresses[1] in addrs and len(h0.interfaces) == 2


def _echo_server(host, port):
    code = ("import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, "
            f"socket.SO_REUSEADDR, 1); s.bind(('0.0.0.0', {port})); s.listen(); "
            "s.settimeout(20); c, _ = s.accept(); c.sendall(b'hi')")
    proc = host.popen([sys.executable, "-c", code])
    time.sleep(0.3)
    return proc


def test_hosts_reach_each_other_and_the_gateway_and_nothing_else(cluster):
    h0, h1, _ = cluster.hosts
    server = _echo_server(h1, 5555)
    got = h0.python(f"import socket; s = socket.create_connection(('{h1.address}', 5555), "
                    "timeout=5); print(s.recv(2))").stdout
    assert got.strip() == "b'hi'"
    server.wait(timeout=10)
    # The second subnet too, and the root namespace's bridge address.
    server = _echo_server(h1, 5556)
    got = h0.python(f"import socket; s = socket.create_connection(('{h1.addresses[1]}', 5556),"
                    " timeout=5); print(s.recv(2))").stdout
    assert got.strip() == "b'hi'"
    server.wait(timeout=10)
    routes = h0.run(["ip", "-4", "route"]).stdout
    assert "default" not in routes
    with socket.create_server((cluster.gateway(), 0)) as srv:
        port = srv.getsockname()[1]
        h0.python(f"import socket; socket.create_connection(('{cluster.gateway()}', {port}), "
                  "timeout=5)")


def test_link_down_cuts_the_host_off_and_up_restores_it(cluster):
    h0, h1, _ = cluster.hosts
    probe = (f"import socket\ntry:\n    socket.create_connection(('{h1.address}', 9), "
             "timeout=1)\nexcept ConnectionRefusedError:\n    print('reached')\n"
             "except OSError as e:\n    print('cut', e)")
    assert h0.python(probe).stdout.startswith("reached")
    h1.link(up=False)
    try:
        assert h0.python(probe).stdout.startswith("cut")
    finally:
        h1.link(up=True)
    assert h0.python(probe).stdout.startswith("reached")


def test_kill_all_ends_every_process_of_a_host(cluster):
    h2 = cluster.hosts[2]
    procs = [h2.popen(["sleep", "100"]) for _ in range(3)]
    # nsenter enters the namespace after the fork: wait (bounded) until all three are in.
    deadline = time.monotonic() + 10
    while len(h2.processes()) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(h2.processes()) >= 3
    assert h2.kill_all() >= 3
    for p in procs:
        assert p.wait(timeout=10) != 0
    assert h2.processes() == []
    assert h2.run(["hostname"]).stdout.strip() == "host2"  # the host itself stays up


def test_rate_shaping_limits_the_bandwidth(cluster):
    h0, h1, _ = cluster.hosts
    sink = ("import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, "
            "socket.SO_REUSEADDR, 1); s.bind(('0.0.0.0', 5557)); s.listen(); "
            "s.settimeout(20); c, _ = s.accept()\nwhile c.recv(1 << 20): pass")
    send = (f"import socket, time; s = socket.create_connection(('{h1.address}', 5557), "
            "timeout=10); b = b'x' * (1 << 20); t = time.time()\n"
            "for _ in range(24): s.sendall(b)\n"
            "s.close(); print(24 * 8 * 2**20 / (time.time() - t) / 1e6)")
    h0.shape(rate="200mbit")
    try:
        server = h1.popen([sys.executable, "-c", sink])
        time.sleep(0.3)
        mbit = float(h0.python(send).stdout)
        server.wait(timeout=20)
    finally:
        h0.shape()
    assert 100 < mbit < 260, mbit


def test_close_leaves_nothing():
    c = netns.Cluster(2)
    c.hosts[0].popen(["sleep", "100"])
    names = [h.netns for h in c.hosts]
    c.close()
    left = netns.leftovers()
    assert not any(n in " ".join(left) for n in names + [c.tag]), left
