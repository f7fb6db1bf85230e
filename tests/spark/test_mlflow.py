"""MLflow logging of a fit (issue 35), on local[2]: one TorchEstimator fit with ``mlflow=True``
and no URI (MLflow's default local store, in a temporary working directory) has its run,
params, per-epoch metrics logged by the driver only (one value per epoch), the run folder
with the TensorBoard logs, and a model that ``mlflow.spark`` and ``mlflow.pyfunc`` load and
predict with as ``transform`` does (pyfunc without Spark; under Spark Connect:
tests/spark/test_connect_estimators.py). The estimators share this code (EstimatorBase), so one
framework's fit covers them; the logger without Spark: tests/unit/test_mlflow_run.py."""

import sys

import cloudpickle
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pyspark")
mlflow = pytest.importorskip("mlflow")

from spark_dl.spark.common.store import Store  # noqa: E402
from spark_dl.spark.torch import TorchEstimator  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]


def mae(output, label):
    return (output - label).abs().mean()


def test_fit_logs_run_params_epoch_metrics_artifacts_and_a_loadable_model(spark, tmp_path,
                                                                          monkeypatch):
    from pyspark.ml.linalg import Vectors

    monkeypatch.chdir(tmp_path)  # MLflow's default store lands here
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(name, raising=False)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(240, 4))
    y = x @ np.array([1.5, -2.0, 0.5, 1.0]) + 0.3
    df = spark.createDataFrame([(i, Vectors.dense(r), float(t))
                                for i, (r, t) in enumerate(zip(x, y))], ["id", "features", "y"])
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    est = TorchEstimator(num_proc=2, model=net, optimizer=torch.optim.Adam(net.parameters(),
                                                                          lr=0.05),
                         loss=torch.nn.functional.mse_loss, metrics=[mae],
                         feature_cols=["features"], label_cols=["y"], batch_size=32, epochs=2,
                         validation=0.25, store=Store.create(str(tmp_path / "store")),
                         run_id="mlf", verbose=1, mlflow=True)
    model = est.fit(df)

    client = mlflow.tracking.MlflowClient()  # MLflow's default URI, in tmp_path
    assert str(tmp_path) in client._tracking_client.tracking_uri
    run = client.get_run(model.mlflow_run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "mlf"
    params = run.data.params
    assert params["epochs"] == "2" and params["batch_size"] == "32"
    assert params["feature_cols"] == '["features"]' and params["mlflow"] == "true"
    assert params["loss"].endswith("mse_loss") and params["model"].startswith("Sequential(")
    assert run.data.tags["spark_dl.run_id"] == "mlf"
    # One value per epoch (the driver logs; two ranks would give two), step = epoch, the
    # values of the model's history.
    history = model.getHistory()
    for key in ("loss", "val_loss", "mae", "val_mae"):
        logged = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
        assert [m.step for m in logged] == [1, 2], key
        assert [m.value for m in logged] == pytest.approx(history[key]), key
    assert len(client.get_metric_history(run.info.run_id, "rows_per_s")) == 2

    # The run folder: TensorBoard's event file, no checkpoint.
    logs = [f.path for f in client.list_artifacts(run.info.run_id, "run/logs")]
    assert any("tfevents" in p for p in logs), logs
    everything = [f.path for f in client.list_artifacts(run.info.run_id, "run")]
    assert not any("checkpoint" in p for p in everything), everything

    # The model, through MLflow's Spark flavor and pyfunc, predicts as transform does.
    uri = f"runs:/{run.info.run_id}/model"
    expected = model.transform(df).select("id", "prediction").orderBy("id").toPandas()
    loaded = mlflow.spark.load_model(uri)
    got = loaded.transform(df).select("id", "prediction").orderBy("id").toPandas()
    np.testing.assert_allclose(got["prediction"], expected["prediction"], rtol=1e-6)
    rows = df.orderBy("id").limit(20).toPandas()
    rows["features"] = [list(v.toArray()) for v in rows["features"]]
    pyfunc = mlflow.pyfunc.load_model(uri)
    predicted = pyfunc.predict(rows[["features"]])
    np.testing.assert_allclose(np.asarray(predicted, dtype=float),
                               expected["prediction"][:20], rtol=1e-6)
    # pyfunc runs the model in this process (no Spark DataFrame made), vectors accepted as
    # toPandas gives them; every output column on request, the model's own predict_pandas.
    rows = df.orderBy("id").limit(20).toPandas()
    every = pyfunc.predict(rows[["features"]], params={"outputs": "all"})
    assert list(every.columns) == ["y__output", "prediction"]
    np.testing.assert_allclose(every["prediction"], expected["prediction"][:20], rtol=1e-6)
    np.testing.assert_allclose(model.predict_pandas(rows)["prediction"],
                               expected["prediction"][:20], rtol=1e-6)
    with pytest.raises(KeyError, match=r"feature columns \['features'\] are not in"):
        pyfunc.predict(rows[["id"]])
