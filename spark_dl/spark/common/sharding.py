"""Which rows each rank reads in an epoch, and how they are cut into batches.

The plan is a pure function of (row-group sizes, number of ranks, seed, batch size), so every
rank computes the same plan on its own and no coordination is needed.

**Rows, not row groups, are assigned.** Row groups are put in one order (seeded when
shuffling), concatenated into one global row range ``[0, N)``, and rank ``r`` gets the
contiguous range ``[r*N//W, (r+1)*N//W)``. Ranks therefore hold ``floor(N/W)`` or
``ceil(N/W)`` rows and every row belongs to exactly one rank; a row group that straddles a
boundary is read in part by two ranks (at most two such partial reads per rank). Assigning
whole row groups instead (as petastorm's ``cur_shard`` does) leaves ranks with unequal row
counts, and ranks with no row group at all when there are fewer row groups than ranks.

The assignment stays the same across epochs (so a rank can cache its share); what changes per
epoch is the order in which a rank reads its slices and its shuffle buffer.

**Equal step counts.** Data-parallel training needs every rank to take the same number of
steps, or a collective waits forever. With ``equal_steps`` every rank yields
``S = ceil(ceil(N/W) / batch_size)`` batches: full batches, then the shortfall is taken from
the last batches (a rank with one row fewer may end with batches of ``B-1`` and ``1`` rows
instead of one of ``B``). No sample is dropped or repeated. When that is impossible (fewer rows
than ranks, or ``batch_size == 1`` with ``N % W != 0``) :func:`batch_sizes` raises and names the
fix.
"""

import dataclasses
from typing import List, Optional, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class RowSlice:
    """Rows ``[start, stop)`` of row group ``row_group`` of file number ``file_index``."""

    file_index: int
    row_group: int
    start: int
    stop: int

    @property
    def num_rows(self) -> int:
        return self.stop - self.start


def row_group_order(num_row_groups: int, shuffle: bool, seed: int) -> np.ndarray:
    """The global order of row groups: natural, or a permutation fixed by ``seed``."""
    if not shuffle:
        return np.arange(num_row_groups)
    return np.random.default_rng([seed, 0x5EED]).permutation(num_row_groups)


def assign_rows(row_groups: Sequence[tuple], size: int, *, shuffle: bool = True,
                seed: int = 0) -> List[List[RowSlice]]:
    """Split the rows of ``row_groups`` over ``size`` ranks, exactly once each.

    Args:
        row_groups: ``(file_index, row_group, num_rows)`` for every row group, in a stable
            order (e.g. files sorted by name, then row groups in file order).
        size: number of ranks.
        shuffle: permute the row groups (with ``seed``) before cutting.
        seed: the same on every rank.

    Returns:
        For each rank, its slices in global order. Empty row groups are skipped.
    """
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    groups = [g for g in row_groups if g[2] > 0]
    order = row_group_order(len(groups), shuffle, seed)
    counts = np.array([groups[i][2] for i in order], dtype=np.int64)
    ends = np.cumsum(counts)
    starts = ends - counts
    total = int(ends[-1]) if len(ends) else 0
    shards: List[List[RowSlice]] = []
    for r in range(size):
        lo, hi = r * total // size, (r + 1) * total // size
        mine = []
        # Row groups overlapping [lo, hi): the first one whose end is past lo, up to the
        # first one starting at or after hi.
        first = int(np.searchsorted(ends, lo, side="right"))
        for k in range(first, len(order)):
            if starts[k] >= hi:
                break
            f, g, n = groups[order[k]]
            a = max(lo, int(starts[k])) - int(starts[k])
            b = min(hi, int(ends[k])) - int(starts[k])
            if b > a:
                mine.append(RowSlice(f, g, a, b))
        shards.append(mine)
    return shards


def rank_row_counts(total_rows: int, size: int) -> List[int]:
    """Rows held by each rank under :func:`assign_rows`."""
    return [(r + 1) * total_rows // size - r * total_rows // size for r in range(size)]


def batch_sizes(num_rows: int, batch_size: int, *, total_rows: Optional[int] = None,
                size: int = 1, equal_steps: bool = True) -> List[int]:
    """Sizes of the batches a rank holding ``num_rows`` rows yields in one epoch.

    Args:
        num_rows: rows of this rank.
        batch_size: the largest batch.
        total_rows, size: rows across all ranks and number of ranks; needed for
            ``equal_steps`` (defaults: this rank alone).
        equal_steps: make every rank yield the same number of batches (see module doc).
            When False, a rank yields ``ceil(num_rows / batch_size)`` batches, the last one
            short.

    Raises:
        ValueError: when equal step counts cannot be had without dropping or repeating rows.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not equal_steps or size == 1:
        full, rest = divmod(num_rows, batch_size)
        return [batch_size] * full + ([rest] if rest else [])
    total_rows = num_rows * size if total_rows is None else total_rows
    most = -(-total_rows // size)
    least = total_rows // size
    steps = -(-most // batch_size)
    if least < steps:
        raise ValueError(
            f"{total_rows} rows cannot give each of {size} ranks the same number of batches "
            f"({steps}) of at most {batch_size} rows without dropping or repeating rows; "
            f"use batch_size >= 2, fewer ranks, more rows, or equal_steps=False")
    sizes = [batch_size] * steps
    shortfall = steps * batch_size - num_rows
    k = steps - 1
    while shortfall > 0:  # take from the end, keeping every batch at least one row
        take = min(shortfall, sizes[k] - 1)
        sizes[k] -= take
        shortfall -= take
        k -= 1
    return sizes
