"""Hosts made of Linux namespaces, on a private test subnet: the multi-host test harness.

A :class:`Cluster` makes ``n`` hosts on this machine. Each host is a network namespace
(``ip netns``) holding a long-lived holder process that has, besides, its own UTS (host
name), IPC and mount namespaces; its ``/dev/shm`` is a private tmpfs and its ``/etc/hosts``
lists every host of the cluster. So, as on real machines, two hosts differ in name,
address, shared memory and :func:`spark_dl.spark.launch.network.host_hash`, while the
processes of one host share them. Commands run on a host through ``nsenter`` into the
holder's namespaces (:meth:`Host.popen`, :meth:`Host.run`).

Network: one Linux bridge per subnet in this (the root) namespace with the subnet's ``.1``
address, and per host a veth pair whose inner end is ``eth0`` (``eth1`` on the optional
second subnet) with address ``.<10 + i>``. Hosts have no default route: they reach each
other and the root namespace's bridge address, nothing else. The subnets are picked in
10.213.0.0/16 among those no route here uses.

Shaping (:meth:`Host.shape`): the host interface's egress, bandwidth with ``tbf``, delay and
loss with ``netem`` where the kernel has it (:func:`netem_available`; the development
machine's kernel has tbf and htb but no netem); every host of a shaped cluster gets the
same, so a path host-to-host is shaped once, at the sender's egress.

Cleanup (:meth:`Cluster.close`, also on ``with`` exit, at interpreter exit and on SIGTERM):
every process in a host's network namespace is killed, the namespaces, veths and bridges
are deleted; :func:`sweep` also removes what a killed earlier run left (by the name
prefix). :func:`leftovers` lists anything of ours still present (tests assert it is empty).

Root only; :func:`unavailable` says why not where it cannot run (tests skip with it).
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Dict, List, Optional, Sequence

PREFIX = "sdlt"           # every namespace, bridge and veth name starts with it
SUPERNET = ipaddress.ip_network("10.213.0.0/16")
_live: List["Cluster"] = []


def _ip(*args, check=True, ns: Optional[str] = None, timeout=30):
    argv = ["ip"] + (["-n", ns] if ns else []) + [str(a) for a in args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {proc.stderr.strip()}")
    return proc


def unavailable() -> Optional[str]:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "multi-host tests need root (network namespaces); run them as root"
    for tool in ("ip", "nsenter", "unshare", "tc"):
        if shutil.which(tool) is None:
            return f"multi-host tests need '{tool}' (Debian: iproute2, util-linux)"
    name = f"{PREFIX}probe{secrets.token_hex(2)}"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    _ip("netns", "delete", name, check=False)
    return None


def _namespaces() -> List[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def _links() -> List[str]:
    out = _ip("-o", "link", "show", check=False).stdout
    names = []
    for line in out.splitlines():
        name = line.split(":", 2)[1].strip().split("@", 1)[0]
        if name.startswith(PREFIX):
            names.append(name)
    return names


def _ns_inode(name: str) -> Optional[int]:
    try:
        return os.stat(f"/run/netns/{name}").st_ino
    except OSError:
        return None


def _pids_in_netns(inode: int) -> List[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}/ns/net").st_ino == inode:
                pids.append(int(entry))
        except OSError:
            continue
    return pids


def _kill_netns_processes(name: str, sig=signal.SIGKILL) -> int:
    """Signals every process in namespace ``name``; returns how many there were."""
    inode = _ns_inode(name)
    if inode is None:
        return 0
    pids = [p for p in _pids_in_netns(inode) if p != os.getpid()]
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return len(pids)


def _rate_bits(rate: str) -> float:
    """'10gbit' -> 1e10 (tc's bit units: kbit, mbit, gbit, bit)."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for unit, factor in units.items():
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * factor
    raise ValueError(f"rate {rate!r}: use tc's units, e.g. 10gbit, 500mbit")


_NETEM: Optional[List[Optional[str]]] = None


def netem_available() -> Optional[str]:
    """Why netem (delay, loss) cannot be used here (None: it can)."""
    global _NETEM
    if _NETEM is None:
        name = f"{PREFIX}q{secrets.token_hex(2)}"
        _ip("link", "add", name, "type", "veth", "peer", "name", name + "p", check=False)
        proc = subprocess.run(["tc", "qdisc", "add", "dev", name, "root", "netem", "delay",
                               "1ms"], capture_output=True, text=True, timeout=30)
        _ip("link", "delete", name, check=False)
        _NETEM = [None if proc.returncode == 0 else
                  f"this kernel has no netem qdisc (delay, loss): {proc.stderr.strip()}"]
    return _NETEM[0]


def _owner_file(tag: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"{PREFIX}{tag}.owner")


def _owned_elsewhere(name: str) -> bool:
    """Whether ``name`` belongs to a cluster of another process that still runs (test
    runs side by side: one's sweep must not take the other's hosts)."""
    try:
        with open(_owner_file(name[len(PREFIX):len(PREFIX) + 4])) as f:
            pid = int(f.read().strip() or 0)
    except (OSError, ValueError):
        return False
    if pid in (0, os.getpid()):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def leftovers() -> List[str]:
    """Namespaces and links of ours still here (after a cleanup: none); clusters of other
    processes that still run are not ours to report."""
    return [f"netns {n}" for n in _namespaces() if not _owned_elsewhere(n)] + \
        [f"link {n}" for n in _links() if not _owned_elsewhere(n)]


def sweep() -> None:
    """Removes every namespace, bridge and veth of ours (also an earlier run's), but not
    those of a cluster whose process still runs."""
    for name in [n for n in _namespaces() if not _owned_elsewhere(n)]:
        for _ in range(50):
            if not _kill_netns_processes(name):
                break
            time.sleep(0.1)
        _ip("netns", "delete", name, check=False)
    for name in [n for n in _links() if not _owned_elsewhere(n)]:
        _ip("link", "delete", name, check=False)
    for name in os.listdir(tempfile.gettempdir()):  # owner files of processes gone
        if name.startswith(PREFIX) and name.endswith(".owner") and \
                not _owned_elsewhere(name[:len(PREFIX) + 4]):
            try:
                os.unlink(os.path.join(tempfile.gettempdir(), name))
            except OSError:
                pass


def _free_subnets(count: int) -> List[ipaddress.IPv4Network]:
    used = []
    for line in _ip("-4", "route", "show", "table", "all", check=False).stdout.splitlines():
        word = line.split()[0] if line.split() else ""
        if word[:1].isdigit():
            try:
                used.append(ipaddress.ip_network(word, strict=False))
            except ValueError:
                pass
    choices = [n for n in SUPERNET.subnets(new_prefix=24)
               if n.network_address.packed[2] >= 16 and not any(n.overlaps(u) for u in used)]
    if len(choices) < count:
        raise RuntimeError("no free /24 left in 10.213.0.0/16 for the test hosts")
    picked = secrets.SystemRandom().sample(choices, count)
    return picked


class Host:
    """One host: a network namespace plus a holder with its own UTS, IPC and mount."""

    def __init__(self, cluster: "Cluster", index: int, name: str, netns: str):
        self.cluster = cluster
        self.index = index
        self.name = name
        self.netns = netns
        self.addresses: List[str] = []        # eth0's, then eth1's
        self.holder: Optional[subprocess.Popen] = None

    @property
    def address(self) -> str:
        return self.addresses[0]

    @property
    def interfaces(self) -> List[str]:
        return [f"eth{i}" for i in range(len(self.addresses))]

    def nsenter(self) -> List[str]:
        """The argv prefix that runs a command on this host."""
        return ["nsenter", f"--target={self.holder.pid}", "--net", "--uts", "--ipc",
                "--mount", "--"]

    def popen(self, argv: Sequence[str], env: Optional[Dict[str, str]] = None,
              **kwargs) -> subprocess.Popen:
        """Starts ``argv`` on this host (in its own session unless told otherwise)."""
        kwargs.setdefault("start_new_session", True)
        return subprocess.Popen(self.nsenter() + [str(a) for a in argv],
                                env=dict(os.environ if env is None else env), **kwargs)

    def run(self, argv: Sequence[str], timeout: float = 60, check: bool = True,
            env: Optional[Dict[str, str]] = None, input: Optional[str] = None):
        proc = subprocess.run(self.nsenter() + [str(a) for a in argv], capture_output=True,
                              text=True, timeout=timeout, input=input,
                              env=dict(os.environ if env is None else env))
        if check and proc.returncode != 0:
            raise RuntimeError(f"on {self.name}: {' '.join(map(str, argv))} exited "
                               f"{proc.returncode}:\n{proc.stdout}{proc.stderr}")
        return proc

    def python(self, code: str, timeout: float = 60, env=None, check=True):
        import sys

        return self.run([sys.executable, "-c", code], timeout=timeout, env=env, check=check)

    def shape(self, rate: Optional[str] = None, delay: Optional[str] = None,
              loss: Optional[str] = None, interface: str = "eth0") -> None:
        """Shapes ``interface``'s egress: rate='10gbit' (tbf), delay='50us' and loss='0.1%'
        (netem, which not every kernel has: :func:`netem_available`)."""
        if delay or loss:
            reason = netem_available()
            if reason:
                raise RuntimeError(reason)
            argv = ["tc", "qdisc", "replace", "dev", interface, "root", "netem"]
            argv += (["delay", delay] if delay else []) + (["loss", loss] if loss else [])
            argv += ["rate", rate] if rate else []
        elif rate:
            # tbf: the bucket must hold at least one burst of a fast link's packets (a
            # jiffy's worth of bytes at the rate, at least 64 KiB with veth's GSO packets).
            bps = _rate_bits(rate)
            burst = max(256 * 1024, int(bps / 8 / 250))
            argv = ["tc", "qdisc", "replace", "dev", interface, "root", "tbf", "rate", rate,
                    "burst", str(burst), "latency", "50ms"]
        else:
            argv = ["tc", "qdisc", "del", "dev", interface, "root"]
        proc = subprocess.run(["ip", "netns", "exec", self.netns] + argv,
                              capture_output=True, text=True, timeout=30)
        if proc.returncode != 0 and argv[2] != "del":
            raise RuntimeError(f"on {self.name}: {' '.join(argv)}: {proc.stderr.strip()}")

    def link(self, up: bool, interface: str = "eth0") -> None:
        """Takes the host's interface down (the host drops off the network) or up."""
        _ip("link", "set", interface, "up" if up else "down", ns=self.netns)

    def processes(self) -> List[int]:
        """Every process on this host (its network namespace) but the holder."""
        inode = _ns_inode(self.netns)
        holder = self.holder.pid if self.holder else None
        return [p for p in (_pids_in_netns(inode) if inode else []) if p != holder]

    def kill_all(self) -> int:
        """Kills every process on the host except the holder (the host "crashes")."""
        pids = self.processes()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(pids)

    def __repr__(self):
        return f"Host({self.name}, {', '.join(self.addresses)})"


class Cluster:
    """``hosts`` namespace hosts named ``names`` (default host0, host1, ...)."""

    def __init__(self, hosts: int = 2, names: Optional[Sequence[str]] = None,
                 second_interface: bool = False, shm_size: str = "1g"):
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        self.tag = secrets.token_hex(2)
        names = list(names or [f"host{i}" for i in range(hosts)])
        self.subnets = _free_subnets(2 if second_interface else 1)
        self.bridges = [f"{PREFIX}{self.tag}b{k}" for k in range(len(self.subnets))]
        self.hosts: List[Host] = []
        self._tmp = tempfile.mkdtemp(prefix="sdl-cluster-")
        self._closed = False
        with open(_owner_file(self.tag), "w") as f:
            f.write(str(os.getpid()))
        _live.append(self)
        try:
            self._make(names, shm_size)
        except BaseException:
            self.close()
            raise

    # -- construction ----------------------------------------------------------------
    def gateway(self, k: int = 0) -> str:
        """This (root) namespace's address on subnet ``k``: the hosts reach it there."""
        return str(self.subnets[k].network_address + 1)

    def _make(self, names, shm_size):
        for k, (bridge, net) in enumerate(zip(self.bridges, self.subnets)):
            _ip("link", "add", bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway(k)}/{net.prefixlen}", "dev", bridge)
            _ip("link", "set", bridge, "up")
        for i, name in enumerate(names):
            host = Host(self, i, name, f"{PREFIX}{self.tag}n{i}")
            _ip("netns", "add", host.netns)
            _ip("link", "set", "lo", "up", ns=host.netns)
            for k, (bridge, net) in enumerate(zip(self.bridges, self.subnets)):
                outer, inner = f"{PREFIX}{self.tag}v{i}{k}", f"{PREFIX}{self.tag}i{i}{k}"
                _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
                _ip("link", "set", outer, "master", bridge)
                _ip("link", "set", outer, "up")
                _ip("link", "set", inner, "netns", host.netns)
                _ip("link", "set", inner, "name", f"eth{k}", ns=host.netns)
                address = str(net.network_address + 10 + i)
                _ip("addr", "add", f"{address}/{net.prefixlen}", "dev", f"eth{k}", ns=host.netns)
                _ip("link", "set", f"eth{k}", "up", ns=host.netns)
                host.addresses.append(address)
            self.hosts.append(host)
        hosts_file = os.path.join(self._tmp, "hosts")
        with open(hosts_file, "w") as f:
            f.write("127.0.0.1 localhost\n")
            for k in range(len(self.subnets)):
                f.write(f"{self.gateway(k)} {'gateway' if k == 0 else f'gateway-{k}'}\n")
            for host in self.hosts:
                f.write(f"{host.address} {host.name}\n")
                for k, extra in enumerate(host.addresses[1:], start=1):
                    f.write(f"{extra} {host.name}-{k}\n")
        self.hosts_file = hosts_file
        for host in self.hosts:
            ready = os.path.join(self._tmp, f"ready.{host.index}")
            setup = (f"hostname {host.name} && "
                     f"mount -t tmpfs -o size={shm_size},mode=1777 tmpfs /dev/shm && "
                     f"mount --bind {hosts_file} /etc/hosts && "
                     f"touch {ready} && exec sleep 100000000")
            host.holder = subprocess.Popen(
                ["ip", "netns", "exec", host.netns, "unshare", "--uts", "--ipc", "--mount",
                 "--propagation", "private", "--", "sh", "-c", setup],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
            deadline = time.monotonic() + 20
            while not os.path.exists(ready):
                if host.holder.poll() is not None or time.monotonic() > deadline:
                    err = host.holder.stderr.read().decode(errors="replace") \
                        if host.holder.poll() is not None else "(timed out)"
                    raise RuntimeError(f"host {host.name} did not start: {err}")
                time.sleep(0.02)

    def hosts_entries(self) -> str:
        with open(self.hosts_file) as f:
            return f.read()

    def shape(self, rate: Optional[str] = None, delay: Optional[str] = None,
              loss: Optional[str] = None) -> None:
        """The same netem on every host's eth0 (each direction is shaped once)."""
        for host in self.hosts:
            host.shape(rate=rate, delay=delay, loss=loss)

    # -- cleanup ----------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for host in self.hosts:
            for _ in range(50):
                if not _kill_netns_processes(host.netns):
                    break
                time.sleep(0.1)
            if host.holder is not None:
                try:
                    host.holder.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        for host in self.hosts:
            _ip("netns", "delete", host.netns, check=False)
        for name in _links():
            if name.startswith(f"{PREFIX}{self.tag}"):
                _ip("link", "delete", name, check=False)
        shutil.rmtree(self._tmp, ignore_errors=True)
        try:
            os.unlink(_owner_file(self.tag))
        except OSError:
            pass
        if self in _live:
            _live.remove(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _close_all(*_args):
    for cluster in list(_live):
        cluster.close()


atexit.register(_close_all)


def _on_sigterm(signum, frame):
    _close_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


if hasattr(signal, "SIGTERM") and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
    try:
        signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread
        pass
