"""Which network a multi-host job uses: the launcher's side and each remote host's side.

One choice, made on the launcher, decides three things, so that services and data take the
same path:

- the address the rendezvous server binds (never all interfaces);
- the address each worker advertises to its peers (``SDL_HOSTNAME``): Gloo's TCP
  listeners bind it and peers connect to it;
- for ``--mpi``, Open MPI's ``oob_tcp_if_include`` and ``btl_tcp_if_include``.

The choice (:func:`choose_network`):

1. every rank on this machine: loopback, nothing to choose;
2. ``--network-interface NIC`` (or the ``gloo_iface`` knob, ``SDL_GLOO_IFACE``,
   in the launcher's environment): this machine's IPv4 address on
   ``NIC``; every remote host uses its own address on ``NIC``, which must lie in the same
   subnet (else the remote side stops with an error naming both);
3. ``--rendezvous-addr ADDR``: the address is the user's; remote workers advertise their
   host name as given in ``-H`` (the rendezvous server binds ``ADDR`` where it is an address
   of this machine, else this machine's address on the route to the first remote host);
4. otherwise: the interface on the route from this machine to the first remote host;
   every remote host uses its address in that interface's subnet, or, on a routed network
   where it has none, its address on the route back to the launcher; with neither, it stops
   with an error saying the hosts share no subnet.

The remote half (:func:`pick_address`) runs in :mod:`spark_dl.runner.remote` on each host,
from the :class:`JobNetwork` the launcher sent. IPv4 only: an IPv6 job gives
``--rendezvous-addr`` (rule 3).
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from spark_dl.runner.hosts import is_own_address

__all__ = ["JobNetwork", "Interface", "interfaces", "choose_network", "pick_address",
           "route_address", "mpi_interface_args"]

_SIOCGIFADDR = 0x8915
_SIOCGIFNETMASK = 0x891B


@dataclass(frozen=True)
class Interface:
    """One IPv4 interface of this machine (its primary address)."""

    name: str
    address: str
    network: ipaddress.IPv4Network

    def __str__(self) -> str:
        return f"{self.name} {self.address}/{self.network.prefixlen}"


def _ioctl_address(sock: socket.socket, request: int, name: str) -> Optional[str]:
    try:
        packed = fcntl.ioctl(sock.fileno(), request, struct.pack("256s", name.encode()[:15]))
    except OSError:
        return None
    return socket.inet_ntoa(packed[20:24])


def interfaces() -> List[Interface]:
    """This machine's interfaces that have an IPv4 address, in index order."""
    result = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            address = _ioctl_address(sock, _SIOCGIFADDR, name)
            mask = _ioctl_address(sock, _SIOCGIFNETMASK, name)
            if address is None or mask is None:
                continue
            network = ipaddress.ip_network(f"{address}/{mask}", strict=False)
            result.append(Interface(name, address, network))
    return result


def _describe(found: Sequence[Interface]) -> str:
    return ", ".join(str(i) for i in found) or "none with IPv4"


def route_address(remote_host: str) -> Optional[str]:
    """This machine's source address on the route to ``remote_host`` (no packet is
    sent); None when there is no route or the name does not resolve."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(remote_host, 22,
                                                       type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect(sockaddr)
            return sock.getsockname()[0]
    except OSError:
        return None


@dataclass(frozen=True)
class JobNetwork:
    """The launcher's choice (see the module docstring).

    Attributes:
        address: this machine's address on the job's network: the rendezvous server binds
            it, and local workers advertise it.
        rendezvous_addr: the address workers reach the rendezvous server at (``address``
            unless ``--rendezvous-addr`` gave another).
        interface: the interface name, where one was named or found (None for rule 3).
        subnet: ``address``'s subnet, in which remote hosts look for their own address;
            None when remote hosts advertise their names (rule 3) or the job is local.
        explicit: the interface was named (rule 2): remote hosts must have it, in
            ``subnet``.
        reason: why this network, for ``--verbose``.
    """

    address: str
    rendezvous_addr: str
    interface: Optional[str] = None
    subnet: Optional[str] = None
    explicit: bool = False
    reason: str = ""

    @property
    def local_only(self) -> bool:
        return self.address == "127.0.0.1"

    def payload(self) -> Optional[Dict[str, object]]:
        """What a remote bootstrap needs to pick its address (None: keep the host name)."""
        if self.subnet is None:
            return None
        return {"interface": self.interface, "subnet": self.subnet,
                "explicit": self.explicit}


def _interface_named(name: str, found: Sequence[Interface]) -> Interface:
    for iface in found:
        if iface.name == name:
            return iface
    raise ValueError(f"--network-interface {name}: this machine ({socket.gethostname()}) "
                     f"has no IPv4 address on {name} (its interfaces: {_describe(found)})")


def choose_network(remote_hosts: Sequence[str], nic: Optional[str] = None,
                   rendezvous_addr: Optional[str] = None) -> JobNetwork:
    """The job's network, on the launcher (rules 1-4 of the module docstring).

    Args:
        remote_hosts: the hosts other than this machine, in ``-H`` order.
        nic: the interface named by ``--network-interface`` or the ``gloo_iface`` knob.
        rendezvous_addr: ``--rendezvous-addr``.

    Raises:
        ValueError: ``nic`` has no IPv4 address here, or no route to the first remote host.
    """
    if nic is not None and "," in nic:
        raise ValueError(f"--network-interface {nic}: name one interface (a list is taken "
                         "by --mpi only)")
    if not remote_hosts:
        return JobNetwork("127.0.0.1", rendezvous_addr or "127.0.0.1", "lo",
                          reason="every rank runs on this machine")
    found = interfaces()
    if nic:
        iface = _interface_named(nic, found)
        return JobNetwork(iface.address, rendezvous_addr or iface.address, iface.name,
                          str(iface.network), explicit=True,
                          reason=f"--network-interface {nic}")
    if rendezvous_addr:
        if is_own_address(rendezvous_addr):
            bind = rendezvous_addr
        else:
            bind = route_address(remote_hosts[0])
            if bind is None:
                raise ValueError(f"no route from this machine to {remote_hosts[0]}")
        return JobNetwork(bind, rendezvous_addr, reason="--rendezvous-addr")
    address = route_address(remote_hosts[0])
    if address is None:
        raise ValueError(f"no route from this machine to {remote_hosts[0]}: check the name, "
                         "or give --network-interface or --rendezvous-addr")
    for iface in found:
        if iface.address == address:
            return JobNetwork(address, address, iface.name, str(iface.network),
                              reason=f"on the route to {remote_hosts[0]}")
    # An address on no listed interface (e.g. a secondary address): no subnet to share.
    return JobNetwork(address, address, reason=f"the route to {remote_hosts[0]}")


def pick_address(network: Dict[str, object], rendezvous_addr: str,
                 host: Optional[str] = None) -> Tuple[str, str]:
    """A remote host's own address on the job's network, and how it was found.

    Args:
        network: :meth:`JobNetwork.payload`.
        rendezvous_addr: the launcher's rendezvous address (the routed fallback).
        host: this host's name, for messages.

    Raises:
        ValueError: the named interface is missing here or outside the launcher's subnet;
            or (automatic choice) no address in the launcher's subnet and no route to it.
    """
    host = host or socket.gethostname()
    subnet = ipaddress.ip_network(str(network["subnet"]))
    nic = network.get("interface")
    found = interfaces()
    if network.get("explicit"):
        for iface in found:
            if iface.name == nic:
                if ipaddress.ip_address(iface.address) not in subnet:
                    raise ValueError(
                        f"{host}'s {nic} ({iface.address}/{iface.network.prefixlen}) is not "
                        f"in the launcher's {nic} subnet {subnet}: the hosts share no subnet "
                        f"on {nic}; name an interface that is on one subnet on every host")
                return iface.address, f"{nic}"
        raise ValueError(f"--network-interface {nic}: {host} has no IPv4 address on {nic} "
                         f"(its interfaces: {_describe(found)})")
    for iface in found:
        if ipaddress.ip_address(iface.address) in subnet:
            return iface.address, f"{iface.name}, in the launcher's subnet {subnet}"
    routed = route_address(rendezvous_addr)
    if routed is None or ipaddress.ip_address(routed).is_loopback:
        raise ValueError(
            f"{host} shares no subnet with the launcher ({subnet} on its {nic}) and has no "
            f"route to {rendezvous_addr} (its interfaces: {_describe(found)}): give "
            "--network-interface naming an interface all hosts have on one subnet")
    return routed, f"the route to {rendezvous_addr} (no address in {subnet})"


def mpi_interface_args(interfaces_value: str, given: Sequence[str] = ()) -> List[str]:
    """``--mca`` arguments restricting Open MPI's TCP and out-of-band transports to
    ``interfaces_value`` (interface names or CIDR subnets, comma-separated; the same value
    on every host), each unless the user's own arguments ``given`` set it. Open MPI then
    connects only over them; its 4.1 listeners still bind every interface (see
    docs/security.md)."""
    args: List[str] = []
    for param in ("btl_tcp_if_include", "oob_tcp_if_include"):
        if param not in given:
            args += ["--mca", param, interfaces_value]
    return args
