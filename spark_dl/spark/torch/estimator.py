"""``TorchEstimator``: trains a PyTorch model on a Spark DataFrame, data-parallel.

The flow is the shared one (:mod:`spark_dl.spark.common.estimator`); this module adds the
PyTorch parts: the checks of model, optimizer and losses, a dry run of the model and loss on
two rows of the prepared data on the driver (so shape and dtype mistakes fail before any
worker starts, naming the shapes), the :class:`~spark_dl.spark.torch.adapter.TorchSpec` the
workers' :class:`~spark_dl.spark.torch.adapter.TorchWorker` receives, and the
:class:`~spark_dl.spark.torch.model.TorchModel` built from rank 0's result.
"""

import warnings
from typing import List

import torch
from pyspark import keyword_only

from spark_dl.spark.common.dataset import Dataset
from spark_dl.spark.common.estimator import EstimatorBase
from spark_dl.spark.common.metrics import metric_pairs
from spark_dl.spark.common.params import (ESTIMATOR_PARAMS, define_params, params_doc,
                                          params_signature)
from spark_dl.spark.torch import util
from spark_dl.spark.torch.adapter import TorchSpec, TorchWorker, preload_torch_dynamo
from spark_dl.spark.torch.model import TorchModel
from spark_dl.spark.torch.params import TORCH_PARAMS
from spark_dl.spark.torch.params_accessors import TorchEstimatorParamsAccessors

__all__ = ["TorchEstimator", "TORCH_PARAMS"]


@define_params(TORCH_PARAMS)
class TorchEstimator(TorchEstimatorParamsAccessors, EstimatorBase):
    """Trains a ``torch.nn.Module`` on a Spark DataFrame with ``num_proc`` data-parallel
    workers and returns a :class:`~spark_dl.spark.torch.TorchModel`.

    Parameters follow ``horovod.spark.torch.TorchEstimator``'s names; each has a getter and
    a setter (``getBatchSize``/``setBatchSize``)::

        est = TorchEstimator(num_proc=2, model=net, optimizer=opt, loss=F.mse_loss,
                             feature_cols=["features"], label_cols=["y"],
                             batch_size=64, epochs=5, validation=0.1,
                             store=Store.create("/tmp/spark_dl"))
        torch_model = est.fit(df)              # a TorchModel
        torch_model.transform(df)              # adds "y__output"

    ``fit`` trains a copy of ``model``/``optimizer`` (the objects passed stay unchanged).
    The optimizer must be built over ``model``'s parameters; its class, hyperparameters and
    state travel with it. See docs/estimators.md.
    """

    _run_prefix = "torch"
    _worker_adapter = TorchWorker

    @keyword_only
    def __init__(self, **kwargs):
        super().__init__(**self._input_kwargs)

    @keyword_only
    def setParams(self, **kwargs):
        """Sets several params at once (keyword arguments named as the params)."""
        return super().setParams(**self._input_kwargs)

    # ------------------------------------------------------------------ checks

    def _check_params_more(self) -> None:
        model, optimizer = self.getModel(), self.getOptimizer()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got "
                            f"{type(model).__name__ if model is not None else 'nothing'}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer built over the "
                            f"model's parameters, got "
                            f"{type(optimizer).__name__ if optimizer is not None else 'nothing'}"
                            f"; e.g. optimizer=torch.optim.SGD(model.parameters(), lr=0.1)")
        own = {id(p) for p in model.parameters()}
        params = [p for g in optimizer.param_groups for p in g["params"]]
        foreign = sum(1 for p in params if id(p) not in own)
        if foreign:
            raise ValueError(f"{foreign} of the optimizer's {len(params)} parameters are not "
                             "parameters of model: build the optimizer over this model object "
                             "(optimizer=torch.optim.Adam(model.parameters()))")
        loss, constructors = self.getLoss(), self.getLossConstructors()
        if loss is None and not constructors:
            raise ValueError("loss is not set: pass loss=torch.nn.functional.mse_loss (or one "
                             "loss per label column, or loss_constructors)")
        if loss is not None and constructors:
            raise ValueError("set loss or loss_constructors, not both")
        n_losses = len(constructors) if constructors else (
            len(loss) if isinstance(loss, list) else 1)
        labels = self.getLabelCols()
        if n_losses not in (1, len(labels)):
            raise ValueError(f"{n_losses} losses for {len(labels)} label columns {labels}: "
                             "give one loss, or one per label column")
        shapes = self.getInputShapes()
        if shapes is not None and len(shapes) != len(self.getFeatureCols()):
            raise ValueError(f"input_shapes has {len(shapes)} shapes for "
                             f"{len(self.getFeatureCols())} feature columns "
                             f"{self.getFeatureCols()}")
        comp = self.getGradientCompression()
        if comp is not None and not (hasattr(comp, "compress") and hasattr(comp, "decompress")):
            raise TypeError(f"gradient_compression must be a compressor such as "
                            f"spark_dl.torch.Compression.fp16, got {comp!r}")
        if any(p.is_cuda for p in model.parameters()):
            raise ValueError("move the model to the CPU before fit(): each worker moves its "
                             "copy to its own GPU (use_gpu=True)")

    def _vector_dtype(self) -> str:
        return "float64" if util.model_dtype(self.getModel()) == torch.float64 else "float32"

    def _losses(self) -> List:
        if self.getLossConstructors():
            return [c() for c in self.getLossConstructors()]
        loss = self.getLoss()
        return list(loss) if isinstance(loss, list) else [loss]

    def _input_shapes(self, dataset: Dataset) -> List[List[int]]:
        features = self.getFeatureCols()
        shapes = self.getInputShapes() or util.default_input_shapes(features, dataset.columns)
        shapes = util.batch_input_shapes(features, shapes, dataset.columns)
        for col, shape in zip(features, shapes):
            per_row = 1
            for d in dataset.columns[col]["shape"]:
                per_row *= d
            if shape[0] == -1 and -1 not in shape[1:]:
                size = 1
                for d in shape[1:]:
                    size *= d
                if size != per_row:
                    raise ValueError(f"input_shapes: feature column {col!r} has {per_row} "
                                     f"value(s) per row, but shape {shape} takes {size}; the "
                                     "sizes after -1 must multiply to the row size")
        return shapes

    def _dry_run(self, store, dataset: Dataset, input_shapes) -> None:
        """Model, loss and metrics on two training rows, on the driver (see module doc)."""
        features, labels = self.getFeatureCols(), self.getLabelCols()
        weight = self.getSampleWeightCol()
        batch = util.torch_batch(self._sample_batch(store, dataset))
        if self.getTransformationFn() is not None:
            try:
                batch = self.getTransformationFn()(batch)
            except Exception as e:
                raise ValueError(f"transformation_fn failed on a batch of the training data "
                                 f"({type(e).__name__}: {e})") from e
        model = self.getModel()
        dtype = util.model_dtype(model)
        inputs = util.feature_tensors(batch, features, input_shapes, dtype)
        label_shapes = self.getLabelShapes()
        label_values = util.label_tensors(batch, labels, label_shapes)
        weights = (util.feature_tensors(batch, [weight], [[-1]], dtype)[0] if weight else None)
        modes = [(m, m.training) for m in model.modules()]
        model.eval()
        try:
            with torch.no_grad():
                outputs = model(*inputs)
        except Exception as e:
            raise ValueError(
                f"the model cannot be applied to the training data: {type(e).__name__}: {e}\n"
                f"  inputs from feature columns {features}: {util.describe(inputs)} "
                f"(input_shapes {input_shapes})\n"
                "Set input_shapes to what the model's forward() expects, or fix its first "
                "layer.") from e
        finally:
            for m, mode in modes:
                m.training = mode
        outputs, matched = util.match_outputs(outputs, label_values,
                                              reshape_labels=label_shapes is None)
        loss_fn = util.make_loss_fn(self._losses(), self.getLossWeights(), len(labels))
        # torch warns (then fails, or broadcasts) when a loss such as MSE gets a target
        # shaped unlike its input: that becomes the error below, with shapes per row.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                loss = loss_fn(outputs, matched, weights)
                failure = None
            except Exception as e:
                loss, failure = None, e
        mismatch = util.loss_mismatch(outputs, label_values, labels)
        broadcast = any("target size" in str(w.message) for w in caught)
        if mismatch and (failure is not None or broadcast):
            raise ValueError(f"the loss cannot pair the model's outputs with the labels: "
                             f"{mismatch}") from None
        for w in caught:  # anything else the loss warned about, as it would have
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        if failure is not None:
            raise ValueError(
                f"the loss cannot be computed: {type(failure).__name__}: {failure}\n"
                f"  outputs per row: {', '.join(util.per_row(o) for o in outputs)}; labels "
                f"per row from {labels}: {', '.join(util.per_row(t) for t in label_values)}"
                f"\nMake the model return one output per label column shaped like the "
                f"label, or set label_shapes.") from failure
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"the loss must return one number (a tensor with one element), "
                             f"got {util.describe(loss)}")
        for name, metric in metric_pairs(self.getMetrics()):
            try:
                util.metric_values([(name, metric)], outputs, matched)
            except Exception as e:
                raise ValueError(
                    f"metric {name!r} failed on outputs of "
                    f"{', '.join(util.per_row(o) for o in outputs)} per row and labels of "
                    f"{', '.join(util.per_row(t) for t in matched)} per row: "
                    f"{type(e).__name__}: {e}") from e

    # ------------------------------------------------------------------ training

    def _on_training_started(self, ctx: dict) -> None:
        # Loading the trained optimizer state at the end imports torch._dynamo (see
        # adapter.preload_torch_dynamo): do it while the workers train.
        preload_torch_dynamo()

    def _framework_spec(self, store, dataset: Dataset) -> TorchSpec:
        input_shapes = self._input_shapes(dataset)
        self._dry_run(store, dataset, input_shapes)
        return TorchSpec(
            model=self.getModel(), optimizer=self.getOptimizer(),
            losses=None if self.getLossConstructors() else self._losses(),
            loss_constructors=self.getLossConstructors(),
            loss_weights=self.getLossWeights(), input_shapes=input_shapes,
            compression=self.getGradientCompression(),
            backward_passes_per_step=self.getBackwardPassesPerStep(),
            train_minibatch_fn=self.getTrainMinibatchFn(),
            scale_learning_rate=bool(self.getScaleLearningRate()))

    def _trained_model(self, result: dict, run_id: str, dataset: Dataset, framework):
        from spark_dl.spark.launch.pickling import pickler

        # A copy of the user's objects (optimizer still bound to the model's parameters),
        # then rank 0's trained state.
        cp = pickler()
        model, optimizer = cp.loads(cp.dumps((self.getModel(), self.getOptimizer())))
        model.load_state_dict(result["state"]["model"])
        optimizer.load_state_dict(result["state"]["optimizer"])
        cols = self.getFeatureCols() + self.getLabelCols()
        metadata = {"columns": {c: dataset.columns[c] for c in cols},
                    "vector_dtype": self._vector_dtype()}
        return TorchModel(
            model=model, optimizer=optimizer, feature_columns=self.getFeatureCols(),
            label_columns=self.getLabelCols(), history=result["history"], run_id=run_id,
            input_shapes=framework.input_shapes, metadata=metadata,
            batch_size=max(self.getValBatchSize() or self.getBatchSize(), 256),
            use_gpu=self.getUseGpu(),
            prediction_kind=self.getPredictionKind() or (
                util.prediction_kind(self._losses()) if len(self.getLabelCols()) == 1
                else None))


TorchEstimator.__init__.__signature__ = params_signature(
    list(ESTIMATOR_PARAMS) + list(TORCH_PARAMS))
TorchEstimator.__init__.__doc__ = ("Creates the estimator; every argument is a param.\n\n"
                                   + params_doc(list(ESTIMATOR_PARAMS) + list(TORCH_PARAMS)))
