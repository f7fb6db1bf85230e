"""The Keras estimator's and model's own params (the shared rows are in
:mod:`spark_dl.spark.common.params`). Their typed accessors are generated into
:mod:`spark_dl.spark.keras.params_accessors` (``python -m spark_dl.spark.common.params_codegen``).

Keras takes losses and metrics by name (``"mse"``) as well as objects, so the shared
``loss`` and ``metrics`` rows are refined here.
"""

from spark_dl.spark.common.params import (SCALE_LEARNING_RATE, ParamSpec, _bool, _dict, _int,
                                          _list)

__all__ = ["KERAS_PARAMS", "KERAS_MODEL_PARAMS"]


def _keras_losses(value):
    """A loss name or callable, or a list/dict of them (one per model output)."""
    if value is None:
        return None
    items = (list(value.values()) if isinstance(value, dict) else
             list(value) if isinstance(value, (list, tuple)) else [value])
    bad = [v for v in items if not (isinstance(v, str) or callable(v))]
    if bad or not items:
        raise TypeError(f"loss must be a Keras loss name (e.g. 'mse'), a loss object or "
                        f"function, or a list/dict of them (one per output), got {value!r}")
    return list(value) if isinstance(value, tuple) else value


_keras_losses.annotation = "Union[str, Callable, List[Any], Dict[str, Any], None]"


def _custom_objects(value):
    value = _dict("custom_objects")(value)
    if value is not None and not all(isinstance(k, str) for k in value):
        raise TypeError("custom_objects must map names (str) to classes or functions, got "
                        f"keys {list(value)}")
    return value


_custom_objects.annotation = "Optional[Dict[str, Any]]"

#: ``KerasEstimator``'s rows beyond ``ESTIMATOR_PARAMS`` (same names replace shared rows).
KERAS_PARAMS = (
    SCALE_LEARNING_RATE,
    ParamSpec("loss", "Keras loss: a name ('mse'), a loss object or function, or a list/dict "
              "with one per model output", None, _keras_losses, pickled=True),
    ParamSpec("metrics", "Keras metrics (names or objects, or per-output lists/dicts), "
              "averaged over rows and workers each epoch", None, _list("metrics"),
              pickled=True),
    ParamSpec("custom_objects", "custom layers, losses and functions by name, needed to load "
              "the model's .keras file (as keras.saving.load_model's custom_objects)", None,
              _custom_objects, pickled=True),
    ParamSpec("checkpoint_callback", "a keras.callbacks.ModelCheckpoint run on rank 0 each "
              "epoch; its files go to the run's directory in the store (the run's own "
              "checkpoint for resuming is written regardless)", None, pickled=True),
    # Horovod's KerasEstimator rows that mean nothing with spark_dl's loader.
    ParamSpec("tensorflow_dataset_prefetch_buffer_size", "Horovod's tf.data prefetch buffer "
              "size", None, _int("tensorflow_dataset_prefetch_buffer_size"),
              ignored="the Arrow loader's reader threads prefetch "
              "(train_reader_num_workers, val_reader_num_workers)"),
)

#: ``KerasModel``'s rows beyond ``MODEL_PARAMS``.
KERAS_MODEL_PARAMS = (
    ParamSpec("custom_objects", "custom layers, losses and functions by name, needed to load "
              "the model", None, _custom_objects, pickled=True),
    ParamSpec("use_gpu", "transform() predicts on a GPU of each executor when the Keras "
              "backend sees one there (the GPU Spark assigned to the task, else the partition "
              "index modulo the executor's GPUs); on the CPU otherwise", True,
              _bool("use_gpu")),
)
