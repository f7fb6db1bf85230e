"""The executor side of ``prepare_data``: Arrow batches of one Spark partition -> Parquet files.

Runs inside ``DataFrame.mapInArrow``: Spark has already converted the columns (vectors through
``vector_to_array``) and hands over Arrow record batches; this code only splits train from
validation rows, re-shapes sparse vectors, groups rows into row groups of a fixed row count,
and writes through the Store's filesystem. It returns one small summary row per file.

Each partition writes ``part-<partition>.parquet`` in the train and validation directories
through :meth:`Store.open_atomic`, so a retried or speculative task replaces the file whole,
and a failed task leaves no partial file under a name readers pick up.
"""

import posixpath
from typing import Dict, List, Optional

from spark_dl.spark.common import constants


def summary_schema():
    """The schema of the summary rows (split, name, rows, row_groups, file_bytes), as a
    StructType: a DDL string would be parsed by the JVM's SQL parser, whose first use in
    a session costs seconds of class loading on a small machine."""
    from pyspark.sql.types import ArrayType, LongType, StringType, StructField, StructType

    return StructType([StructField("split", StringType()), StructField("name", StringType()),
                       StructField("rows", LongType()),
                       StructField("row_groups", ArrayType(LongType())),
                       StructField("file_bytes", LongType())])


SPLIT_COLUMN = "__spark_dl_is_val__"


class PartitionWriter:
    """Picklable ``mapInArrow`` function writing one partition (see module doc).

    Args:
        store: the Store (pickled to the executors).
        dirs: ``{"train": path, "val": path}`` of the directories to write.
        rows_per_group: rows per Parquet row group (the last one of a file may be smaller).
        sparse: {column: value dtype} of columns arriving as Spark ML vector structs and
            written as struct<indices, values>.
        split: whether batches carry the boolean ``SPLIT_COLUMN`` (True = validation row).
        compression: Parquet codec.
    """

    def __init__(self, store, dirs: Dict[str, str], rows_per_group: int,
                 sparse: Dict[str, str], split: bool, compression: str = "snappy"):
        self.store = store
        self.dirs = dirs
        self.rows_per_group = rows_per_group
        self.sparse = sparse
        self.split = split
        self.compression = compression

    def __call__(self, batches):
        import pyarrow as pa
        from pyspark import TaskContext

        ctx = TaskContext.get()
        name = constants.PART_FILE_TEMPLATE.format(partition=ctx.partitionId() if ctx else 0)
        writers: Dict[str, _FileWriter] = {}
        try:
            for rb in batches:
                if rb.num_rows == 0:
                    continue
                parts = {"train": rb}
                if self.split:
                    flag = rb.column(SPLIT_COLUMN)
                    rb = rb.drop_columns([SPLIT_COLUMN])
                    import pyarrow.compute as pc

                    parts = {"train": rb.filter(pc.invert(flag)), "val": rb.filter(flag)}
                for split, part in parts.items():
                    if part.num_rows == 0:
                        continue
                    part = self._convert(part)
                    if split not in writers:
                        writers[split] = _FileWriter(
                            self.store, posixpath.join(self.dirs[split], name), part.schema,
                            self.rows_per_group, self.compression)
                    writers[split].write(part)
            summaries = [(split, name) + w.close() for split, w in writers.items()]
        except BaseException:
            for w in writers.values():
                w.abort()
            raise
        if summaries:
            cols = list(zip(*summaries))
            yield pa.RecordBatch.from_arrays(
                [pa.array(cols[0]), pa.array(cols[1]), pa.array(cols[2], pa.int64()),
                 pa.array(cols[3], pa.list_(pa.int64())), pa.array(cols[4], pa.int64())],
                names=["split", "name", "rows", "row_groups", "file_bytes"])

    def _convert(self, rb):
        """Spark ML vector structs -> struct<indices: list<int32>, values: list<dtype>>."""
        if not self.sparse:
            return rb
        import pyarrow as pa

        arrays, fields = [], []
        for field, arr in zip(rb.schema, rb.columns):
            if field.name in self.sparse:
                value_type = pa.from_numpy_dtype(__import__("numpy").dtype(
                    self.sparse[field.name]))
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

    def __init__(self, store, path, schema, rows_per_group, compression):
        import pyarrow.parquet as pq

        self._ctx = store.open_atomic(path)
        self._stream = self._ctx.__enter__()
        self._writer = pq.ParquetWriter(self._stream, schema, compression=compression)
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


def sparse_dtypes(infos) -> Optional[Dict[str, str]]:
    """{name: dtype} of the sparse columns among ``infos`` (ColumnInfo values)."""
    return {i.name: i.dtype for i in infos if i.sparse}
