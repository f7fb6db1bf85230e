"""What every estimator does, whatever its framework.

``fit(df)`` (pyspark's ``Estimator.fit`` calls :meth:`EstimatorBase._fit`):

1. check the params (cheap, before any Spark job): required params, counts that must agree,
   ``num_proc`` and ``backend`` not both;
2. pick the backend (:class:`~spark_dl.spark.common.backend.SparkBackend` by default) and
   the store (a temporary local one when none is given and the master is local);
3. ``prepare_data``: the DataFrame's feature, label and weight columns become Parquet in the
   store (checked, cached by plan, see docs/data.md);
4. the framework's ``_train``: its own checks on the prepared data, then the training
   function on the workers, then the model.

``fit_on_parquet()`` starts at step 4 with data already in the store. The framework
subclass supplies :meth:`_check_params_more`, :meth:`_vector_dtype` and :meth:`_train`.
"""

import atexit
import secrets
import shutil
import tempfile
import threading
import time
from typing import List, Optional

from pyspark.ml import Estimator, Model

from spark_dl.spark.common.backend import Backend, SparkBackend
from spark_dl.spark.common.dataset import Dataset
from spark_dl.spark.common.params import (ESTIMATOR_PARAMS, MODEL_PARAMS, TableParams,
                                          define_params)
from spark_dl.spark.common.persistence import PersistableParams
from spark_dl.spark.common.store import Store

__all__ = ["EstimatorBase", "ModelBase", "make_run_id", "default_store"]


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

    Sharing it between fits lets a second fit reuse prepared data.
    """
    global _default_store
    master = spark.sparkContext.master
    if not master.startswith("local"):
        raise ValueError(f"store is required with master {master!r}: the executors must "
                         "reach it, e.g. store=Store.create('hdfs:///user/me/spark_dl') or "
                         "an s3:// / shared-filesystem prefix")
    with _default_store_lock:
        if _default_store is None:
            path = tempfile.mkdtemp(prefix="spark_dl_store_")
            atexit.register(shutil.rmtree, path, True)
            _default_store = Store.create(path)
        return _default_store


@define_params(ESTIMATOR_PARAMS)
class EstimatorBase(TableParams, Estimator, PersistableParams):
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

    def _check_params_more(self) -> None:
        """Framework checks of the params (model, optimizer, loss ...)."""

    def _check_dataset(self, dataset: Dataset, num_proc: int) -> None:
        cols = self.getFeatureCols() + self.getLabelCols() + (
            [self.getSampleWeightCol()] if self.getSampleWeightCol() else [])
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
        if backend is None:
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
        self._on_begin(store, ctx)
        return ctx

    def _on_begin(self, store: Store, ctx: dict) -> None:
        """Hook: work to start before the data is prepared (e.g. slow imports)."""

    def _fit(self, df):
        started = time.time()
        self._check_params()
        backend = self._backend()
        num_proc = backend.num_processes()
        _check_capacity(backend)
        store = self._store(df.sparkSession)
        ctx = self._begin(store)
        ctx["fit_start"] = started
        from spark_dl.spark.common.util import prepare_data

        idx = prepare_data(num_proc, store, df, label_columns=self.getLabelCols(),
                           feature_columns=self.getFeatureCols(),
                           validation=self.getValidation(),
                           sample_weight_col=self.getSampleWeightCol(),
                           partitions_per_process=self.getPartitionsPerProcess(),
                           verbose=int(self.getVerbose() >= 2),
                           vector_dtype=self._vector_dtype(),
                           seed=self.getRandomSeed() or 0)
        dataset = Dataset.from_store(store, idx)
        self._check_dataset(dataset, num_proc)
        ctx["prepare_s"] = time.time() - started
        return self._train(backend, store, dataset, ctx)

    def fit_on_parquet(self, params: Optional[dict] = None, dataset_idx: Optional[str] = None):
        """Trains on data already in the store and returns the model.

        Args:
            params: param values overriding this estimator's for this call.
            dataset_idx: the index ``prepare_data`` returned; None reads plain Parquet from
                the store's train (and val, if present) directories.
        """
        if params:
            return self.copy(params).fit_on_parquet(dataset_idx=dataset_idx)
        started = time.time()
        self._check_params()
        if self.getStore() is None:
            raise ValueError("fit_on_parquet needs store: the store holding the data")
        backend = self._backend()
        num_proc = backend.num_processes()
        _check_capacity(backend)
        store = self.getStore()
        ctx = self._begin(store)
        ctx["fit_start"] = started
        cols = self.getFeatureCols() + self.getLabelCols() + (
            [self.getSampleWeightCol()] if self.getSampleWeightCol() else [])
        dataset = (Dataset.from_store(store, dataset_idx) if dataset_idx is not None
                   else Dataset.from_plain_parquet(store, cols))
        self._check_dataset(dataset, num_proc)
        return self._train(backend, store, dataset, ctx)

    def _vector_dtype(self) -> str:
        """dtype ``prepare_data`` gives Spark ML vectors: "float32" or "float64"."""
        return "float64"

    def _train(self, backend: Backend, store: Store, dataset: Dataset, ctx: dict):
        """Runs training on the workers and returns the Model; ``ctx`` is the fit's context
        (see :meth:`_begin`; ``prepare_s`` is the time to prepared data)."""
        raise NotImplementedError


@define_params(MODEL_PARAMS)
class ModelBase(TableParams, Model, PersistableParams):
    """Base of the framework models: params from :data:`MODEL_PARAMS`, persistence."""

    def getOutputCols(self) -> List[str]:
        """The columns transform() adds: ``output_cols``, else ``<label>__output`` each."""
        cols = self.getOrDefault("output_cols")
        if cols:
            return list(cols)
        return [f"{c}__output" for c in (self.getLabelColumns() or [])]
