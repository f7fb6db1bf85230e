"""Hosts and slots: ``-H``/``--hostfile`` parsing and rank assignment.

Ranks are assigned host by host, in the order the hosts were given: the first host's
slots take ranks 0..s0-1, the next host continues, until ``np`` ranks are placed. Within a
host, ``local_rank`` counts from 0. ``cross_rank`` of a worker is the index of its host
among the hosts that have a worker with the same ``local_rank``, and ``cross_size`` is
the number of such hosts (Horovod's definitions), so ranks with equal ``local_rank`` form
one "cross" communicator spanning hosts.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Sequence

__all__ = ["HostSlots", "SlotInfo", "parse_hosts", "parse_hostfile", "merge_hosts",
           "is_local_host", "assign_ranks"]

LOCALHOST = "localhost"


@dataclass(frozen=True)
class HostSlots:
    """A host name or address and how many workers it may run."""

    hostname: str
    slots: int

    def __str__(self) -> str:
        host = f"[{self.hostname}]" if ":" in self.hostname else self.hostname
        return f"{host}:{self.slots}"


@dataclass(frozen=True)
class SlotInfo:
    """Where one rank runs and its place in the job's topology."""

    hostname: str
    rank: int
    local_rank: int
    cross_rank: int
    size: int
    local_size: int
    cross_size: int


def _parse_entry(text: str, where: str) -> HostSlots:
    """Parses ``host``, ``host:slots``, ``[v6addr]`` or ``[v6addr]:slots``."""
    text = text.strip()
    error = ValueError(f"{where}: cannot parse host {text!r}; expected host or host:slots "
                       "(IPv6 addresses in brackets: [::1]:2)")
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise error
        slots_text = rest[1:] if rest else None
    else:
        host, sep, slots_text = text.partition(":")
        if not sep:
            slots_text = None
    if not host or any(c.isspace() for c in host) or (":" in host and not text.startswith("[")):
        raise error
    if slots_text is None:
        return HostSlots(host, 1)
    if not slots_text.isdigit():
        raise error
    slots = int(slots_text)
    if slots < 1:
        raise ValueError(f"{where}: host {text!r} has {slots} slots; need at least 1")
    return HostSlots(host, slots)


def parse_hosts(spec: str) -> List[HostSlots]:
    """Parses ``-H``: comma-separated ``host[:slots]`` (1 slot when omitted).

    Raises:
        ValueError: an entry is malformed or the list is empty.
    """
    entries = [e for e in spec.split(",") if e.strip()]
    if not entries:
        raise ValueError("-H: no hosts given")
    return [_parse_entry(e, "-H") for e in entries]


def parse_hostfile(path: str) -> List[HostSlots]:
    """Parses a host file: one host per line as ``host``, ``host:N`` or ``host slots=N``.

    Blank lines and ``#`` comments are ignored.

    Raises:
        ValueError: a line is malformed or the file names no host.
        OSError: the file cannot be read.
    """
    hosts = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            where = f"{path}:{lineno}"
            fields = line.split()
            if len(fields) == 2 and fields[1].startswith("slots="):
                slots_text = fields[1][len("slots="):]
                if not slots_text.isdigit():
                    raise ValueError(f"{where}: bad slots value in {line!r}")
                name = fields[0]
                if ":" in name and not name.startswith("["):
                    name = f"[{name}]"
                hosts.append(_parse_entry(f"{name}:{slots_text}", where))
            elif len(fields) == 1:
                hosts.append(_parse_entry(fields[0], where))
            else:
                raise ValueError(f"{where}: cannot parse {line!r}; expected 'host slots=N' "
                                 "or 'host:N'")
    if not hosts:
        raise ValueError(f"{path}: no hosts listed")
    return hosts


def is_own_address(address: str) -> bool:
    """True when ``address`` belongs to this machine (a socket can bind it)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.bind((address, 0))
        return True
    except (OSError, UnicodeError):
        return False


def is_local_host(hostname: str) -> bool:
    """True when ``hostname`` names this machine.

    Loopback names and addresses and this host's own names are local without a lookup;
    any other name is resolved, and is local if an address it resolves to can be bound
    here (i.e. belongs to one of this machine's interfaces).
    """
    name = hostname.strip().lower()
    own = socket.gethostname().lower()
    if name in (LOCALHOST, own, own.split(".")[0]):
        return True
    try:
        if ipaddress.ip_address(name).is_loopback:
            return True
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    for info in infos:
        address = info[4][0]
        if ipaddress.ip_address(address.split("%")[0]).is_loopback or is_own_address(address):
            return True
    return False


def merge_hosts(hosts: Iterable[HostSlots],
                is_local: Optional[Callable[[str], bool]] = None) -> List[HostSlots]:
    """Merges entries naming the same host, adding their slots, in first-seen order.

    Args:
        is_local: when given, every host for which it returns True is merged into one
            ``localhost`` entry, so that ``localhost`` and this machine's name do not
            become two "hosts" with overlapping local ranks.
    """
    merged: dict = {}
    for host in hosts:
        key = host.hostname.lower()
        if is_local is not None and is_local(host.hostname):
            key = LOCALHOST
        prev = merged.get(key)
        if prev is None:
            merged[key] = HostSlots(LOCALHOST if key == LOCALHOST else host.hostname,
                                    host.slots)
        else:
            merged[key] = HostSlots(prev.hostname, prev.slots + host.slots)
    return list(merged.values())


def assign_ranks(hosts: Sequence[HostSlots], np: int) -> List[SlotInfo]:
    """Places ``np`` ranks on ``hosts`` host by host; returns one SlotInfo per rank.

    Raises:
        ValueError: ``np`` < 1, more ranks than slots, or a host listed twice (merge
            first with :func:`merge_hosts`).
    """
    if np < 1:
        raise ValueError(f"-np must be at least 1, got {np}")
    total = sum(h.slots for h in hosts)
    if np > total:
        listed = ",".join(str(h) for h in hosts)
        raise ValueError(f"-np {np} exceeds the {total} slots available on {listed}")
    names = [h.hostname for h in hosts]
    if len(set(names)) != len(names):
        raise ValueError(f"host listed more than once: {names}")
    per_host: List[int] = []  # workers placed on each host, in host order
    remaining = np
    for host in hosts:
        used = min(host.slots, remaining)
        if used == 0:
            break
        per_host.append(used)
        remaining -= used
    slots: List[SlotInfo] = []
    rank = 0
    for host_index, local_size in enumerate(per_host):
        for local_rank in range(local_size):
            # Hosts holding a worker with this local_rank, in host order.
            cross = [i for i, n in enumerate(per_host) if n > local_rank]
            slots.append(SlotInfo(hostname=hosts[host_index].hostname, rank=rank,
                                  local_rank=local_rank, cross_rank=cross.index(host_index),
                                  size=np, local_size=local_size, cross_size=len(cross)))
            rank += 1
    return slots
