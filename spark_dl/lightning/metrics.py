"""torchmetrics synchronization over spark_dl.

A ``torchmetrics.Metric`` syncs its states in ``compute()`` only when
``torch.distributed`` is initialized, through ``torch.distributed.all_gather``. spark_dl
does not start ``torch.distributed``, so :func:`attach` (called by ``SparkDLStrategy`` for
every metric of the module) gives each metric spark_dl's gather instead. For metrics outside
a LightningModule pass the same functions to the constructor::

    acc = torchmetrics.classification.BinaryAccuracy(**spark_dl.lightning.metric_kwargs())
"""

from typing import Any, List, Optional

import torch

__all__ = ["gather_all_tensors", "distributed_available", "metric_kwargs", "attach"]


def distributed_available() -> bool:
    """True when spark_dl runs more than one rank (torchmetrics then syncs)."""
    import spark_dl.torch as sdl

    return sdl.is_initialized() and sdl.size() > 1


def gather_all_tensors(result: torch.Tensor, group: Optional[Any] = None) -> List[torch.Tensor]:
    """Every rank's ``result`` as a list indexed by rank (torchmetrics' ``dist_sync_fn``
    contract); the tensors may differ in shape between ranks but not in rank count of
    dimensions. ``group`` must be None (spark_dl process sets are not torch groups)."""
    import spark_dl.torch as sdl

    if group is not None:
        raise ValueError("spark_dl's torchmetrics gather works on all ranks (group=None)")
    result = result.detach().contiguous()
    if result.ndim == 0:
        return list(sdl.allgather(result.reshape(1)).unbind(0))
    shapes = sdl.allgather(torch.tensor([list(result.shape)], dtype=torch.int64))
    rows = [tuple(int(d) for d in s) for s in shapes.tolist()]
    if all(s == rows[0] for s in rows):
        return list(sdl.allgather(result.unsqueeze(0)).unbind(0))
    if all(s[1:] == rows[0][1:] for s in rows):
        # Only the first dimension differs: allgather concatenates unequal first dims.
        return list(torch.split(sdl.allgather(result), [s[0] for s in rows]))
    # Pad every dimension to the largest, gather, trim.
    biggest = [max(s[d] for s in rows) for d in range(result.ndim)]
    padded = result.new_zeros(biggest)
    padded[tuple(slice(0, n) for n in result.shape)] = result
    gathered = sdl.allgather(padded.unsqueeze(0))
    return [g[tuple(slice(0, n) for n in s)] for g, s in zip(gathered.unbind(0), rows)]


def metric_kwargs() -> dict:
    """Constructor arguments making a torchmetrics metric sync through spark_dl."""
    return {"dist_sync_fn": gather_all_tensors, "distributed_available_fn": distributed_available}


def attach(module: torch.nn.Module) -> int:
    """Gives every ``torchmetrics.Metric`` inside ``module`` spark_dl's gather, unless it
    has its own ``dist_sync_fn``; returns how many it changed."""
    try:
        from torchmetrics import Metric
    except ImportError:
        return 0
    changed = 0
    for sub in module.modules():
        if isinstance(sub, Metric) and getattr(sub, "dist_sync_fn", None) is None:
            sub.dist_sync_fn = gather_all_tensors
            sub.distributed_available_fn = distributed_available
            changed += 1
    return changed
