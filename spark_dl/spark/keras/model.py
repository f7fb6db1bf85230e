"""``KerasModel``: a trained Keras model as a Spark ML Transformer.

``transform`` is the shared one (:mod:`spark_dl.spark.common.model`: Arrow batches in an
Arrow UDF, the model shipped once per transform); this class supplies the
:class:`~spark_dl.spark.keras.adapter.KerasPredictor`, which carries the model as ``.keras``
bytes, converts feature columns exactly as training did (:mod:`spark_dl.spark.keras.util`)
and predicts ``batch_size`` rows at a time. ML persistence saves the model as a ``.keras``
file too, and loads it with ``custom_objects``.
"""

from typing import Optional

import numpy as np
from pyspark import keyword_only

from spark_dl.spark.common.model import ModelBase
from spark_dl.spark.common.params import (MODEL_PARAMS, define_params, params_doc,
                                          params_signature)
from spark_dl.spark.keras import util
from spark_dl.spark.keras.adapter import KerasPredictor
from spark_dl.spark.keras.params import KERAS_MODEL_PARAMS
from spark_dl.spark.keras.params_accessors import KerasModelParamsAccessors

__all__ = ["KerasModel", "KERAS_MODEL_PARAMS"]


class _KerasFile:
    """A Keras model as ``.keras`` bytes inside the pickled params (see module doc)."""

    def __init__(self, data: bytes):
        self.data = data


@define_params(KERAS_MODEL_PARAMS)
class KerasModel(KerasModelParamsAccessors, ModelBase):
    """A trained Keras model (see the module doc). ``fit`` returns one; ``getModel()``
    gives the ``keras.Model`` (compiled, with the trained optimizer state where it fits),
    ``getHistory()`` the per-epoch metrics.

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

    def _keras_model(self):
        import keras

        model = self.getModel()
        if not isinstance(model, keras.Model):
            raise ValueError("this KerasModel has no model: setModel(keras_model) first")
        return model

    def _default_vector_dtype(self) -> str:
        model = self.getModel()
        return "float32" if model is None else util.vector_dtype(model)

    def _predictor(self, specs) -> KerasPredictor:
        model = self._keras_model()
        data = util.model_to_bytes(model)
        return KerasPredictor(data, util.with_shipped_classes(data, self.getCustomObjects()),
                              self.getFeatureColumns(), util.input_specs(model),
                              self.getBatchSize(), use_gpu=self.getUseGpu())

    def _row_size_from_input_shapes(self, col: str) -> Optional[int]:
        """How many values a row of feature ``col`` holds: the size of the model input it
        feeds (inputs in feature order), where every dimension is known; else None."""
        model, features = self.getModel(), self.getFeatureColumns()
        try:
            specs = util.input_specs(model)
        except ValueError:
            return None
        shape = specs[features.index(col)][1] if len(specs) == len(features) else None
        if not shape or None in shape:
            return None
        return int(np.prod(shape, dtype=np.int64))

    def _params_to_pickle(self, params: dict) -> dict:
        if params.get("model") is not None:
            params = dict(params, model=_KerasFile(util.model_to_bytes(params["model"])))
        return params

    def _params_from_pickle(self, params: dict) -> dict:
        saved = params.get("model")
        if isinstance(saved, _KerasFile):
            model = util.model_from_bytes(saved.data, params.get("custom_objects"),
                                          compile=True)
            params = dict(params, model=model)
        return params


KerasModel.__init__.__signature__ = params_signature(
    list(MODEL_PARAMS) + list(KERAS_MODEL_PARAMS))
KerasModel.__init__.__doc__ = ("Creates the model; every argument is a param.\n\n"
                               + params_doc(list(MODEL_PARAMS) + list(KERAS_MODEL_PARAMS)))
