"""``TorchModel``: a trained PyTorch model as a Spark ML Transformer.

``transform`` is the shared one (:mod:`spark_dl.spark.common.model`: Arrow batches in an
Arrow UDF, the model shipped once per transform); this class supplies the
:class:`~spark_dl.spark.torch.adapter.TorchPredictor`, which converts feature columns
exactly as training did (:mod:`spark_dl.spark.torch.util`: cast to the model's dtype,
reshaped to ``input_shapes``) and runs the model in eval mode without gradients.
"""

import torch
from pyspark import keyword_only

from spark_dl.spark.common.model import ModelBase
from spark_dl.spark.common.params import (MODEL_PARAMS, define_params, params_doc,
                                          params_signature)
from spark_dl.spark.torch import util
from spark_dl.spark.torch.adapter import TorchPredictor
from spark_dl.spark.torch.params import TORCH_MODEL_PARAMS
from spark_dl.spark.torch.params_accessors import TorchModelParamsAccessors

__all__ = ["TorchModel", "TORCH_MODEL_PARAMS"]


@define_params(TORCH_MODEL_PARAMS)
class TorchModel(TorchModelParamsAccessors, ModelBase):
    """A trained PyTorch model (see the module doc). ``fit`` returns one; ``getModel()``
    gives the ``torch.nn.Module``, ``getHistory()`` the per-epoch metrics.

    ``timings`` (not persisted) holds the fit's durations: ``total_s``, ``prepare_s``,
    ``first_step_s`` (from ``fit()`` to the end of the first training step) and ``epoch_s``.
    """

    @keyword_only
    def __init__(self, **kwargs):
        super().__init__(**self._input_kwargs)

    @keyword_only
    def setParams(self, **kwargs):
        """Sets several params at once (keyword arguments named as the params)."""
        return super().setParams(**self._input_kwargs)

    def _default_vector_dtype(self) -> str:
        model = self.getModel()
        return ("float64" if isinstance(model, torch.nn.Module) and
                util.model_dtype(model) == torch.float64 else "float32")

    def _predictor(self, specs) -> TorchPredictor:
        model = self.getModel()
        if not isinstance(model, torch.nn.Module):
            raise ValueError("this TorchModel has no model: setModel(torch_module) first")
        features = self.getFeatureColumns()
        # The rule fit applied (a model fitted before it, or built by hand, may hold a
        # per-row shape such as [2]).
        shapes = self.getInputShapes() or util.default_input_shapes(features, specs)
        shapes = util.batch_input_shapes(features, shapes, specs)
        return TorchPredictor(model, features, shapes, self.getBatchSize(),
                              use_gpu=self.getUseGpu())


TorchModel.__init__.__signature__ = params_signature(
    list(MODEL_PARAMS) + list(TORCH_MODEL_PARAMS))
TorchModel.__init__.__doc__ = ("Creates the model; every argument is a param.\n\n"
                               + params_doc(list(MODEL_PARAMS) + list(TORCH_MODEL_PARAMS)))
