"""The estimator layer on a Spark Connect session (no SparkContext, no py4j): transform,
ML persistence and Pipelines, prepare_data and its cache, the default store.

Everything is compared with the classic path on the same data in the same process: the
in-process Connect server (``connect_server``) is itself a classic session, used inside
:func:`classic_mode`, where pyspark's process-wide ``is_remote()`` is false again.
"""

import contextlib
import glob
import json
import os
import sys

import cloudpickle
import numpy as np
import pytest

torch = pytest.importorskip("torch")
from spark_support import require_connect_server  # noqa: E402

require_connect_server()  # the server jar ships with pyspark 4.x only

from pyspark.ml import Pipeline, PipelineModel  # noqa: E402

from spark_dl.spark.common import model as model_module  # noqa: E402
from spark_dl.spark.common import persistence  # noqa: E402
from spark_dl.spark.common.cache import (TrainingDataCache, UncacheablePlan,  # noqa: E402
                                         plan_fingerprint)
from spark_dl.spark.common.data_loader import ArrowDataLoader  # noqa: E402
from spark_dl.spark.common.data_loader_base import DataSource  # noqa: E402
from spark_dl.spark.common.estimator import default_store  # noqa: E402
from spark_dl.spark.common.session import is_connect, is_local_master, master_of  # noqa: E402
from spark_dl.spark.common.store import Store  # noqa: E402
from spark_dl.spark.common.util import get_dataset_metadata, prepare_data  # noqa: E402
from spark_dl.spark.torch import TorchEstimator, TorchModel  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

W = np.array([1.5, -2.0, 0.5, 1.0])
ROWS = 120


@contextlib.contextmanager
def classic_mode():
    """pyspark.sql.functions and pyspark.ml choose their classic implementations inside."""
    saved = os.environ.pop("SPARK_CONNECT_MODE_ENABLED")
    try:
        yield
    finally:
        os.environ["SPARK_CONNECT_MODE_ENABLED"] = saved


def rows():
    """(id, features as a vector, the same as an array, label) with y = x . W."""
    from pyspark.ml.linalg import Vectors

    x = np.random.default_rng(0).normal(size=(ROWS, 4))
    return [(i, Vectors.dense(r), [float(v) for v in r], float(r @ W))
            for i, r in enumerate(x)]


def frame(spark):
    return spark.createDataFrame(rows(), ["id", "vec", "arr", "y"])


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def torch_model(col="vec", net=None):
    """A TorchModel as a fit on ``col`` would build it (training metadata included)."""
    kind = "vector" if col == "vec" else "array"
    return TorchModel(model=net or mlp(), feature_columns=[col], label_columns=["y"],
                      use_gpu=False, prediction_kind="regression",
                      metadata={"columns": {col: {"kind": kind, "dtype": "float64",
                                                  "shape": [4]},
                                            "y": {"kind": "scalar", "dtype": "float64",
                                                  "shape": []}},
                                "vector_dtype": "float64"})


def predictions(model, df, col="y__output"):
    pdf = model.transform(df).orderBy("id").toPandas()
    return pdf[col].to_numpy()


def expected(net):
    x = np.stack([r[2] for r in rows()])
    with torch.no_grad():
        return net(torch.tensor(x, dtype=torch.float32)).numpy().reshape(-1)


@pytest.fixture(scope="module")
def df(connect_spark):
    return frame(connect_spark)


@pytest.fixture(scope="module")
def classic_df(connect_server):
    with classic_mode():
        return frame(connect_server)


# ----------------------------------------------------------------------------- session


def test_session_helpers(connect_spark, connect_server, df):
    assert is_connect(connect_spark) and is_connect(df) and is_connect(df["id"])
    assert not is_connect(connect_server)
    assert master_of(connect_spark) == master_of(connect_server) == "local[2]"
    assert is_local_master(connect_spark) and is_local_master(df)
    store = default_store(connect_spark)
    assert isinstance(store, Store) and store is default_store(connect_server)


class _Builder:
    def __init__(self, host):
        self.host = host


class _Client:
    def __init__(self, host):
        self._builder = _Builder(host)


class _Conf:
    def __init__(self, master):
        self.master = master

    def get(self, key, default=None):
        if self.master is None:
            raise RuntimeError("[CONFIG_NOT_AVAILABLE] spark.master")
        return self.master


class FakeConnectSession:
    """What the helpers read of a Connect session: its class's module, conf and host."""

    def __init__(self, master, host):
        self.conf = _Conf(master)
        self.client = _Client(host)


FakeConnectSession.__module__ = "pyspark.sql.connect.session"


@pytest.mark.parametrize("master, host, local", [
    ("local[4]", "localhost", True), ("local[4]", "127.0.0.1", True),
    ("local[4]", "adb-123.azuredatabricks.net", False),  # a local master elsewhere
    ("spark://head:7077", "localhost", False), (None, "localhost", False)])
def test_local_master_on_connect_means_a_server_on_this_host(master, host, local):
    session = FakeConnectSession(master, host)
    assert is_connect(session) and master_of(session) == master
    assert is_local_master(session) is local
    if not local:
        with pytest.raises(ValueError, match="store is required"):
            default_store(session)


# ----------------------------------------------------------------------------- transform


@pytest.mark.parametrize("col", ["vec", "arr"])
def test_transform_matches_classic(df, classic_df, col):
    model = torch_model(col)
    got = model.transform(df)
    assert got.columns == ["id", "vec", "arr", "y", "y__output", "prediction"]
    pdf = got.orderBy("id").toPandas()
    with classic_mode():
        want = predictions(model, classic_df)
    np.testing.assert_array_equal(pdf["y__output"].to_numpy(), want)
    np.testing.assert_allclose(want, expected(model.getModel()), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(pdf["prediction"].to_numpy(), want)



def test_transform_keeps_a_name_that_a_join_left_twice(df, connect_spark):
    # Spark Connect resolves names on the server: the columns named twice travel under
    # positional names there too and come back as they were.
    other = connect_spark.createDataFrame([(i, f"r{i}") for i in range(ROWS)], ["id", "t"])
    model = torch_model("arr")
    got = model.transform(df.join(other, df.id == other.id))
    assert got.columns == ["id", "vec", "arr", "y", "id", "t", "y__output", "prediction"]
    pdf = got.toPandas()
    assert [tuple(r) for r in pdf.iloc[:, [0, 4, 5]].itertuples(index=False)] == \
        [(i, i, f"r{i}") for i in pdf.iloc[:, 0]]
    np.testing.assert_allclose(pdf["y__output"].to_numpy(),
                               expected(model.getModel())[pdf.iloc[:, 0].to_numpy()],
                               rtol=1e-5, atol=1e-5)

def test_small_predictors_ride_in_the_udf_large_ones_as_artifacts(connect_spark,
                                                                   monkeypatch):
    assert isinstance(model_module._ship_predictor(connect_spark, b"x" * 100),
                      model_module._Inline)
    shipped = model_module._ship_predictor(connect_spark, b"y" * (2 << 20))
    assert isinstance(shipped, model_module._ArtifactFile)
    # The same bytes again: the same artifact, not uploaded twice (a second add of the same
    # name with other content would fail on the server).
    assert model_module._ship_predictor(connect_spark, b"y" * (2 << 20)).name == shipped.name

    def refuse(spark, blob):
        raise RuntimeError("artifacts disabled")

    monkeypatch.setattr(model_module, "_upload_artifact", refuse)
    assert isinstance(model_module._ship_predictor(connect_spark, b"z" * (2 << 20)),
                      model_module._Inline)
    monkeypatch.setattr(model_module, "_INLINE_MAX_BYTES", 1 << 20)
    with pytest.raises(ValueError, match="too large to send inside a Spark Connect query.*"
                                         "artifacts disabled"):
        model_module._ship_predictor(connect_spark, b"z" * (2 << 20))


def test_transform_through_an_artifact_file(df, monkeypatch):
    monkeypatch.setattr(model_module, "_INLINE_BYTES", 0)
    # Built by hand (no training metadata): the feature shape comes from the first row.
    net = mlp()
    model = TorchModel(model=net, feature_columns=["vec"], label_columns=["y"], use_gpu=False)
    np.testing.assert_allclose(np.stack(predictions(model, df)).reshape(-1), expected(net),
                               rtol=1e-5, atol=1e-5)


class Regressor(torch.nn.Module):
    """A LightningModule's forward is all transform needs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.net = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.net(x)


def test_lightning_model_transforms(df, classic_df):
    # (Keras shares the same transform; its import in the driver and both workers would
    # triple this module's time.)
    pytest.importorskip("lightning")
    from spark_dl.spark.lightning import LightningModel

    net = Regressor()
    model = LightningModel(model=net, feature_columns=["arr"], label_columns=["y"],
                           input_shapes=[[-1, 4]], use_gpu=False)
    got = predictions(model, df)
    np.testing.assert_allclose(got, expected(net), rtol=1e-5, atol=1e-5)
    with classic_mode():
        np.testing.assert_array_equal(predictions(model, classic_df), got)


# ----------------------------------------------------------------------------- persistence


def _read_part(path):
    [part] = glob.glob(os.path.join(path, "part-*"))
    with open(part) as f:
        return f.read().splitlines()


def test_model_save_load_overwrite_and_the_classic_reads_it(df, classic_df, connect_server,
                                                            tmp_path, monkeypatch):
    model = torch_model("vec")
    path = str(tmp_path / "model")
    model.write().save(path)
    loaded = TorchModel.load(path)
    assert loaded.uid == model.uid and loaded.getMetadata() == model.getMetadata()
    want = predictions(model, df)
    np.testing.assert_array_equal(predictions(loaded, df), want)
    with pytest.raises(Exception, match="already exists"):
        model.write().save(path)
    # overwrite(): the server deletes the old path (pyspark's py4j route is classic-only);
    # where it cannot, both parts are written in overwrite mode.
    other = torch_model("vec", torch.nn.Sequential(torch.nn.Linear(4, 1)))
    other.write().overwrite().save(path)
    assert TorchModel.load(path).uid == other.uid
    monkeypatch.setattr(persistence, "_delete_on_connect", lambda path: False)
    model.write().overwrite().save(path)
    assert TorchModel.load(path).uid == model.uid
    meta = json.loads(_read_part(os.path.join(path, "metadata"))[0])
    assert meta["class"] == "spark_dl.spark.torch.model.TorchModel"
    assert meta["spark_dl"]["format"] == persistence.FORMAT_VERSION
    # The classic path reads what Connect wrote, and the other way round.
    classic_path = str(tmp_path / "classic_model")
    with classic_mode():
        from_connect = TorchModel.read().session(connect_server).load(path)
        np.testing.assert_array_equal(predictions(from_connect, classic_df), want)
        model.write().session(connect_server).save(classic_path)
    np.testing.assert_array_equal(predictions(TorchModel.load(classic_path), df), want)


def test_estimator_save_load(connect_spark, tmp_path):
    net = mlp()
    est = TorchEstimator(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                         loss=torch.nn.functional.mse_loss, feature_cols=["vec"],
                         label_cols=["y"], epochs=2, store=Store.create(str(tmp_path / "s")))
    path = str(tmp_path / "estimator")
    est.write().save(path)
    loaded = TorchEstimator.load(path)
    assert loaded.uid == est.uid and loaded.getEpochs() == 2
    assert loaded.getStore().prefix_path == est.getStore().prefix_path
    assert loaded.getOptimizer().param_groups[0]["params"][0] is \
        next(loaded.getModel().parameters())


def test_pipeline_round_trips(df, tmp_path):
    from pyspark.ml.feature import VectorAssembler

    assembler = VectorAssembler(inputCols=["vec"], outputCol="features")
    model = torch_model("vec")
    fitted = PipelineModel(stages=[assembler, model.copy().setFeatureColumns(["features"])
                                   .setMetadata({"vector_dtype": "float64"})])
    path = str(tmp_path / "pipeline_model")
    fitted.write().save(path)
    fitted.write().overwrite().save(path)
    loaded = PipelineModel.load(path)
    assert [type(s).__name__ for s in loaded.stages] == ["VectorAssembler", "TorchModel"]
    np.testing.assert_allclose(predictions(loaded, df), predictions(model, df), rtol=1e-6)
    est = TorchEstimator(model=mlp(), feature_cols=["features"], label_cols=["y"], epochs=3)
    path = str(tmp_path / "pipeline")
    Pipeline(stages=[assembler, est]).write().save(path)
    stages = Pipeline.load(path).getStages()
    assert isinstance(stages[1], TorchEstimator) and stages[1].uid == est.uid
    assert stages[1].getEpochs() == 3


# ----------------------------------------------------------------------------- prepare_data


def _read_all(store, idx):
    loader = ArrowDataLoader(DataSource.from_store(store, idx), batch_size=7, shuffle=False)
    batches = list(loader)
    data = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
    order = np.argsort(data["id"])
    return {k: v[order] for k, v in data.items()}


def test_prepare_data_writes_what_the_classic_path_writes(df, classic_df, tmp_path):
    store = Store.create(str(tmp_path / "store"))
    args = dict(label_columns=["y"], feature_columns=["id", "vec", "arr"],
                cache=TrainingDataCache())
    idx = prepare_data(2, store, df, **args)
    with classic_mode():
        classic_idx = prepare_data(2, store, classic_df, **args)
    assert idx != classic_idx  # keyed by different plans
    meta, classic_meta = (get_dataset_metadata(store, i) for i in (idx, classic_idx))
    assert meta["columns"] == classic_meta["columns"]
    assert meta["train"]["rows"] == classic_meta["train"]["rows"] == ROWS
    got, want = _read_all(store, idx), _read_all(store, classic_idx)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    np.testing.assert_array_equal(got["vec"], np.stack([r[2] for r in rows()]))


def test_cache_hits_on_the_same_query_and_misses_on_another(connect_spark, df, tmp_path):
    from pyspark.sql import functions as F

    store, cache = Store.create(str(tmp_path / "store")), TrainingDataCache()

    def prepare(frame):
        return prepare_data(1, store, frame, ["y"], ["vec"], cache=cache)

    idx = prepare(df)
    assert prepare(df) == idx
    # Built again (fresh plan ids), with a column referred to through its DataFrame.
    again = frame(connect_spark)
    assert prepare(again.select(again["vec"], "y", "id")) == \
        prepare(df.select(df["vec"], "y", "id"))
    assert prepare(frame(connect_spark)) == idx
    assert len({prepare(df.filter("id > 3")), prepare(df.withColumn("y", F.col("y") * 2)),
                prepare(connect_spark.range(5).select(F.array(F.lit(1.0), F.lit(2.0))
                                                      .alias("vec"), F.lit(0.0).alias("y"))),
                idx}) == 4
    assert len(cache) == 5


def test_session_state_is_never_cached(connect_spark, df, tmp_path, monkeypatch):
    store, cache = Store.create(str(tmp_path / "store")), TrainingDataCache()
    df.createOrReplaceTempView("connect_common_view")
    view = connect_spark.table("connect_common_view")
    sql = connect_spark.sql("SELECT * FROM connect_common_view")
    for frame_, why in ((view, "temporary view 'connect_common_view'"),
                        (sql, "SQL text")):
        with pytest.raises(UncacheablePlan, match=why):
            plan_fingerprint(frame_)
        first = prepare_data(1, store, frame_, ["y"], ["id", "arr"], cache=cache)
        assert prepare_data(1, store, frame_, ["y"], ["id", "arr"], cache=cache) != first
        np.testing.assert_array_equal(_read_all(store, first)["arr"],
                                      np.stack([r[2] for r in rows()]))
    assert len(cache) == 0
    # A client that compresses large plans changes nothing: the relation is read as built.
    client = connect_spark.client
    if getattr(client, "_zstd_module", None) is not None:
        fingerprint = plan_fingerprint(df)
        monkeypatch.setattr(client, "_plan_compression_threshold", 0)
        monkeypatch.setattr(client, "_plan_compression_algorithm", "ZSTD")
        assert df._plan.to_proto(client).HasField("compressed_operation")
        assert plan_fingerprint(df) == fingerprint
        with pytest.raises(UncacheablePlan, match="SQL text"):
            plan_fingerprint(sql)
    # Redefined, the view holds other rows: a cache keyed by its name would be wrong.
    df.filter("id < 10").createOrReplaceTempView("connect_common_view")
    idx = prepare_data(1, store, connect_spark.table("connect_common_view"), ["y"], ["arr"],
                       cache=cache)
    assert get_dataset_metadata(store, idx)["train"]["rows"] == 10
