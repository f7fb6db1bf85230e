"""Horovod's "legacy" Lightning path: a plain ``torch.nn.Module`` trained with the
estimator's ``optimizer`` and ``loss``.

:func:`wrap` puts the module inside a small LightningModule whose ``forward`` calls it; the
estimator then gives that wrapper its steps and ``configure_optimizers`` from ``loss`` and
``optimizer`` (:func:`~spark_dl.spark.lightning.util.install_default_steps`), as for any
LightningModule that does not define them. The optimizer stays bound to the module's
parameters, which are the wrapper's. The fitted :class:`~spark_dl.spark.lightning.LightningModel`
holds the plain module again (:func:`unwrap`), as Horovod's ``TorchModel`` does.

Lightning's two distributions have separate class trees, so there is one wrapper class per
package, made on first use and kept in this module's namespace under a fixed name
(:data:`CLASS_NAMES`): pickle finds it by that name on the workers.
"""

import importlib
import sys
from typing import Dict

import torch

from spark_dl.spark.lightning.util import PACKAGES

__all__ = ["wrap", "unwrap", "is_wrapper", "wrapper_class", "package_for", "CLASS_NAMES"]

#: Lightning package -> name of its wrapper class in this module.
CLASS_NAMES: Dict[str, str] = {
    "lightning.pytorch": "WrappedModule_lightning",
    "pytorch_lightning": "WrappedModule_pytorch_lightning",
}


def wrapper_class(package: str):
    """The wrapper LightningModule class of ``package`` (made once per process)."""
    name = CLASS_NAMES[package]
    cls = globals().get(name)
    if cls is None:
        pl = importlib.import_module(package)

        def __init__(self, module: torch.nn.Module):
            pl.LightningModule.__init__(self)
            self.module = module

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

        cls = type(name, (pl.LightningModule,), {
            "__init__": __init__, "forward": forward, "__module__": __name__,
            "__qualname__": name,
            "__doc__": "A plain torch.nn.Module as a LightningModule (see the module doc)."})
        globals()[name] = cls
    return cls


def __getattr__(name):
    # Unpickling a wrapper in a fresh process asks for its class by name.
    for package, class_name in CLASS_NAMES.items():
        if name == class_name:
            return wrapper_class(package)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def package_for(*objects) -> str:
    """The Lightning package to wrap with: that of the first Lightning object among
    ``objects`` (callbacks, logger ...), else one already imported (``lightning.pytorch``
    first), else the first importable one."""
    for obj in objects:
        root = type(obj).__module__ or ""
        for package in PACKAGES:
            if root == package or root.startswith(package + "."):
                return package
    for package in PACKAGES:
        if package in sys.modules:
            return package
    for package in PACKAGES:
        try:
            importlib.import_module(package)
            return package
        except ImportError:
            continue
    raise ImportError("Lightning is not installed: pip install lightning")


def wrap(module: torch.nn.Module, package: str):
    """``module`` inside a LightningModule of ``package``."""
    return wrapper_class(package)(module)


def is_wrapper(module) -> bool:
    return type(module).__name__ in CLASS_NAMES.values() and \
        type(module).__module__ == __name__


def unwrap(module):
    """The plain module inside a wrapper; any other module as it is."""
    return module.module if is_wrapper(module) else module
