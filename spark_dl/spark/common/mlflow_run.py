"""MLflow logging of a fit, done by the driver alone.

When an estimator's ``mlflow`` param asks for it (or ``mlflow_tracking_uri`` /
``mlflow_experiment`` is set), :class:`MlflowLogger` records the fit in MLflow:

- the estimator's params, flattened (:func:`flatten_params`: one MLflow param per value,
  objects by their bounded ``repr``), and tags naming the spark_dl run, estimator and store;
- the per-epoch metrics rank 0 reports to the driver (the progress events TensorBoard also
  gets, see :mod:`~spark_dl.spark.common.progress`), step = epoch: one value per epoch,
  never one per rank, since only the driver logs;
- the files of the run's folder in the Store (the TensorBoard logs, and whatever else the
  fit wrote there), checkpoints left out, under the artifact path ``run``;
- the fitted model (artifact path ``model``), on classic and Spark Connect sessions alike
  (:mod:`~spark_dl.spark.common.mlflow_model`): ``mlflow.spark.load_model`` gives a
  ``PipelineModel`` holding it, ``mlflow.pyfunc.load_model`` predicts on pandas without Spark
  (its ``predictionCol``, or its output).

Where: the active run (``with mlflow.start_run():`` around ``fit``) when neither
``mlflow_tracking_uri`` nor ``mlflow_experiment`` names another place; else a new run named as
the spark_dl run, in ``mlflow_experiment`` (default: MLflow's current experiment) of
``mlflow_tracking_uri`` (default: MLflow's own, ``MLFLOW_TRACKING_URI`` or a local store in
the working directory: ``sqlite:///mlflow.db`` from MLflow 3.7, ``./mlruns`` before), ended
when the fit ends (FAILED if it failed). The calls go through an ``MlflowClient`` for that
URI, so the process's MLflow settings (``mlflow.get_tracking_uri()``) stay as they were.

Importing MLflow and opening its store take seconds (creating a SQLite store's tables more),
so that and every metric write run in one background thread, off the thread that reads the
workers' output; errors become one warning line, never a failed fit (training has finished).
"""

import json
import os
import queue
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

__all__ = ["MlflowLogger", "flatten_params", "mlflow_requested", "MAX_VALUE_CHARS"]

#: Longest param value logged (MLflow accepts 6000 from 2.x, 500 before; long reprs of
#: models say little in a table of params).
MAX_VALUE_CHARS = 500
_SKIPPED_PROGRESS_KEYS = ("epoch",)


def mlflow_requested(estimator) -> bool:
    """``mlflow`` True, or left None with a tracking URI or experiment set."""
    on = estimator.getOrDefault("mlflow")
    if on is not None:
        return bool(on)
    return bool(estimator.getOrDefault("mlflow_tracking_uri") or
                estimator.getOrDefault("mlflow_experiment"))


def _bounded(text: str, limit: int = MAX_VALUE_CHARS) -> str:
    text = " ".join(text.split())  # a multi-line repr (a torch module) on one line
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _value_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (bool, int, float)) or value is None:
        return json.dumps(value)
    if isinstance(value, (list, tuple)) and all(
            isinstance(v, (str, bool, int, float, type(None))) for v in value):
        return json.dumps(list(value))
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '') or ''}.{value.__qualname__}".lstrip(".")
    return repr(value)


def flatten_params(params: Dict[str, Any], limit: int = MAX_VALUE_CHARS) -> Dict[str, str]:
    """MLflow params of ``params`` (name -> value): None values left out, a dict's entries
    as ``name.key``, lists of plain values as JSON, functions by their qualified name,
    other objects by their ``repr``; every value on one line and at most ``limit`` chars."""
    flat: Dict[str, str] = {}

    def add(key: str, value: Any) -> None:
        if value is None:
            return
        if isinstance(value, dict) and value:
            for k, v in value.items():
                add(f"{key}.{k}", v)
            return
        if isinstance(value, (list, tuple)) and value and all(
                callable(v) and hasattr(v, "__qualname__") for v in value):
            value = [_value_text(v) for v in value]
        flat[key] = _bounded(_value_text(value), limit)

    for name in sorted(params):
        add(name, params[name])
    return flat


def _epoch_metrics(logs: Dict[str, Any]) -> Dict[str, float]:
    """The numeric entries of one epoch's logs (the epoch is the step, not a metric)."""
    out = {}
    for key, value in logs.items():
        if key in _SKIPPED_PROGRESS_KEYS or isinstance(value, bool):
            continue
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            continue
    return out


def _current_mlflow() -> Optional[dict]:
    """The calling thread's MLflow state (active run, tracking URI, experiment): MLflow
    keeps the active run per thread, so it is read here, not in the background thread.
    None where MLflow is not imported yet: then nothing in this process has set any (the
    environment variables are read later)."""
    import sys

    mlflow = sys.modules.get("mlflow")
    if mlflow is None or not hasattr(mlflow, "active_run"):
        return None
    active = mlflow.active_run()
    # MLflow's current experiment (set_experiment, MLFLOW_EXPERIMENT_NAME/_ID); no public
    # function returns it without starting a run.
    experiment = getattr(mlflow.tracking.fluent, "_get_experiment_id", lambda: None)
    return {"active_run": active.info.run_id if active else None,
            "tracking_uri": mlflow.get_tracking_uri(),
            "experiment_id": active.info.experiment_id if active else experiment()}


class _Off:
    """The logger of a fit that did not ask for MLflow: every call does nothing."""

    run_id = None
    spark = None

    def on_event(self, event: dict) -> None:
        pass

    def finish(self, model, history, say: Callable[[str], None]) -> None:
        pass


class MlflowLogger:
    """Logs one fit (see the module doc). Created on the driver by :meth:`create`.

    Args:
        params: flattened params (:func:`flatten_params`).
        tags: run tags.
        store: the fit's Store; run_id: the spark_dl run.
        tracking_uri, experiment: where to log (None: MLflow's current ones, and the active
            run if there is one).
    """

    def __init__(self, params: Dict[str, str], tags: Dict[str, str], store, run_id: str,
                 tracking_uri: Optional[str] = None, experiment: Optional[str] = None,
                 current: Optional[dict] = None):
        self.params, self.tags = params, tags
        self._current = current
        self.store, self.spark_dl_run = store, run_id
        self.tracking_uri, self.experiment = tracking_uri, experiment
        self.run_id: Optional[str] = None  # the MLflow run, once open
        self.spark = None  # the session that saves the model (else the active one)
        self.first_epoch = 0
        self._client = None
        self._own_run = False
        self._logged_epochs = set()
        self._errors: List[str] = []
        self._queue: "queue.Queue[Optional[Tuple[Callable, tuple]]]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None

    def _start(self) -> None:
        """Starts the background thread and queues the opening of the run, once: at the
        first progress event, so a fit that fails before training leaves no run (and no
        thread) behind."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="spark_dl-mlflow",
                                            daemon=True)
            self._thread.start()
            self._queue.put((self._open, ()))

    @classmethod
    def create(cls, estimator, store, run_id: str):
        """The fit's logger: :class:`MlflowLogger` where the estimator asks for MLflow (an
        ImportError naming the extra where MLflow is missing: before any Spark job), else
        one that does nothing."""
        if not mlflow_requested(estimator):
            return _Off()
        import importlib.util

        if importlib.util.find_spec("mlflow") is None:
            raise ImportError("the mlflow param needs MLflow: pip install 'spark_dl[mlflow]'")
        values = {p.name: v for p, v in estimator.extractParamMap().items()}
        tags = {"spark_dl.run_id": run_id, "spark_dl.estimator": type(estimator).__name__,
                "spark_dl.store": _bounded(str(getattr(store, "prefix_path", store)))}
        return cls(flatten_params(values), tags, store, run_id,
                   estimator.getOrDefault("mlflow_tracking_uri"),
                   estimator.getOrDefault("mlflow_experiment"), _current_mlflow())

    # ------------------------------------------------------------------ background thread

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args = item
            if self._errors and self.run_id is None:
                continue  # the run did not open: nothing more can be logged
            try:
                fn(*args)
            except Exception as e:  # noqa: BLE001 - reported by finish(), never raised
                self._errors.append(f"{type(e).__name__}: {e}")

    def _open(self) -> None:
        import mlflow
        from mlflow.tracking import MlflowClient

        current = self._current or {"tracking_uri": mlflow.get_tracking_uri()}
        if current.get("active_run") and self.tracking_uri is None and self.experiment is None:
            self._client = MlflowClient(current["tracking_uri"])
            self.run_id = current["active_run"]
        else:
            uri = self.tracking_uri or current["tracking_uri"]
            self._client = MlflowClient(uri)
            experiment = self._experiment_id(uri == current["tracking_uri"] and
                                             current.get("experiment_id"))
            self.run_id = self._client.create_run(experiment,
                                                  run_name=self.spark_dl_run).info.run_id
            self._own_run = True
        # Params cannot change once logged: in a run used before (the active run of an
        # earlier fit), the values already there are kept.
        logged = self._client.get_run(self.run_id).data.params
        self._log_batch(params=[(k, v) for k, v in self.params.items() if k not in logged],
                        tags=list(self.tags.items()))

    def _experiment_id(self, current: Optional[str]) -> str:
        if self.experiment:
            found = self._client.get_experiment_by_name(self.experiment)
            return found.experiment_id if found else \
                self._client.create_experiment(self.experiment)
        if current:
            return current
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
        found = self._client.get_experiment_by_name(name) if name else None
        return os.environ.get("MLFLOW_EXPERIMENT_ID") or \
            (found.experiment_id if found else "0")  # "0": MLflow's Default experiment

    def _log_batch(self, metrics=(), params=(), tags=()) -> None:
        from mlflow.entities import Metric, Param, RunTag

        now = int(time.time() * 1000)
        metrics, params, tags = list(metrics), list(params), list(tags)
        # MLflow takes at most 1000 metrics / 100 params per batch.
        for i in range(0, max(len(metrics), len(params), len(tags), 1), 100):
            self._client.log_batch(
                self.run_id,
                metrics=[Metric(k, v, now, step) for k, v, step in metrics[i:i + 100]],
                params=[Param(k, v) for k, v in params[i:i + 100]],
                tags=[RunTag(k, v) for k, v in tags[i:i + 100]])

    # ------------------------------------------------------------------ driver side

    def on_event(self, event: dict) -> None:
        """Progress listener: logs each ``epoch`` event's metrics once, step = epoch."""
        self._start()
        kind = event.get("kind")
        if kind == "start":
            self.first_epoch = int(event.get("start_epoch") or 0)
        elif kind == "epoch":
            logs = dict(event.get("logs") or {})
            if event.get("rows_per_s") is not None:  # beside the logs, as in the history
                logs.setdefault("rows_per_s", event["rows_per_s"])
            self._add(int(event["epoch"]), logs)

    def _add(self, epoch: int, logs: dict) -> None:
        if epoch in self._logged_epochs:
            return
        self._logged_epochs.add(epoch)
        self._start()
        rows = [(k, v, epoch) for k, v in _epoch_metrics(logs).items()]
        self._queue.put((self._log_batch, (rows,)))

    def finish(self, model, history: Optional[dict], say: Callable[[str], None]) -> None:
        """Logs what the live events missed from ``history`` (a backend that forwards no
        output), the run folder and ``model`` (None: the fit failed), waits for the
        background thread and ends a run this logger started. ``say`` prints notes."""
        from spark_dl.spark.common.history import epochs_after

        for epoch, logs in epochs_after(history, self.first_epoch):
            self._add(epoch, logs)
        self._start()  # a fit that reported nothing still gets its run
        self._queue.put(None)
        self._thread.join()
        notes = []
        if not self._errors:
            for what, step in (("run folder", self._log_run_folder),
                               ("model", lambda: self._log_model(model, notes))):
                if model is None and what == "model":
                    continue
                try:
                    step()
                except Exception as e:  # noqa: BLE001 - a note: the fit itself succeeded
                    self._errors.append(f"{what}: {type(e).__name__}: {e}")
        if self._own_run and self._client is not None:
            try:
                # The fit's outcome; a part that failed to log is the warning below.
                self._client.set_terminated(self.run_id,
                                            "FINISHED" if model is not None else "FAILED")
            except Exception as e:  # noqa: BLE001
                self._errors.append(f"{type(e).__name__}: {e}")
        if model is not None:
            model.mlflow_run_id = self.run_id
        where = f"MLflow run {self.run_id}" if self.run_id else "MLflow"
        for note in notes:
            say(f"{where}: {note}")
        if self._errors:
            say(f"warning: {where}: logging failed: {'; '.join(self._errors)}")

    def _log_run_folder(self) -> None:
        """The run folder's files but its checkpoints, as artifacts under ``run``."""
        from spark_dl.spark.common.mlflow_model import copy_from_store

        store = self.store
        run_path = store.get_run_path(self.spark_dl_run)
        if not store.exists(run_path):
            return
        checkpoint = store.get_checkpoint_filename()
        with tempfile.TemporaryDirectory(prefix="spark_dl_mlflow_") as tmp:
            if copy_from_store(store, run_path, tmp,
                               lambda rel: not rel.split("/")[0].startswith(checkpoint)):
                self._client.log_artifacts(self.run_id, tmp, "run")

    def _log_model(self, model, notes: List[str]) -> None:
        from spark_dl.spark.common.mlflow_model import save_mlflow_model
        from spark_dl.spark.launch.session import active_session

        with tempfile.TemporaryDirectory(prefix="spark_dl_mlflow_") as tmp:
            path = os.path.join(tmp, "model")
            save_mlflow_model(model, self.spark or active_session(), self.store,
                              self.spark_dl_run, path, _requirements(model))
            self._client.log_artifacts(self.run_id, path, "model")
        notes.append(f"model logged: mlflow.spark.load_model('runs:/{self.run_id}/model') "
                     f"or mlflow.pyfunc.load_model('runs:/{self.run_id}/model')")


#: The packages a framework's model needs beside pyspark (distribution names).
_FRAMEWORK_DISTRIBUTIONS = {"torch": ("torch",),
                            "keras": ("tensorflow", "tensorflow-cpu", "keras"),
                            "lightning": ("torch", "lightning", "pytorch-lightning")}


def _requirements(model) -> List[str]:
    """The model's pip requirements, given to MLflow: without them MLflow infers them by
    loading the model in a new process with its own Spark session (minutes on a small
    machine). pyspark, cloudpickle, spark_dl and the framework, at the versions running
    (local version labels such as torch's ``+cpu`` dropped: pip cannot resolve them)."""
    import importlib.metadata as md

    framework = type(model).__module__.split(".")[2:3]  # spark_dl.spark.<framework>.model
    names = ("pyspark", "cloudpickle", "spark_dl") + \
        _FRAMEWORK_DISTRIBUTIONS.get(framework[0] if framework else "", ())
    reqs = []
    for name in names:
        try:
            reqs.append(f"{name}=={md.version(name).split('+')[0]}")
        except md.PackageNotFoundError:
            continue
    return reqs
