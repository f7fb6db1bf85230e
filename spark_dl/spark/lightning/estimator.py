"""``LightningEstimator``: trains a LightningModule on a Spark DataFrame, data-parallel.

The flow is the shared one (:mod:`spark_dl.spark.common.estimator`); this module adds the
Lightning parts: the checks of module, optimizer, loss, callbacks and Trainer arguments; a
dry run of one training (and validation) step on two rows of the prepared data on the
driver, in a throw-away Trainer on a copy of the module, so that shape and dtype mistakes
fail before any worker starts and the names the module logs are known (they become the
history's metrics); the :class:`~spark_dl.spark.lightning.adapter.LightningSpec` the
workers' :class:`~spark_dl.spark.lightning.adapter.LightningWorker` receives; and the
:class:`~spark_dl.spark.lightning.model.LightningModel` built from rank 0's result.
"""

import contextlib
import importlib
import logging
import math
import tempfile
import warnings
from typing import List, Optional

import torch
from pyspark import keyword_only

from spark_dl.spark.common.dataset import Dataset
from spark_dl.spark.common.estimator import EstimatorBase
from spark_dl.spark.common.params import (ESTIMATOR_PARAMS, define_params, params_doc,
                                          params_signature)
from spark_dl.spark.lightning import util
from spark_dl.spark.lightning.adapter import LightningSpec, LightningWorker
from spark_dl.spark.lightning.model import LightningModel
from spark_dl.spark.lightning.params import LIGHTNING_PARAMS, RESERVED_TRAINER_ARGS
from spark_dl.spark.lightning.params_accessors import LightningEstimatorParamsAccessors

__all__ = ["LightningEstimator", "LIGHTNING_PARAMS"]


class _Once:
    """A sized iterable of one batch (a list would be read as several loaders)."""

    def __init__(self, batch):
        self.batch = batch

    def __len__(self):
        return 1

    def __iter__(self):
        yield self.batch


@contextlib.contextmanager
def _quiet(package: str):
    """Lightning's start-up lines and warnings off, for the driver's dry run."""
    names = [package, "lightning.fabric", "lightning_fabric"]
    loggers = [(logging.getLogger(n), logging.getLogger(n).level) for n in names]
    for lg, _ in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in loggers:
            lg.setLevel(level)


@define_params(LIGHTNING_PARAMS)
class LightningEstimator(LightningEstimatorParamsAccessors, EstimatorBase):
    """Trains a LightningModule on a Spark DataFrame with ``num_proc`` data-parallel workers
    and returns a :class:`~spark_dl.spark.lightning.LightningModel`.

    Parameters follow ``horovod.spark.lightning.LightningEstimator``'s names; each has a
    getter and a setter::

        est = LightningEstimator(num_proc=2, model=module, feature_cols=["features"],
                                 label_cols=["label"], batch_size=64, epochs=5,
                                 validation=0.1, store=Store.create("/tmp/spark_dl"))
        lightning_model = est.fit(df)           # a LightningModel
        lightning_model.transform(df)           # adds "label__output"

    The module's steps receive each batch as a dict column -> tensor. ``optimizer`` is
    needed only when the module does not define ``configure_optimizers``, ``loss`` only
    when it defines no ``training_step``/``validation_step`` (then ``loss(forward(*features),
    label)`` is used). Values the module logs with ``self.log`` become the history's metrics
    (``train_acc``/``val_acc`` -> ``acc``/``val_acc``). See docs/lightning.md.
    """

    _run_prefix = "lightning"
    _worker_adapter = LightningWorker

    @keyword_only
    def __init__(self, **kwargs):
        super().__init__(**self._input_kwargs)

    @keyword_only
    def setParams(self, **kwargs):
        """Sets several params at once (keyword arguments named as the params)."""
        return super().setParams(**self._input_kwargs)

    # ------------------------------------------------------------------ checks

    def _package(self) -> str:
        module = self.getModel()
        package = util.lightning_package(module) if module is not None else None
        if package is None:
            raise TypeError(f"model must be a LightningModule (lightning.pytorch or "
                            f"pytorch_lightning), got "
                            f"{type(module).__name__ if module is not None else 'nothing'}")
        return package

    def _losses(self) -> Optional[List]:
        loss = self.getLoss()
        if loss is None:
            return None
        return list(loss) if isinstance(loss, list) else [loss]

    def _check_params_more(self) -> None:
        package = self._package()
        pl = importlib.import_module(package)
        module, optimizer = self.getModel(), self.getOptimizer()
        if optimizer is not None:
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(f"optimizer must be a torch.optim.Optimizer built over the "
                                f"module's parameters, got {type(optimizer).__name__}")
            own = {id(p) for p in module.parameters()}
            params = [p for g in optimizer.param_groups for p in g["params"]]
            foreign = sum(1 for p in params if id(p) not in own)
            if foreign:
                raise ValueError(f"{foreign} of the optimizer's {len(params)} parameters are "
                                 "not parameters of model: build it over this module "
                                 "(optimizer=torch.optim.Adam(module.parameters()))")
        elif not util.overrides(module, "configure_optimizers"):
            raise ValueError(f"{type(module).__name__} does not define configure_optimizers(): "
                             "define it, or pass optimizer=torch.optim.Adam(module.parameters())")
        losses = self._losses()
        labels = self.getLabelCols()
        if losses is not None and len(losses) not in (1, len(labels)):
            raise ValueError(f"{len(losses)} losses for {len(labels)} label columns {labels}: "
                             "give one loss, or one per label column")
        if not losses and not util.overrides(module, "training_step"):
            raise ValueError(f"{type(module).__name__} does not define training_step(): "
                             "define it, or pass loss= (e.g. torch.nn.functional.mse_loss) "
                             "to train forward(*features) against the labels")
        if (self.getValidation() is not None and not losses
                and not util.overrides(module, "validation_step")):
            raise ValueError(f"validation is set but {type(module).__name__} does not define "
                             "validation_step(): define it (log 'val_loss'), pass loss=, or "
                             "drop validation")
        if self.getMetrics():
            raise ValueError("metrics is not used by LightningEstimator: log metrics from the "
                             "module's steps with self.log('acc', value); they become the "
                             "history's metrics")
        if self.getDataModule() is not None:
            raise ValueError("data_module is not supported: the estimator feeds the steps "
                             "from its Arrow loader (each batch a dict column -> tensor); "
                             "reshape or augment batches with transformation_fn")
        reserved = sorted(set(self.getTrainerArgs() or {}) & set(RESERVED_TRAINER_ARGS))
        if reserved:
            raise ValueError("trainer_args sets what the estimator sets itself: " + "; ".join(
                f"{k} ({RESERVED_TRAINER_ARGS[k]})" for k in reserved))
        for i, cb in enumerate(self.getCallbacks() or []):
            if not isinstance(cb, pl.Callback):
                raise TypeError(f"callbacks[{i}] is a {type(cb).__name__}, not a "
                                f"{package}.Callback (e.g. EarlyStopping(monitor='val_loss'))")
        logger = self.getLogger()
        if logger is not None and logger is not False and not isinstance(
                logger, pl.loggers.Logger):
            raise TypeError(f"logger must be a {package} logger (TensorBoardLogger, "
                            f"CSVLogger ...), got {type(logger).__name__}")
        ckpt = self.getCheckpointCallback()
        if ckpt is not None and not isinstance(ckpt, pl.callbacks.ModelCheckpoint):
            raise TypeError(f"checkpoint_callback must be a {package} ModelCheckpoint, got "
                            f"{type(ckpt).__name__}")
        comp = self.getGradientCompression()
        if comp is not None and not (hasattr(comp, "compress") and hasattr(comp, "decompress")):
            raise TypeError(f"gradient_compression must be a compressor such as "
                            f"spark_dl.torch.Compression.fp16, got {comp!r}")
        shapes = self.getInputShapes()
        if shapes is not None and len(shapes) != len(self.getFeatureCols()):
            raise ValueError(f"input_shapes has {len(shapes)} shapes for "
                             f"{len(self.getFeatureCols())} feature columns "
                             f"{self.getFeatureCols()}")
        if any(p.is_cuda for p in module.parameters()):
            raise ValueError("move the module to the CPU before fit(): each worker moves its "
                             "copy to its own GPU (use_gpu=True)")

    def _vector_dtype(self) -> str:
        return ("float64" if util.module_dtype(self.getModel()) == torch.float64
                else "float32")

    # ------------------------------------------------------------------ dry run

    def _dry_run(self, store, dataset: Dataset, package: str) -> List[str]:
        """One training (and validation) step on two rows, on the driver; returns the
        metric names (base names the steps log, ``loss`` aside)."""
        from spark_dl.spark.launch.pickling import pickler

        pl = importlib.import_module(package)
        features, labels = self.getFeatureCols(), self.getLabelCols()
        cp = pickler()
        module, optimizer = cp.loads(cp.dumps((self.getModel(), self.getOptimizer())))
        batch = util.to_batch(self._sample_batch(store, dataset), features,
                              self.getInputShapes(), util.module_dtype(module))
        described = util.describe(batch)
        if self.getTransformationFn() is not None:
            try:
                batch = self.getTransformationFn()(batch)
            except Exception as e:
                raise ValueError(f"transformation_fn failed on a batch of the training data "
                                 f"{described} ({type(e).__name__}: {e})") from e
        util.install_default_steps(module, self._losses(), optimizer, features, labels)
        capture = util.LogCapture(module)
        names = set()

        class Record(pl.Callback):
            def on_train_batch_end(self, *args):
                names.update(capture.values)

            def on_validation_batch_end(self, *args, **kwargs):
                names.update(capture.values)

        validate = dataset.val_rows > 0
        try:
            with _quiet(package), tempfile.TemporaryDirectory(prefix="spark_dl_dry_") as tmp:
                args = dict(self.getTrainerArgs() or {})
                # A cluster environment of our choosing: Lightning would otherwise probe
                # for MPI, importing mpi4py.MPI, which starts an MPI singleton (an orted
                # that outlives the dry run) in the driver.
                args.setdefault("plugins", [importlib.import_module(
                    f"{package}.plugins.environments").LightningEnvironment()])
                trainer = pl.Trainer(
                    **args, accelerator="cpu", devices=1,
                    max_epochs=1, limit_train_batches=1, limit_val_batches=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, num_sanity_val_steps=0,
                    callbacks=[Record()], default_root_dir=tmp)
                trainer.fit(module, _Once(batch), _Once(batch) if validate else None)
        except Exception as e:
            raise ValueError(
                f"the LightningModule failed on two rows of the training data: "
                f"{type(e).__name__}: {e}\n  batch (a dict column -> tensor): {described}"
                f"\n  feature_cols {features}, label_cols {labels}, input_shapes "
                f"{self.getInputShapes()}\nFix the module's steps/forward() or set "
                "input_shapes.") from e
        return sorted(n for n in names if n != "loss")

    # ------------------------------------------------------------------ training

    def _framework_spec(self, store, dataset: Dataset) -> LightningSpec:
        package = self._package()
        metric_names = self._dry_run(store, dataset, package)
        return LightningSpec(
            module=self.getModel(), optimizer=self.getOptimizer(), losses=self._losses(),
            input_shapes=self.getInputShapes(), trainer_args=dict(self.getTrainerArgs() or {}),
            logger=self.getLogger(), checkpoint_callback=self.getCheckpointCallback(),
            profiler=self.getProfiler(), log_every_n_steps=self.getLogEveryNSteps(),
            compression=self.getGradientCompression(),
            backward_passes_per_step=self.getBackwardPassesPerStep(), package=package,
            metric_names=metric_names)

    def _trained_model(self, result: dict, run_id: str, dataset: Dataset, framework):
        from spark_dl.spark.launch.pickling import pickler

        cp = pickler()
        module = cp.loads(cp.dumps(self.getModel()))
        module.load_state_dict(result["state"]["state_dict"])
        # A value logged only in validation (or only in training) has no value in the other
        # pass: the loop records NaN there, dropped here.
        history = {k: v for k, v in result["history"].items()
                   if not (isinstance(v, list) and v and all(_nan(x) for x in v))}
        cols = self.getFeatureCols() + self.getLabelCols()
        metadata = {"columns": {c: dataset.columns[c] for c in cols},
                    "vector_dtype": self._vector_dtype(),
                    "logged_metrics": result["state"].get("logged_metrics", {})}
        return LightningModel(
            model=module, feature_columns=self.getFeatureCols(),
            label_columns=self.getLabelCols(), history=history, run_id=run_id,
            input_shapes=framework.input_shapes, metadata=metadata,
            batch_size=max(self.getValBatchSize() or self.getBatchSize(), 256),
            use_gpu=self.getUseGpu())


def _nan(x) -> bool:
    return isinstance(x, float) and math.isnan(x)


LightningEstimator.__init__.__signature__ = params_signature(
    list(ESTIMATOR_PARAMS) + list(LIGHTNING_PARAMS))
LightningEstimator.__init__.__doc__ = (
    "Creates the estimator; every argument is a param.\n\n"
    + params_doc(list(ESTIMATOR_PARAMS) + list(LIGHTNING_PARAMS)))
