"""What every estimator does, whatever its framework.

``fit(df)`` (pyspark's ``Estimator.fit`` calls :meth:`EstimatorBase._fit`):

1. check the params (cheap, before any Spark job): required params, counts that must agree,
   ``num_proc`` and ``backend`` not both, then the framework's own checks;
2. pick the backend (:class:`~spark_dl.spark.common.backend.SparkBackend` by default) and
   the store (a temporary local one when none is given and the master is local);
3. ``prepare_data``: the DataFrame's feature, label and weight columns become Parquet in the
   store (checked, cached by plan, see docs/data.md);
4. :meth:`EstimatorBase._train`: the framework's spec for its workers (with a dry run on two
   rows of the prepared data, so shape mistakes fail before any worker starts), the shared
   training function (:mod:`~spark_dl.spark.common.worker`) on the workers through the
   backend, progress and TensorBoard scalars on the driver as epochs end, then the Model
   built from rank 0's result.

``fit_on_parquet()`` starts at step 4 with data already in the store. A framework subclass
supplies :meth:`~EstimatorBase._check_params_more`, :meth:`~EstimatorBase._vector_dtype`,
:meth:`~EstimatorBase._framework_spec` and :meth:`~EstimatorBase._trained_model`, and names
its :class:`~spark_dl.spark.common.adapter.WorkerAdapter` in ``_worker_adapter`` (see
:mod:`spark_dl.spark.common.adapter`).
"""

import atexit
import secrets
import shutil
import tempfile
import threading
import time
from typing import Any, List, Optional

from pyspark.ml import Estimator

from spark_dl.spark.common.backend import Backend, SparkBackend
from spark_dl.spark.common.dataset import Dataset
from spark_dl.spark.common.params import ESTIMATOR_PARAMS, TableParams, define_params
from spark_dl.spark.common.params_accessors import EstimatorParamsAccessors
from spark_dl.spark.common.persistence import PersistableParams
from spark_dl.spark.common.store import Store

__all__ = ["EstimatorBase", "make_run_id", "default_store"]


def _check_capacity(backend) -> None:
    check = getattr(backend, "check_capacity", None)
    if callable(check):
        check()


def make_run_id(prefix: str) -> str:
    """A new run name: ``<prefix>_<YYYYmmdd_HHMMSS>_<6 hex>``."""
    return f"{prefix}_{time.strftime('%Y%m%d_%H%M%S')}_{secrets.token_hex(3)}"


_default_store_lock = threading.Lock()
_default_store: Optional[Store] = None


def default_store(spark) -> Store:
    """One temporary LocalStore per driver process (removed at exit), on local masters.

    Sharing it between fits lets a second fit reuse prepared data. The master comes from
    the session conf, so classic and Spark Connect sessions both answer; a master the
    server does not show, or a Connect server on another host, needs a store.
    """
    global _default_store
    from spark_dl.spark.common.session import connect_host, is_local_master, master_of

    if not is_local_master(spark):
        host = connect_host(spark)
        where = f"master {master_of(spark)!r}" + (f" (Spark Connect server {host})"
                                                  if host else "")
        raise ValueError(f"store is required with {where}: the executors must "
                         "reach it, e.g. store=Store.create('hdfs:///user/me/spark_dl') or "
                         "an s3:// / shared-filesystem prefix")
    with _default_store_lock:
        if _default_store is None:
            path = tempfile.mkdtemp(prefix="spark_dl_store_")
            atexit.register(shutil.rmtree, path, True)
            _default_store = Store.create(path)
        return _default_store


@define_params(ESTIMATOR_PARAMS)
class EstimatorBase(EstimatorParamsAccessors, TableParams, Estimator, PersistableParams):
    """Base of the framework estimators (see the module doc for the flow)."""

    #: Prefix of generated run ids.
    _run_prefix = "run"

    # ------------------------------------------------------------------ checks

    def _check_params(self) -> None:
        """Raises for missing or inconsistent params, before any Spark job."""
        if not self.getFeatureCols():
            raise ValueError("feature_cols is not set: name the feature column(s), e.g. "
                             "feature_cols=['features']")
        if not self.getLabelCols():
            raise ValueError("label_cols is not set: name the label column(s), e.g. "
                             "label_cols=['label']")
        features, labels = self.getFeatureCols(), self.getLabelCols()
        weight = self.getSampleWeightCol()
        overlap = sorted(set(features) & set(labels) |
                         ({weight} & (set(features) | set(labels)) if weight else set()))
        if overlap:
            raise ValueError(f"columns {overlap} appear in more than one of feature_cols, "
                             "label_cols and sample_weight_col")
        if self.getNumProc() is not None and self.getBackend() is not None:
            raise ValueError("set num_proc or backend, not both: a custom backend decides "
                             "the number of processes")
        if (self.getMinNumProc() is not None or self.getMaxNumProc() is not None) and \
                not self.getElastic():
            raise ValueError("min_num_proc and max_num_proc are for elastic training: set "
                             "elastic=True too (docs/elastic.md)")
        if self.getElastic() and self.getBackend() is not None:
            raise ValueError("elastic=True runs on spark_dl's elastic Spark backend: leave "
                             "backend unset (or pass an ElasticSparkBackend as backend "
                             "without elastic)")
        if self.getElastic():
            num = self.getNumProc()
            low, high = self.getMinNumProc(), self.getMaxNumProc()
            if low is not None and high is not None and low > high:
                raise ValueError(f"min_num_proc={low} is above max_num_proc={high}")
            if num is not None and ((low is not None and num < low) or
                                    (high is not None and num > high)):
                raise ValueError(f"num_proc={num} is outside min_num_proc..max_num_proc "
                                 f"({low}..{high})")
        backend = self.getBackend()
        if backend is not None and not (callable(getattr(backend, "run", None)) and
                                        callable(getattr(backend, "num_processes", None))):
            raise TypeError(f"backend must have run(fn, args, kwargs, env) and "
                            f"num_processes() (see spark_dl.spark.common.backend.Backend), "
                            f"got {type(backend).__name__}")
        store = self.getStore()
        if store is not None and not isinstance(store, Store):
            raise TypeError(f"store must be a spark_dl Store (Store.create(path)), not "
                            f"{type(store).__name__}")
        if store is not None and self.getRunId() is not None:
            store.get_run_path(self.getRunId())  # ValueError for a bad name
        shapes = self.getOrDefault("label_shapes")
        if shapes is not None and len(shapes) != len(labels):
            raise ValueError(f"label_shapes has {len(shapes)} shapes for {len(labels)} label "
                             f"columns {labels}")
        weights = self.getLossWeights()
        if weights is not None and len(weights) != len(labels):
            raise ValueError(f"loss_weights has {len(weights)} values for {len(labels)} label "
                             f"columns {labels}")
        self._check_params_more()
        self._note_ignored_params()

    def _note_ignored_params(self) -> None:
        """One line per Horovod param that is set but means nothing here."""
        for spec in type(self)._param_specs.values():
            if spec.ignored and self.isSet(self.getParam(spec.name)) and \
                    self.getOrDefault(spec.name) is not None:
                print(f"{type(self).__name__}: {spec.name} is ignored: {spec.ignored}",
                      flush=True)

    def _check_params_more(self) -> None:
        """Framework checks of the params (model, optimizer, loss ...)."""

    def _check_dataset(self, dataset: Dataset, num_proc: int) -> None:
        cols = self._columns()
        missing = [c for c in cols if c not in dataset.columns]
        if missing:
            raise KeyError(f"columns {missing} are not in the prepared data (it has "
                           f"{sorted(dataset.columns)})")
        if dataset.train_rows < num_proc:
            raise ValueError(f"the training data has {dataset.train_rows} rows, fewer than "
                             f"the {num_proc} training processes; use fewer processes")
        if dataset.val_rows and dataset.val_rows < num_proc:
            raise ValueError(f"the validation data has {dataset.val_rows} rows, fewer than "
                             f"the {num_proc} training processes; use a larger validation "
                             "fraction or fewer processes")

    # ------------------------------------------------------------------ fit

    def _backend(self):
        backend = self.getBackend()
        if backend is None and self.getElastic():
            from spark_dl.spark.common.backend import ElasticSparkBackend

            backend = ElasticSparkBackend(num_proc=self.getNumProc(),
                                          min_num_proc=self.getMinNumProc(),
                                          max_num_proc=self.getMaxNumProc(),
                                          verbose=1 if self.getVerbose() < 2 else 2)
        elif backend is None:
            backend = SparkBackend(num_proc=self.getNumProc(),
                                   verbose=1 if self.getVerbose() < 2 else 2)
        return backend

    def _store(self, spark) -> Store:
        return self.getStore() or default_store(spark)

    def _begin(self, store: Store) -> dict:
        """The fit's context: ``fit_start``, ``run_id`` (checked against the store), plus
        what :meth:`_on_begin` adds."""
        ctx = {"fit_start": time.time(), "prepare_s": 0.0}
        ctx["run_id"] = self.getRunId() or make_run_id(self._run_prefix)
        store.get_run_path(ctx["run_id"])  # ValueError for a bad name
        from spark_dl.spark.common.tensorboard import TensorBoardLogger

        ctx["tensorboard"] = TensorBoardLogger(store, ctx["run_id"])
        from spark_dl.spark.common.mlflow_run import MlflowLogger

        ctx["mlflow"] = MlflowLogger.create(self, store, ctx["run_id"])  # no-op unless asked
        self._on_begin(store, ctx)
        return ctx

    def _on_begin(self, store: Store, ctx: dict) -> None:
        """Hook: work to start before the data is prepared."""

    def _on_training_started(self, ctx: dict) -> None:
        """Hook: runs once, on the driver, when rank 0 reports its first training step (or
        its first epoch, when steps are not reported): the place for slow work the driver
        needs only later (e.g. imports for loading the trained state), which would compete
        for CPU with Spark's jobs and the workers' start-up if started earlier."""

    def _fit(self, df):
        started = time.time()
        self._check_params()
        backend = self._backend()
        num_proc = backend.num_processes()
        _check_capacity(backend)
        store = self._store(df.sparkSession)
        from spark_dl.spark.common.store_check import check_store_reachable

        check_store_reachable(df.sparkSession, store, num_proc)
        ctx = self._begin(store)
        ctx["fit_start"] = started
        ctx["mlflow"].spark = df.sparkSession  # saves the fitted model
        from spark_dl.spark.common.util import prepare_data

        idx = prepare_data(num_proc, store, df, label_columns=self.getLabelCols(),
                           feature_columns=self.getFeatureCols(),
                           validation=self.getValidation(),
                           sample_weight_col=self.getSampleWeightCol(),
                           partitions_per_process=self.getPartitionsPerProcess(),
                           verbose=int(self.getVerbose() >= 2),
                           vector_dtype=self._vector_dtype(),
                           seed=self.getRandomSeed() or 0,
                           allow_nonfinite=bool(self.getAllowNonfinite()),
                           compress_sparse=bool(self.getCompressSparseCols()))
        dataset = Dataset.from_store(store, idx)
        self._check_dataset(dataset, num_proc)
        ctx["prepare_s"] = time.time() - started
        return self._train(backend, store, dataset, ctx)

    def fit_on_parquet(self, params: Optional[dict] = None, dataset_idx: Optional[str] = None):
        """Trains on data already in the store and returns the model.

        Args:
            params: param values overriding this estimator's for this call.
            dataset_idx: the index ``prepare_data`` returned (it knows its store, so the
                estimator's ``store`` may be unset); None reads plain Parquet from the
                store's train (and val, if present) directories.
        """
        if params:
            return self.copy(params).fit_on_parquet(dataset_idx=dataset_idx)
        started = time.time()
        self._check_params()
        store = self.getStore() or getattr(dataset_idx, "store", None)
        if store is None:
            raise ValueError("fit_on_parquet needs store: the store holding the data")
        backend = self._backend()
        num_proc = backend.num_processes()
        _check_capacity(backend)
        if isinstance(backend, SparkBackend):
            from spark_dl.spark.common.store_check import check_store_reachable
            from spark_dl.spark.launch.session import active_session

            check_store_reachable(active_session(), store, num_proc)
        ctx = self._begin(store)
        ctx["fit_start"] = started
        cols = self._columns()
        dataset = (Dataset.from_store(store, dataset_idx) if dataset_idx is not None
                   else Dataset.from_plain_parquet(store, cols))
        self._check_dataset(dataset, num_proc)
        return self._train(backend, store, dataset, ctx)

    def _vector_dtype(self) -> str:
        """dtype ``prepare_data`` gives Spark ML vectors: "float32" or "float64"."""
        return "float64"

    # ------------------------------------------------------------------ framework hooks

    #: The framework's :class:`~spark_dl.spark.common.adapter.WorkerAdapter` subclass.
    _worker_adapter: Any = None

    def _framework_spec(self, store: Store, dataset: Dataset) -> Any:
        """What the framework's workers need beyond the shared params (model, optimizer,
        losses ...), as one picklable object: ``TrainSpec.framework``. Runs on the driver
        with the data prepared; the place to try the model on a few rows
        (:meth:`_sample_batch`) so mistakes fail before any worker starts."""
        raise NotImplementedError

    def _trained_model(self, result: dict, run_id: str, dataset: Dataset, framework: Any):
        """The Model of a finished fit: ``result["state"]`` is what rank 0's
        ``WorkerAdapter.result()`` returned, ``result["history"]`` the per-epoch metrics."""
        raise NotImplementedError

    def _worker_env(self) -> dict:
        """Environment variables the workers need (e.g. the framework's backend choice)."""
        return {}

    def _sample_batch(self, store: Store, dataset: Dataset, rows: Optional[int] = None) -> dict:
        """The first ``rows`` training rows (column -> NumPy array), as workers read them
        (default: 2, or 1 with ``batch_size=1``, so shapes that fix the batch size fit)."""
        from spark_dl.spark.common.data_loader import ArrowDataLoader

        rows = rows or min(2, self.getBatchSize())

        loader = ArrowDataLoader(dataset.source(store, "train"), batch_size=rows,
                                 shuffle=False, num_threads=1, equal_steps=False,
                                 columns=self._columns())
        try:
            return next(iter(loader))
        finally:
            loader.close()

    def _columns(self) -> List[str]:
        weight = self.getSampleWeightCol()
        return self.getFeatureCols() + self.getLabelCols() + ([weight] if weight else [])

    # ------------------------------------------------------------------ training

    def _train(self, backend: Backend, store: Store, dataset: Dataset, ctx: dict):
        """Runs training on the workers and returns the Model; ``ctx`` is the fit's context
        (see :meth:`_begin`; ``prepare_s`` is the time to prepared data)."""
        from spark_dl.spark.common.backend import run_on_backend
        from spark_dl.spark.common.output_spool import StoreSpool
        from spark_dl.spark.common.progress import (ProgressDisplay,
                                                    spark_console_progress_paused)
        from spark_dl.spark.common.worker import TrainSpec, train

        run_id, board, verbose = ctx["run_id"], ctx["tensorboard"], self.getVerbose()
        framework = self._framework_spec(store, dataset)
        num_proc = backend.num_processes()
        metrics = self.getMetrics()
        metrics = [] if metrics is None else (metrics if isinstance(metrics, list) else [metrics])
        spec = TrainSpec(
            adapter=self._worker_adapter, framework=framework, metrics=metrics,
            feature_cols=self.getFeatureCols(), label_cols=self.getLabelCols(),
            sample_weight_col=self.getSampleWeightCol(), label_shapes=self.getLabelShapes(),
            batch_size=self.getBatchSize(),
            val_batch_size=self.getValBatchSize() or self.getBatchSize(),
            epochs=self.getEpochs(), train_steps=self.getTrainStepsPerEpoch(),
            val_steps=self.getValidationStepsPerEpoch(),
            shuffle_buffer_size=self.getShuffleBufferSize(),
            transformation_fn=self.getTransformationFn(),
            callbacks=list(self.getCallbacks() or []),
            remote_store=store.to_remote(run_id, dataset.idx), dataset=dataset,
            seed=self.getRandomSeed() if self.getRandomSeed() is not None
            else int(time.time() * 1000) % (2 ** 31),
            random_seed=self.getRandomSeed(), terminate_on_nan=self.getTerminateOnNan(),
            cache_all=self.getInMemoryCacheAll(),
            train_threads=self.getTrainReaderNumWorkers(),
            val_threads=self.getValReaderNumWorkers(), use_gpu=self._use_gpu(),
            verbose=verbose, run_id=run_id, shuffle=self.getShuffle() is not False)
        blob = _pickle_or_explain(spec)
        display = ProgressDisplay(verbose, listeners=[board.on_event, ctx["mlflow"].on_event,
                                                      self._training_started_listener(ctx)])
        name = type(self).__name__
        if verbose:
            display.print(f"{name}: run {run_id}, {num_proc} processes, "
                          f"{dataset.train_rows} training / {dataset.val_rows} validation rows "
                          f"(data ready after {ctx['prepare_s']:.1f}s), store "
                          f"{store.prefix_path}")
        result = None
        ctx["launch"] = time.time()
        try:
            # Unbuffered: the workers' own prints reach the driver as they happen.
            env = dict(self.getBackendEnv() or {}, **self._worker_env(),
                       PYTHONUNBUFFERED="1")
            # Spark's console bar would draw over the epoch lines, and for the barrier
            # stage it says nothing (every task runs until training ends).
            with spark_console_progress_paused():
                results = run_on_backend(backend, train, (blob,), env,
                                         display.stream("stdout"), display.stream("stderr"),
                                         output_spool=StoreSpool.for_run(store, run_id))
            result = results[0]
            ctx["returned"] = time.time()
        finally:
            display.close()
            note = board.close(result["history"] if result else None)
            if note and verbose:
                display.print(note)
            if result is None:
                ctx["mlflow"].finish(None, None, display.print)  # the MLflow run: FAILED
        model = self._trained_model(result, run_id, dataset, framework)
        model.timings = _timings(ctx, result["timings"])
        ctx["mlflow"].finish(model, result["history"], display.print)
        if verbose:
            first = model.timings["first_step_s"]
            display.print(f"{name}: run {run_id} done in {model.timings['total_s']:.1f}s"
                          + (f" (first training step after {first:.1f}s)" if first else ""))
        return model

    def _use_gpu(self) -> Optional[bool]:
        """The workers' ``use_gpu``: the value set, or None where it was left at its
        default. Both use a GPU when there is one; only an explicit ``use_gpu=True`` (a
        GPU asked for, Horovod's meaning) warns when there is none, the default says so in
        one info line (:func:`~spark_dl.spark.launch.task.devices.choose_gpu`)."""
        return self.getUseGpu() if self.isSet(self.getParam("use_gpu")) else None

    def _training_started_listener(self, ctx: dict):
        """A progress listener calling :meth:`_on_training_started` at the first step or
        epoch event."""
        started = []

        def listener(event: dict) -> None:
            if not started and event.get("kind") in ("step", "epoch"):
                started.append(True)
                self._on_training_started(ctx)
        return listener


def _timings(ctx: dict, worker: dict) -> dict:
    """The fit's durations from the driver's context and rank 0's timestamps."""
    start = ctx["fit_start"]
    first = worker.get("first_step")
    return {
        "total_s": time.time() - start, "prepare_s": ctx["prepare_s"],
        "launch_s": ctx["launch"] - start, "returned_s": ctx["returned"] - start,
        "first_step_s": (first - start) if first else None,
        "epoch_s": worker.get("epoch_s", []),
        # rank 0's phases, from fit():
        "worker_phases_s": {k: worker[k] - start
                            for k in ("start", "imported", "initialized", "ready", "end")
                            if worker.get(k)},
    }


def _pickle_or_explain(spec) -> bytes:
    """cloudpickle of the TrainSpec (the user's modules executors lack travel by value:
    :mod:`~spark_dl.spark.common.shipping`); on failure, an error naming what cannot
    travel."""
    from spark_dl.spark.common.shipping import dumps_for_workers
    from spark_dl.spark.launch.pickling import dumps_or_explain

    try:
        return dumps_for_workers(spec)
    except Exception as first:
        fields = dict(vars(spec))
        framework = fields.pop("framework")
        fields.update(vars(framework) if hasattr(framework, "__dict__") else
                      {"framework": framework})
        for field, value in fields.items():
            dumps_or_explain(value, field, field)  # raises, naming the path inside it
        raise TypeError(f"the training function's arguments cannot be pickled: {first}") \
            from first
