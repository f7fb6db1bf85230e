"""The shard plan: rows (not row groups) go to ranks exactly once; equal step counts."""

import itertools

import numpy as np
import pytest

from spark_dl.spark.common.sharding import assign_rows, batch_sizes, rank_row_counts


def _rows_of(shards, groups):
    """Global (file, group, row) ids per rank."""
    out = []
    for shard in shards:
        out.append([(s.file_index, s.row_group, r) for s in shard for r in range(s.start, s.stop)])
    return out


UNEVEN = [(0, 0, 7), (0, 1, 13), (0, 2, 1), (1, 0, 29), (2, 0, 3), (2, 1, 0), (2, 2, 50)]


@pytest.mark.parametrize("size", [1, 2, 3, 4, 7, 10, 103, 200])
@pytest.mark.parametrize("shuffle", [False, True])
def test_every_row_exactly_once_and_balanced(size, shuffle):
    shards = assign_rows(UNEVEN, size, shuffle=shuffle, seed=11)
    per_rank = _rows_of(shards, UNEVEN)
    flat = list(itertools.chain.from_iterable(per_rank))
    expected = [(f, g, r) for f, g, n in UNEVEN for r in range(n)]
    assert sorted(flat) == sorted(expected)  # no duplicates, no drops
    counts = [len(r) for r in per_rank]
    assert max(counts) - min(counts) <= 1
    assert counts == rank_row_counts(len(expected), size)


def test_plan_is_deterministic_and_seeded():
    a = assign_rows(UNEVEN, 3, shuffle=True, seed=1)
    assert a == assign_rows(UNEVEN, 3, shuffle=True, seed=1)
    assert a != assign_rows(UNEVEN, 3, shuffle=True, seed=2)
    plain = assign_rows(UNEVEN, 1, shuffle=False)[0]
    assert [(s.file_index, s.row_group) for s in plain] == \
        [(f, g) for f, g, n in UNEVEN if n]


def test_fewer_row_groups_than_ranks_still_gives_every_rank_rows():
    shards = assign_rows([(0, 0, 10)], 4, shuffle=False)
    assert [sum(s.num_rows for s in sh) for sh in shards] == [2, 3, 2, 3]


@pytest.mark.parametrize("total,size,bs", [(10, 3, 3), (100, 3, 7), (64, 4, 16), (65, 4, 16),
                                            (1001, 8, 32), (5, 5, 2), (7, 2, 2), (9, 4, 2)])
def test_equal_steps_without_dropping(total, size, bs):
    counts = rank_row_counts(total, size)
    plans = [batch_sizes(c, bs, total_rows=total, size=size) for c in counts]
    assert len({len(p) for p in plans}) == 1, plans
    for c, p in zip(counts, plans):
        assert sum(p) == c and all(1 <= b <= bs for b in p)
        assert all(b == bs for b in p[:-2])  # only the tail is short


def test_equal_steps_impossible_is_an_error_naming_the_fix():
    with pytest.raises(ValueError, match="equal_steps=False"):
        batch_sizes(1, 1, total_rows=3, size=2)  # batch_size 1 and 3 rows on 2 ranks
    with pytest.raises(ValueError, match="fewer ranks"):
        batch_sizes(0, 4, total_rows=2, size=3)  # fewer rows than ranks
    assert batch_sizes(1, 1, total_rows=3, size=2, equal_steps=False) == [1]


def test_unequal_mode_is_plain_batching():
    assert batch_sizes(10, 4, equal_steps=False) == [4, 4, 2]
    assert batch_sizes(8, 4) == [4, 4]


def test_random_plans_property():
    rng = np.random.default_rng(0)
    for _ in range(200):
        groups = [(f, g, int(rng.integers(0, 40))) for f in range(int(rng.integers(1, 4)))
                  for g in range(int(rng.integers(1, 5)))]
        total = sum(n for _, _, n in groups)
        size = int(rng.integers(1, 9))
        shards = assign_rows(groups, size, shuffle=bool(rng.integers(2)), seed=int(rng.integers(9)))
        flat = sorted(itertools.chain.from_iterable(_rows_of(shards, groups)))
        assert flat == sorted((f, g, r) for f, g, n in groups for r in range(n))
        assert [sum(s.num_rows for s in sh) for sh in shards] == rank_row_counts(total, size)
