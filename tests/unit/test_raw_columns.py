"""The raw encoding of dense array columns (format 2): encode/decode round trips bitwise for
every element dtype, slices, the zeros written for rows the data checks reject, the loader
reading a raw Parquet file without metadata, and petastorm's bytes values."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spark_dl.spark.common import raw_columns
from spark_dl.spark.common.data_loader import ArrowDataLoader
from spark_dl.spark.common.data_loader_base import DataSource
from spark_dl.spark.common.metadata import ColumnSpec


def lists(x):
    return pa.array(list(x), pa.list_(pa.from_numpy_dtype(x.dtype)))


@pytest.mark.parametrize("dtype", ["float32", "float64", "int8", "int16", "int32", "int64",
                                   "bool"])
def test_round_trip_is_bitwise(dtype):
    rng = np.random.default_rng(1)
    x = (rng.normal(size=(50, 5)) * 40).astype(dtype)
    if dtype.startswith("float"):
        x[3, 2], x[4, 0] = np.nan, -np.inf  # allow_nonfinite data keeps them
    arr = raw_columns.encode(lists(x), dtype, 5)
    assert arr.type == pa.binary(5 * np.dtype(dtype).itemsize)
    got = raw_columns.decode(arr, dtype, 5)
    assert got.dtype == np.dtype(dtype) and got.shape == (50, 5)
    assert got.tobytes() == x.tobytes()
    # A slice decodes from its own offset; petastorm's bytes values decode alike.
    np.testing.assert_array_equal(raw_columns.decode(arr.slice(7, 11), dtype, 5), x[7:18])
    values = np.array(arr.slice(7, 11).to_pylist(), dtype=object)
    np.testing.assert_array_equal(raw_columns.decode_values(values, dtype, 5), x[7:18])


def test_a_sliced_list_input_and_the_cast_to_the_column_dtype():
    x = np.arange(40, dtype=np.float64).reshape(10, 4)
    arr = raw_columns.encode(lists(x).slice(3, 5), "float32", 4)
    np.testing.assert_array_equal(raw_columns.decode(arr, "float32", 4),
                                  x[3:8].astype(np.float32))


@pytest.mark.parametrize("bad", [
    pa.array([[1.0, 2.0], [3.0]], pa.list_(pa.float32())),
    pa.array([[1.0, 2.0], None], pa.list_(pa.float32())),
    pa.array([[1.0, None], [3.0, 4.0]], pa.list_(pa.float32())),
])
def test_rows_the_checks_reject_are_zeros_of_the_right_width(bad):
    arr = raw_columns.encode(bad, "float32", 2)
    assert len(arr) == 2 and arr.type == pa.binary(8) and arr.null_count == 0
    assert not raw_columns.decode(arr, "float32", 2).any()


def test_a_width_that_does_not_match_is_refused():
    arr = raw_columns.encode(lists(np.ones((3, 4), np.float32)), "float32", 4)
    with pytest.raises(ValueError, match="expected 3 x float32"):
        raw_columns.decode(arr, "float32", 3)


def test_loader_reads_a_raw_file_without_metadata(tmp_path):
    x = np.random.default_rng(2).normal(size=(300, 6)).astype(np.float32)
    arr = raw_columns.encode(lists(x), "float32", 6)
    table = pa.table([pa.array(np.arange(300)), arr],
                     schema=pa.schema([pa.field("id", pa.int64()),
                                       raw_columns.field("x", arr, "float32", 6)]))
    pq.write_table(table, str(tmp_path / "part-00000.parquet"), row_group_size=64)
    loader = ArrowDataLoader(DataSource.from_path(str(tmp_path)), batch_size=50,
                             shuffle=True, seed=4, shuffle_buffer_size=100)
    assert loader.specs["x"] == ColumnSpec("x", "array", "float32", (6,))
    seen = np.zeros(300, bool)
    for batch in loader:
        np.testing.assert_array_equal(batch["x"], x[batch["id"]])
        seen[batch["id"]] = True
    assert seen.all()


def test_petastorm_values_of_a_raw_column_are_decoded():
    from spark_dl.spark.common.petastorm_loader import PetastormDataLoader

    x = np.arange(12, dtype=np.float32).reshape(3, 2, 2)
    arr = raw_columns.encode(lists(x.reshape(3, 4)), "float32", 4)
    source = DataSource(files=["unused"], columns={
        "x": ColumnSpec("x", "array", "float32", (2, 2)),
        "y": ColumnSpec("y", "scalar", "float64", ())})
    loader = PetastormDataLoader.__new__(PetastormDataLoader)  # petastorm need not import
    loader.source = source
    np.testing.assert_array_equal(loader._column("x", np.array(arr.to_pylist(), object)), x)
    np.testing.assert_array_equal(loader._column("y", [1.0, 2.0]), [1.0, 2.0])


@pytest.mark.parametrize("shuffle", [False, True])
def test_raw_and_list_files_give_the_same_batches(tmp_path, shuffle):
    # Format 2 against format 1: the same rows and row groups, stored raw and as lists, give
    # bitwise the same batches, in order and shuffled with the same seed.
    rng = np.random.default_rng(3)
    x = rng.normal(size=(900, 8)).astype(np.float32)
    b = rng.random(size=(900, 3)) < 0.5
    ids = np.arange(900)
    dirs = {}
    for layout in ("raw", "list"):
        fields, cols = [pa.field("id", pa.int64())], [pa.array(ids)]
        for name, values, dtype in (("x", x, "float32"), ("b", b, "bool")):
            arr = lists(values)
            if layout == "raw":
                arr = raw_columns.encode(arr, dtype, values.shape[1])
                fields.append(raw_columns.field(name, arr, dtype, values.shape[1]))
            else:
                fields.append(pa.field(name, arr.type))
            cols.append(arr)
        dirs[layout] = tmp_path / layout
        dirs[layout].mkdir()
        pq.write_table(pa.table(cols, schema=pa.schema(fields)),
                       str(dirs[layout] / "part-00000.parquet"), row_group_size=128)
    batches = {}
    for layout, path in dirs.items():
        loader = ArrowDataLoader(DataSource.from_path(str(path)), batch_size=32,
                                 shuffle=shuffle, seed=7, shuffle_buffer_size=200,
                                 rank=1, size=2)
        batches[layout] = [batch for epoch in range(2) for batch in loader]
    assert len(batches["raw"]) == len(batches["list"]) > 0
    for got, want in zip(batches["raw"], batches["list"]):
        for name in ("id", "x", "b"):
            assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape
            assert got[name].tobytes() == want[name].tobytes(), name
