"""PyTorch Lightning 2.x on spark_dl: :class:`SparkDLStrategy`.

::

    from lightning.pytorch import Trainer          # or: from pytorch_lightning import Trainer
    from spark_dl.lightning import SparkDLStrategy

    trainer = Trainer(strategy=SparkDLStrategy(), accelerator="cpu", max_epochs=5)
    trainer.fit(module, train_loader)

run with ``sdlrun -np 4 python train.py`` or inside ``spark_dl.spark.run``. The class is
built for the Lightning package the program imported (``lightning.pytorch`` or
``pytorch_lightning``: import it first; :func:`strategy_class` picks one explicitly). See
docs/lightning.md.
"""

__all__ = ["SparkDLStrategy", "strategy_class", "metric_kwargs", "gather_all_tensors"]


def __getattr__(name):
    if name == "SparkDLStrategy":
        from spark_dl.lightning.strategy import strategy_class

        return strategy_class()
    if name == "strategy_class":
        from spark_dl.lightning.strategy import strategy_class

        return strategy_class
    if name in ("metric_kwargs", "gather_all_tensors"):
        from spark_dl.lightning import metrics

        return getattr(metrics, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
