"""Which addresses the launch services bind and advertise, and which tasks share a host.

- The driver service and the rendezvous server bind the interfaces named by ``nics``;
  without ``nics``, the address Spark's own driver uses (``spark.driver.bindAddress`` /
  ``spark.driver.host``, which the executors already reach), or 127.0.0.1 when the
  master is ``local``/``local-cluster`` (everything on this machine).
- The caller's output link (:mod:`~spark_dl.spark.launch.link`) binds like the driver's
  services in a classic session; under Spark Connect, 127.0.0.1 when the executors run
  on this machine (a local master of a server on this host),
  else the ``nics`` interfaces or this machine's address on the route to the Connect
  server (which the executors may or may not reach: the link is optional).
- Task 0's services (the job's coordinator) bind the ``nics`` interfaces, 127.0.0.1 on
  local masters, else the executor's address as Spark knows it.
- A task service binds the ``nics`` interfaces of its executor; without ``nics``, its
  executor's address on the route to the driver (the address the driver reaches it by).
- Tasks whose :func:`host_hash` is equal run on one host and may share memory
  (``/dev/shm``): same host name, same boot, same IPC and mount namespaces (two
  containers on one machine are two hosts).
"""

from __future__ import annotations

import hashlib
import os
import socket
import struct
from typing import Callable, List, Optional, Sequence, Tuple

from spark_dl.runner.gloo_run import route_address

__all__ = ["host_hash", "interface_addresses", "address_network", "driver_addresses",
           "task_bind_addresses", "is_local_master", "caller_addresses"]

_SIOCGIFADDR = 0x8915


def host_hash() -> str:
    """Identifies this machine (and its namespaces) for grouping ranks by host."""
    parts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id",):
        try:
            with open(path, encoding="ascii") as f:
                parts.append(f.read().strip())
        except OSError:
            parts.append("")
    for ns in ("/proc/self/ns/ipc", "/proc/self/ns/mnt"):
        try:
            parts.append(os.readlink(ns))
        except OSError:
            parts.append("")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _ipv4_of(nic: str) -> Optional[str]:
    """The IPv4 address of interface ``nic`` (Linux), or None."""
    try:
        import psutil  # optional: more portable, and lists every address
    except ImportError:
        psutil = None
    if psutil is not None:
        for addr in psutil.net_if_addrs().get(nic, ()):
            if addr.family == socket.AF_INET:
                return addr.address
        return None
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR,
                                 struct.pack("256s", nic.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_addresses(nics: Sequence[str]) -> List[str]:
    """The IPv4 addresses of the named interfaces, in order.

    Raises:
        ValueError: an interface does not exist here or has no IPv4 address.
    """
    addresses = []
    for nic in nics:
        address = _ipv4_of(nic)
        if address is None:
            try:
                known = ", ".join(name for _, name in socket.if_nameindex())
            except OSError:
                known = "?"
            raise ValueError(f"network interface {nic!r} has no IPv4 address on "
                             f"{socket.gethostname()} (interfaces here: {known})")
        if address not in addresses:
            addresses.append(address)
    return addresses


def address_network(address: str) -> Optional[str]:
    """The network (``10.0.0.0/24``) of the interface here that holds ``address``, or
    None (not an address of this machine, or no psutil to list the netmasks).

    Open MPI's TCP transport needs the interfaces' real networks in
    ``btl_tcp_if_include``: given each host's address as a ``/32``, ranks on different
    hosts reject each other's connections and the job hangs in its first collective.
    """
    import ipaddress

    try:
        import psutil
    except ImportError:
        return None
    for addrs in psutil.net_if_addrs().values():
        for addr in addrs:
            if addr.family == socket.AF_INET and addr.address == address and addr.netmask:
                return str(ipaddress.ip_interface(f"{address}/{addr.netmask}").network)
    return None


def is_local_master(master: str) -> bool:
    """True for ``local``, ``local[N]``, ``local[N,F]`` and ``local-cluster[...]``."""
    return master == "local" or master.startswith(("local[", "local-cluster["))


def _resolve(host: str) -> str:
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError):
        return host


def driver_addresses(conf_get: Callable[[str], Optional[str]], master: str,
                     nics: Optional[Sequence[str]]) -> Tuple[List[str], List[str]]:
    """Returns (addresses to bind, addresses to advertise) for the driver's services."""
    if nics:
        addresses = interface_addresses(nics)
        return addresses, addresses
    if is_local_master(master):
        return ["127.0.0.1"], ["127.0.0.1"]
    host = conf_get("spark.driver.host") or socket.gethostname()
    advertised = _resolve(host)
    bind = conf_get("spark.driver.bindAddress") or advertised
    return [_resolve(bind)], [advertised]


def task_bind_addresses(driver_hosts: Sequence[str],
                        nics: Optional[Sequence[str]]) -> List[str]:
    """The addresses a task service binds (and registers) on its executor."""
    if nics:
        return interface_addresses(nics)
    return [route_address(driver_hosts[0])]


def caller_addresses(spark, master: str,
                     nics: Optional[Sequence[str]]) -> Tuple[List[str], List[str]]:
    """(addresses to bind, addresses to advertise) of the caller's output link: see the
    module doc. Empty when no address can be chosen (the link is then left out)."""
    from spark_dl.spark.launch.session import conf_get, connect_host, is_connect, runs_here

    if not is_connect(spark):
        return driver_addresses(lambda key: conf_get(spark, key), master, nics)
    if nics:
        try:
            addresses = interface_addresses(nics)
        except ValueError:  # the interfaces are the executors'; the link is optional
            addresses = []
    elif runs_here(spark):
        addresses = ["127.0.0.1"]
    else:
        host = connect_host(spark)
        addresses = [route_address(_resolve(host))] if host else []
    return addresses, addresses
