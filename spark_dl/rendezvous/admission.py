"""Which connections a job's servers keep: unauthenticated ones may not starve the others.

The launch services (:mod:`spark_dl.spark.launch.service`) and the rendezvous store
(:mod:`spark_dl.runner.kvstore`) listen on ports anyone on the network may reach. A
connection is *pending* from its accept until its first authenticated message, and
*authenticated* after that. :class:`PendingConnections` holds the rules for pending ones:

- a pending connection must authenticate within ``deadline_s`` of its accept, else it is
  closed (:meth:`PendingConnections.expired`);
- at most ``per_peer`` pending connections per peer address and ``total`` overall: a new
  connection over either bound *evicts the oldest* pending one (of that peer, or overall)
  instead of being refused, so a flood of idle connections cannot keep a legitimate caller
  out: its connection is the newest, and it authenticates within milliseconds;
- authenticated connections are never counted, refused or evicted here (only holders of
  the job secret can make them).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Dict, Hashable, List, Tuple

__all__ = ["PendingConnections", "DEFAULT_PER_PEER", "DEFAULT_TOTAL",
           "DEFAULT_AUTH_DEADLINE_S"]

DEFAULT_PER_PEER = 64
DEFAULT_TOTAL = 512
DEFAULT_AUTH_DEADLINE_S = 10.0


class PendingConnections:
    """Pending (not yet authenticated) connections, oldest first. Thread-safe.

    Args:
        per_peer: most pending connections per peer address.
        total: most pending connections overall.
        deadline_s: seconds a connection may stay pending.
    """

    def __init__(self, per_peer: int = DEFAULT_PER_PEER, total: int = DEFAULT_TOTAL,
                 deadline_s: float = DEFAULT_AUTH_DEADLINE_S):
        if per_peer < 1 or total < 1 or deadline_s <= 0:
            raise ValueError("per_peer and total must be >= 1 and deadline_s positive")
        self.per_peer = per_peer
        self.total = total
        self.deadline_s = deadline_s
        self._order: "collections.OrderedDict[Hashable, Tuple[str, float]]" = \
            collections.OrderedDict()
        self._of_peer: Dict[str, "collections.OrderedDict[Hashable, None]"] = {}
        self._lock = threading.Lock()
        self.evicted = 0  # pending connections closed to make room
        self.expired_count = 0  # pending connections closed at their deadline

    def admit(self, conn: Hashable, peer: str) -> List[Any]:
        """Adds a new pending connection; returns the ones it evicts (the caller closes
        them)."""
        evict = []
        with self._lock:
            mine = self._of_peer.setdefault(peer, collections.OrderedDict())
            while len(mine) >= self.per_peer:
                evict.append(self._remove(next(iter(mine))))
            while len(self._order) >= self.total:
                evict.append(self._remove(next(iter(self._order))))
            self._order[conn] = (peer, time.monotonic() + self.deadline_s)
            mine[conn] = None
            self.evicted += len(evict)
        return evict

    def authenticated(self, conn: Hashable) -> bool:
        """The connection authenticated: it is no longer pending. False if it was not
        pending (already evicted or expired: the caller should close it)."""
        with self._lock:
            if conn not in self._order:
                return False
            self._remove(conn)
            return True

    def discard(self, conn: Hashable) -> None:
        """The connection ended (closed by either side)."""
        with self._lock:
            if conn in self._order:
                self._remove(conn)

    def expired(self) -> List[Any]:
        """Removes and returns the connections past their deadline."""
        now = time.monotonic()
        out = []
        with self._lock:
            while self._order:
                conn, (_peer, deadline) = next(iter(self._order.items()))
                if deadline > now:
                    break  # admitted in order with one lifetime: the rest are younger
                out.append(self._remove(conn))
            self.expired_count += len(out)
        return out

    def __contains__(self, conn: Hashable) -> bool:
        with self._lock:
            return conn in self._order

    def __len__(self) -> int:
        with self._lock:
            return len(self._order)

    def _remove(self, conn: Hashable) -> Any:
        peer, _ = self._order.pop(conn)
        mine = self._of_peer[peer]
        del mine[conn]
        if not mine:
            del self._of_peer[peer]
        return conn
