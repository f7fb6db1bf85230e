"""The Arrow-native data loader: Parquet row groups -> NumPy batches on one rank.

Pipeline of one epoch (threads in brackets)::

    [reader x num_threads]  Parquet slice -> decoded pieces (dict of NumPy arrays)
            | ordered hand-off, admission bounded by the prefetch budget
    [assembler]             shuffle buffer -> batches of the planned sizes
            | queue of finished batches (in groups of ~1 MiB)
    [caller]                for batch in loader: ...

Without a shuffle buffer and without the in-memory cache there is no assembler: the caller's
thread cuts batches from the pieces as it iterates, and a batch inside one piece is a view of
it (no copy; only batches across piece boundaries are copied). Otherwise every batch is a
copy, made by the assembler.

What each rank reads is fixed by :func:`~spark_dl.spark.common.sharding.assign_rows` (rows,
not whole row groups, so every sample is seen exactly once per epoch across ranks), and the
batch sizes by :func:`~spark_dl.spark.common.sharding.batch_sizes` (equal step counts on all
ranks by default). Both are computed identically on every rank from the row-group sizes.

Shuffling (``shuffle=True``) is seeded and reproducible: the global row-group order depends on
``seed``; each epoch a rank reads its slices in an order drawn from ``(seed, epoch, rank)``
and mixes rows through a shuffle buffer of up to ``shuffle_buffer_size`` rows: each batch is a
random subset of the full buffer, and the next rows of the stream take the freed slots.
Readers run in parallel but hand pieces over in plan order, and the shuffle draws depend only
on row counts, so the batches depend neither on thread timing nor on the memory plan. Cutting
batches and the shuffle buffer live in :mod:`spark_dl.spark.common.batching`.

Memory: ``memory_limit_bytes`` bounds what the loader holds: prefetched pieces, the shuffle
buffer, queued batches, the batch being handed out, and the Parquet readers' working memory.
The loader derives the number of reader threads, the buffer size, the piece size (rows decoded
at once, which may be smaller than a row group) and the prefetch budget from it; pieces are
admitted into the prefetch stage only while they fit. The reader working memory and the
decoding peak are estimates (measured with pyarrow 26), so the bound holds to within about a
quarter, and a limit far below the size of a few row groups raises at construction. The
optional in-memory cache (``cache_in_memory=True``) keeps this rank's decoded data after the
first epoch and is not counted in the limit: use it for data that fits.
"""

import queue
import threading
import weakref
from typing import Dict, Iterator, List, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from spark_dl.spark.common import constants, raw_columns
from spark_dl.spark.common.batching import cut, pool_shuffle
from spark_dl.spark.common.data_loader_base import BaseDataLoader, DataSource
from spark_dl.spark.common.metadata import ColumnSpec
from spark_dl.spark.common.sharding import RowSlice, assign_rows, batch_sizes

_POLL_S = 0.1
# Buffered reads of column chunks: without it a whole column chunk is read into memory at once.
_READ_BUFFER = 1 << 20
# Working memory of one reader thread besides the rows it decodes: the read buffer, compressed
# and decompressed pages, level buffers (measured 4-6 MiB with pyarrow 26 and 1 MiB pages; less
# for row groups smaller than that).
_READER_OVERHEAD = 6 << 20
# Peak Arrow memory while decoding a piece, as a multiple of its decoded size (record batch
# builders plus the finished arrays).
_DECODE_FACTOR = 3


class _Closed(Exception):
    """Raised inside pipeline threads when the epoch is being torn down."""


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


_END = object()


def _nbytes(piece: Dict[str, np.ndarray]) -> int:
    return sum(a.nbytes for a in piece.values())


class _PrefetchBudget:
    """Byte budget for decoded pieces waiting for the assembler, admitted in plan order.

    Slices are numbered in the order the assembler consumes them. A reader may reserve bytes
    for its slice only when all earlier slices have reserved everything they need ("turn"),
    and only while the reservation fits (or nothing is reserved). Because the assembler
    consumes in the same order and releases a piece as soon as it takes it, the slice it
    waits for can always make progress: no deadlock, and at most one piece beyond the limit
    (the head-of-line slice, if a piece turns out larger than estimated).
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self.peak = 0
        self.turn = 0
        self.head = 0
        self.closed = False
        self.cv = threading.Condition()

    def acquire(self, turn: int, nbytes: int, last: bool) -> None:
        with self.cv:
            while not self.closed:
                if turn == self.head or (turn <= self.turn and
                                         (self.used == 0 or self.used + nbytes <= self.limit)):
                    break
                self.cv.wait(_POLL_S)
            if self.closed:
                raise _Closed()
            self.used += nbytes
            self.peak = max(self.peak, self.used)
            if last and turn >= self.turn:
                self.turn = turn + 1
                self.cv.notify_all()

    def end_turn(self, turn: int) -> None:
        with self.cv:
            if turn >= self.turn:
                self.turn = turn + 1
                self.cv.notify_all()

    def adjust(self, delta: int) -> None:
        with self.cv:
            self.used += delta
            self.peak = max(self.peak, self.used)
            self.cv.notify_all()

    def set_head(self, head: int) -> None:
        with self.cv:
            self.head = head
            self.cv.notify_all()

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify_all()


class ArrowDataLoader(BaseDataLoader):
    """Reads Parquet with ``pyarrow.parquet`` and yields batches for one rank.

    Args:
        source: the :class:`DataSource` to read (``DataSource.from_store(store, idx)`` for a
            prepared dataset, ``DataSource.from_path(dir)`` for plain Parquet).
        batch_size: rows per batch (the last batches of an epoch may be smaller).
        rank, size: this rank and the number of ranks (from the training framework).
        columns: columns to yield; default all.
        shuffle: seeded shuffling of row-group order and rows (see module doc).
        seed: shuffle seed; must be the same on all ranks.
        shuffle_buffer_size: rows in the shuffle buffer (0: only row-group order is shuffled).
            Capped by what ``memory_limit_bytes`` allows.
        num_threads: background reader threads (Parquet decoding releases the GIL).
        prefetch_batches: finished batches kept ready ahead of the caller (at least; small
            batches travel in groups of about 1 MiB). Without a shuffle buffer or cache the
            batches are views cut by the caller, and decoded pieces are what is read ahead.
        memory_limit_bytes: bound on the memory the loader holds, within about a quarter
            (see module doc).
        cache_in_memory: keep this rank's decoded rows after the first epoch.
        equal_steps: every rank yields the same number of batches per epoch (raises at
            construction when impossible without dropping or repeating rows).
        read_chunk_rows: rows decoded at once (default: derived from the memory limit).
            Output does not depend on it.

    Attributes:
        total_rows: rows across all ranks; num_rows: rows of this rank;
        specs: ColumnSpec per yielded column; plan: the derived memory plan.
    """

    def __init__(self, source: DataSource, *, batch_size: int, rank: int = 0, size: int = 1,
                 columns: Optional[Sequence[str]] = None, shuffle: bool = True, seed: int = 0,
                 shuffle_buffer_size: int = 65536, num_threads: int = 2,
                 prefetch_batches: int = 2, memory_limit_bytes: int = 256 << 20,
                 cache_in_memory: bool = False, equal_steps: bool = True,
                 read_chunk_rows: Optional[int] = None):
        super().__init__(source, batch_size=batch_size, rank=rank, size=size, columns=columns,
                         shuffle=shuffle, seed=seed)
        if num_threads < 1 or prefetch_batches < 1 or shuffle_buffer_size < 0:
            raise ValueError("need num_threads >= 1, prefetch_batches >= 1, "
                             "shuffle_buffer_size >= 0")
        if not source.files:
            raise ValueError("the data source has no files")
        self._fs = source.filesystem or pafs.LocalFileSystem()
        self._num_threads = int(num_threads)
        self._read_chunk_rows = read_chunk_rows
        self._prefetch_batches = int(prefetch_batches)
        self._shape_lock = threading.Lock()

        footer0 = None
        if source.row_groups is not None:
            row_groups = source.row_groups
        else:
            footers = [pq.read_metadata(f, filesystem=self._fs) for f in source.files]
            row_groups = [[md.row_group(g).num_rows for g in range(md.num_row_groups)]
                          for md in footers]
            footer0 = footers[0]
        self.specs = self._resolve_specs()
        self._parquet_columns = list(self.specs)
        groups = [(f, g, n) for f, counts in enumerate(row_groups) for g, n in enumerate(counts)]
        self.total_rows = sum(g[2] for g in groups)
        if self.total_rows == 0:
            raise ValueError(f"the data source ({len(source.files)} files) has no rows")
        self._slices: List[RowSlice] = assign_rows(groups, size, shuffle=shuffle, seed=seed)[rank]
        self.num_rows = sum(s.num_rows for s in self._slices)
        self._sizes = batch_sizes(self.num_rows, self.batch_size, total_rows=self.total_rows,
                                  size=size, equal_steps=equal_steps)
        self._row_bytes = self._estimate_row_bytes(footer0)
        group_bytes = max(g[2] for g in groups) * self._row_bytes
        self._read_buffer = int(min(_READ_BUFFER, max(64 << 10, group_bytes)))
        self._reader_overhead = int(min(_READER_OVERHEAD, 2 * group_bytes + self._read_buffer))
        self.plan = self._memory_plan(int(memory_limit_bytes), int(shuffle_buffer_size),
                                      bool(cache_in_memory))
        self._cache: Optional[Dict[int, List[Dict[str, np.ndarray]]]] = \
            {} if cache_in_memory else None
        self._runs = weakref.WeakSet()

    # ------------------------------------------------------------------ set-up

    def _resolve_specs(self) -> Dict[str, ColumnSpec]:
        known = self.source.columns
        if known is None:
            schema = pq.read_schema(self.source.files[0], filesystem=self._fs)
            known = {}
            for field in schema:
                spec = _spec_from_arrow(field)
                if spec is not None:
                    known[field.name] = spec
            names = self.columns if self.columns is not None else schema.names
            for name in names:
                if name not in schema.names:
                    raise KeyError(f"column {name!r} is not in the Parquet files "
                                   f"(columns: {schema.names})")
                if name not in known:
                    raise TypeError(
                        f"column {name!r} has Parquet type {schema.field(name).type} that the "
                        "Arrow loader cannot decode without dataset metadata; supported: "
                        "numeric/bool scalars and lists of numbers of one length (pass "
                        "columns=[...] to leave it out)")
        names = self.columns if self.columns is not None else list(known)
        missing = [n for n in names if n not in known]
        if missing:
            raise KeyError(f"columns {missing} are not in the dataset (columns: {list(known)})")
        if not names:
            raise ValueError("no columns to read")
        return {n: known[n] for n in names}

    def _estimate_row_bytes(self, footer0) -> int:
        exact = [s.row_bytes for s in self.specs.values()]
        if all(b is not None for b in exact):
            return max(1, sum(exact))
        md = footer0 or pq.read_metadata(self.source.files[0], filesystem=self._fs)
        wanted = set(self.specs)
        size = rows = 0
        for g in range(md.num_row_groups):
            rg = md.row_group(g)
            rows += rg.num_rows
            for c in range(rg.num_columns):
                col = rg.column(c)
                if col.path_in_schema.split(".")[0] in wanted:
                    size += col.total_uncompressed_size
        return max(1, size // max(rows, 1))

    def _memory_plan(self, limit: int, shuffle_buffer_size: int,
                     cache_in_memory: bool) -> Dict[str, int]:
        rb = self._row_bytes
        batch_bytes = self.batch_size * rb
        # Batches travel to the caller in groups of about 1 MiB: one queue hand-off per batch
        # would cost more than building small batches.
        group = int(max(1, min(64, (1 << 20) // batch_bytes)))
        queued = -(-self._prefetch_batches // group)
        # Batches: queued groups + the group being assembled + the group being handed out.
        fixed = (queued + 2) * group * batch_bytes
        # Reader threads cost working memory of their own: use fewer when the limit is tight
        # (at most a third of what is left goes to reader overhead).
        overhead = self._reader_overhead
        threads = int(min(self._num_threads, max(1, (limit - fixed) // (3 * overhead))))
        remaining = limit - fixed - threads * overhead
        min_prefetch = 2 * _DECODE_FACTOR * rb * min(self.batch_size, 256)
        if remaining < min_prefetch:
            raise ValueError(
                f"memory_limit_bytes={limit} is too small for batches of {self.batch_size} rows "
                f"of ~{rb} bytes and a reader thread: need at least "
                f"{fixed + overhead + min_prefetch}; raise the limit or lower "
                "batch_size/prefetch_batches")
        pool_rows = 0
        if self.shuffle and shuffle_buffer_size > 0:
            # At most half of what is left goes to the shuffle buffer.
            pool_rows = int(max(self.batch_size, min(shuffle_buffer_size, remaining // 2 // rb)))
        prefetch = remaining - pool_rows * rb
        # Without a shuffle buffer or a cache, batches inside one piece are views of it (no
        # copy), and each group of batches queued or held by the caller may keep a whole
        # piece alive: those pieces are part of the budget.
        views = pool_rows == 0 and not cache_in_memory
        pinned = queued + 2 if views else 0
        max_group = max(s.num_rows for s in self._slices) if self._slices else 1
        piece_rows = int(max(1, min(prefetch // (((threads + 1) * _DECODE_FACTOR + pinned) * rb),
                                    max_group)))
        if self._read_chunk_rows:
            piece_rows = int(self._read_chunk_rows)
        prefetch = max(0, prefetch - pinned * piece_rows * rb)
        return {"memory_limit_bytes": limit, "row_bytes": rb, "batch_bytes": batch_bytes,
                "threads": threads, "pool_rows": pool_rows, "prefetch_bytes": int(prefetch),
                "group_batches": group, "queued_groups": queued,
                "piece_rows": piece_rows, "views": int(views)}

    # ------------------------------------------------------------------ contract

    def __len__(self) -> int:
        return len(self._sizes)

    @property
    def batch_sizes(self) -> List[int]:
        """Sizes of the batches of one epoch on this rank."""
        return list(self._sizes)

    def _iterate(self, epoch: int) -> Iterator[Dict[str, object]]:
        run = _EpochRun(self, epoch)
        self._runs.add(run)
        try:
            for batch in run:
                yield batch
        finally:
            run.close()

    def close(self) -> None:
        for run in list(self._runs):
            run.close()
        self._cache = None
        super().close()

    # ------------------------------------------------------------------ decoding

    def _read_slice(self, sl: RowSlice, budget: _PrefetchBudget, turn: int,
                    stop: threading.Event) -> Iterator[Dict[str, np.ndarray]]:
        """Decoded pieces of ``sl``; reserves budget before each piece is decoded."""
        path = self.source.files[sl.file_index]
        piece_rows = self.plan["piece_rows"]
        rb = self._row_bytes
        try:
            if isinstance(self._fs, pafs.LocalFileSystem):
                # Mapped, a local file's pages are decoded where they lie in the page cache
                # instead of being read into a buffer first: 1.4x faster (pyarrow 26, raw
                # columns). The Arrow buffers taken from it keep the mapping alive.
                pf = pq.ParquetFile(pa.memory_map(path))
            else:
                pf = pq.ParquetFile(path, filesystem=self._fs, pre_buffer=False,
                                    buffer_size=self._read_buffer)
            batches = pf.iter_batches(batch_size=piece_rows, row_groups=[sl.row_group],
                                      columns=self._parquet_columns, use_threads=False)
        except (OSError, pa.ArrowException) as e:
            raise _unreadable(path, sl.row_group, e) from e
        pos = 0  # row of the row group at which the next record batch starts
        try:
            while pos < sl.stop and not stop.is_set():
                # Pieces start at multiples of piece_rows in the row group; those before
                # sl.start are read and dropped (only the two boundary slices of a rank).
                end = min(pos + piece_rows, sl.stop)
                # Reserve the decoding peak; settle to the decoded size once it is known.
                est = _DECODE_FACTOR * min(piece_rows, end - pos) * rb
                budget.acquire(turn, est, last=end >= sl.stop)
                try:
                    record_batch = next(batches)
                except StopIteration:
                    budget.adjust(-est)
                    raise RuntimeError(f"{path} row group {sl.row_group} ended at row {pos}, "
                                       f"before {sl.stop}: the file changed while reading")
                except (OSError, pa.ArrowException) as e:
                    budget.adjust(-est)
                    raise _unreadable(path, sl.row_group, e) from e
                n = record_batch.num_rows
                a, b = max(sl.start, pos), min(sl.stop, pos + n)
                pos += n
                if b <= a:
                    budget.adjust(-est)
                    continue
                piece = self._decode(record_batch.slice(a - (pos - n), b - a), path)
                actual = _nbytes(piece)
                budget.adjust(actual - est)
                yield piece, actual
        finally:
            batches.close()
            pf.close()

    def _decode(self, rb: pa.RecordBatch, path: str) -> Dict[str, np.ndarray]:
        out = {}
        n = rb.num_rows
        for name, spec in self.specs.items():
            arr = rb.column(name)
            if arr.null_count:
                raise ValueError(f"column {name!r} has null values in {path}; fill or drop them "
                                 "before training (prepare_data rejects them)")
            if spec.sparse:
                out[name] = _densify(arr, spec, n, name)
            elif spec.kind == constants.KIND_SCALAR:
                out[name] = _as_dtype(arr.to_numpy(zero_copy_only=False), spec.dtype)
            elif pa.types.is_fixed_size_binary(arr.type):
                out[name] = self._raw_to_numpy(arr, spec, n, name, path)
            else:
                out[name] = self._list_to_numpy(arr, spec, n, name, path)
            if self.plan["views"] and not out[name].flags.writeable:
                # Batches will be views of this piece, and a batch is the caller's to change:
                # Arrow's zero-copy scalar arrays are read-only (raw columns are not).
                out[name] = out[name].copy()
        return out

    def _raw_to_numpy(self, arr, spec: ColumnSpec, n: int, name: str, path: str):
        shape = tuple(spec.shape) if spec.shape is not None else None
        length = int(np.prod(shape)) if shape is not None else \
            arr.type.byte_width // np.dtype(spec.dtype).itemsize
        try:
            values = raw_columns.decode(arr, spec.dtype, length)
        except ValueError as e:
            raise ValueError(f"column {name!r} in {path}: {e} (shape {shape}); the file does "
                             "not match the dataset's metadata: prepare it again") from None
        return values.reshape((n,) + (shape if shape is not None else (length,)))

    def _list_to_numpy(self, arr, spec: ColumnSpec, n: int, name: str, path: str):
        if pa.types.is_fixed_size_list(arr.type):
            length = arr.type.list_size
        else:
            lengths = np.diff(np.asarray(arr.offsets))
            length = int(lengths[0]) if n else 0
            if n and (lengths != length).any():
                raise ValueError(
                    f"column {name!r} holds arrays of different lengths ({lengths.min()} to "
                    f"{lengths.max()}) in {path}; every row must have the same length")
        flat = arr.flatten()
        if flat.null_count:
            raise ValueError(f"column {name!r} has null array elements in {path}")
        values = _as_dtype(flat.to_numpy(zero_copy_only=False), spec.dtype)
        shape = spec.shape
        if shape is None:
            with self._shape_lock:
                shape = self.specs[name].shape
                if shape is None:  # first piece decides; later pieces must agree
                    shape = (length,)
                    self.specs[name] = ColumnSpec(name, spec.kind, spec.dtype, shape)
        if int(np.prod(shape)) != length:
            raise ValueError(f"column {name!r} has arrays of length {length} in {path}, "
                             f"expected {int(np.prod(shape))} (shape {tuple(shape)})")
        return values.reshape((n,) + tuple(shape))


def _unreadable(path: str, row_group: int, e: BaseException) -> Exception:
    """pyarrow's error about a file it cannot read, with the file, the row group and what
    to do; of the same kind (``OSError``, ``ValueError``) where it was one."""
    detail = " ".join(str(e).split()).rstrip(".")  # pyarrow's may span lines
    msg = (f"cannot read {path} (row group {row_group}): {detail}. The file is "
           "damaged, or was changed or removed while the loader ran: write it again (for data "
           "a fit prepared: remove that dataset with Store.cleanup and fit again)")
    for kind in (OSError, ValueError):
        if isinstance(e, kind):
            return kind(msg)
    return RuntimeError(msg)


def _as_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
    return values if values.dtype == np.dtype(dtype) else values.astype(dtype)


def _densify(arr, spec: ColumnSpec, n: int, name: str) -> np.ndarray:
    """Struct<indices: list<int32>, values: list<T>> -> dense (n, size) array, vectorised."""
    children = arr.flatten()  # respects the struct's slice offset, unlike .field()
    ind = children[arr.type.get_field_index(constants.SPARSE_INDICES_FIELD)]
    val = children[arr.type.get_field_index(constants.SPARSE_VALUES_FIELD)]
    size = int(np.prod(spec.shape))
    lengths = np.diff(np.asarray(ind.offsets))
    idx = ind.flatten().to_numpy(zero_copy_only=False)
    vals = val.flatten().to_numpy(zero_copy_only=False)
    if len(idx) != len(vals):
        raise ValueError(f"sparse column {name!r} has indices and values of different lengths")
    if len(idx) and (idx.min() < 0 or idx.max() >= size):
        raise ValueError(f"sparse column {name!r} has an index outside [0, {size})")
    dense = np.zeros((n, size), dtype=spec.dtype)
    dense[np.repeat(np.arange(n), lengths), idx] = vals
    return dense.reshape((n,) + tuple(spec.shape))


def _spec_from_arrow(field: pa.Field) -> Optional[ColumnSpec]:
    t = field.type
    raw = raw_columns.spec_of_field(field)
    if raw is not None:
        return ColumnSpec(field.name, constants.KIND_ARRAY, raw[0], (raw[1],))
    if _is_number(t):
        return ColumnSpec(field.name, constants.KIND_SCALAR, _numpy_dtype(t), ())
    if (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)) \
            and _is_number(t.value_type):
        shape = (t.list_size,) if pa.types.is_fixed_size_list(t) else None
        return ColumnSpec(field.name, constants.KIND_ARRAY, _numpy_dtype(t.value_type), shape)
    return None


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _numpy_dtype(t: pa.DataType) -> str:
    return np.dtype(t.to_pandas_dtype()).name


class _EpochRun:
    """The threads and queues of one epoch of one loader."""

    def __init__(self, loader: ArrowDataLoader, epoch: int):
        self.loader = loader
        self.rng = np.random.default_rng([loader.seed, epoch, loader.rank, 1])
        n = len(loader._slices)
        self.order = self.rng.permutation(n) if loader.shuffle else np.arange(n)
        cache = loader._cache
        self.cached = dict(cache) if cache is not None else {}
        # Positions (in self.order) that must be read from files, in consumption order.
        self.to_read = [k for k in range(n) if int(self.order[k]) not in self.cached]
        self.read_turn = {k: t for t, k in enumerate(self.to_read)}
        self.results = [queue.Queue() for _ in self.to_read]
        self.budget = _PrefetchBudget(loader.plan["prefetch_bytes"])
        self.stop = threading.Event()
        self.out: "queue.Queue" = queue.Queue(maxsize=loader.plan["queued_groups"])
        self._claim = 0
        self._claim_lock = threading.Lock()
        self._closed = False
        self.threads = [threading.Thread(target=self._reader, daemon=True,
                                         name=f"spark_dl-reader-{i}")
                        for i in range(min(loader.plan["threads"], len(self.to_read)))]
        # Batches that are views of the pieces cost only slicing: the caller's thread cuts
        # them (an assembler thread would add two hand-offs per group and nothing to overlap).
        self.inline = bool(loader.plan["views"])
        if not self.inline:
            self.threads.append(threading.Thread(target=self._assembler, daemon=True,
                                                 name="spark_dl-assembler"))
        for t in self.threads:
            t.start()

    # -- readers

    def _reader(self) -> None:
        while not self.stop.is_set():
            with self._claim_lock:
                turn = self._claim
                self._claim += 1
            if turn >= len(self.to_read):
                return
            sl = self.loader._slices[int(self.order[self.to_read[turn]])]
            results = self.results[turn]
            try:
                for item in self.loader._read_slice(sl, self.budget, turn, self.stop):
                    results.put(item)
                results.put(_END)
            except _Closed:
                return
            except BaseException as e:  # handed to the caller's thread
                results.put(_Failure(e))
                return
            finally:
                self.budget.end_turn(turn)

    def _pieces(self) -> Iterator[Dict[str, np.ndarray]]:
        cache = self.loader._cache
        for k in range(len(self.order)):
            slice_id = int(self.order[k])
            if slice_id in self.cached:
                yield from self.cached[slice_id]
                continue
            turn = self.read_turn[k]
            self.budget.set_head(turn)
            kept = [] if cache is not None else None
            while True:
                try:
                    item = self.results[turn].get(timeout=_POLL_S)
                except queue.Empty:
                    if self.stop.is_set():
                        raise _Closed()
                    continue
                if item is _END:
                    break
                if isinstance(item, _Failure):
                    raise item.exc
                piece, nbytes = item
                self.budget.adjust(-nbytes)
                if kept is not None:
                    kept.append(piece)
                yield piece
            if kept is not None and self.loader._cache is not None:
                self.loader._cache[slice_id] = kept

    # -- assembler

    def _assembler(self) -> None:
        try:
            pieces = self._pieces()
            sizes = self.loader._sizes
            if self.loader.plan["pool_rows"] > 0:
                batches = pool_shuffle(pieces, sizes, self.loader.plan["pool_rows"], self.rng)
            else:
                batches = cut(pieces, sizes, self.loader.plan["group_batches"])
            group, per_group = [], self.loader.plan["group_batches"]
            for batch in batches:
                group.append(batch)
                if len(group) == per_group:
                    self._put(group)
                    group = []
            if group:
                self._put(group)
            self._put(_END)
        except _Closed:
            pass
        except BaseException as e:
            try:
                self._put(_Failure(e))
            except _Closed:
                pass

    def _put(self, item) -> None:
        while True:
            if self.stop.is_set():
                raise _Closed()
            try:
                self.out.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                continue

    # -- caller side

    def __iter__(self):
        if self.inline:
            try:
                yield from cut(self._pieces(), self.loader._sizes, views=True)
            except _Closed:
                pass
            return
        while True:
            try:
                item = self.out.get(timeout=_POLL_S)
            except queue.Empty:
                if self.stop.is_set():
                    return
                continue
            if item is _END:
                return
            if isinstance(item, _Failure):
                raise item.exc
            yield from item

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.stop.set()
        self.budget.close()
        for t in self.threads:
            if t is not threading.current_thread():
                t.join()
