"""How the ``metrics`` param names its metrics, for every framework whose adapter reports
metrics by name (the history, progress lines and TensorBoard key them as ``name`` and
``val_name``). Kept free of pyspark so that workers can import it cheaply."""

from typing import Callable, List, Tuple

__all__ = ["metric_pairs", "is_metric_pair"]


def metric_pairs(metrics) -> List[Tuple[str, Callable]]:
    """``[(name, fn), ...]`` for a ``metrics`` value: a callable, a ``(name, fn)`` pair, a
    list of either, or a dict name -> fn (None: ``[]``). A callable is named by its
    ``__name__`` (its class name for objects); raises ValueError when a name is not a
    non-empty string or two metrics share a name (the history and TensorBoard
    key metrics by name; two lambdas are both ``<lambda>``)."""
    if metrics is None:
        return []
    if isinstance(metrics, dict):
        items = list(metrics.items())
    elif is_metric_pair(metrics):
        items = [tuple(metrics)]
    else:
        items = []
        for m in (metrics if isinstance(metrics, (list, tuple)) else [metrics]):
            if is_metric_pair(m):
                items.append(tuple(m))
            elif callable(m):
                items.append((getattr(m, "__name__", None) or type(m).__name__, m))
            else:
                raise TypeError(f"metrics: {m!r} is neither a callable nor a (name, fn) pair")
    seen = {}
    for name, fn in items:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"metrics: a metric name must be a non-empty string, got "
                             f"{name!r}")
        if not callable(fn):
            raise TypeError(f"metrics: metric {name!r} is {fn!r}, which is not callable")
        if name == "loss":
            raise ValueError("metrics: 'loss' is the name of the training loss in the "
                             "history; give the metric another name, e.g. ('my_loss', fn)")
        if name in seen:
            hint = (" (every lambda is named '<lambda>')" if name == "<lambda>" else "")
            raise ValueError(
                f"metrics: two metrics are named {name!r}{hint}; the history keys metrics "
                f"by name, so name them apart: metrics={{'mae': fn1, 'rmse': fn2}} or "
                f"[('mae', fn1), ('rmse', fn2)]")
        seen[name] = fn
    return items


def is_metric_pair(value) -> bool:
    """Whether ``value`` is a ``(name, fn)`` pair (a tuple or list of a str and a callable)."""
    return (isinstance(value, (tuple, list)) and len(value) == 2
            and isinstance(value[0], str) and callable(value[1]))
