"""How the function, its arguments and the results travel: cloudpickle.

cloudpickle (a dependency of spark_dl) pickles closures, lambdas and functions defined in
``__main__`` by value; pyspark's bundled copy is the fallback where it is missing. Driver
and executors must run the same Python environment (``PYSPARK_PYTHON``): a function
pickled by one cloudpickle version may not load with another, and :func:`describe`
lets the worker say which versions met. When something cannot be pickled,
:func:`dumps_or_explain` names the part that fails by its path from the function (a
closure variable, a global it uses, an attribute of one of those), for ``spark.run`` and
for the estimators' training specs alike.
"""

from __future__ import annotations

import functools
import itertools
import sys
import types
from typing import Any, Iterator, Optional, Tuple

__all__ = ["pickler", "describe", "find_unpicklable", "dumps_or_explain",
           "dumps_call"]


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


# How deep and how wide find_unpicklable looks (it runs only after a failure).
_MAX_DEPTH = 8
_MAX_CHILDREN = 256


def _children(obj: Any, path: str) -> Iterator[Tuple[str, Any]]:
    """The parts ``obj`` is pickled from, with the path that names each."""
    if isinstance(obj, types.FunctionType):
        code = obj.__code__
        for var, cell in zip(code.co_freevars, obj.__closure__ or ()):
            try:
                yield var, cell.cell_contents  # a closure variable: its own name
            except ValueError:  # an empty cell
                continue
        for name in code.co_names:
            if name in obj.__globals__:
                yield name, obj.__globals__[name]  # a global the function uses
        for i, value in enumerate(obj.__defaults__ or ()):
            yield f"{path}.__defaults__[{i}]", value
        for key, value in (obj.__kwdefaults__ or {}).items():
            yield f"{path}.__kwdefaults__[{key!r}]", value
    elif isinstance(obj, types.MethodType):
        yield f"{path}.__self__", obj.__self__
        yield f"{path}.__func__", obj.__func__
    elif isinstance(obj, functools.partial):
        yield f"{path}.func", obj.func
        for i, value in enumerate(obj.args):
            yield f"{path}.args[{i}]", value
        for key, value in obj.keywords.items():
            yield f"{path}.keywords[{key!r}]", value
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield f"{path}[{key!r}]", value
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for i, value in enumerate(obj):
            yield f"{path}[{i}]", value
    else:
        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict):
            for key, value in attrs.items():
                yield f"{path}.{key}", value
        for slot in getattr(type(obj), "__slots__", ()):
            if isinstance(slot, str) and hasattr(obj, slot):
                yield f"{path}.{slot}", getattr(obj, slot)


def find_unpicklable(obj: Any, path: str) -> Optional[Tuple[str, Any, Exception]]:
    """Where ``obj`` fails to pickle: ``(path, part, error)`` for the innermost part that
    cannot be pickled although everything it holds can (e.g. ``state.lock`` for a closure
    variable ``state`` whose attribute ``lock`` is a ``threading.Lock``); None if ``obj``
    pickles.

    Paths name closure variables and globals a function uses by their own names, then
    attributes (``.x``), items (``[0]``, ``['k']``) and a method's ``__self__``.
    """
    dumps = pickler().dumps
    try:
        dumps(obj)
        return None
    except Exception as exc:  # cloudpickle raises TypeError, PicklingError, ...
        error = exc
    seen = {id(obj)}
    for _depth in range(_MAX_DEPTH):
        for child_path, child in itertools.islice(_children(obj, path), _MAX_CHILDREN):
            if id(child) in seen:
                continue
            seen.add(id(child))
            try:
                dumps(child)
            except Exception as exc:
                obj, path, error = child, child_path, exc
                break
        else:
            break  # every part pickles: obj itself is the culprit
    return path, obj, error


def dumps_or_explain(obj: Any, path: str, what: str) -> bytes:
    """cloudpickle of ``obj``; on failure a TypeError naming the unpicklable part.

    Args:
        obj: what to pickle.
        path: how the message names ``obj`` (``"fn"``, ``"args[0]"``, a param's name).
        what: what ``obj`` is, for the message (``"the function train"``).
    """
    try:
        return pickler().dumps(obj)
    except Exception as first:
        found = find_unpicklable(obj, path) or (path, obj, first)
        where, part, error = found
        kind = type(part)
        kind = kind.__qualname__ if kind.__module__ == "builtins" else \
            f"{kind.__module__}.{kind.__qualname__}"
        inside = "" if where == path else f": {where} is a {kind} object"
        raise TypeError(
            f"{what} cannot be sent to the workers{inside} that cannot be pickled "
            f"({type(error).__name__}: {error}). Define classes and functions at module "
            "level (in the main script or an importable module), and create objects "
            "holding locks, open files, sockets, threads or a SparkContext inside the "
            "function instead of capturing them") from first


def dumps_call(fn: Any, args: tuple, kwargs: dict, caller: str) -> bytes:
    """cloudpickle of ``(fn, args, kwargs)``; on failure a TypeError naming the function
    (or argument) and the path to what cannot be pickled (see :func:`dumps_or_explain`)."""
    try:
        return pickler().dumps((fn, args, kwargs))
    except Exception:
        name = getattr(fn, "__qualname__", None) or repr(fn)
        dumps_or_explain(fn, name, f"{caller}: the function {name}")
        for i, value in enumerate(args):
            dumps_or_explain(value, f"args[{i}]", f"{caller}: argument {i} of {name}")
        for key, value in kwargs.items():
            dumps_or_explain(value, key, f"{caller}: keyword argument {key!r} of {name}")
        raise
