"""prepare_data on a local Spark session: round trips for every supported type, metadata,
validation splits, the cache, and every bad input rejected with nothing left in the store."""

import json
import os
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spark_dl.spark.common.cache import TrainingDataCache
from spark_dl.spark.common.data_loader import ArrowDataLoader
from spark_dl.spark.common.data_loader_base import DataSource
from spark_dl.spark.common.store import Store
from spark_dl.spark.common.util import (get_dataset_metadata, get_dataset_properties,
                                        prepare_data, remove_dataset)

pytestmark = pytest.mark.spark


@pytest.fixture
def store(tmp_path):
    return Store.create(str(tmp_path / "store"))


@pytest.fixture
def cache():
    return TrainingDataCache()


@pytest.fixture(scope="module")
def typed_df(spark):
    """One column of every supported type; row i is a function of i."""
    from pyspark.ml.linalg import Vectors
    from pyspark.sql import types as T

    schema = T.StructType([
        T.StructField("id", T.LongType()), T.StructField("b", T.BooleanType()),
        T.StructField("i8", T.ByteType()), T.StructField("i16", T.ShortType()),
        T.StructField("i32", T.IntegerType()), T.StructField("f32", T.FloatType()),
        T.StructField("f64", T.DoubleType()),
        T.StructField("ai", T.ArrayType(T.IntegerType(), False)),
        T.StructField("af", T.ArrayType(T.FloatType(), False)),
        T.StructField("ab", T.ArrayType(T.BooleanType(), False)),
        T.StructField("dv", __import__("pyspark.ml.linalg", fromlist=["VectorUDT"]).VectorUDT()),
        T.StructField("sv", __import__("pyspark.ml.linalg", fromlist=["VectorUDT"]).VectorUDT()),
        T.StructField("mixed", __import__("pyspark.ml.linalg",
                                          fromlist=["VectorUDT"]).VectorUDT()),
        T.StructField("y", T.DoubleType()), T.StructField("w", T.FloatType()),
        T.StructField("is_val", T.BooleanType()),
    ])
    rows = []
    for i in range(60):
        rows.append((i, i % 2 == 0, i % 100, i * 3, i * 7, i / 4.0, i / 3.0,
                     [i, i + 1, i + 2], [i * 0.5, -i * 0.5], [i % 3 == 0] * 4,
                     Vectors.dense([float(i), i * 2.0, i * 3.0]),
                     Vectors.sparse(6, [i % 6], [i + 0.25]),
                     Vectors.sparse(4, [1], [float(i)]) if i % 2 else
                     Vectors.dense([0.0, float(i), 0.0, 1.0]),
                     float(i % 5), 1.0 + i % 2, i % 5 == 0))
    return spark.createDataFrame(rows, schema).repartition(3)


FEATURES = ["b", "i8", "i16", "i32", "f32", "f64", "ai", "af", "ab", "dv", "sv", "mixed"]


def expected_rows(i):
    sv = np.zeros(6)
    sv[i % 6] = i + 0.25
    mixed = np.array([0.0, i, 0.0, 0.0]) if i % 2 else np.array([0.0, i, 0.0, 1.0])
    return {"b": i % 2 == 0, "i8": i % 100, "i16": i * 3, "i32": i * 7, "f32": i / 4.0,
            "f64": i / 3.0, "ai": [i, i + 1, i + 2], "af": [i * 0.5, -i * 0.5],
            "ab": [i % 3 == 0] * 4, "dv": [i, 2.0 * i, 3.0 * i], "sv": sv, "mixed": mixed,
            "y": float(i % 5), "w": 1.0 + i % 2}


def read_all(store, idx, split="train", **kw):
    loader = ArrowDataLoader(DataSource.from_store(store, idx, split), batch_size=7,
                             shuffle=False, **kw)
    batches = list(loader)
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


@pytest.mark.parametrize("compress_sparse", [False, True])
def test_round_trip_every_type(typed_df, store, cache, compress_sparse):
    idx = prepare_data(2, store, typed_df, label_columns=["y"],
                       feature_columns=["id"] + FEATURES, sample_weight_col="w",
                       compress_sparse=compress_sparse, cache=cache)
    meta = get_dataset_metadata(store, idx)
    cols = meta["columns"]
    assert cols["sv"]["sparse"] is compress_sparse  # only SparseVectors: compressible
    assert cols["mixed"]["sparse"] is False  # holds DenseVectors too: stored dense
    assert (cols["dv"]["kind"], cols["dv"]["dtype"], cols["dv"]["shape"]) == \
        ("vector", "float64", [3])
    assert (cols["ai"]["kind"], cols["ai"]["dtype"], cols["ai"]["shape"]) == \
        ("array", "int32", [3])
    assert (cols["i16"]["kind"], cols["i16"]["dtype"], cols["i16"]["shape"]) == \
        ("scalar", "int16", [])
    assert cols["ab"]["dtype"] == "bool" and cols["f32"]["dtype"] == "float32"
    assert all(c["rows"] == 60 for c in cols.values())
    assert cols["dv"]["bytes"] == 60 * 3 * 8
    assert meta["train"]["rows"] == 60 and meta["val"] is None
    data = read_all(store, idx)
    order = np.argsort(data["id"])
    np.testing.assert_array_equal(data["id"][order], np.arange(60))
    for name in FEATURES + ["y", "w"]:
        got = data[name][order]
        want = np.array([expected_rows(i)[name] for i in range(60)])
        assert got.dtype == np.dtype(cols[name]["dtype"]), name
        np.testing.assert_allclose(got.astype(float), want.astype(float), err_msg=name)
    # Dense arrays and vectors are stored raw (format 2), and decode without the metadata.
    raw = ["ai", "af", "ab", "dv", "mixed"] + ([] if compress_sparse else ["sv"])
    assert sorted(n for n, c in cols.items() if c.get("encoding") == "raw") == sorted(raw)
    first = os.path.join(meta["train"]["path"], meta["train"]["files"][0]["name"])
    schema = pq.read_schema(first)
    assert all(pa.types.is_fixed_size_binary(schema.field(n).type) for n in raw)
    assert pa.types.is_struct(schema.field("sv").type) is compress_sparse
    # Raw columns: no dictionary, no min/max statistics. The others keep their statistics,
    # and a dictionary where values repeat (y, w, the sparse struct; booleans never get
    # one): the scalars whose every value differs are written plain.
    group = pq.read_metadata(first).row_group(0)
    chunks = {group.column(c).path_in_schema: group.column(c)
              for c in range(group.num_columns)}
    for path, chunk in chunks.items():
        top = path.split(".")[0]
        is_raw = top in raw
        assert chunk.is_stats_set is not is_raw, path
        if chunk.physical_type != "BOOLEAN":
            dictionary = not is_raw and top in ("y", "w", "sv")
            assert ("RLE_DICTIONARY" in chunk.encodings) is dictionary, path
    plain = ArrowDataLoader(DataSource.from_path(meta["train"]["path"]), batch_size=60,
                            columns=["id"] + raw, shuffle=False)
    for batch in plain:
        for name in raw:  # data[name][order] is row id's value
            np.testing.assert_array_equal(batch[name], data[name][order][batch["id"]],
                                          err_msg=name)


def test_files_and_metadata_agree(typed_df, store, cache):
    idx = prepare_data(1, store, typed_df, ["y"], ["dv", "ai"], row_group_size_mb=0.0005,
                       cache=cache)
    meta = get_dataset_metadata(store, idx)
    assert meta["rows_per_row_group"] < 60
    for f in meta["train"]["files"]:
        md = pq.read_metadata(os.path.join(meta["train"]["path"], f["name"]))
        assert [md.row_group(g).num_rows for g in range(md.num_row_groups)] == f["row_groups"]
        assert sum(f["row_groups"]) == f["rows"]
    assert sum(f["rows"] for f in meta["train"]["files"]) == 60
    train_rows, val_rows, _, avg = get_dataset_properties(store, idx)
    assert (train_rows, val_rows, avg) == (60, 0, 3 * 8 + 3 * 4 + 8)
    # Horovod's forms: prepare_data as a context manager, properties from the index alone.
    with prepare_data(1, store, typed_df, ["y"], ["dv", "ai"], row_group_size_mb=0.0005,
                      cache=cache) as same:
        assert same == idx and isinstance(same, str)
        assert get_dataset_properties(same) == get_dataset_properties(store, idx)
    with pytest.raises(ValueError, match="which store"):
        get_dataset_properties(str(idx))
    # Only complete files are visible in the data directory.
    names = sorted(os.listdir(meta["train"]["path"]))
    assert names == sorted(f["name"] for f in meta["train"]["files"])


def test_vector_dtype_float32(typed_df, store, cache):
    idx = prepare_data(1, store, typed_df, ["y"], ["dv"], vector_dtype="float32", cache=cache)
    assert read_all(store, idx)["dv"].dtype == np.float32


def test_validation_column_and_fraction(typed_df, store, cache):
    idx = prepare_data(2, store, typed_df, ["y"], ["id"], validation="is_val", cache=cache)
    val = read_all(store, idx, "val")["id"]
    train = read_all(store, idx, "train")["id"]
    assert sorted(val) == [i for i in range(60) if i % 5 == 0]
    assert sorted(train) == [i for i in range(60) if i % 5]
    idx2 = prepare_data(2, store, typed_df, ["y"], ["id"], validation=0.3, seed=3, cache=cache)
    meta = get_dataset_metadata(store, idx2)
    assert meta["train"]["rows"] + meta["val"]["rows"] == 60
    assert 5 <= meta["val"]["rows"] <= 35
    both = np.concatenate([read_all(store, idx2, "train")["id"],
                           read_all(store, idx2, "val")["id"]])
    assert sorted(both) == list(range(60))



def test_names_with_dots_and_spaces(typed_df, store, cache):
    # pyspark's mapInArrow looks columns up by name, where "a.b" means field b of struct a:
    # prepare_data hands Spark positional names and writes the users' back.
    df = typed_df.select(typed_df["id"].alias("x.id"), typed_df["sv"].alias("v.s"),
                         typed_df["dv"].alias("d v"), typed_df["y"].alias("y.1"),
                         typed_df["is_val"].alias("val.flag"))
    idx = prepare_data(2, store, df, ["y.1"], ["x.id", "v.s", "d v"], validation="val.flag",
                       compress_sparse=True, cache=cache)
    meta = get_dataset_metadata(store, idx)
    assert sorted(meta["columns"]) == ["d v", "v.s", "x.id", "y.1"]
    assert meta["columns"]["v.s"]["sparse"] is True
    first = os.path.join(meta["train"]["path"], meta["train"]["files"][0]["name"])
    assert sorted(pq.read_schema(first).names) == ["d v", "v.s", "x.id", "y.1"]
    train, val = read_all(store, idx), read_all(store, idx, "val")
    assert sorted(val["x.id"]) == [i for i in range(60) if i % 5 == 0]
    order = np.argsort(train["x.id"])
    ids = train["x.id"][order]
    for name, col in (("v.s", "sv"), ("d v", "dv"), ("y.1", "y")):
        want = np.array([expected_rows(i)[col] for i in ids])
        np.testing.assert_allclose(train[name][order].astype(float), want, err_msg=name)

def test_loader_ranks_over_prepared_data(typed_df, store, cache):
    idx = prepare_data(3, store, typed_df, ["y"], ["dv"], row_group_size_mb=0.0003,
                       cache=cache)
    src = DataSource.from_store(store.to_remote("run", idx), idx)  # as a worker would
    seen, steps = [], set()
    for rank in range(3):
        loader = ArrowDataLoader(src, batch_size=4, rank=rank, size=3, seed=1)
        batches = list(loader)
        steps.add(len(batches))
        seen += [int(v) for b in batches for v in b["dv"][:, 0]]
    assert sorted(seen) == list(range(60)) and len(steps) == 1


def test_cache_hit_on_equal_plan_miss_on_changed(spark, tmp_path, store, cache):
    from pyspark.sql import functions as F

    src = str(tmp_path / "src")
    spark.range(40).withColumn("x", F.col("id") * 2.0).write.parquet(src)
    df1 = spark.read.parquet(src).select("id", "x")
    df2 = spark.read.parquet(src).select("id", "x")  # a different object, the same plan
    idx = prepare_data(1, store, df1, ["x"], ["id"], cache=cache)
    meta_path = store.get_data_metadata_path(idx)
    first = store.read(meta_path)
    assert prepare_data(4, store, df2, ["x"], ["id"], cache=cache) == idx  # another fit
    assert store.read(meta_path) == first  # not rewritten
    changed = prepare_data(1, store, df1.filter("id > 3"), ["x"], ["id"], cache=cache)
    assert changed != idx
    other_params = prepare_data(1, store, df1, ["x"], ["id"], validation=0.5, cache=cache)
    assert other_params not in (idx, changed)
    # Removable: the data goes and the next call prepares it again.
    remove_dataset(store, idx, cache=cache)
    assert not store.exists(store.get_train_data_path(idx)) and not store.exists(meta_path)
    assert prepare_data(1, store, df1, ["x"], ["id"], cache=cache) == idx
    assert store.exists(meta_path)
    cache.clear()
    for i in (idx, changed, other_params):
        assert not store.exists(store.get_data_metadata_path(i))
        assert not store.exists(store.get_train_data_path(i))
    assert len(cache) == 0


def test_prepare_to_s3(spark, s3_endpoint, cache):
    """Executors write through the store's filesystem: here s3fs against moto."""
    pytest.importorskip("s3fs")
    from pyspark.sql import functions as F

    store = Store.create(f"s3://spark-dl-test/p-{uuid.uuid4().hex[:6]}", storage_options={
        "key": "testing", "secret": "testing",
        "client_kwargs": {"endpoint_url": s3_endpoint, "region_name": "us-east-1"}})
    df = spark.range(30).select("id", F.array(F.col("id").cast("float"),
                                              F.lit(1.0).cast("float")).alias("a"))
    idx = prepare_data(1, store, df, [], ["id", "a"], validation=0.2, cache=cache)
    meta = get_dataset_metadata(store, idx)
    assert meta["train"]["rows"] + meta["val"]["rows"] == 30
    got = np.concatenate([read_all(store, idx, s)["id"] for s in ("train", "val")])
    assert sorted(got) == list(range(30))


# ----------------------------------------------------------------------------- bad input

def assert_nothing_written(store):
    root = store.get_fs_path(store.prefix_path)
    files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
    assert files == [], files


def bad(spark, rows, schema):
    return spark.createDataFrame(rows, schema)


def test_bad_inputs_raise_and_leave_nothing(spark, store, cache):
    from pyspark.ml.linalg import Vectors
    from pyspark.sql import functions as F

    ok = spark.createDataFrame([(1.0, [1.0, 2.0]), (2.0, [3.0, 4.0])], "y double, x array<double>")
    cases = [
        (ok, dict(feature_columns=["nope"]), KeyError, "'nope'"),
        (ok.withColumn("s", F.lit("a")), dict(feature_columns=["s"]), TypeError,
         "'s'.*StringIndexer"),
        (ok.withColumn("m", F.create_map(F.lit("k"), F.lit(1.0))), dict(feature_columns=["m"]),
         TypeError, "'m'.*map"),
        (ok.withColumn("st", F.struct(F.lit(1.0).alias("a"))), dict(feature_columns=["st"]),
         TypeError, "'st'.*struct"),
        (ok.withColumn("n", F.array(F.array(F.lit(1.0)))), dict(feature_columns=["n"]),
         TypeError, "'n'.*flatten"),
        (ok.withColumn("d", F.lit(1).cast("decimal(10,2)")), dict(feature_columns=["d"]),
         TypeError, "'d'.*double"),
        (ok.withColumn("t", F.current_timestamp()), dict(feature_columns=["t"]), TypeError,
         "'t'.*timestamp"),
        (bad(spark, [(1.0, [1.0]), (None, [2.0])], "y double, x array<double>"), {},
         ValueError, "'y' has 1 null"),
        (bad(spark, [(1.0, [1.0]), (2.0, None)], "y double, x array<double>"), {},
         ValueError, "'x' has 1 null"),
        (bad(spark, [(1.0, [1.0, None]), (2.0, [2.0, 3.0])], "y double, x array<double>"), {},
         ValueError, "'x' has 1 arrays with null elements"),
        (bad(spark, [(1.0, [1.0]), (2.0, [2.0, 3.0])], "y double, x array<double>"), {},
         ValueError, "'x' holds arrays of different lengths \\(1 to 2\\)"),
        (spark.createDataFrame([(1.0, Vectors.dense([1.0])), (2.0, Vectors.dense([1.0, 2.0]))],
                               ["y", "x"]), {}, ValueError, "'x' holds vectors of different"),
        (spark.createDataFrame([(1.0, Vectors.sparse(3, [0], [1.0])),
                                (2.0, Vectors.sparse(4, [0], [1.0]))], ["y", "x"]),
         dict(compress_sparse=True), ValueError, "'x' holds vectors of different sizes"),
        (ok.filter("y > 10"), {}, ValueError, "empty"),
        (ok, dict(validation=1.5), ValueError, "fraction must be in \\(0, 1\\)"),
        (ok, dict(validation=0.0), ValueError, "fraction must be in \\(0, 1\\)"),
        (ok, dict(validation="nope"), KeyError, "'nope'"),
        (ok.withColumn("v", F.lit(True)), dict(validation="v"), ValueError,
         "'v' marks every row"),
        (ok.withColumn("v", F.lit(None).cast("boolean")), dict(validation="v"), ValueError,
         "'v' has 2 nulls"),
        (ok, dict(feature_columns=[]), ValueError, "feature_columns is empty"),
        (ok, dict(label_columns=["x"]), ValueError, "more than once"),
        (ok.select("y", "x", "x"), {}, ValueError,  # a join on a.x == b.x keeps both
         r"columns \['x'\] are each in the DataFrame more than once"),
        (ok.withColumn("w", F.array(F.lit(1.0))), dict(sample_weight_col="w"), TypeError,
         "'w' must be a numeric column, not array<double>"),
        # Not a feature's advice (StringIndexer) for a weight or a validation flag.
        (ok.withColumn("w", F.lit("a")), dict(sample_weight_col="w"), TypeError,
         "'w' must be a numeric column, not string$"),
        (ok.withColumn("v", F.lit("yes")), dict(validation="v"), TypeError,
         r"validation column 'v' must be boolean or numeric \(true/non-zero = validation "
         r"row\), not string$"),
    ]
    for df, kw, exc, match in cases:
        args = dict(label_columns=["y"], feature_columns=["x"])
        args.update(kw)
        with pytest.raises(exc, match=match):
            prepare_data(1, store, df, cache=cache, **args)
        assert_nothing_written(store)


def test_unwritable_and_process_local_stores(spark, tmp_path, cache):
    df = spark.createDataFrame([(1.0, 2.0)], "y double, x double")
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(PermissionError, match="not writable"):
        prepare_data(1, Store.create(str(blocker / "store")), df, ["y"], ["x"], cache=cache)
    with pytest.raises(ValueError, match="lives in this process only"):
        prepare_data(1, Store.create("memory://spark-dl/x"), df, ["y"], ["x"], cache=cache)
    with pytest.raises(TypeError, match="Store"):
        prepare_data(1, "/tmp/x", df, ["y"], ["x"], cache=cache)
    with pytest.raises(ValueError, match="num_processes"):
        prepare_data(0, Store.create(str(tmp_path / "s")), df, ["y"], ["x"], cache=cache)
    assert not os.path.exists(tmp_path / "s")


def test_metadata_is_json_and_marks_completion(typed_df, store, cache):
    idx = prepare_data(1, store, typed_df, ["y"], ["f64"], cache=cache)
    meta = json.loads(store.read_text(store.get_data_metadata_path(idx)))
    assert meta["dataset_idx"] == idx and meta["format_version"] == 2
    path = store.get_data_metadata_path(idx)
    for version, readable in ((1, True), (3, False)):  # format 1: lists, read as before
        store.write_text(path, json.dumps(dict(meta, format_version=version)))
        if readable:
            assert DataSource.from_store(store, idx).columns["f64"].dtype == "float64"
        else:
            with pytest.raises(ValueError, match="metadata format 3.*prepare it again"):
                DataSource.from_store(store, idx)
    store.delete(store.get_data_metadata_path(idx))  # as if prepare_data had died before it
    with pytest.raises(FileNotFoundError, match="run prepare_data first"):
        DataSource.from_store(store, idx)
    # The cache notices and prepares again.
    assert prepare_data(1, store, typed_df, ["y"], ["f64"], cache=cache) == idx
    assert store.exists(store.get_data_metadata_path(idx))
