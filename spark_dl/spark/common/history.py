"""A fitted model's training history as a table and as curves.

Every model keeps what its fit recorded per epoch (``getHistory()``): a dict of lists,
``{"epoch": [1, 2, ...], "loss": [...], "val_loss": [...], <metric>: [...],
"val_<metric>": [...], "rows_per_s": [...]}``. :func:`history_frame` turns it into a pandas
DataFrame with one row per epoch, :func:`plot_history` draws it with matplotlib (imported
only then): one panel per quantity, training solid and validation dashed. The models offer
both as ``history_df()`` and ``plot_history()``.
"""

import math
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["history_frame", "plot_history", "epochs_after"]

#: Columns that are not a training quantity: ``epoch`` is the index, ``rows_per_s`` is
#: throughput (plotted only when asked for).
_NOT_CURVES = ("epoch", "rows_per_s")


def epochs_after(history: Optional[Dict[str, Sequence]], first_epoch: int):
    """``(epoch, logs)`` for each epoch of ``history`` after ``first_epoch`` (a resumed fit's
    earlier epochs are not this fit's), ``logs`` holding every column's value of that epoch:
    for listeners that fill in the epochs their live events missed."""
    history = history or {}
    for i, epoch in enumerate(history.get("epoch", [])):
        if epoch > first_epoch:
            yield int(epoch), {k: v[i] for k, v in history.items() if i < len(v)}


def history_frame(history: Optional[Dict[str, Sequence]]):
    """The history as a pandas DataFrame, one row per epoch.

    The index is ``epoch`` (the history's own numbers, from 1; 1, 2, ... when it has
    none); the columns are the history's other keys in their order, ``loss`` and
    ``val_loss`` first. A list shorter than the others (a metric that started late) is
    padded with NaN at its end; a value that is not a list (a single number) fills its
    column. An empty or missing history gives an empty DataFrame.
    """
    import pandas as pd

    history = dict(history or {})
    columns = {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in history.items()}
    lengths = [len(v) for v in columns.values() if isinstance(v, list)]
    rows = max(lengths, default=0)
    epochs = columns.pop("epoch", None)
    if not isinstance(epochs, list) or len(epochs) != rows:
        epochs = list(range(1, rows + 1))
    order = [k for k in ("loss", "val_loss") if k in columns]
    order += [k for k in columns if k not in order]
    data = {}
    for key in order:
        value = columns[key]
        if isinstance(value, list):
            value = value + [math.nan] * (rows - len(value))
        data[key] = value
    frame = pd.DataFrame(data, index=pd.Index(epochs, name="epoch"), columns=order)
    return frame.astype({k: float for k in order if _numeric(frame[k])})


def _numeric(column) -> bool:
    from pandas.api.types import is_bool_dtype, is_numeric_dtype

    return is_numeric_dtype(column) and not is_bool_dtype(column)


def _panels(frame, metrics: Optional[Sequence[str]]) -> List[Tuple[str, List[str]]]:
    """(name, columns) of each panel: a quantity and its ``val_`` twin."""
    numeric = [k for k in frame.columns if _numeric(frame[k])]
    if metrics is None:
        names = [k for k in numeric if k not in _NOT_CURVES]
        bases = []
        for k in names:
            base = k[4:] if k.startswith("val_") and k[4:] in names else k
            if base not in bases:
                bases.append(base)
    else:
        bases = list(metrics)
        unknown = [b for b in bases if b not in numeric and f"val_{b}" not in numeric]
        if unknown:
            raise KeyError(f"the history has no {unknown} (it has {list(frame.columns)})")
    return [(b, [k for k in (b, f"val_{b}") if k in numeric]) for b in bases]


def plot_history(history: Optional[Dict[str, Sequence]], metrics: Optional[Sequence[str]] = None,
                 *, title: Optional[str] = None, figsize=None):
    """Draws the training curves; returns the ``matplotlib.figure.Figure``.

    Args:
        history: a model's ``getHistory()`` (or anything :func:`history_frame` takes).
        metrics: the quantities to draw, one panel each with its ``val_`` twin (e.g.
            ``["loss", "mae"]``; ``"rows_per_s"`` may be named too). Default: every
            numeric one but ``rows_per_s``, loss first.
        title: the figure's title.
        figsize: matplotlib's ``(width, height)`` in inches; default 4 x 3 per panel.

    pyplot makes the figure (which sets up a Jupyter kernel's inline display of figures)
    and lets go of it at once: a notebook shows it once, as the cell's value (not again at
    the cell's end), ``plt.show()`` does not show it, and a driver that plots after every
    fit keeps no figures alive. Save it with ``fig.savefig(path)``; show it with
    ``IPython.display.display(fig)``.

    Raises:
        KeyError: a name in ``metrics`` is not in the history.
        ValueError: the history has no epochs.
    """
    import matplotlib.pyplot as plt

    frame = history_frame(history)
    if frame.empty:
        raise ValueError("the history has no epochs to plot")
    panels = _panels(frame, metrics)
    fig = plt.figure(figsize=figsize or (4 * max(len(panels), 1), 3), layout="constrained")
    plt.close(fig)
    axes = fig.subplots(1, max(len(panels), 1), squeeze=False)[0]
    epochs = frame.index.to_numpy()
    for ax, (name, keys) in zip(axes, panels):
        for key in keys:
            ax.plot(epochs, frame[key].to_numpy(), marker="o", markersize=3,
                    linestyle="--" if key.startswith("val_") and len(keys) > 1 else "-",
                    label=key)
        ax.set_xlabel("epoch")
        ax.set_title(name)
        if len(epochs) < 12:  # whole epochs only
            ax.set_xticks(epochs)
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    return fig
