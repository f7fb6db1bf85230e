"""``sdlrun`` across hosts as users run it: from the first host, over ssh, Gloo and MPI.

Two namespace hosts with two interfaces each (eth0, eth1 on separate subnets) and an sshd
each (sshd.py); ``sdlrun -np 4 -H host0:2,host1:2`` runs on host0 with ``-p``/``-i`` for
ssh. The worker script (below) reports its topology, host hash, allreduce result,
transports and the interface byte counters of its host around two phases: an allreduce
inside each host (process sets {0,1} and {2,3}) and one across hosts. Then it waits,
bounded, until the test has listed every listening socket on both hosts (``ss -ltnp``).

What is checked: the topology and the sums; ranks of one host share a host hash and the
hosts differ; the in-host phase crosses no network interface (shared memory), the global
phase crosses the job's interface and not the other one; spark_dl's listeners (the
rendezvous server, Gloo's) are bound to the job's address only, never a wildcard; Open
MPI's listeners are recorded as they are (docs/security.md). Every wait is bounded.
"""

import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest

import netns
import sshd

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
ELEMENTS = 1 << 20            # float32: 4 MiB per allreduce
ROUNDS = 3
JOB_TIMEOUT = 90

WORKER = r'''
import json, os, sys, time
import numpy as np
import spark_dl.numpy as sdl
from spark_dl.common.process_sets import ProcessSet
from spark_dl.spark.launch.network import host_hash

def net_bytes():
    out = {}
    with open("/proc/net/dev") as f:
        for line in f.readlines()[2:]:
            name, data = line.split(":", 1)
            fields = data.split()
            out[name.strip()] = int(fields[0]) + int(fields[8])   # rx + tx
    return out

sets = [ProcessSet([0, 1]), ProcessSet([2, 3])]
sdl.init(process_sets=sets)
rank, size = sdl.rank(), sdl.size()
mine = sets[0] if rank < 2 else sets[1]
n = int(os.environ["ELEMENTS"]); rounds = int(os.environ["ROUNDS"])
x = np.full(n, rank + 1, dtype=np.float32)
sdl.barrier()
before = net_bytes()
for i in range(rounds):
    local = sdl.allreduce(x, op=sdl.Sum, name=f"local{i}", process_set=mine)
sdl.barrier(process_set=mine)
middle = net_bytes()
sdl.barrier()
middle2 = net_bytes()
for i in range(rounds):
    total = sdl.allreduce(x, op=sdl.Sum, name=f"global{i}")
sdl.barrier()
after = net_bytes()
report = dict(
    rank=rank, size=size, local_rank=sdl.local_rank(), local_size=sdl.local_size(),
    cross_rank=sdl.cross_rank(), cross_size=sdl.cross_size(), host=os.uname().nodename,
    host_hash=host_hash(), hostname_env=os.environ.get("SDL_HOSTNAME"),
    local_sum=float(local[0]), local_ok=bool((local == local[0]).all()),
    total=float(total[0]), total_ok=bool((total == total[0]).all()),
    transport=sdl.transport(), local_transport=sdl.transport(mine),
    local_phase={k: middle[k] - before[k] for k in before},
    global_phase={k: after[k] - middle2[k] for k in after},
    counters=sdl.counters())
print("REPORT " + json.dumps(report), flush=True)
pause = os.environ.get("PAUSE_DIR")
if pause:   # hold the job (and its listeners) until the test has looked, at most 30 s
    open(os.path.join(pause, f"ready.{rank}"), "w").close()
    deadline = time.monotonic() + 30
    while not os.path.exists(os.path.join(pause, "go")) and time.monotonic() < deadline:
        time.sleep(0.05)
sdl.barrier()
sdl.shutdown()
'''


@pytest.fixture(scope="module")
def hosts():
    reason = sshd.unavailable()
    if reason:
        pytest.skip(reason)
    with netns.Cluster(2, second_interface=True) as cluster:
        servers = sshd.SshServers(cluster)
        try:
            servers.install_client_config(cluster.hosts[0])
            yield cluster, servers
        finally:
            servers.close()            # raises if an sshd is left
            assert not servers.sshd_pids()


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    path = tmp_path_factory.mktemp("sdlrun-hosts") / "worker.py"
    path.write_text(WORKER)
    return str(path)


def _env(**extra):
    env = dict(os.environ)
    env.update(PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""),
               ELEMENTS=str(ELEMENTS), ROUNDS=str(ROUNDS), SDL_TIMEOUT="30",
               SDL_START_TIMEOUT="40",
               # The tests run as root; mpirun needs to be told that this is wanted.
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.update(extra)
    return env


def _sockets(host, listening=True):
    """(local address, port, process name, pid) of every listening (else established) TCP
    socket on ``host``."""
    argv = ["ss", "-H", "-tnp"] + (["-l"] if listening else ["state", "established"])
    out = host.run(argv, timeout=20).stdout
    found = []
    for line in out.splitlines():
        fields = line.split()
        local = next((f for f in fields if re.match(r"^[\[\]0-9a-f.:*%]+:\d+$", f)), None)
        if local is None:
            continue
        address, _, port = local.rpartition(":")
        for name, pid in re.findall(r'\("([^"]+)",pid=(\d+)', line):
            found.append((address.strip("[]"), int(port), name, int(pid)))
    return found


def _wildcard(address):
    return address in ("0.0.0.0", "*", "::")


def run_job(hosts, worker, args, pause=True, timeout=JOB_TIMEOUT, env=None):
    """Runs sdlrun on host0; returns (rc, stdout, stderr, reports by rank, sockets): sockets
    maps each host to its (listening, established) sockets while the job paused."""
    cluster, servers = hosts
    h0 = cluster.hosts[0]
    with tempfile.TemporaryDirectory(prefix="sdl-hosts-") as tmp:
        pause_dir = os.path.join(tmp, "pause")
        os.mkdir(pause_dir)
        argv = [PY, "-m", "spark_dl.runner", "-p", str(servers.port), "-i", servers.identity,
                *args, PY, worker]
        out_path, err_path = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = h0.popen(argv, env=_env(**(env or {}), **({"PAUSE_DIR": pause_dir}
                                                            if pause else {})),
                            stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        sockets = {}
        try:
            if pause:
                deadline = time.monotonic() + timeout
                while len([f for f in os.listdir(pause_dir) if f.startswith("ready.")]) < 4:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        break
                    time.sleep(0.1)
                else:
                    sockets = {h.name: (_sockets(h), _sockets(h, listening=False))
                               for h in cluster.hosts}
                open(os.path.join(pause_dir, "go"), "w").close()
            rc = proc.wait(timeout=timeout)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)   # sdlrun and its session; cluster.close
            proc.wait(timeout=10)                 # ends whatever ran on the hosts
            raise
        finally:
            with open(out_path, errors="replace") as f:
                stdout = f.read()
            with open(err_path, errors="replace") as f:
                stderr = f.read()
    reports = {}
    for line in stdout.splitlines():
        if "REPORT " in line:
            report = json.loads(line.split("REPORT ", 1)[1])
            reports[report["rank"]] = report
    _wait_quiet(cluster)
    return rc, stdout, stderr, reports, sockets


def _wait_quiet(cluster, timeout=15):
    """Every job process on every host is gone (only the sshds stay)."""
    deadline = time.monotonic() + timeout
    while True:
        left = [(h.name, pid) for h in cluster.hosts for pid in h.processes()
                if not sshd.is_sshd(pid)]
        if not left:
            return
        assert time.monotonic() < deadline, f"job processes left running: {left}"
        time.sleep(0.1)


def check_job(cluster, reports, iface, other):
    """Topology, sums, host hashes, and which interface carried what."""
    assert sorted(reports) == [0, 1, 2, 3]
    h0, h1 = cluster.hosts
    k = int(iface[-1])
    for rank, r in reports.items():
        on_first = rank < 2
        assert r["size"] == 4 and r["local_size"] == 2 and r["cross_size"] == 2
        assert r["local_rank"] == rank % 2 and r["cross_rank"] == rank // 2
        assert r["host"] == ("host0" if on_first else "host1")
        assert r["local_ok"] and r["local_sum"] == (3.0 if on_first else 7.0)
        assert r["total_ok"] and r["total"] == 10.0
        # In-host phase: nothing (beyond a little control traffic) crossed the wire.
        assert r["local_phase"][iface] < 256 * 1024, r["local_phase"]
        # Across hosts: at least one payload per round, over the job's interface only.
        assert r["global_phase"][iface] > ROUNDS * ELEMENTS * 4, r["global_phase"]
        assert r["global_phase"][other] < 256 * 1024, r["global_phase"]
    print(f"\n{iface}: bytes (rx+tx) per rank, in-host phase "
          f"{[reports[r]['local_phase'][iface] for r in range(4)]}, across hosts "
          f"{[reports[r]['global_phase'][iface] for r in range(4)]} ({other}: "
          f"{[reports[r]['global_phase'][other] for r in range(4)]}); payload "
          f"{ROUNDS} x {ELEMENTS * 4} B; transports {reports[0]['transport']}/"
          f"{reports[0]['local_transport']}")
    assert reports[0]["host_hash"] == reports[1]["host_hash"]
    assert reports[2]["host_hash"] == reports[3]["host_hash"]
    assert reports[0]["host_hash"] != reports[2]["host_hash"]
    return {h.name: h.addresses[k] for h in (h0, h1)}


def check_spark_dl_sockets(sockets, addresses, sshd_pids):
    """Every listener but the test's sshd is bound to its host's job address, and so is
    every established connection of the job's processes that is not on loopback."""
    assert set(sockets) == {"host0", "host1"}, "the job did not pause for the check"
    listening = established = 0
    for host, (listeners, connections) in sockets.items():
        for address, port, name, pid in listeners:
            if pid not in sshd_pids:
                listening += 1
                assert address == addresses[host], (host, address, port, name)
        for address, port, name, pid in connections:
            # ssh goes to the names given in -H, whatever the job's network.
            if name in ("ssh", "sshd") or pid in sshd_pids:
                continue
            if not ipaddress.ip_address(address).is_loopback:
                established += 1
                assert address == addresses[host], (host, address, port, name)
    # The rendezvous server at least; Gloo closes its listeners once the ranks connected.
    assert listening >= 1 and established >= 2
    return listening, established


@pytest.mark.timeout(150)
def test_gloo_across_hosts_automatic_network(hosts, worker):
    cluster, servers = hosts
    rc, out, err, reports, sockets = run_job(
        hosts, worker, ["-np", "4", "-H", "host0:2,host1:2", "--verbose"])
    assert rc == 0, err[-3000:]
    # host1 resolves to its eth0 address: the route from host0 to it is eth0's.
    addresses = check_job(cluster, reports, "eth0", "eth1")
    assert f"job network: eth0 {cluster.subnets[0]} (on the route to host1)" in err
    for rank, r in reports.items():
        assert r["hostname_env"] == addresses["host0" if rank < 2 else "host1"]
        assert r["transport"] == "hierarchical" and r["local_transport"] == "shm"
    pids = set(servers.sshd_pids())
    check_spark_dl_sockets(sockets, addresses, pids)


@pytest.mark.timeout(150)
def test_gloo_network_interface_eth1(hosts, worker):
    cluster, servers = hosts
    rc, out, err, reports, sockets = run_job(
        hosts, worker, ["-np", "4", "-H", "host0:2,host1:2", "--network-interface", "eth1",
                        "--verbose"])
    assert rc == 0, err[-3000:]
    addresses = check_job(cluster, reports, "eth1", "eth0")
    assert f"bound to {addresses['host0']}" in err
    for rank, r in reports.items():
        assert r["hostname_env"] == addresses["host0" if rank < 2 else "host1"]
    check_spark_dl_sockets(sockets, addresses, set(servers.sshd_pids()))


@pytest.mark.timeout(120)
def test_network_interface_errors(hosts, worker):
    cluster, _ = hosts
    h1 = cluster.hosts[1]
    rc, _, err, _, _ = run_job(hosts, worker, ["-np", "4", "-H", "host0:2,host1:2",
                                               "--network-interface", "eth7"], pause=False)
    assert rc == 2 and "has no IPv4 address on eth7" in err and "eth1 " in err
    # host1's eth1 moved to another subnet: the hosts share none on eth1.
    original = f"{h1.addresses[1]}/{cluster.subnets[1].prefixlen}"
    h1.run(["ip", "addr", "flush", "dev", "eth1"])
    h1.run(["ip", "addr", "add", "10.213.9.11/24", "dev", "eth1"])
    try:
        start = time.monotonic()
        rc, _, err, _, _ = run_job(hosts, worker, ["-np", "4", "-H", "host0:2,host1:2",
                                                   "--network-interface", "eth1"],
                                   pause=False)
        assert rc != 0
        assert "host1's eth1 (10.213.9.11/24) is not in the launcher's eth1 subnet" in err
        assert "share no subnet" in err
        assert time.monotonic() - start < 30
    finally:
        h1.run(["ip", "addr", "flush", "dev", "eth1"])
        h1.run(["ip", "addr", "add", original, "dev", "eth1"])


@pytest.mark.timeout(90)
def test_unreachable_host_fails_within_start_timeout(hosts, worker):
    cluster, _ = hosts
    h1 = cluster.hosts[1]
    h1.link(up=False)   # host1 is off the network: ssh cannot reach it
    try:
        start = time.monotonic()
        rc, _, err, _, _ = run_job(hosts, worker, ["-np", "4", "-H", "host0:2,host1:2",
                                                   "--start-timeout", "5"], pause=False,
                                   timeout=60)
        elapsed = time.monotonic() - start
    finally:
        h1.link(up=True)
    print(f"\nhost1 unreachable: exit code {rc} after {elapsed:.1f} s:\n{err[-600:]}")
    assert rc != 0 and "host1" in err, err[-2000:]
    assert elapsed < 30, elapsed


@pytest.mark.timeout(150)
@pytest.mark.parametrize("iface", ["eth0", "eth1"])
def test_mpi_across_hosts(hosts, worker, iface):
    cluster, servers = hosts
    args = ["--mpi", "-np", "4", "-H", "host0:2,host1:2", "--verbose"]
    if iface == "eth1":
        args += ["--network-interface", "eth1"]
    rc, out, err, reports, sockets = run_job(hosts, worker, args)
    assert rc == 0, err[-3000:]
    other = "eth1" if iface == "eth0" else "eth0"
    addresses = check_job(cluster, reports, iface, other)
    subnet = str(cluster.subnets[int(iface[-1])])
    want = "eth1" if iface == "eth1" else subnet
    assert f"--mca oob_tcp_if_include {want}" in err
    assert f"--mca btl_tcp_if_include {want}" in err
    assert f"--mca plm_rsh_args '-p {servers.port} -i {servers.identity}'" in err
    assert set(sockets) == {"host0", "host1"}, "the job did not pause for the check"
    sshd_pids = set(servers.sshd_pids())
    wide, narrow = set(), set()
    for host, (found, _) in sockets.items():
        for address, _, name, pid in found:
            if pid not in sshd_pids:
                (wide if _wildcard(address) else narrow).add((host, name, address))
    # Recorded for docs/security.md: Open MPI 4.1 binds every interface whatever
    # *_if_include say; nothing of spark_dl's own listens under --mpi.
    print(f"\nMPI ({iface}) listeners, wildcard: {sorted(wide)}\nMPI ({iface}) listeners, "
          f"bound: {sorted(narrow)}")
    for _, _, address in narrow:
        assert ipaddress.ip_address(address).is_loopback or address in addresses.values()
    # Open MPI's connections, though, follow *_if_include: none leaves the job's network.
    for host, (_, connections) in sockets.items():
        for address, port, name, pid in connections:
            if name not in ("ssh", "sshd") and pid not in sshd_pids and \
                    not ipaddress.ip_address(address).is_loopback:
                assert address == addresses[host], (host, address, port, name)
