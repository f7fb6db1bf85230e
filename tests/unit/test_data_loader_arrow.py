"""The Arrow loader on Parquet files written here (no Spark): exact-once epochs across ranks,
reproducible shuffles, the memory bound, the cache, torch output, decoding and errors."""

import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spark_dl.spark.common.data_loader import ArrowDataLoader
from spark_dl.spark.common.data_loader_base import (BaseDataLoader, DataSource,
                                                    get_data_loader_class, make_data_loader,
                                                    register_data_loader)
from spark_dl.spark.common.metadata import ColumnSpec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Row groups of very different sizes, including tiny and empty ones, over three files.
UNEVEN = [[7, 13, 1], [29], [3, 0, 50, 2]]


def write_dataset(path, groups=UNEVEN, dim=3):
    """Files of rows with id i, x = [i, 2i, ...] (float32) and y = i % 5 (int32)."""
    os.makedirs(path, exist_ok=True)
    start = 0
    for f, sizes in enumerate(groups):
        writer = None
        for n in sizes:
            ids = np.arange(start, start + n, dtype=np.int64)
            start += n
            x = (ids[:, None] * np.arange(1, dim + 1)).astype(np.float32)
            table = pa.table({"id": ids,
                              "x": pa.FixedSizeListArray.from_arrays(x.ravel(), dim)
                              .cast(pa.list_(pa.float32())),
                              "y": (ids % 5).astype(np.int32)})
            if writer is None:
                writer = pq.ParquetWriter(os.path.join(path, f"part-{f:05d}.parquet"),
                                          table.schema)
            writer.write_table(table, row_group_size=max(n, 1))
        writer.close()
    return start


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("uneven"))
    total = write_dataset(path)
    return DataSource.from_path(path), total


def epoch_ids(source, size, epoch=0, **kw):
    """ids seen by each rank in one epoch, and the batch counts."""
    out, steps = [], []
    for rank in range(size):
        loader = ArrowDataLoader(source, rank=rank, size=size, **kw)
        loader.set_epoch(epoch)
        batches = list(loader)
        assert len(batches) == len(loader)
        for b in batches:  # rows stay intact through shuffling
            np.testing.assert_array_equal(b["x"][:, 1], 2 * b["id"])
            np.testing.assert_array_equal(b["y"], b["id"] % 5)
        out.append(np.concatenate([b["id"] for b in batches]))
        steps.append(len(batches))
    return out, steps


@pytest.mark.parametrize("size", [1, 2, 3])
@pytest.mark.parametrize("mode", ["plain", "shuffle", "tiny-pieces"])
def test_exact_once_per_epoch_across_ranks(uneven, size, mode):
    source, total = uneven
    kw = {"batch_size": 4, "seed": 7}
    if mode == "plain":
        kw["shuffle"] = False
    elif mode == "tiny-pieces":  # forces pieces smaller than row groups and a small pool
        kw.update(read_chunk_rows=4, shuffle_buffer_size=6, num_threads=3)
    for epoch in range(2):
        ids, steps = epoch_ids(source, size, epoch, **kw)
        seen = np.concatenate(ids)
        assert len(seen) == total and len(np.unique(seen)) == total  # no drops, no dupes
        assert len(set(steps)) == 1  # equal step counts on every rank
        counts = [len(i) for i in ids]
        assert max(counts) - min(counts) <= 1
    if mode == "plain" and size == 1:
        np.testing.assert_array_equal(ids[0], np.arange(total))


def test_shuffle_is_reproducible_and_changes_per_epoch(uneven):
    source, _ = uneven
    kw = dict(batch_size=5, rank=1, size=2, seed=3, shuffle_buffer_size=16)
    a = [b["id"] for b in ArrowDataLoader(source, **kw)]
    b = [b["id"] for b in ArrowDataLoader(source, **kw)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b)) and len(a) == len(b)
    loader = ArrowDataLoader(source, **kw)
    first = np.concatenate([x["id"] for x in loader])
    second = np.concatenate([x["id"] for x in loader])  # next epoch without set_epoch
    assert not np.array_equal(first, second)
    assert sorted(first) == sorted(second)  # same shard every epoch
    loader.set_epoch(0)
    np.testing.assert_array_equal(np.concatenate([x["id"] for x in loader]), first)
    other_seed = np.concatenate([x["id"] for x in ArrowDataLoader(source, **{**kw, "seed": 4})])
    assert not np.array_equal(first, other_seed)
    assert not np.array_equal(np.sort(first), first)  # it is actually shuffled


def test_thread_count_does_not_change_the_order(uneven):
    source, _ = uneven
    kw = dict(batch_size=3, seed=5, shuffle_buffer_size=10, read_chunk_rows=5)
    runs = [np.concatenate([b["id"] for b in ArrowDataLoader(source, num_threads=t, **kw)])
            for t in (1, 2, 4)]
    assert all(np.array_equal(runs[0], r) for r in runs[1:])


def test_unequal_steps_mode(uneven):
    source, total = uneven
    lens = [len(ArrowDataLoader(source, batch_size=1, rank=r, size=4, equal_steps=False))
            for r in range(4)]
    assert sum(lens) == total and max(lens) - min(lens) == 1
    with pytest.raises(ValueError, match="equal_steps=False"):
        ArrowDataLoader(source, batch_size=1, rank=0, size=4)


def test_numpy_batches_convert_to_torch_without_copy(uneven):
    torch = pytest.importorskip("torch")
    from spark_dl.spark.torch.util import torch_batch

    source, _ = uneven
    arrays = next(iter(ArrowDataLoader(source, batch_size=8, shuffle=False)))
    assert all(isinstance(v, np.ndarray) for v in arrays.values())
    batch = torch_batch(arrays)
    assert batch["x"].data_ptr() == arrays["x"].ctypes.data  # shares the loader's memory
    assert isinstance(batch["x"], torch.Tensor) and batch["x"].dtype == torch.float32
    assert tuple(batch["x"].shape) == (8, 3) and batch["id"].dtype == torch.int64
    assert batch["id"].tolist() == list(range(8))
    frozen = np.arange(4, dtype=np.float32)
    frozen.flags.writeable = False  # as Arrow hands its buffers out: copied, no torch warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = torch_batch({"x": frozen})["x"]
    assert t.data_ptr() != frozen.ctypes.data and t.tolist() == [0, 1, 2, 3]


def test_cut_hands_out_views_of_pieces_and_copies_across_boundaries():
    from spark_dl.spark.common.batching import cut

    pieces = [{"x": np.arange(n * 2, dtype=np.float32).reshape(n, 2) + 100 * i}
              for i, n in enumerate([7, 5, 9])]
    sizes = [3, 3, 3, 3, 3, 3, 3]
    expected = np.concatenate([p["x"] for p in pieces])
    for views in (False, True):
        batches = [b["x"] for b in cut(iter(pieces), sizes, group=2, views=views)]
        np.testing.assert_array_equal(np.concatenate(batches), expected)
        assert [len(b) for b in batches] == sizes
        shared = [any(np.shares_memory(b, p["x"]) for p in pieces) for b in batches]
        # rows 0-2, 3-5 in piece 0 (rows 0-6); 6-8 across 0/1; 9-11 in piece 1 (7-11) ...
        assert shared == ([True, True, False, True, True, True, True] if views
                          else [False] * 7)


@pytest.mark.parametrize("kw", [dict(shuffle=False), dict(shuffle=True, shuffle_buffer_size=0),
                                dict(shuffle=True, shuffle_buffer_size=16),
                                dict(shuffle=False, cache_in_memory=True)])
def test_batches_are_the_same_and_writable_with_or_without_views(uneven, kw):
    """In order without a cache, batches are views of the decoded pieces (plan["views"]);
    they hold the same values as the copies made otherwise, and every column of every
    batch is writable (Arrow's zero-copy scalar arrays are not), in every mode."""
    source, _ = uneven
    loader = ArrowDataLoader(source, batch_size=4, seed=2, read_chunk_rows=9, **kw)
    no_pool = not kw["shuffle"] or kw["shuffle_buffer_size"] == 0
    assert loader.plan["views"] == (no_pool and "cache_in_memory" not in kw)
    batches = list(loader)
    copies = list(ArrowDataLoader(source, batch_size=4, seed=2, read_chunk_rows=9,
                                  cache_in_memory=True, **{k: v for k, v in kw.items()
                                                           if k != "cache_in_memory"}))
    assert len(batches) == len(copies)
    for b, c in zip(batches, copies):
        for name in b:
            assert b[name].dtype == c[name].dtype
            np.testing.assert_array_equal(b[name], c[name])
            assert b[name].flags.writeable, name
    before = [b["x"].copy() for b in batches]
    batches[0]["x"][:] = -1  # a batch is the caller's: changing it changes no other batch
    for b, old in zip(batches[1:], before[1:]):
        np.testing.assert_array_equal(b["x"], old)


def test_columns_selection_and_errors(uneven, tmp_path):
    source, _ = uneven
    batch = next(iter(ArrowDataLoader(source, batch_size=2, columns=["y"])))
    assert list(batch) == ["y"]
    with pytest.raises(KeyError, match="nope"):
        ArrowDataLoader(source, batch_size=2, columns=["nope"])
    pq.write_table(pa.table({"s": ["a", "b"]}), str(tmp_path / "s.parquet"))
    with pytest.raises(TypeError, match="'s'"):
        ArrowDataLoader(DataSource.from_path(str(tmp_path / "s.parquet")), batch_size=1)
    with pytest.raises(ValueError, match="rank"):
        ArrowDataLoader(source, batch_size=2, rank=2, size=2)
    with pytest.raises(ValueError, match="memory_limit_bytes"):
        ArrowDataLoader(source, batch_size=1000, memory_limit_bytes=10000)


def test_bad_data_is_reported_with_the_column(tmp_path):
    pq.write_table(pa.table({"a": pa.array([[1.0, 2.0], [3.0]])}), str(tmp_path / "ragged.parquet"))
    with pytest.raises(ValueError, match="'a' holds arrays of different lengths"):
        list(ArrowDataLoader(DataSource.from_path(str(tmp_path / "ragged.parquet")),
                             batch_size=2))
    pq.write_table(pa.table({"b": pa.array([1.0, None])}), str(tmp_path / "nulls.parquet"))
    with pytest.raises(ValueError, match="'b' has null"):
        list(ArrowDataLoader(DataSource.from_path(str(tmp_path / "nulls.parquet")),
                             batch_size=2))


def test_sparse_columns_are_densified(tmp_path):
    indices = pa.array([[0, 3], [], [2]], type=pa.list_(pa.int32()))
    values = pa.array([[1.5, 2.5], [], [7.0]], type=pa.list_(pa.float64()))
    s = pa.StructArray.from_arrays([indices, values], names=["indices", "values"])
    pq.write_table(pa.table({"s": s, "id": [0, 1, 2]}), str(tmp_path / "sp.parquet"))
    src = DataSource.from_path(str(tmp_path / "sp.parquet"))
    src.columns = {"s": ColumnSpec("s", "vector", "float64", (4,), sparse=True),
                   "id": ColumnSpec("id", "scalar", "int64", ())}
    batch = next(iter(ArrowDataLoader(src, batch_size=3, shuffle=False)))
    np.testing.assert_array_equal(batch["s"], [[1.5, 0, 0, 2.5], [0, 0, 0, 0], [0, 0, 7.0, 0]])


def test_cache_in_memory_serves_later_epochs_without_files(tmp_path):
    path = str(tmp_path / "c")
    total = write_dataset(path)
    loader = ArrowDataLoader(DataSource.from_path(path), batch_size=4, seed=1,
                             cache_in_memory=True)
    first = np.concatenate([b["id"] for b in loader])
    for name in os.listdir(path):  # the second epoch must not touch the files
        os.remove(os.path.join(path, name))
    second = np.concatenate([b["id"] for b in loader])
    assert sorted(first) == sorted(second) == list(range(total))
    assert not np.array_equal(first, second)


@pytest.mark.parametrize("shuffle", [True, False])  # False: no assembler, views
def test_early_break_and_close_stop_the_threads(uneven, shuffle):
    source, _ = uneven
    before = threading.active_count()
    loader = ArrowDataLoader(source, batch_size=1, read_chunk_rows=2, num_threads=3,
                             shuffle=shuffle)
    it = iter(loader)
    next(it)
    it.close()
    loader2 = ArrowDataLoader(source, batch_size=1, read_chunk_rows=2, num_threads=3,
                              shuffle=shuffle)
    it2 = iter(loader2)
    next(it2)
    loader2.close()
    deadline = time.time() + 5
    while threading.active_count() > before and time.time() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before
    with pytest.raises(RuntimeError, match="closed"):
        iter(loader2)


@pytest.mark.parametrize("shuffle", [True, False])
def test_reader_errors_reach_the_caller(tmp_path, shuffle):
    path = str(tmp_path / "bad")
    write_dataset(path, groups=[[10]])
    src = DataSource.from_path(path)
    loader = ArrowDataLoader(src, batch_size=2, shuffle=shuffle)
    with open(src.files[0], "r+b") as f:  # corrupt the data pages, keep the footer
        f.seek(4)
        f.write(b"\xff" * 200)
    with pytest.raises(OSError, match=r"cannot read .*part-00000\.parquet \(row group 0\):"
                                      r".*damaged.*Store\.cleanup"):
        list(loader)
    loader = ArrowDataLoader(src, batch_size=2, shuffle=shuffle)
    os.remove(src.files[0])  # gone after the loader was made: named too
    with pytest.raises(OSError, match=r"cannot read .*part-00000\.parquet \(row group 0\)"):
        list(loader)


def test_registry_and_custom_loader(uneven):
    source, _ = uneven
    assert get_data_loader_class("arrow") is ArrowDataLoader
    with pytest.raises(ValueError, match="unknown data loader"):
        get_data_loader_class("nope")

    class Ones(BaseDataLoader):
        def __len__(self):
            return 2

        def _iterate(self, epoch):
            for _ in range(2):
                yield {"one": np.ones(self.batch_size) * epoch}

    register_data_loader("ones", Ones)
    loader = make_data_loader(source, "ones", batch_size=3)
    assert [b["one"].tolist() for b in loader] == [[0.0] * 3] * 2
    assert next(iter(loader))["one"].tolist() == [1.0] * 3  # second epoch
    with pytest.raises(TypeError):
        register_data_loader("bad", dict)


MEMORY_SCRIPT = textwrap.dedent("""
    import os, sys, tracemalloc, numpy as np, pandas, pyarrow as pa, pyarrow.parquet as pq
    sys.path.insert(0, {root!r})
    from spark_dl.spark.common.data_loader import ArrowDataLoader
    from spark_dl.spark.common.data_loader_base import DataSource
    # Warm up lazy imports (pyarrow pulls in pandas on first conversion) on a tiny file, so
    # that they are not counted; the Arrow pool's peak is still untouched by real data.
    tiny = os.path.join({tmp!r}, "tiny.parquet")
    pq.write_table(pa.table({{"a": [1, 2]}}), tiny)
    next(iter(ArrowDataLoader(DataSource.from_path(tiny), batch_size=2)))
    limit = {limit}
    loader = ArrowDataLoader(DataSource.from_path({path!r}), batch_size=256, seed=0,
                             memory_limit_bytes=limit, shuffle_buffer_size=10**6,
                             shuffle={shuffle})
    held = []  # the caller keeps a few batches, as a training loop may
    pool = pa.default_memory_pool()
    tracemalloc.start()
    base_np = tracemalloc.get_traced_memory()[0]
    rows = 0
    for batch in loader:
        rows += len(batch["id"])
        held = (held + [batch])[-{held}:]
        del batch
    np_peak = tracemalloc.get_traced_memory()[1] - base_np
    print(rows, np_peak, pool.max_memory(), loader.plan["pool_rows"], loader.plan["piece_rows"])
""")


@pytest.mark.parametrize("shuffle", [True, False])
def test_memory_bound_is_respected(tmp_path, shuffle):
    """64 MB of decoded data through a 16 MB limit, with a shuffle buffer asked for that alone
    would take 600 MB (or in order, where batches are views that keep their pieces alive,
    and the caller holds its last two batches): the peak of NumPy (tracemalloc) plus Arrow
    (memory pool) allocations stays near the limit."""
    path = str(tmp_path / "big")
    total = write_dataset(path, groups=[[20000] * 4, [15000, 5000]], dim=150)
    data_bytes = total * (150 * 4 + 8 + 4)
    limit = 16 << 20
    out = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT.format(
        root=ROOT, path=path, limit=limit, tmp=str(tmp_path), shuffle=shuffle, held=2)],
        capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    rows, np_peak, arrow_peak, pool_rows, piece_rows = map(int, out.stdout.split())
    assert rows == total
    assert piece_rows < 20000 and pool_rows < 10**6 // 10  # pieces and pool were capped
    assert (pool_rows > 0) == shuffle
    assert data_bytes > 3.5 * limit
    # Both peaks are added although they need not coincide (an upper bound of the real
    # peak); the slack covers Parquet reader working memory, which is estimated, not known.
    assert np_peak + arrow_peak <= 1.5 * limit, (np_peak, arrow_peak, limit)
