"""``KerasEstimator``: trains a Keras 3 model on a Spark DataFrame, data-parallel.

The flow is the shared one (:mod:`spark_dl.spark.common.estimator`); this module adds the
Keras parts: the checks of model, optimizer and loss; the model's ``.keras`` round trip
(an unserializable custom layer fails here, named); a dry run of the compiled model on two
rows of the prepared data on the driver (shape mistakes fail before any worker starts, and
the run learns the metric names Keras will report); the
:class:`~spark_dl.spark.keras.adapter.KerasSpec` the workers'
:class:`~spark_dl.spark.keras.adapter.KerasWorker` receives; and the
:class:`~spark_dl.spark.keras.model.KerasModel` built from rank 0's result.
"""

import warnings
from typing import List

import numpy as np
from pyspark import keyword_only

from spark_dl.spark.common.dataset import Dataset
from spark_dl.spark.common.estimator import EstimatorBase
from spark_dl.spark.common.params import (ESTIMATOR_PARAMS, define_params, params_doc,
                                          params_signature)
from spark_dl.spark.keras import util
from spark_dl.spark.keras.adapter import (KerasSpec, KerasWorker, assign_variables,
                                          compile_kwargs, make_optimizer)
from spark_dl.spark.keras.model import KerasModel
from spark_dl.spark.keras.params import KERAS_PARAMS
from spark_dl.spark.keras.params_accessors import KerasEstimatorParamsAccessors

__all__ = ["KerasEstimator", "KERAS_PARAMS"]


def _keras():
    import keras

    return keras


@define_params(KERAS_PARAMS)
class KerasEstimator(KerasEstimatorParamsAccessors, EstimatorBase):
    """Trains a Keras 3 model on a Spark DataFrame with ``num_proc`` data-parallel workers
    and returns a :class:`~spark_dl.spark.keras.KerasModel`.

    Parameters follow ``horovod.spark.keras.KerasEstimator``'s names; each has a getter and
    a setter (``getBatchSize``/``setBatchSize``)::

        est = KerasEstimator(num_proc=2, model=model, optimizer=keras.optimizers.Adam(1e-3),
                             loss="mse", metrics=["mae"],
                             feature_cols=["features"], label_cols=["y"],
                             batch_size=64, epochs=5, validation=0.1)
        keras_model = est.fit(df)              # a KerasModel
        keras_model.transform(df)              # adds "y__output"

    ``model`` must be built (it has inputs); feature columns feed its inputs in order and
    label columns match its outputs in order. ``optimizer`` may be left out when the model
    was compiled (its optimizer, loss and metrics are used; params given here override
    them). The model travels as a ``.keras`` file; custom layers need ``custom_objects``.
    The workers use the driver's Keras backend (TensorFlow or PyTorch), or the one
    ``backend_env={"KERAS_BACKEND": ...}`` names. See docs/keras.md.
    """

    _run_prefix = "keras"
    _worker_adapter = KerasWorker

    @keyword_only
    def __init__(self, **kwargs):
        super().__init__(**self._input_kwargs)

    @keyword_only
    def setParams(self, **kwargs):
        """Sets several params at once (keyword arguments named as the params)."""
        return super().setParams(**self._input_kwargs)

    # ------------------------------------------------------------------ checks

    def _optimizer(self):
        optimizer = self.getOptimizer() or getattr(self.getModel(), "optimizer", None)
        if isinstance(optimizer, (str, dict)):  # a name or a config, as model.compile takes
            try:
                return _keras().optimizers.get(optimizer)
            except ValueError as e:
                raise ValueError(f"optimizer {optimizer!r} is not a Keras optimizer: {e} (a "
                                 "name such as 'adam' or 'sgd', or an optimizer object such "
                                 "as keras.optimizers.Adam(1e-3))") from None
        return optimizer

    def _check_params_more(self) -> None:
        keras = _keras()
        self._workers_backend()  # a backend the workers cannot train on fails here
        model = self.getModel()
        if not isinstance(model, keras.Model):
            raise TypeError(f"model must be a keras.Model, got "
                            f"{type(model).__name__ if model is not None else 'nothing'}")
        optimizer = self._optimizer()
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                f"optimizer must be a Keras optimizer, e.g. 'adam' or "
                f"keras.optimizers.Adam(1e-3), got "
                f"{type(optimizer).__name__ if optimizer is not None else 'nothing'} (or "
                "compile the model with one)")
        if self.getLoss() is None and not getattr(model, "compiled", False):
            raise ValueError("loss is not set: pass loss='mse' (or a Keras loss object, or "
                             "one per output), or compile the model with a loss")
        specs = util.input_specs(model)
        features = self.getFeatureCols()
        if len(specs) != len(features):
            raise ValueError(f"the model has {len(specs)} input(s) "
                             f"{[name for name, _, _ in specs]} but feature_cols names "
                             f"{len(features)} column(s) {features}: give one feature column "
                             "per model input, in order")
        labels = self.getLabelCols()
        if len(model.outputs) != len(labels):
            raise ValueError(f"the model has {len(model.outputs)} output(s) but label_cols "
                             f"names {len(labels)} column(s) {labels}: give one label column "
                             "per model output, in order")
        comp = self.getGradientCompression()
        if comp is not None and not (hasattr(comp, "compress") and hasattr(comp, "decompress")):
            raise TypeError(f"gradient_compression must be a compressor such as "
                            f"spark_dl.keras.Compression.fp16, got {comp!r}")
        cb = self.getCheckpointCallback()
        if cb is not None and not hasattr(cb, "set_model"):
            raise TypeError(f"checkpoint_callback must be a Keras callback such as "
                            f"keras.callbacks.ModelCheckpoint('best.keras'), got {cb!r}")

    def _vector_dtype(self) -> str:
        return util.vector_dtype(self.getModel())

    def _workers_backend(self) -> str:
        """The workers' Keras backend: ``backend_env``'s ``KERAS_BACKEND`` when given, else
        the driver's. The driver only saves, loads and dry-runs the model, and ``.keras``
        files move between backends, so a driver on TensorFlow can train on PyTorch workers
        (the backend must be chosen before Keras is imported: the driver's is fixed)."""
        chosen = (self.getBackendEnv() or {}).get("KERAS_BACKEND")
        backend = str(chosen).strip().lower() if chosen else _keras().backend.backend()
        if backend not in ("tensorflow", "torch"):
            raise ValueError(
                f"KerasEstimator trains on the tensorflow or torch Keras backend, not "
                f"{backend!r} ({'backend_env KERAS_BACKEND' if chosen else 'the driver'}'s): "
                "spark_dl.keras.DistributedOptimizer cannot run in a jax train step; set "
                "backend_env={'KERAS_BACKEND': 'tensorflow'} or 'torch'")
        return backend

    def _worker_env(self) -> dict:
        return {"KERAS_BACKEND": self._workers_backend()}

    # ------------------------------------------------------------------ dry run

    def _check_label_sizes(self, dataset: Dataset, out_shapes) -> None:
        """A label with several values per row must fit its output's size."""
        if self.getLabelShapes():
            return
        for col, shape in zip(self.getLabelCols(), out_shapes):
            per_row = int(np.prod(dataset.columns[col]["shape"] or [1]))
            if None in shape or per_row == 1:
                continue  # e.g. class indices against per-class scores
            if per_row != int(np.prod(shape or [1])):
                raise ValueError(f"label column {col!r} has {per_row} values per row but its "
                                 f"model output has shape {['batch'] + list(shape)}: give "
                                 f"the model one output per label column with {per_row} "
                                 f"units, e.g. keras.layers.Dense({per_row}) as its last "
                                 "layer")

    def _dry_run(self, store, dataset: Dataset, fw: KerasSpec) -> List[str]:
        """Compiles a copy of the model and evaluates it on two training rows; returns the
        metric names Keras reports (see module doc)."""
        batch = self._sample_batch(store, dataset)
        if self.getTransformationFn() is not None:
            try:
                batch = self.getTransformationFn()(batch)
            except Exception as e:
                raise ValueError(f"transformation_fn failed on a batch of the training data "
                                 f"({type(e).__name__}: {e})") from e
        features, labels = self.getFeatureCols(), self.getLabelCols()
        x = util.feature_arrays(batch, features, fw.input_specs)
        y = util.label_arrays(batch, labels, fw.output_shapes, self.getLabelShapes(),
                              fw.output_dtypes)
        weight = self.getSampleWeightCol()
        w = np.asarray(batch[weight]).reshape(-1) if weight else None
        model = util.model_from_bytes(fw.model_bytes, fw.custom_objects)
        try:
            model.compile(**compile_kwargs(fw, make_optimizer(fw)))
        except Exception as e:
            raise ValueError(f"the model cannot be compiled with loss {self.getLoss()!r} and "
                             f"metrics {self.getMetrics()!r}: {type(e).__name__}: "
                             f"{util.strip_ansi(str(e))}") from e
        try:
            logs = model.test_on_batch(util.pack(x), util.pack(y), sample_weight=w,
                                       return_dict=True)
        except Exception as e:
            loss = self.getLoss() if self.getLoss() is not None else getattr(
                self.getModel(), "loss", None)
            advice = util.shape_advice(features, x, fw.input_specs, labels, y,
                                       fw.output_shapes,
                                       list(getattr(model, "output_names", None) or []), loss)
            fix = ("Likely fix:\n" + "\n".join(f"  - {a}" for a in advice) if advice else
                   "Make the model's inputs and outputs match the columns (one input per "
                   "feature column and one output per label column, in order).")
            raise ValueError(
                f"the model cannot be evaluated on the training data: "
                f"{type(e).__name__}: {util.strip_ansi(str(e)).strip()}\n"
                f"  inputs from feature columns {features}: {util.describe(x)} (model inputs "
                f"{[['batch'] + s for _, s, _ in fw.input_specs]})\n"
                f"  labels from label columns {labels}: {util.describe(y)} (model outputs "
                f"{[['batch'] + s for s in fw.output_shapes]})\n" + fix) from e
        return [k for k in logs if k != "loss"]

    # ------------------------------------------------------------------ training

    def _framework_spec(self, store, dataset: Dataset) -> KerasSpec:
        keras = _keras()
        model = self.getModel()
        custom = self.getCustomObjects()
        model_bytes = util.check_round_trip(model, custom)
        # Custom classes from the user's modules that executors lack travel with the spec.
        custom = util.with_shipped_classes(model_bytes, custom)
        out_shapes = util.output_shapes(model)
        self._check_label_sizes(dataset, out_shapes)
        fw = KerasSpec(
            model_bytes=model_bytes, custom_objects=custom,
            optimizer_config=keras.optimizers.serialize(self._optimizer()),
            compile_config=(model.get_compile_config() if getattr(model, "compiled", False)
                            else None),
            loss=self.getLoss(), metrics=self.getMetrics(), loss_weights=self.getLossWeights(),
            input_specs=util.input_specs(model), output_shapes=out_shapes, metric_names=[],
            compression=self.getGradientCompression(),
            backward_passes_per_step=self.getBackwardPassesPerStep(),
            checkpoint_callback=self.getCheckpointCallback(),
            backend=self._workers_backend(),
            scale_learning_rate=bool(self.getScaleLearningRate()),
            output_dtypes=util.output_dtypes(model))
        fw.metric_names = self._dry_run(store, dataset, fw)
        return fw

    def _trained_model(self, result: dict, run_id: str, dataset: Dataset, framework):
        fw: KerasSpec = framework
        state = result["state"]
        model = util.model_from_bytes(fw.model_bytes, fw.custom_objects)
        assign_variables(model.weights, state["weights"], "trained weights")
        optimizer = make_optimizer(fw)
        model.compile(**compile_kwargs(fw, optimizer))
        optimizer.build(model.trainable_variables)
        try:  # the trained optimizer state, when the plain optimizer has the same variables
            assign_variables(optimizer.variables, state["optimizer"], "optimizer state")
        except ValueError as e:
            warnings.warn(f"the fitted model's optimizer starts without the trained state ({e})",
                          RuntimeWarning, stacklevel=2)
        cols = self.getFeatureCols() + self.getLabelCols()
        metadata = {"columns": {c: dataset.columns[c] for c in cols},
                    "vector_dtype": self._vector_dtype()}
        return KerasModel(
            model=model, custom_objects=fw.custom_objects,
            feature_columns=self.getFeatureCols(), label_columns=self.getLabelCols(),
            history=result["history"], run_id=run_id, metadata=metadata,
            batch_size=max(self.getValBatchSize() or self.getBatchSize(), 256),
            use_gpu=self.getUseGpu(),
            prediction_kind=self.getPredictionKind() or (
                util.prediction_kind(self.getLoss() if self.getLoss() is not None
                                     else getattr(self.getModel(), "loss", None))
                if len(self.getLabelCols()) == 1 else None))


KerasEstimator.__init__.__signature__ = params_signature(
    list(ESTIMATOR_PARAMS) + list(KERAS_PARAMS))
KerasEstimator.__init__.__doc__ = ("Creates the estimator; every argument is a param.\n\n"
                                   + params_doc(list(ESTIMATOR_PARAMS) + list(KERAS_PARAMS)))
