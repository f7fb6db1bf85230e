"""Rank assignment: registered tasks -> ranks, grouped by host.

Hosts are ordered by their lowest task index, and within a host tasks by index; ranks
are then assigned host by host exactly as ``sdlrun`` assigns them to ``-H`` entries
(:func:`spark_dl.runner.hosts.assign_ranks`), so ranks on one host are consecutive and
``local_rank``/``local_size``/``cross_rank``/``cross_size`` follow Horovod's definitions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence

from spark_dl.runner.hosts import HostSlots, SlotInfo, assign_ranks
from spark_dl.spark.launch.driver.service import Registration

__all__ = ["Placement", "plan_ranks"]


@dataclass(frozen=True)
class Placement:
    """One rank: the task hosting it and its place in the topology."""

    task: Registration
    slot: SlotInfo

    @property
    def rank(self) -> int:
        return self.slot.rank


def plan_ranks(registrations: Sequence[Registration]) -> List[Placement]:
    """Returns one placement per registration, ordered by rank."""
    by_host: Dict[str, List[Registration]] = {}
    for reg in sorted(registrations, key=lambda r: r.index):
        by_host.setdefault(reg.host_hash, []).append(reg)
    hosts = [HostSlots(h, len(regs)) for h, regs in by_host.items()]
    slots = assign_ranks(hosts, len(registrations))
    ordered = [reg for regs in by_host.values() for reg in regs]
    return [Placement(reg, slot) for reg, slot in zip(ordered, slots)]
