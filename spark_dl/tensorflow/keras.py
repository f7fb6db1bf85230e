"""Horovod's ``horovod.tensorflow.keras`` path: everything of :mod:`spark_dl.keras`.

``import spark_dl.tensorflow.keras as hvd`` is ``import spark_dl.keras as hvd``; the
callbacks are ``spark_dl.tensorflow.keras.callbacks`` too, and the elastic API
``spark_dl.tensorflow.keras.elastic``.
"""

import sys

import spark_dl.keras as _keras
from spark_dl.keras import *  # noqa: F401,F403
from spark_dl.keras import __all__, callbacks, elastic, load_model  # noqa: F401

# ``import spark_dl.tensorflow.keras.callbacks`` (Horovod's module path) finds the same module.
sys.modules.setdefault(__name__ + ".callbacks", _keras.callbacks)
sys.modules.setdefault(__name__ + ".elastic", _keras.elastic)
