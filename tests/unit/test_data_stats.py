"""DataStats: the data checks prepare_data counts inside its write job, per Arrow batch,
merged on the driver; the errors for column types it cannot take, and for names missing
or held twice (no Spark needed)."""

import math

import pyarrow as pa
import pytest

from spark_dl.spark.common import constants
from spark_dl.spark.common.schema import ColumnInfo, DataStats, check_stats, column_positions

NAN, INF = math.nan, math.inf


def _sparse(rows):
    """Spark's vector struct (type, size, indices, values); None = a null row."""
    mask = pa.array([r is None for r in rows])
    rows = [r or (0, 0, [], []) for r in rows]
    return pa.StructArray.from_arrays(
        [pa.array([r[0] for r in rows], pa.int8()), pa.array([r[1] for r in rows], pa.int32()),
         pa.array([r[2] for r in rows], pa.list_(pa.int32())),
         pa.array([r[3] for r in rows], pa.list_(pa.float64()))],
        names=["type", "size", "indices", "values"], mask=mask)


COLUMNS = [("y", constants.KIND_SCALAR, "float64", False),
           ("a", constants.KIND_ARRAY, "float32", False),
           ("i", constants.KIND_ARRAY, "int32", False),
           ("s", constants.KIND_VECTOR, "float64", True)]


def _batch(y, a, i, s):
    return pa.RecordBatch.from_arrays(
        [pa.array(y, pa.float64()), pa.array(a, pa.list_(pa.float32())),
         pa.array(i, pa.list_(pa.int32())), _sparse(s)], names=["y", "a", "i", "s"])


def test_counts_nulls_lengths_nonfinite_and_null_elements_per_row():
    rb = _batch(y=[1.0, None, NAN, INF, 2.0],
                a=[[1.0, NAN, INF], [1.0, 2.0, 3.0], None, [0.0, 0.0], [NAN, 1.0, 1.0]],
                i=[[1, None, None], [1, 2], [3, 4], [5, 6], [7, 8]],
                s=[(0, 3, [0], [NAN]), None, (0, 3, [1], [1.0]), (0, 3, [2], [INF]),
                   (0, 3, [], [])])
    stats = DataStats(COLUMNS, check_finite=True)
    stats.add_batch(rb.slice(0, 2))   # sliced batches: offsets must be honoured
    stats.add_batch(rb.slice(2))
    c = DataStats.merge([stats.counts])
    assert c["n"] == 5
    assert (c["nulls_0"], c["nonfinite_0"]) == (1, 2)
    assert (c["nulls_1"], c["min_1"], c["max_1"], c["nonfinite_1"]) == (1, 2, 3, 2)
    assert (c["min_2"], c["max_2"], c["elemnulls_2"]) == (2, 3, 1)
    assert "nonfinite_2" not in c        # integer arrays hold no NaN
    assert (c["nulls_3"], c["nonfinite_3"]) == (1, 2)
    assert "min_3" not in c              # sparse sizes come from the vector pass


def test_nonfinite_not_counted_when_allowed_and_validation_flags():
    stats = DataStats(COLUMNS[:1], check_finite=False)
    stats.add_batch(pa.RecordBatch.from_arrays([pa.array([NAN, 1.0])], names=["y"]))
    stats.add_validation_flags(pa.array([True, None, False, True]))
    assert stats.counts == {"n": 2, "nulls_0": 0, "val_nulls": 1, "val_rows": 2}


def test_merge_sums_counts_and_keeps_extreme_lengths():
    parts = [{"n": 3, "nulls_0": 1, "min_1": 4, "max_1": 4},
             {"n": 0},
             {"n": 2, "nulls_0": 0, "min_1": 2, "max_1": 5, "max_2": None}]
    assert DataStats.merge(parts) == {"n": 5, "nulls_0": 1, "min_1": 2, "max_1": 5}


def test_check_stats_reads_merged_counts():
    infos = {"y": ColumnInfo("y", constants.KIND_SCALAR, "float64", "double"),
             "a": ColumnInfo("a", constants.KIND_ARRAY, "float32", "array<float>")}
    ok = {"n": 4, "nulls_0": 0, "nulls_1": 0, "min_1": 3, "max_1": 3, "elemnulls_1": 0}
    assert check_stats(ok, infos, compress_sparse=False) == 4
    assert infos["a"].shape == [3] and infos["y"].shape == []
    with pytest.raises(ValueError, match="'a' holds arrays of different lengths \\(2 to 3\\)"):
        check_stats(dict(ok, min_1=2), infos, compress_sparse=False)
    with pytest.raises(ValueError, match="'y' has 2 rows out of 4 with NaN"):
        check_stats(dict(ok, nonfinite_0=2), infos, compress_sparse=False)
    with pytest.raises(ValueError, match="empty"):
        check_stats({"n": 0}, infos, compress_sparse=False)


@pytest.mark.parametrize("make, fix", [
    (lambda T: T.DecimalType(10, 2), r"cast it to double first \(col.cast\('double'\)\)"),
    (lambda T: T.ArrayType(T.DecimalType(10, 2)), r"col.cast\('array<double>'\)"),
    (lambda T: T.ArrayType(T.ArrayType(T.FloatType())), "flatten it to one level"),
    (lambda T: T.ArrayType(T.StringType()), "convert its elements to numbers first"),
    (lambda T: T.StringType(), "StringIndexer"),
])
def test_unsupported_types_name_their_fix(make, fix):
    # Each unsupported column type gets the fix that suits it: an array is cast whole.
    pytest.importorskip("pyspark")
    from pyspark.sql import types as T

    from spark_dl.spark.common.schema import classify

    with pytest.raises(TypeError, match=r"column 'c' has unsupported type .*" + fix):
        classify("c", make(T), "float64")


def test_column_positions_find_each_name_once():
    names = ["id", "x.y", "id", "z"]
    assert column_positions(names, ["z", "x.y"]) == [3, 1]
    with pytest.raises(ValueError, match=r"columns \['id'\] are each in the DataFrame more "
                                         r"than once \(columns: \['id', 'x.y', 'id', 'z'\]\)"):
        column_positions(names, ["z", "id"])
    with pytest.raises(KeyError, match=r"feature columns \['a', 'b'\] are not in the "
                                       "DataFrame"):
        column_positions(names, ["a", "z", "b", "a"], "feature columns")
    with pytest.raises(KeyError, match="case too: did you mean 'id' for 'ID', 'z' for 'Z'"):
        column_positions(["id", "z"], ["ID", "Z"])
