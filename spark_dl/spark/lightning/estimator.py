"""``LightningEstimator``: trains a LightningModule on a Spark DataFrame, data-parallel.

The flow is the shared one (:mod:`spark_dl.spark.common.estimator`); this module adds the
Lightning parts: the checks of module, optimizer, loss, callbacks and Trainer arguments; a
plain ``torch.nn.Module`` with ``optimizer`` and ``loss`` wrapped into a LightningModule
(Horovod's legacy path, :mod:`~spark_dl.spark.lightning.legacy`); a dry run of one training
(and validation) step on two rows of the prepared data on the driver, in a throw-away
Trainer on a copy of the module with copies of the user's callbacks and a stand-in logger,
so that shape and dtype mistakes and callbacks that cannot run fail before any worker
starts, and the names the module logs are known (they become the history's metrics); the
:class:`~spark_dl.spark.lightning.adapter.LightningSpec` the workers'
:class:`~spark_dl.spark.lightning.adapter.LightningWorker` receives; and the
:class:`~spark_dl.spark.lightning.model.LightningModel` built from rank 0's result.
"""

import contextlib
import importlib
import logging
import math
import os
import tempfile
import warnings
from typing import List, Optional

import torch
from pyspark import keyword_only

from spark_dl.spark.common.dataset import Dataset
from spark_dl.spark.common.estimator import EstimatorBase
from spark_dl.spark.common.prediction import torch_prediction_kind
from spark_dl.spark.common.params import (ESTIMATOR_PARAMS, define_params, params_doc,
                                          params_signature)
from spark_dl.spark.lightning import legacy, util
from spark_dl.spark.lightning.adapter import LightningSpec, LightningWorker
from spark_dl.spark.lightning.model import LightningModel
from spark_dl.spark.lightning.params import LIGHTNING_PARAMS, RESERVED_TRAINER_ARGS
from spark_dl.spark.lightning.params_accessors import LightningEstimatorParamsAccessors

__all__ = ["LightningEstimator", "TorchEstimator", "LIGHTNING_PARAMS", "MIN_PL_VERSION"]

#: The oldest Lightning this estimator supports (pyproject's ``lightning`` extra), under
#: Horovod's name (``horovod.spark.lightning.estimator.MIN_PL_VERSION``), which its
#: examples compare with ``pytorch_lightning.__version__`` before training.
MIN_PL_VERSION = "2.6.0"


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

    Horovod calls this class ``horovod.spark.lightning.TorchEstimator``; it is exported
    under that name too (:data:`TorchEstimator`, the same class), and every param of
    Horovod's follows its name (those that mean nothing here print a one-line note when
    set). Each param has a getter and a setter::

        est = LightningEstimator(num_proc=2, model=module, feature_cols=["features"],
                                 label_cols=["label"], batch_size=64, epochs=5,
                                 validation=0.1, store=Store.create("/tmp/spark_dl"))
        lightning_model = est.fit(df)           # a LightningModel
        lightning_model.transform(df)           # adds "label__output"

    The module's steps receive each batch as a dict column -> tensor. ``optimizer`` is
    needed only when the module does not define ``configure_optimizers``, ``loss`` only
    when it defines no ``training_step``/``validation_step`` (then ``loss(forward(*features),
    label)`` is used). A plain ``torch.nn.Module`` with ``optimizer`` and ``loss`` is trained
    the same way (Horovod's legacy path); the fitted model then holds the plain module.
    Values the module logs with ``self.log`` become the history's metrics
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

    def _module(self):
        """The LightningModule to train: ``model``, or a plain ``torch.nn.Module`` inside a
        wrapper (Horovod's legacy path; a new wrapper of the same module on every call)."""
        model = self.getModel()
        if model is not None and util.lightning_package(model) is not None:
            return model
        if isinstance(model, torch.nn.Module):
            if self.getOptimizer() is None or self.getLoss() is None:
                raise TypeError(
                    f"model is a plain torch.nn.Module ({type(model).__name__}), not a "
                    "LightningModule: pass optimizer= (built over its parameters) and loss= "
                    "to train it (Horovod's legacy path), or make it a LightningModule")
            package = legacy.package_for(*(self.getCallbacks() or []), self.getLogger(),
                                         self.getCheckpointCallback())
            return legacy.wrap(model, package)
        raise TypeError(f"model must be a LightningModule (lightning.pytorch or "
                        f"pytorch_lightning), or a torch.nn.Module with optimizer and loss; "
                        f"got {type(model).__name__ if model is not None else 'nothing'}")

    def _losses(self) -> Optional[List]:
        loss = self.getLoss()
        if loss is None:
            return None
        return list(loss) if isinstance(loss, list) else [loss]

    def _trainer_args_conflicts(self, pl) -> List[str]:
        """The reserved ``trainer_args`` (:data:`RESERVED_TRAINER_ARGS`) whose value differs
        from what the estimator does, each as ``key=value (advice; what agrees)``. A value
        that agrees (Horovod programs pass ``num_sanity_val_steps=0``) changes nothing:
        the workers' Trainer gets the estimator's own value, which is the same."""
        use_gpu, epochs = self.getUseGpu(), self.getEpochs()
        steps, val_steps = self.getTrainStepsPerEpoch(), self.getValidationStepsPerEpoch()
        given = list(self.getCallbacks() or []) + [self.getCheckpointCallback()]
        checkpointing = any(isinstance(cb, pl.callbacks.ModelCheckpoint) for cb in given)
        accelerators = ["auto"] + (["gpu", "cuda"] if use_gpu else ["cpu"])

        def whole_pass(n):
            # 1.0 is "all batches" to Lightning, an int a count of batches.
            return (lambda v: (isinstance(v, float) and v == 1.0) or
                    (n is not None and _is_int(v) and v == n),
                    "1.0" + (f" or {n}" if n is not None else ""))

        def equal(value, text=None):
            return (lambda v: _same(v, value), text or repr(value))

        def param(value, name):
            return (lambda v: v is None or v is value or (not isinstance(v, bool) and
                                                          _same(v, value)),
                    f"None or the {name} param's value")

        agree = {
            "strategy": equal("spark_dl"),
            "accelerator": (lambda v: v in accelerators, " or ".join(map(repr, accelerators))
                            + f" (use_gpu={use_gpu})"),
            "devices": equal(1), "num_nodes": equal(1), "max_epochs": equal(epochs),
            "min_epochs": equal(None), "max_steps": (lambda v: v is None or _same(v, -1),
                                                     "-1"),
            "min_steps": equal(None), "limit_train_batches": whole_pass(steps),
            "limit_val_batches": whole_pass(val_steps),
            "val_check_interval": (lambda v: v is None or (isinstance(v, float) and
                                                           v == 1.0), "None or 1.0"),
            "check_val_every_n_epoch": equal(1), "num_sanity_val_steps": equal(0),
            "fast_dev_run": equal(False), "overfit_batches": (lambda v: v == 0, "0"),
            "reload_dataloaders_every_n_epochs": equal(0),
            # The estimator's feeds are not DataLoaders: Lightning adds no sampler either way.
            "use_distributed_sampler": (lambda v: isinstance(v, bool), "True or False"),
            "callbacks": param(self.getCallbacks(), "callbacks"),
            "logger": param(self.getLogger(), "logger"),
            "profiler": param(self.getProfiler(), "profiler"),
            "accumulate_grad_batches": equal(self.getBackwardPassesPerStep()),
            "enable_checkpointing": equal(checkpointing, f"{checkpointing} (a ModelCheckpoint "
                                          f"is{'' if checkpointing else ' not'} given)"),
            "log_every_n_steps": equal(self.getLogEveryNSteps()),
        }
        conflicts = []
        for key, value in (self.getTrainerArgs() or {}).items():
            if key not in RESERVED_TRAINER_ARGS:
                continue
            agrees, text = agree.get(key, (lambda v: False, "no value"))
            if not agrees(value):
                conflicts.append(f"{key}={value!r} ({RESERVED_TRAINER_ARGS[key]}; {text} "
                                 "agrees)")
        return conflicts

    def _check_params_more(self) -> None:
        module = self._module()
        package = util.lightning_package(module)
        pl = importlib.import_module(package)
        optimizer = self.getOptimizer()
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
        conflicts = self._trainer_args_conflicts(pl)
        if conflicts:
            raise ValueError("trainer_args sets what the estimator sets itself, to another "
                             "value: " + "; ".join(conflicts))
        for i, cb in enumerate(self.getCallbacks() or []):
            if not isinstance(cb, pl.Callback):
                raise TypeError(f"callbacks[{i}] is a {type(cb).__name__}, not a "
                                f"{package}.Callback (e.g. EarlyStopping(monitor='val_loss'))")
        ignored = util.removed_hooks(module, self.getCallbacks() or [])
        if ignored:
            warnings.warn("Lightning 2 never calls these hooks (removed since Lightning 1.x), "
                          "so what they do would not happen: " + "; ".join(ignored),
                          UserWarning, stacklevel=3)
        logger = self.getLogger()
        if logger is False:
            # Lightning's callbacks that refuse a Trainer without a logger, known before any
            # Spark job; the dry run finds the others.
            needy = (pl.callbacks.LearningRateMonitor, pl.callbacks.DeviceStatsMonitor)
            names = [type(cb).__name__ for cb in self.getCallbacks() or []
                     if isinstance(cb, needy)]
            if names:
                raise ValueError(f"{', '.join(names)} need(s) a logger, and logger=False "
                                 "turns it off: leave logger unset (a TensorBoard logger in "
                                 "the store) or pass one")
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

    def _dry_run(self, store, dataset: Dataset, module) -> List[str]:
        """One training (and validation) step on two rows, on the driver; returns the
        metric names (base names the steps log, ``loss`` aside).

        The throw-away Trainer runs copies of the user's callbacks (and
        ``checkpoint_callback``) and, unless ``logger=False``, a CSV logger standing in for
        the workers' logger, so a callback that cannot run (``LearningRateMonitor`` without a
        logger, a monitored key nobody logs) fails here, before the training job. Copies:
        the user's objects keep their state; a ``ModelCheckpoint`` copy writes into a
        temporary directory."""
        from spark_dl.spark.launch.pickling import pickler

        package = util.lightning_package(module)
        pl = importlib.import_module(package)
        features, labels = self.getFeatureCols(), self.getLabelCols()
        cp = pickler()
        user_callbacks = list(self.getCallbacks() or [])
        if self.getCheckpointCallback() is not None:
            user_callbacks.append(self.getCheckpointCallback())
        module, optimizer, user_callbacks = cp.loads(cp.dumps(
            (module, self.getOptimizer(), user_callbacks)))
        batch = util.to_batch(self._sample_batch(store, dataset), features,
                              self.getInputShapes(), util.module_dtype(module))
        described = util.describe(batch)
        if self.getTransformationFn() is not None:
            try:
                batch = self.getTransformationFn()(batch)
            except Exception as e:
                raise ValueError(f"transformation_fn failed on a batch of the training data "
                                 f"{described} ({type(e).__name__}: {e})") from e
        util.install_default_steps(module, self._losses(), optimizer, features, labels,
                                   self.getLossWeights(), self.getSampleWeightCol())
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
                # Reserved keys agree with the estimator's values (checked): ours are set.
                args = {k: v for k, v in (self.getTrainerArgs() or {}).items()
                        if k not in RESERVED_TRAINER_ARGS}
                # A cluster environment of our choosing: Lightning would otherwise probe
                # for MPI, importing mpi4py.MPI, which starts an MPI singleton (an orted
                # that outlives the dry run) in the driver.
                args.setdefault("plugins", [importlib.import_module(
                    f"{package}.plugins.environments").LightningEnvironment()])
                for cb in user_callbacks:
                    if isinstance(cb, pl.callbacks.ModelCheckpoint):
                        cb.dirpath = os.path.join(tmp, "checkpoints")
                logger = (False if self.getLogger() is False
                          else pl.loggers.CSVLogger(tmp, name="dry_run"))
                trainer = pl.Trainer(
                    **args, accelerator="cpu", devices=1,
                    max_epochs=1, limit_train_batches=1, limit_val_batches=1, logger=logger,
                    enable_checkpointing=any(isinstance(cb, pl.callbacks.ModelCheckpoint)
                                             for cb in user_callbacks),
                    enable_progress_bar=False, enable_model_summary=False,
                    num_sanity_val_steps=0, callbacks=user_callbacks + [Record()],
                    default_root_dir=tmp)
                trainer.fit(module, _Once(batch), _Once(batch) if validate else None)
        except Exception as e:
            hint = ""
            if "no logger" in str(e) and self.getLogger() is False:
                hint = ("\nlogger=False leaves the Trainer without a logger: leave logger "
                        "unset (a TensorBoard logger in the store) or pass one.")
            raise ValueError(
                f"the LightningModule failed in a dry run of one step on two rows of the "
                f"training data, with the callbacks and trainer_args given: "
                f"{type(e).__name__}: {e}\n  batch (a dict column -> tensor): {described}"
                f"\n  feature_cols {features}, label_cols {labels}, input_shapes "
                f"{self.getInputShapes()}\nFix the module's steps/forward() or set "
                f"input_shapes, or fix the callback or Trainer argument named above.{hint}"
                ) from e
        return sorted(n for n in names if n != "loss")

    # ------------------------------------------------------------------ training

    def _framework_spec(self, store, dataset: Dataset) -> LightningSpec:
        module = self._module()
        package = util.lightning_package(module)
        metric_names = self._dry_run(store, dataset, module)
        return LightningSpec(
            module=module, optimizer=self.getOptimizer(), losses=self._losses(),
            input_shapes=self.getInputShapes(), trainer_args=dict(self.getTrainerArgs() or {}),
            logger=self.getLogger(), checkpoint_callback=self.getCheckpointCallback(),
            profiler=self.getProfiler(), log_every_n_steps=self.getLogEveryNSteps(),
            compression=self.getGradientCompression(),
            backward_passes_per_step=self.getBackwardPassesPerStep(), package=package,
            metric_names=metric_names, loss_weights=self.getLossWeights())

    def _trained_model(self, result: dict, run_id: str, dataset: Dataset, framework):
        from spark_dl.spark.launch.pickling import pickler

        cp = pickler()
        module = cp.loads(cp.dumps(self._module()))
        module.load_state_dict(result["state"]["state_dict"])
        # Horovod's legacy path returns the plain module it was given, trained.
        module = legacy.unwrap(module)
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
            use_gpu=self.getUseGpu(), prediction_kind=self._prediction_kind())

    def _prediction_kind(self) -> Optional[str]:
        """``prediction_kind``, else inferred from the loss by the torch estimator's rule
        when the estimator's own steps train with it (one label column)."""
        if self.getPredictionKind() is not None:
            return self.getPredictionKind()
        losses = self._losses()
        if not losses or len(self.getLabelCols()) != 1 or util.overrides(self._module(),
                                                                         "training_step"):
            return None
        return torch_prediction_kind(losses)


#: Horovod's name of the Lightning estimator (``horovod.spark.lightning.TorchEstimator``):
#: the same class.
TorchEstimator = LightningEstimator


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _same(a, b) -> bool:
    """Equal values of the same kind (``True`` is not ``1``, ``1.0`` is not ``1``)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return type(a) is type(b) and a == b if a is not None and b is not None else a is b


def _nan(x) -> bool:
    return isinstance(x, float) and math.isnan(x)


LightningEstimator.__init__.__signature__ = params_signature(
    list(ESTIMATOR_PARAMS) + list(LIGHTNING_PARAMS))
LightningEstimator.__init__.__doc__ = (
    "Creates the estimator; every argument is a param.\n\n"
    + params_doc(list(ESTIMATOR_PARAMS) + list(LIGHTNING_PARAMS)))
