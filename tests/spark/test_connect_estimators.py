"""The three estimators end to end through a Spark Connect session (``local[2]`` behind an
in-process Connect server): fit -> transform -> save/load -> Pipeline, resume by run_id,
and bad inputs refused before any job. One small fit per framework (two for torch)."""

import io
import sys
from contextlib import redirect_stdout

import cloudpickle
import numpy as np
import pytest

from spark_support import require_connect_server

require_connect_server()  # the server jar ships with pyspark 4.x only
torch = pytest.importorskip("torch")

from pyspark.ml import Pipeline, PipelineModel  # noqa: E402

from spark_dl.spark.common.store import Store  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])
# Spark's own functions (the store probe's) go through pyspark's copy of cloudpickle.
pytest.importorskip("pyspark.cloudpickle").register_pickle_by_value(sys.modules[__name__])
pytestmark = [pytest.mark.spark, pytest.mark.timeout(400)]

W = np.array([1.5, -2.0, 0.5, 1.0])


def regression_df(spark, rows=256, seed=0):
    from pyspark.ml.linalg import Vectors

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 4))
    y = x @ W + 0.3
    return spark.createDataFrame([(Vectors.dense(r), float(t)) for r, t in zip(x, y)],
                                 ["features", "y"])


def features_of(pdf):
    return np.stack([v.toArray() for v in pdf["features"]]).astype("float32")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return Store.create(str(tmp_path_factory.mktemp("connect_est") / "store"))


@pytest.fixture(scope="module")
def df(connect_spark):
    return regression_df(connect_spark)


def torch_estimator(store, **kwargs):
    from spark_dl.spark.torch import TorchEstimator

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    params = dict(num_proc=2, store=store, model=net,
                  optimizer=torch.optim.Adam(net.parameters(), lr=0.05),
                  loss=torch.nn.functional.mse_loss, feature_cols=["features"],
                  label_cols=["y"], batch_size=32, epochs=2, validation=0.25, verbose=1,
                  use_gpu=False)
    params.update(kwargs)
    return TorchEstimator(**params)


def _check_predictions(model, module, df, col="y__output"):
    pdf = model.transform(df).toPandas()
    with torch.no_grad():
        want = module(torch.from_numpy(features_of(pdf))).numpy().reshape(-1)
    got = np.asarray([float(np.asarray(v).reshape(-1)[0]) for v in pdf[col]])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_torch_fit_transform_persistence_and_resume(connect_spark, df, store, tmp_path):
    from spark_dl.spark.torch import TorchModel

    out = io.StringIO()
    with redirect_stdout(out):
        model = torch_estimator(store, run_id="connect_resume").fit(df)
    assert "Epoch 2/2" in out.getvalue()
    history = model.getHistory()
    assert len(history["loss"]) == 2 and "val_loss" in history
    _check_predictions(model, model.getModel(), df)
    # ML persistence and a Pipeline round trip, through the Connect session.
    model.write().overwrite().save(str(tmp_path / "model"))
    loaded = TorchModel.load(str(tmp_path / "model"))
    _check_predictions(loaded, model.getModel(), df)
    PipelineModel(stages=[model]).write().overwrite().save(str(tmp_path / "pipeline"))
    back = PipelineModel.load(str(tmp_path / "pipeline"))
    _check_predictions(back, model.getModel(), df)
    Pipeline(stages=[torch_estimator(store)]).write().overwrite().save(str(tmp_path / "est"))
    assert isinstance(Pipeline.load(str(tmp_path / "est")).getStages()[0],
                      type(torch_estimator(store)))
    # The same run_id resumes after the last epoch, here from the prepared data
    # (fit_on_parquet; prepare_data finds the fit's data in its cache).
    from spark_dl.spark.common.util import prepare_data

    idx = prepare_data(2, store, df, label_columns=["y"], feature_columns=["features"],
                       validation=0.25, vector_dtype="float32")
    out = io.StringIO()
    with redirect_stdout(out):
        resumed = torch_estimator(store, run_id="connect_resume",
                                  epochs=3).fit_on_parquet(dataset_idx=idx)
    assert "resuming run connect_resume after epoch 2" in out.getvalue()
    assert len(resumed.getHistory()["loss"]) >= 1


def test_keras_fit_transform_persistence_and_mlflow(connect_spark, df, store, tmp_path,
                                                    monkeypatch):
    keras = pytest.importorskip("keras")
    mlflow = pytest.importorskip("mlflow")
    from spark_dl.spark.keras import KerasEstimator, KerasModel

    monkeypatch.chdir(tmp_path)  # MLflow's default local store lands here
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(name, raising=False)
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                            keras.layers.Dense(1)])
    est = KerasEstimator(num_proc=2, store=store, model=net,
                         optimizer=keras.optimizers.Adam(0.05), loss="mse",
                         feature_cols=["features"], label_cols=["y"], batch_size=32,
                         epochs=2, verbose=1, run_id="connect_mlflow", mlflow=True)
    out = io.StringIO()
    with redirect_stdout(out):
        model = est.fit(df)
    assert len(model.getHistory()["loss"]) == 2
    model.write().overwrite().save(str(tmp_path / "keras_model"))
    for fitted in (model, KerasModel.load(str(tmp_path / "keras_model"))):
        pdf = fitted.transform(df).toPandas()
        want = model.getModel().predict(features_of(pdf), verbose=0).reshape(-1)
        got = np.asarray([float(np.asarray(v).reshape(-1)[0]) for v in pdf["y__output"]])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # MLflow under Connect (issue 35): the model is logged, and its pyfunc flavor predicts
    # in this process without Spark what transform gives (vectors in, as toPandas makes them).
    assert "model logged" in out.getvalue(), out.getvalue()
    pyfunc = mlflow.pyfunc.load_model(f"runs:/{model.mlflow_run_id}/model")
    column = "prediction" if "prediction" in pdf else "y__output"
    want = np.asarray([float(np.asarray(v).reshape(-1)[0]) for v in pdf[column]])
    np.testing.assert_allclose(np.asarray(pyfunc.predict(pdf[["features"]]), dtype=float),
                               want, rtol=1e-5, atol=1e-6)
    every = pyfunc.predict(pdf[["features"]], params={"outputs": "all"})
    assert "y__output" in every.columns
    # The staging copy in the run folder is gone.
    assert not [n for n in store.listdir(store.get_run_path("connect_mlflow"))
                if "mlflow_model" in n]


def test_lightning_fit_transform_and_persistence(connect_spark, df, store, tmp_path):
    pytest.importorskip("lightning.pytorch")
    from spark_dl.spark.lightning import LightningEstimator, LightningModel

    est = LightningEstimator(num_proc=2, store=store, model=_lightning_module(),
                             feature_cols=["features"], label_cols=["y"], batch_size=32,
                             epochs=2, verbose=1)
    model = est.fit(df)
    assert model.getHistory()
    _check_predictions(model, model.getModel(), df)
    model.write().overwrite().save(str(tmp_path / "lightning_model"))
    _check_predictions(LightningModel.load(str(tmp_path / "lightning_model")),
                       model.getModel(), df)


def _lightning_module():
    import lightning.pytorch as pl

    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                           torch.nn.Linear(8, 1))

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            loss = torch.nn.functional.mse_loss(self(batch["features"]).squeeze(-1),
                                                batch["y"])
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.05)

    return Regression()


def test_bad_inputs_fail_before_any_job(connect_spark, df, store):
    import threading

    with pytest.raises(KeyError, match=r"columns \[.nope.\] are not in the DataFrame"):
        torch_estimator(store, feature_cols=["nope"]).fit(df)

    lock = threading.Lock()

    def loss(output, label):
        with lock:
            return torch.nn.functional.mse_loss(output, label)

    with pytest.raises(TypeError, match="lock"):
        torch_estimator(store, loss=loss).fit(df)
    with pytest.raises(Exception, match="num_proc=3 exceeds the 2 task slots"):
        torch_estimator(store, num_proc=3).fit(df)


class _ElsewhereStore(Store.create("/tmp").__class__):
    """Writes on the caller's side land in another folder than the executors read:
    a local path of a Connect client, seen from a cluster."""

    def write(self, path, data):
        import os

        target = path.replace(self.prefix_path, self.prefix_path + "_caller", 1)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as f:
            f.write(data)


def test_a_store_the_executors_cannot_reach_fails_first(connect_spark, monkeypatch, tmp_path):
    from spark_dl.spark.common import store_check

    monkeypatch.setattr(store_check, "_same_machine", lambda spark: False)
    store_check.check_store_reachable(connect_spark, Store.create(str(tmp_path / "ok")), 2)
    bad = _ElsewhereStore(str(tmp_path / "bad"))
    with pytest.raises(store_check.StoreUnreachableError, match="cannot read the store"):
        store_check.check_store_reachable(connect_spark, bad, 2)
