"""prepare_data's partition writer outside Spark: the Parquet encodings it chooses per column
and the values it writes (no Spark needed: without a task context it is partition 0)."""

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from spark_dl.spark.common import constants
from spark_dl.spark.common.parquet_writer import PartitionWriter, _plain_encoded
from spark_dl.spark.common.schema import DataStats
from spark_dl.spark.common.store import Store

ROWS = 4000


def _batches():
    rng = np.random.default_rng(3)
    table = pa.table({
        "unique": rng.random(ROWS),                                 # every value differs
        "label": pa.array(rng.integers(0, 10, ROWS), pa.int64()),   # ten classes
        "grid": pa.array(np.round(rng.random(ROWS), 1), pa.float32()),  # 11 values
        "flag": pa.array(rng.random(ROWS) < 0.5),
        "ids": pa.array(np.arange(ROWS, dtype=np.int32)),
    })
    return table.to_batches(max_chunksize=1000)


def _write(tmp_path, batches):
    store = Store.create(str(tmp_path / "store"))
    dirs = {"train": str(tmp_path / "store" / "train"), "val": str(tmp_path / "store" / "val")}
    stats = DataStats([(f.name, constants.KIND_SCALAR, str(f.type), False)
                       for f in batches[0].schema], check_finite=True)
    writer = PartitionWriter(store, dirs, stats, row_group_bytes=8 * 1024, sparse={},
                             split=False)
    summary = pa.Table.from_batches(list(writer(iter(batches)))).to_pylist()
    path = os.path.join(dirs["train"], constants.PART_FILE_TEMPLATE.format(partition=0))
    return path, summary


def test_dictionary_only_for_columns_whose_values_repeat(tmp_path):
    batches = _batches()
    assert sorted(_plain_encoded(batches[0])) == ["ids", "unique"]
    path, summary = _write(tmp_path, batches)
    assert summary[0]["rows"] == ROWS
    meta = pq.read_metadata(path)
    assert meta.num_row_groups > 1
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for c in range(group.num_columns):
            chunk = group.column(c)
            name = chunk.path_in_schema
            assert chunk.is_stats_set, name  # statistics stay on every scalar column
            dictionary = "RLE_DICTIONARY" in chunk.encodings
            assert dictionary is (name in ("label", "grid")), (name, chunk.encodings)
    # The values are written as they came, whatever the encoding.
    assert pq.read_table(path).equals(pa.Table.from_batches(batches))


def test_plain_encoded_rule_edges():
    empty = pa.RecordBatch.from_arrays([pa.array([None, None], pa.float64())], names=["x"])
    assert _plain_encoded(empty) == []  # nothing to judge: pyarrow's default stays
    few = pa.RecordBatch.from_arrays([pa.array([1.5, 2.5, 3.5], pa.float64())], names=["x"])
    assert _plain_encoded(few) == ["x"]  # three distinct of three
    half = pa.RecordBatch.from_arrays([pa.array(np.arange(1000) // 2, pa.int64())],
                                      names=["x"])
    assert _plain_encoded(half) == []  # 500 values of 8 bytes + 9-bit indices: 62%
    lists = pa.RecordBatch.from_arrays([pa.array([[1.0], [2.0]])], names=["x"])
    assert _plain_encoded(lists) == []  # nested columns keep pyarrow's default
