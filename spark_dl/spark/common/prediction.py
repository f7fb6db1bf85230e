"""What a trained model's output means (its ``prediction_kind``), inferred from the loss it
was trained with: one rule for every estimator whose losses are PyTorch's (the torch and
Lightning estimators), so both write the same pyspark.ml prediction columns.

PyTorch is imported only when called: this layer is framework-neutral.
"""

from typing import Optional, Sequence

__all__ = ["torch_prediction_kind"]


def torch_prediction_kind(losses: Sequence) -> Optional[str]:
    """The ``prediction_kind`` (see :data:`~spark_dl.spark.common.params.PREDICTION_KINDS`)
    of a model trained with ``losses``: None when there are several losses or the loss is
    not one of PyTorch's known ones (a lambda, a custom function)."""
    if len(losses) != 1:
        return None
    import torch

    fn = losses[0]
    nn, F = torch.nn, torch.nn.functional
    table = (((F.cross_entropy, nn.CrossEntropyLoss), "logits"),
             ((F.nll_loss, nn.NLLLoss), "log_probabilities"),
             ((F.binary_cross_entropy_with_logits, nn.BCEWithLogitsLoss), "binary_logits"),
             ((F.binary_cross_entropy, nn.BCELoss), "binary_probabilities"),
             ((F.mse_loss, nn.MSELoss, F.l1_loss, nn.L1Loss, F.smooth_l1_loss,
               nn.SmoothL1Loss, F.huber_loss, nn.HuberLoss), "regression"))
    for known, kind in table:
        if any(fn is k or (isinstance(k, type) and isinstance(fn, k)) for k in known):
            return kind
    return None
