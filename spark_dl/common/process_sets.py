"""Process sets: collectives among a subset of ranks.

Every rank must register the same process sets in the same order (at
``init(process_sets=...)`` or with :func:`add_process_set`), including ranks
that are not members. Operations on different process sets run concurrently
with each other.
"""

from spark_dl.common.native import core as _core
from spark_dl.common.exceptions import InvalidArgumentError, raise_from_core

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set"]


def _topology(field):
    # The core's topology, read here rather than through basics.rank()/size(): basics
    # imports this module (init registers process sets), so this one does not import it.
    try:
        return _core.topology()[field]
    except _core.CoreError as e:
        raise_from_core(e)


class ProcessSet:
    """A set of ranks; ``process_set_id`` is assigned when it is registered.

    Args:
        ranks: the member ranks (any order; duplicates are an error at registration).
    """

    def __init__(self, ranks):
        self.ranks = sorted(int(r) for r in ranks)
        self.process_set_id = None

    def _require_registered(self):
        if self.process_set_id is None:
            raise InvalidArgumentError(f"process set {self.ranks} is not registered; "
                                       "pass it to init(process_sets=...) or add_process_set()")

    def size(self):
        """Number of members."""
        self._require_registered()
        return len(self.ranks)

    def rank(self):
        """This process's index in the set, or -1 when it is not a member."""
        self._require_registered()
        r = _topology("rank")
        return self.ranks.index(r) if r in self.ranks else -1

    def included(self):
        """True when this process is a member."""
        return self.rank() >= 0

    def __eq__(self, other):
        return isinstance(other, ProcessSet) and self.process_set_id == other.process_set_id \
            and self.ranks == other.ranks

    def __hash__(self):
        return hash((self.process_set_id, tuple(self.ranks)))

    def __repr__(self):
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


class _GlobalProcessSet(ProcessSet):
    def __init__(self):
        super().__init__([])
        self.process_set_id = 0

    @property
    def ranks(self):
        return list(range(_topology("size"))) if _core.is_initialized() else []

    @ranks.setter
    def ranks(self, value):
        pass


global_process_set = _GlobalProcessSet()


def _on_init(initial_sets):
    """Assigns ids 1..n to the sets registered by init (the core's order)."""
    for i, s in enumerate(initial_sets, start=1):
        if isinstance(s, ProcessSet):
            s.process_set_id = i


def add_process_set(process_set, timeout=None):
    """Registers a process set on every rank (all ranks must call this in the same order).

    Args:
        process_set: a :class:`ProcessSet` or a list of ranks.
        timeout: seconds to wait for the other ranks (None: as long as it takes).

    Returns:
        The registered :class:`ProcessSet` (with ``process_set_id`` set).
    """
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise InvalidArgumentError(f"{ps} is already registered")
    from spark_dl.common.handles import Handle

    try:
        set_id, hid = _core.add_process_set(ps.ranks)
    except _core.CoreError as e:
        raise_from_core(e)
    Handle(hid, None, lambda outputs, ints: None, name=f"add_process_set({ps.ranks})").wait(timeout)
    ps.process_set_id = set_id
    return ps


def remove_process_set(process_set, timeout=None):
    """Unregisters a process set on every rank; its pending operations fail.

    Returns:
        True when it was registered.
    """
    if process_set.process_set_id in (None, 0):
        return False
    from spark_dl.common.handles import Handle

    try:
        hid = _core.remove_process_set(process_set.process_set_id)
    except _core.CoreError as e:
        raise_from_core(e)
    Handle(hid, None, lambda outputs, ints: None, name="remove_process_set").wait(timeout)
    process_set.process_set_id = None
    return True
