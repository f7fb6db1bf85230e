"""``LightningModel``: a trained LightningModule as a Spark ML Transformer.

``transform`` is the shared one (:mod:`spark_dl.spark.common.model`: Arrow batches in an
Arrow UDF, the model shipped once per transform); this class supplies the
:class:`~spark_dl.spark.lightning.adapter.LightningPredictor`, which converts feature
columns exactly as training did and calls the module's ``forward`` in eval mode without
gradients.
"""

import torch
from pyspark import keyword_only

from spark_dl.spark.common.model import ModelBase
from spark_dl.spark.common.params import (MODEL_PARAMS, define_params, params_doc,
                                          params_signature)
from spark_dl.spark.lightning import util
from spark_dl.spark.lightning.adapter import LightningPredictor
from spark_dl.spark.lightning.params import LIGHTNING_MODEL_PARAMS
from spark_dl.spark.lightning.params_accessors import LightningModelParamsAccessors

__all__ = ["LightningModel", "TorchModel", "LIGHTNING_MODEL_PARAMS"]


@define_params(LIGHTNING_MODEL_PARAMS)
class LightningModel(LightningModelParamsAccessors, ModelBase):
    """A trained LightningModule (see the module doc). ``fit`` returns one; Horovod calls
    it ``horovod.spark.lightning.TorchModel`` (exported under that name too, the same
    class). ``getModel()`` gives the module (the plain ``torch.nn.Module`` when one was
    trained through Horovod's legacy path), ``getHistory()`` the per-epoch metrics, and
    ``getMetadata()["logged_metrics"]`` what Lightning's ``callback_metrics`` held at the
    end of training (rank 0).

    ``timings`` (not persisted) holds the fit's durations, as for every spark_dl model.
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
                util.module_dtype(model) == torch.float64 else "float32")

    def _predictor(self, specs) -> LightningPredictor:
        model = self.getModel()
        if not isinstance(model, torch.nn.Module):
            raise ValueError("this LightningModel has no model: setModel(lightning_module) "
                             "first")
        return LightningPredictor(model, self.getFeatureColumns(), self.getInputShapes(),
                                  self.getBatchSize(), use_gpu=self.getUseGpu())


LightningModel.__init__.__signature__ = params_signature(
    list(MODEL_PARAMS) + list(LIGHTNING_MODEL_PARAMS))
LightningModel.__init__.__doc__ = ("Creates the model; every argument is a param.\n\n"
                                   + params_doc(list(MODEL_PARAMS) + list(LIGHTNING_MODEL_PARAMS)))


#: Horovod's name of the Lightning model (``horovod.spark.lightning.TorchModel``): the same
#: class.
TorchModel = LightningModel
