"""How the function, its arguments and the results travel: cloudpickle.

cloudpickle (a dependency of spark_dl) pickles closures, lambdas and functions defined in
``__main__`` by value; pyspark's bundled copy is the fallback where it is missing. Driver
and executors must run the same Python environment (``PYSPARK_PYTHON``): a function
pickled by one cloudpickle version may not load with another, and :func:`describe`
lets the worker say which versions met.
"""

from __future__ import annotations

import sys

__all__ = ["pickler", "describe"]


def pickler():
    """The cloudpickle module in use (``dumps``/``loads``)."""
    try:
        import cloudpickle
    except ImportError:  # executors always have pyspark's copy
        from pyspark import cloudpickle
    return cloudpickle


def describe() -> str:
    """``cloudpickle 3.1.2 under /usr/bin/python3.11`` (for error messages)."""
    module = pickler()
    version = getattr(module, "__version__", "?")
    return f"{module.__name__} {version} under {sys.executable}"
