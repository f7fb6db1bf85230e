"""The executor side of ``prepare_data``: Arrow batches of one Spark partition -> Parquet files.

Runs inside ``DataFrame.mapInArrow``: Spark has already converted the columns (vectors through
``vector_to_array``) and hands over Arrow record batches; this code counts the data checks
(:class:`~.schema.DataStats`), splits train from validation rows, re-shapes sparse vectors,
groups rows into row groups of a fixed row count, and writes through the Store's filesystem.
It returns one small summary row per file and one row with the partition's counts.

Each partition writes ``part-<partition>.parquet`` in the train and validation directories
through :meth:`Store.open_atomic`, so a retried or speculative task replaces the file whole,
and a failed task leaves no partial file under a name readers pick up.
"""

import posixpath
from typing import Dict, List, Optional

from spark_dl.spark.common import constants, raw_columns


_SUMMARY_FIELDS = ["split", "name", "rows", "row_groups", "file_bytes", "stats"]


def summary_schema():
    """The schema of the summary rows (split, name, rows, row_groups, file_bytes, stats), as
    a StructType: a DDL string would be parsed by the JVM's SQL parser, whose first use in
    a session costs seconds of class loading on a small machine. File rows have a split;
    the partition's counts come in one row with split null and ``stats`` (JSON) set."""
    from pyspark.sql.types import ArrayType, LongType, StringType, StructField, StructType

    return StructType([StructField("split", StringType()), StructField("name", StringType()),
                       StructField("rows", LongType()),
                       StructField("row_groups", ArrayType(LongType())),
                       StructField("file_bytes", LongType()),
                       StructField("stats", StringType())])


SPLIT_COLUMN = "__spark_dl_is_val__"


class PartitionWriter:
    """Picklable ``mapInArrow`` function writing one partition (see module doc).

    Args:
        store: the Store (pickled to the executors).
        dirs: ``{"train": path, "val": path}`` of the directories to write.
        stats: a fresh :class:`~.schema.DataStats` naming the columns to check.
        row_group_bytes: target decoded bytes of a row group; the row count follows from
            the first batch's row size (array and vector lengths included; every row has
            the same size in data that passes the checks).
        sparse: {column: (value dtype, stored bytes per row)} of columns arriving as Spark
            ML vector structs and written as struct<indices, values>.
        raw: {column: element dtype} of dense array and vector columns (lists by then),
            written as raw fixed-width values (:mod:`.raw_columns`); the length is the
            longest array of the partition's first batch (a column of empty arrays stays a
            list).
        split: whether batches carry the boolean ``SPLIT_COLUMN`` (True = validation row;
            null = a null in the validation column, counted and written as training).
        compression: Parquet codec.
        names: the names of the batches' columns, in order, when Spark hands them over
            under other names (``prepare_data`` selects them as ``_0``, ``_1``, ...:
            pyspark's ``mapInArrow`` looks each column up by name, and would read a name
            holding a dot as a struct's field).
    """

    def __init__(self, store, dirs: Dict[str, str], stats, row_group_bytes: float,
                 sparse: Dict[str, tuple], split: bool, compression: str = "snappy",
                 raw: Optional[Dict[str, str]] = None, names: Optional[List[str]] = None):
        self.names = names
        self.store = store
        self.dirs = dirs
        self.stats = stats
        self.row_group_bytes = row_group_bytes
        self.sparse = sparse
        self.raw = raw or {}
        self.split = split
        self.compression = compression

    def __call__(self, batches):
        import json

        import pyarrow as pa
        import pyarrow.compute as pc
        from pyspark import TaskContext

        ctx = TaskContext.get()
        name = constants.PART_FILE_TEMPLATE.format(partition=ctx.partitionId() if ctx else 0)
        writers: Dict[str, _FileWriter] = {}
        rows_per_group = None
        lengths: Dict[str, int] = {}
        try:
            for rb in batches:
                if rb.num_rows == 0:
                    continue
                if self.names is not None:
                    rb = pa.RecordBatch.from_arrays(rb.columns, names=self.names)
                parts = {"train": rb}
                if self.split:
                    flag = rb.column(SPLIT_COLUMN)
                    # select: pyarrow 12 has no RecordBatch.drop_columns
                    rb = rb.select([n for n in rb.schema.names if n != SPLIT_COLUMN])
                    self.stats.add_validation_flags(flag)
                    flag = flag.fill_null(False)
                    parts = {"train": rb.filter(pc.invert(flag)), "val": rb.filter(flag)}
                self.stats.add_batch(rb)
                if rows_per_group is None:
                    longest = _longest_arrays(rb)
                    rows_per_group = self._rows_per_group(rb, longest)
                    # Raw columns take the first batch's length; columns of empty arrays
                    # stay lists (where lengths differ, the data checks reject the data).
                    lengths = {n: longest[n] for n in self.raw if longest.get(n)}
                for split, part in parts.items():
                    if part.num_rows == 0:
                        continue
                    part = self._convert(part, lengths)
                    if split not in writers:
                        writers[split] = _FileWriter(
                            self.store, posixpath.join(self.dirs[split], name), part.schema,
                            rows_per_group, self.compression, _plain_encoded(part))
                    writers[split].write(part)
            rows = [(split, name) + w.close() + (None,) for split, w in writers.items()]
        except BaseException:
            for w in writers.values():
                w.abort()
            raise
        rows.append((None, name, None, None, None,
                     json.dumps({"counts": self.stats.counts, "rows_per_group": rows_per_group})))
        cols = list(zip(*rows))
        yield pa.RecordBatch.from_arrays(
            [pa.array(cols[0], pa.string()), pa.array(cols[1], pa.string()),
             pa.array(cols[2], pa.int64()), pa.array(cols[3], pa.list_(pa.int64())),
             pa.array(cols[4], pa.int64()), pa.array(cols[5], pa.string())],
            names=_SUMMARY_FIELDS)

    def _rows_per_group(self, rb, longest: Dict[str, int]) -> int:
        """Rows per row group: ``row_group_bytes`` over the decoded size of a row (the
        longest array of this batch for list columns, from :func:`_longest_arrays`)."""
        row = 0.0
        for field in rb.schema:
            if field.name in self.sparse:
                row += self.sparse[field.name][1]
            elif field.name in longest:
                row += longest[field.name] * max(field.type.value_type.bit_width // 8, 1)
            else:
                row += max(field.type.bit_width // 8, 1)
        return max(1, int(self.row_group_bytes // max(row, 1)))

    def _convert(self, rb, lengths: Dict[str, int]):
        """Spark ML vector structs -> struct<indices: list<int32>, values: list<dtype>>;
        dense arrays and vectors (lists by now) -> raw fixed-width values."""
        if not self.sparse and not lengths:
            return rb
        import pyarrow as pa

        arrays, fields = [], []
        for field, arr in zip(rb.schema, rb.columns):
            if field.name in lengths:
                dtype, length = self.raw[field.name], lengths[field.name]
                arr = raw_columns.encode(arr, dtype, length)
                field = raw_columns.field(field.name, arr, dtype, length)
            elif field.name in self.sparse:
                value_type = pa.from_numpy_dtype(__import__("numpy").dtype(
                    self.sparse[field.name][0]))
                indices = arr.field("indices").cast(pa.list_(pa.int32()))
                values = arr.field("values").cast(pa.list_(value_type))
                arr = pa.StructArray.from_arrays(
                    [indices, values],
                    names=[constants.SPARSE_INDICES_FIELD, constants.SPARSE_VALUES_FIELD])
                field = pa.field(field.name, arr.type, nullable=False)
            arrays.append(arr)
            fields.append(field)
        return pa.RecordBatch.from_arrays(arrays, schema=pa.schema(fields))


class _FileWriter:
    """Buffers batches into row groups of exactly ``rows_per_group`` rows."""

    def __init__(self, store, path, schema, rows_per_group, compression,
                 no_dictionary: Optional[List[str]] = None):
        import pyarrow.parquet as pq

        self._ctx = store.open_atomic(path)
        self._stream = self._ctx.__enter__()
        # Raw columns (one fixed-width value per row) get no dictionary and no min/max
        # statistics: rows of features rarely repeat, and dictionary pages of them cost 18%
        # of the read (pyarrow 26, 64 float32 per row).
        plain = [f for f in schema if raw_columns.spec_of_field(f) is None]
        stats = [path for f in plain for path in _leaf_paths(f.name, f.type)]
        dictionary = [path for f in plain if f.name not in (no_dictionary or ())
                      for path in _leaf_paths(f.name, f.type)]
        self._writer = pq.ParquetWriter(self._stream, schema, compression=compression,
                                        use_dictionary=dictionary, write_statistics=stats)
        self._rows_per_group = rows_per_group
        self._buffer: List = []
        self._buffered = 0
        self._groups: List[int] = []
        self._rows = 0

    def write(self, rb) -> None:
        while rb.num_rows:
            take = min(rb.num_rows, self._rows_per_group - self._buffered)
            self._buffer.append(rb.slice(0, take))
            self._buffered += take
            rb = rb.slice(take)
            if self._buffered == self._rows_per_group:
                self._flush()

    def _flush(self) -> None:
        import pyarrow as pa

        if not self._buffered:
            return
        table = pa.Table.from_batches(self._buffer)
        self._writer.write_table(table, row_group_size=self._buffered)
        self._groups.append(self._buffered)
        self._rows += self._buffered
        self._buffer, self._buffered = [], 0

    def close(self) -> tuple:
        self._flush()
        self._writer.close()
        size = self._stream.tell()
        self._ctx.__exit__(None, None, None)
        return self._rows, list(self._groups), int(size)

    def abort(self) -> None:
        err = RuntimeError("partition write aborted")
        try:
            self._ctx.__exit__(RuntimeError, err, None)
        except Exception:
            pass


def _plain_encoded(rb) -> List[str]:
    """The fixed-width columns of ``rb`` (a file's first batch) whose values repeat too
    little for a dictionary to pay: the dictionary plus its indices would take at least
    80% of the plain values. For them pyarrow would hash every value of a row group before
    falling back to plain pages (parquet-mr, Spark's writer, gives up after the first
    page): 8 columns of random doubles took 0.9 s per 1 M rows that way, and 0.12 s plain,
    in a file a fifth smaller. Columns whose values do repeat (labels, categories, flags)
    keep their dictionary."""
    import pyarrow as pa
    import pyarrow.compute as pc

    out = []
    for field, arr in zip(rb.schema, rb.columns):
        if not pa.types.is_primitive(field.type) or pa.types.is_boolean(field.type):
            continue
        values = len(arr) - arr.null_count
        if values == 0:
            continue
        width = field.type.bit_width / 8
        distinct = pc.count_distinct(arr).as_py()
        encoded = distinct * width + values * max(distinct.bit_length(), 1) / 8
        if encoded >= 0.8 * values * width:
            out.append(field.name)
    return out


def _longest_arrays(rb) -> Dict[str, int]:
    """{list column of ``rb``: its longest array's length}."""
    import pyarrow as pa
    import pyarrow.compute as pc

    return {f.name: int(pc.max(pc.list_value_length(arr)).as_py() or 0)
            for f, arr in zip(rb.schema, rb.columns)
            if pa.types.is_list(f.type) or pa.types.is_large_list(f.type)}


def _leaf_paths(path: str, t) -> List[str]:
    """The Parquet leaf column paths of an Arrow field (as the writer's per-column options
    name them: ``v.indices.list.element`` for a struct of lists)."""
    import pyarrow as pa

    if pa.types.is_struct(t):
        return [leaf for i in range(t.num_fields)
                for leaf in _leaf_paths(f"{path}.{t.field(i).name}", t.field(i).type)]
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _leaf_paths(f"{path}.list.element", t.value_type)
    return [path]


def sparse_columns(infos, row_bytes) -> Dict[str, tuple]:
    """{name: (dtype, stored bytes per row)} of the sparse columns among ``infos``
    (ColumnInfo values); ``row_bytes(info)`` estimates a row's stored size."""
    return {i.name: (i.dtype, row_bytes(i)) for i in infos if i.sparse}
