"""The PyTorch estimator's and model's own params (the shared rows are in
:mod:`spark_dl.spark.common.params`). Their typed accessors are generated into
:mod:`spark_dl.spark.torch.params_accessors` (``python -m spark_dl.spark.common.params_codegen``).
"""

from spark_dl.spark.common.params import (SCALE_LEARNING_RATE, ParamSpec, _bool, _callable,
                                          _callables, _shapes)

__all__ = ["TORCH_PARAMS", "TORCH_MODEL_PARAMS"]

#: ``TorchEstimator``'s rows beyond ``ESTIMATOR_PARAMS``.
TORCH_PARAMS = (
    SCALE_LEARNING_RATE,
    ParamSpec("loss_constructors", "functions called on each worker to build the loss "
              "functions (instead of loss, for losses that cannot be pickled)", None,
              _callables("loss_constructors", allow_single=False), pickled=True,
              annotation="Optional[List[Callable]]"),
    ParamSpec("train_minibatch_fn", "custom training step train_minibatch(model, optimizer, "
              "transform_outputs, loss_fn, inputs, labels, sample_weights) -> (outputs, "
              "loss)", None, _callable("train_minibatch_fn"), pickled=True),
    ParamSpec("input_shapes", "shape of each feature column's model input, e.g. "
              "[[-1, 1, 28, 28]] (default: [-1, n] for n values per row, [-1, 1] for "
              "scalars)", None, _shapes("input_shapes")),
)

#: ``TorchModel``'s rows beyond ``MODEL_PARAMS``.
TORCH_MODEL_PARAMS = (
    ParamSpec("optimizer", "the optimizer in its trained state (bound to model)", None,
              pickled=True),
    ParamSpec("input_shapes", "shape of each feature column's model input", None,
              _shapes("input_shapes")),
    ParamSpec("use_gpu", "transform() predicts on a GPU of each executor when CUDA is "
              "available there (the GPU Spark assigned to the task, else the partition "
              "index modulo the executor's GPUs); on the CPU otherwise", True,
              _bool("use_gpu")),
)
