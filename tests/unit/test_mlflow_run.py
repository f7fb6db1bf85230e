"""The MLflow logger of a fit, without Spark: params flattened and bounded, and the metric
path (progress events on the driver -> one value per epoch in a run, epochs the events
missed taken from the history, duplicates dropped); the fit with Spark is in
tests/spark/test_mlflow.py."""

import pytest

from spark_dl.spark.common.mlflow_run import MAX_VALUE_CHARS, MlflowLogger, flatten_params


def mse_loss(output, label):
    return output


class Opaque:
    def __repr__(self):
        return "Opaque(\n  " + "x" * 2000 + "\n)"


def test_params_are_flattened_plain_and_bounded():
    flat = flatten_params({
        "epochs": 3, "batch_size": 32, "shuffle": True, "validation": 0.2, "run_id": "r1",
        "feature_cols": ["a", "b"], "loss": [mse_loss], "model": Opaque(),
        "backend_env": {"OMP_NUM_THREADS": "1", "X": 2}, "store": None})
    assert flat["epochs"] == "3" and flat["shuffle"] == "true" and flat["validation"] == "0.2"
    assert flat["run_id"] == "r1"
    assert flat["feature_cols"] == '["a", "b"]'
    assert flat["loss"] == '["' + __name__ + '.mse_loss"]'
    # dict entries as name.key; None values left out
    assert flat["backend_env.OMP_NUM_THREADS"] == "1" and flat["backend_env.X"] == "2"
    assert "backend_env" not in flat and "store" not in flat
    # objects by repr, on one line, bounded
    model = flat["model"]
    assert len(model) == MAX_VALUE_CHARS and model.endswith("...") and "\n" not in model
    assert model.startswith("Opaque( xxx")
    assert list(flat) == sorted(flat)


class FakeStore:
    """The two calls the logger makes when the run folder does not exist."""

    prefix_path = "/nowhere"

    def get_run_path(self, run_id):
        return f"/nowhere/runs/{run_id}"

    def exists(self, path):
        return False


class FakeModel:
    mlflow_run_id = None


def test_epoch_metrics_reach_the_run_once_per_epoch(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    # A file store: quick to open (a SQLite store creates its tables first, seconds here);
    # MLflow 3 refuses file stores unless allowed.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    logger = MlflowLogger({"epochs": "3", "batch_size": "32"}, {"spark_dl.run_id": "r1"},
                          FakeStore(), "r1", tracking_uri=uri, experiment="unit")
    monkeypatch.setattr(logger, "_log_model", lambda model, notes: notes.append("skipped"))
    events = [{"kind": "start", "start_epoch": 0}, {"kind": "step", "loss": 9.0},
              {"kind": "epoch", "epoch": 1, "logs": {"loss": 3.0, "val_loss": 4.0, "mae": 1.0,
                                                    "note": "text"}, "rows_per_s": 10.0},
              {"kind": "epoch", "epoch": 2, "logs": {"loss": 2.0, "val_loss": 3.0, "mae": 0.5},
               "rows_per_s": 20.0},
              {"kind": "epoch", "epoch": 2, "logs": {"loss": 99.0}}]  # a repeat: dropped
    for event in events:
        logger.on_event(event)
    # epoch 3 never came as an event (a backend that forwards no output): from the history
    history = {"epoch": [1, 2, 3], "loss": [3.0, 2.0, 1.0], "val_loss": [4.0, 3.0, 2.0],
               "mae": [1.0, 0.5, 0.25], "rows_per_s": [10.0, 20.0, 30.0]}
    said, model = [], FakeModel()
    logger.finish(model, history, said.append)
    assert not any("warning" in s for s in said), said
    assert model.mlflow_run_id == logger.run_id

    client = mlflow.tracking.MlflowClient(uri)
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "r1"
    assert client.get_experiment(run.info.experiment_id).name == "unit"
    assert run.data.params == {"epochs": "3", "batch_size": "32"}
    assert run.data.tags["spark_dl.run_id"] == "r1"
    assert set(run.data.metrics) == {"loss", "val_loss", "mae", "rows_per_s"}
    loss = client.get_metric_history(logger.run_id, "loss")
    assert [(m.step, m.value) for m in sorted(loss, key=lambda m: m.step)] == \
        [(1, 3.0), (2, 2.0), (3, 1.0)]
    speed = client.get_metric_history(logger.run_id, "rows_per_s")
    assert sorted(m.value for m in speed) == [10.0, 20.0, 30.0]
    # the process's MLflow settings are untouched
    assert mlflow.get_tracking_uri() != uri and mlflow.active_run() is None


def test_a_failed_fit_ends_its_run_failed_and_a_bad_store_is_a_warning(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    logger = MlflowLogger({}, {}, FakeStore(), "r2", tracking_uri=uri)
    # nothing happens before the first event or finish(): a fit failing before its workers
    # start leaves no run and no thread
    assert logger._thread is None and not (tmp_path / "mlruns").exists()
    said = []
    logger.finish(None, None, said.append)
    assert mlflow.tracking.MlflowClient(uri).get_run(logger.run_id).info.status == "FAILED"
    assert said == []

    logger = MlflowLogger({}, {}, FakeStore(), "r3", tracking_uri="nosuchscheme://x")
    logger.on_event({"kind": "epoch", "epoch": 1, "logs": {"loss": 1.0}})
    logger.finish(FakeModel(), None, said.append)
    assert len(said) == 1 and said[0].startswith("warning: MLflow: logging failed"), said
