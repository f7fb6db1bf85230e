"""TorchModel.transform without a fit: a model made by hand from a module, and the Arrow
path (:mod:`spark_dl.spark.common.inference`) checked against the module applied to the same
rows, for every feature column kind, and its errors for bad rows.

Split from test_torch_estimator.py, whose transform checks of a fitted model stay beside its
fit. One Spark session (tests/spark/conftest.py's module-scoped ``spark``) for the module.
"""

import sys

import cloudpickle
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pyspark")

from spark_dl.spark.torch import TorchModel  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.spark, pytest.mark.timeout(240)]


def test_hand_built_model_transforms_without_fit(spark):
    # A TorchModel made from a module (no fit, no training metadata): shapes are read
    # from the DataFrame, integer array features are cast to the model's dtype.
    torch.manual_seed(1)
    net = torch.nn.Linear(3, 2)
    model = TorchModel(model=net, feature_columns=["x"], label_columns=["y"])
    df = spark.createDataFrame([([1, 2, 3],), ([4, 5, 6],)], ["x"])
    pdf = model.transform(df).toPandas()
    assert list(pdf.columns) == ["x", "y__output"]
    with torch.no_grad():
        expected = net(torch.tensor([[1.0, 2, 3], [4, 5, 6]])).numpy()
    np.testing.assert_allclose(np.stack(pdf["y__output"]), expected, rtol=1e-6)
    # A label that was a Spark ML vector in training gives a vector output column.
    model.setMetadata({"columns": {"y": {"kind": "vector", "dtype": "float32", "shape": [2]}}})
    out = model.transform(df)
    assert dict(out.dtypes)["y__output"] == "vector"
    np.testing.assert_allclose(np.stack([v.toArray() for v in out.toPandas()["y__output"]]),
                               expected, rtol=1e-6)


def _net32(outputs):
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, outputs))


def test_arrow_transform_equals_the_model_on_numpy_for_each_column_kind(spark):
    # transform reads Arrow buffers straight into NumPy (common.inference): the predictions
    # are bitwise the module applied to the same float32 rows, for a vector column (dense
    # and sparse rows), array<float> and array<double>; other columns pass through. (One
    # row per call on both sides: BLAS may round differently for other row counts.)
    import transform_data as data

    df = data.frame(spark)
    x32 = torch.from_numpy(data.features().astype(np.float32))
    one, three = _net32(1), _net32(3)
    with torch.no_grad():
        want1, want3 = [np.concatenate([net(x32[i:i + 1]).numpy() for i in range(len(x32))])
                        for net in (one, three)]
    for col in ("vec", "af", "ad"):
        model = TorchModel(model=one, feature_columns=[col], label_columns=["y"],
                           batch_size=1)
        out = model.transform(df)
        assert out.schema.fields[:5] == df.schema.fields
        assert out.columns == df.columns + ["y__output"]
        assert dict(out.dtypes)["y__output"] == "double"
        pdf = out.orderBy("id").toPandas()
        assert list(pdf["name"]) == [f"row{i}" for i in range(data.ROWS)]
        np.testing.assert_array_equal(data.column(pdf, "y__output"),
                                      want1.reshape(-1).astype(np.float64), err_msg=col)
    # Several values per row: array<float> with output_format="array", else a vector; an
    # output column named as an input replaces it in place of being appended twice.
    arr = TorchModel(model=three, feature_columns=["vec"], label_columns=["y"],
                     output_format="array", output_cols=["ad"], batch_size=1)
    out = arr.transform(df)
    assert out.columns == ["id", "name", "vec", "af", "ad"]
    assert dict(out.dtypes)["ad"] == "array<float>"
    got = data.column(out.orderBy("id").toPandas(), "ad")  # float32 values, exactly
    np.testing.assert_array_equal(got.astype(np.float32), want3)
    vec = TorchModel(model=three, feature_columns=["af"], label_columns=["y"], batch_size=1)
    out = vec.transform(df)
    assert dict(out.dtypes)["y__output"] == "vector"
    np.testing.assert_array_equal(data.column(out.orderBy("id").toPandas(), "y__output"),
                                  want3.astype(np.float64))


def test_arrow_transform_names_bad_rows(spark):
    from pyspark.ml.linalg import Vectors

    net = _net32(1)
    meta = {"columns": {"x": {"kind": "array", "dtype": "float32", "shape": [4]}}}
    model = TorchModel(model=net, feature_columns=["x"], label_columns=["y"], metadata=meta)
    cases = [([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0]], "array<double>",
              r"feature column 'x' holds arrays of different lengths \[3, 4\]"),
             ([[1.0, 2.0, 3.0, 4.0], None], "array<double>", "feature column 'x' has null"),
             ([[1.0, 2.0, 3.0]], "array<double>",
              r"feature column 'x' has rows of shape \[3\]; the model takes rows of "
              r"shape \[4\]")]
    for rows, dtype, match in cases:
        bad = spark.createDataFrame([(r,) for r in rows], f"x {dtype}").coalesce(1)
        with pytest.raises(Exception, match=match):
            model.transform(bad).collect()
    vmodel = model.copy().setMetadata(
        {"columns": {"x": {"kind": "vector", "dtype": "float32", "shape": [4]}}})
    bad = spark.createDataFrame([(Vectors.dense([1.0, 2, 3, 4]),), (Vectors.sparse(5, {0: 1.0}),)],
                                ["x"]).coalesce(1)
    with pytest.raises(Exception, match=r"feature column 'x' holds arrays of different "
                                        r"lengths \[4, 5\]"):
        vmodel.transform(bad).collect()
    with pytest.raises(TypeError, match="column 'x' has unsupported type string"):
        model.transform(spark.createDataFrame([("a",)], ["x"]))


def test_arrow_udf_and_map_in_arrow_give_the_same_rows(spark, monkeypatch):
    # Where pyspark has arrow_udf (4.1+) every frame takes it: only the features travel to
    # Python. mapInArrow (pyspark 3.5) ships whole rows. Both give the same columns and
    # bitwise the same values.
    import transform_data as data
    from pyspark.sql import functions as F

    import spark_dl.spark.common.model as model_module

    df = data.frame(spark).drop("vec").withColumn("s", F.col("id") * 0.5)
    three = TorchModel(model=_net32(3), feature_columns=["af"], label_columns=["y"],
                       output_format="array", batch_size=7)
    one = TorchModel(model=torch.nn.Linear(1, 1), feature_columns=["s"], label_columns=["y"],
                     output_cols=["ad"])  # replaces a column in place

    def plan(out):
        return out._jdf.queryExecution().executedPlan().toString()

    has_udf = model_module._arrow_udf() is not None
    default = [model.transform(df) for model in (three, one)]
    for out in default:
        assert ("ArrowEvalPython" in plan(out)) == has_udf
        assert ("MapInArrow" in plan(out)) != has_udf
    with monkeypatch.context() as patch:
        patch.setattr(model_module, "_arrow_udf", lambda: None)
        by_map = [model.transform(df) for model in (three, one)]
    for a, b in zip(default, by_map):
        assert a.schema == b.schema
        got, want = a.orderBy("id").toPandas(), b.orderBy("id").toPandas()
        assert list(got["name"]) == list(want["name"])
        for col in (c for c in got.columns if c != "name"):
            np.testing.assert_array_equal(data.column(got, col), data.column(want, col),
                                          err_msg=col)


def test_a_frame_with_a_name_twice_transforms(spark, monkeypatch):
    # A join leaves `id` twice. Spark resolves columns by name, so transform carries them
    # under positional names and gives theirs back: every column stays where it was. An
    # output named like them replaces both; a feature named twice is an error up front.
    import spark_dl.spark.common.model as model_module

    a = spark.createDataFrame([(1, [1.0, 2.0]), (2, [3.0, 4.0])], ["id", "x"])
    b = spark.createDataFrame([(1, "p"), (2, "q")], ["id", "t"])
    joined = a.join(b, a.id == b.id)
    torch.manual_seed(0)
    net = torch.nn.Linear(2, 1)
    with torch.no_grad():
        want = net(torch.tensor([[1.0, 2.0], [3.0, 4.0]])).numpy().reshape(-1)
    model = TorchModel(model=net, feature_columns=["x"], label_columns=["y"])
    replacing = TorchModel(model=net, feature_columns=["x"], label_columns=["y"],
                           output_cols=["id"])
    for carrier in ("default", "mapInArrow"):
        with monkeypatch.context() as patch:
            if carrier == "mapInArrow":
                patch.setattr(model_module, "_arrow_udf", lambda: None)
            out = model.transform(joined)
            assert out.columns == ["id", "x", "id", "t", "y__output"], carrier
            rows = sorted(out.collect(), key=lambda r: r[0])
            assert [tuple(r)[:4] for r in rows] == [(1, [1.0, 2.0], 1, "p"),
                                                    (2, [3.0, 4.0], 2, "q")]
            np.testing.assert_allclose([r[4] for r in rows], want, rtol=1e-6)
            out = replacing.transform(joined)
            assert out.columns == ["x", "t", "id"], carrier
            np.testing.assert_allclose(sorted(r.id for r in out.collect()), sorted(want),
                                       rtol=1e-6)
    twice = TorchModel(model=torch.nn.Linear(1, 1), feature_columns=["id"],
                       label_columns=["y"])
    with pytest.raises(ValueError, match=r"feature columns \['id'\] are each in the "
                                         r"DataFrame more than once"):
        twice.transform(joined)


def test_names_with_dots_and_spaces_transform(spark, monkeypatch):
    # Spark reads "a.b" as field b of struct a where a name is looked up (pyspark's
    # mapInArrow does that for every column): the features and the outputs keep theirs.
    import spark_dl.spark.common.model as model_module

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.linear = torch.nn.Linear(2, 1)

        def forward(self, a, b):
            return self.linear(torch.cat([a, b], 1))

    net = Two()
    df = spark.createDataFrame([(float(i), [i * 2.0], i * 3.0) for i in range(6)],
                               ["a.b", "c d", "y.z"])
    with torch.no_grad():
        want = net(torch.arange(6.0).reshape(6, 1),
                   torch.arange(6.0).reshape(6, 1) * 2).numpy().reshape(-1)
    model = TorchModel(model=net, feature_columns=["a.b", "c d"], label_columns=["y.z"])
    for carrier in ("default", "mapInArrow"):
        with monkeypatch.context() as patch:
            if carrier == "mapInArrow":
                patch.setattr(model_module, "_arrow_udf", lambda: None)
            out = model.transform(df)
            assert out.columns == ["a.b", "c d", "y.z", "y.z__output"], carrier
            pdf = out.toPandas().sort_values("a.b")
            np.testing.assert_allclose(pdf["y.z__output"].to_numpy(), want, rtol=1e-6)


def test_streaming_frames_transform(spark, tmp_path):
    # Structured Streaming: transform adds a streaming column, as pyspark.ml's models do. A
    # fitted model (or input_shapes [-1, n]) knows each row's size; a model built by hand
    # without them would read a row, which a stream cannot give: a clear error instead.
    import pyspark.sql.types as T

    torch.manual_seed(0)
    net = torch.nn.Linear(2, 1)
    rows = [(i, [float(i), 1.0]) for i in range(8)]
    schema = T.StructType([T.StructField("id", T.LongType()),
                           T.StructField("x", T.ArrayType(T.DoubleType()))])
    spark.createDataFrame(rows, schema).write.parquet(str(tmp_path / "in"))
    stream = spark.readStream.schema(schema).parquet(str(tmp_path / "in"))
    with torch.no_grad():
        want = net(torch.tensor([r[1] for r in rows])).numpy().reshape(-1)
    by_hand = TorchModel(model=net, feature_columns=["x"], label_columns=["y"])
    with pytest.raises(ValueError, match="streaming DataFrame cannot give.*input_shapes"):
        by_hand.transform(stream)
    for i, model in enumerate([by_hand.copy().setInputShapes([[-1, 2]]),
                               by_hand.copy().setMetadata(
                                   {"columns": {"x": {"kind": "array", "dtype": "float32",
                                                      "shape": [2]}}})]):
        out = model.transform(stream)
        assert out.isStreaming
        query = (out.writeStream.format("memory").queryName(f"scored{i}")
                 .trigger(availableNow=True).start())
        try:
            assert query.awaitTermination(120), "the stream did not finish in 120 s"
        finally:
            query.stop()
        got = spark.sql(f"select id, y__output from scored{i}").toPandas().sort_values("id")
        np.testing.assert_allclose(got["y__output"].to_numpy(), want, rtol=1e-6)
