"""User code the executors cannot import travels by value, decided on the driver.

The training spec (model, optimizer, losses, callbacks) and ``transform``'s predictor are
cloudpickled on the driver. cloudpickle pickles a class or function by reference (module
and name) unless it comes from ``__main__``, so a model class defined in the user's own
module (``from mymodels import Net`` beside the script, or a folder the program put on
``sys.path``) loads on the workers only where that module is importable: elsewhere every
worker fails with ``ModuleNotFoundError`` after the data was prepared and the job
launched. :func:`dumps_for_workers` pickles once while recording the modules the pickle
refers to, and pickles again with those the executors lack registered by value
(``cloudpickle.register_pickle_by_value``, for this call only).

Which modules the executors lack is decided here, without asking them: a module is
shipped when its top-level package was imported from a folder that is not part of the
Python installation (not under ``sys.prefix`` / ``sys.base_prefix``, not in a folder named
``site-packages`` or ``dist-packages`` wherever it is, nor a folder a ``.pth`` file in one
adds, not found by an installed import hook such as an editable install's). Those are the
script's folder, the working directory, ``PYTHONPATH`` and ``sys.path`` entries the
program added: things a cluster's executors do not have. On a local master the executors
may still import some of them (the working directory); shipping those too only costs their
pickled size. A ``site-packages`` folder outside the installation is one that some set-up
put on the path (a cluster's or notebook's libraries, ``site.addsitedir``): what is there
was installed, and clusters install it on every node.

A module that cannot be pickled by value (a function of it uses an unpicklable module
global) keeps travelling by reference, with a one-line note naming it.
"""

from __future__ import annotations

import functools
import importlib.machinery
import io
import os
import site
import sys
import sysconfig
import types
from typing import Any, FrozenSet, List, Set

__all__ = ["dumps_for_workers", "executors_lack", "modules_referenced"]

# Never by value: what every executor must have installed anyway.
_ALWAYS_INSTALLED = frozenset({"spark_dl", "pyspark", "py4j", "cloudpickle", "__main__"})

#: Rounds of "pickle, register what is missing": a module shipped by value may refer to
#: another user module, found in the next round.
_ROUNDS = 4


def _cloudpickle():
    import cloudpickle

    return cloudpickle


def _recording_pickler_class():
    cloudpickle = _cloudpickle()

    class Recorder(cloudpickle.Pickler):
        """cloudpickle's pickler, noting the module of each class, function and module
        it meets (those it pickles by reference name their module in the pickle)."""

        def __init__(self, file):
            super().__init__(file, protocol=cloudpickle.DEFAULT_PROTOCOL)
            self.modules: Set[str] = set()

        def reducer_override(self, obj):
            if isinstance(obj, types.ModuleType):
                self.modules.add(obj.__name__)
            elif isinstance(obj, (type, types.FunctionType)):
                module = getattr(obj, "__module__", None)
                if isinstance(module, str):
                    self.modules.add(module)
            return super().reducer_override(obj)

    return Recorder


def modules_referenced(obj: Any) -> tuple:
    """``(pickle bytes, names of the modules it names)`` of ``obj`` by cloudpickle."""
    buffer = io.BytesIO()
    pickler = _recording_pickler_class()(buffer)
    pickler.dump(obj)
    return buffer.getvalue(), pickler.modules


@functools.lru_cache(maxsize=1)
def _install_dirs() -> FrozenSet[str]:
    """Folders of the Python installation: prefixes, site-packages, stdlib, and the
    folders ``.pth`` files in site-packages add (legacy editable installs)."""
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    roots.update(v for v in sysconfig.get_paths().values() if v)
    sites = list(getattr(site, "getsitepackages", lambda: [])())
    user = getattr(site, "getusersitepackages", lambda: None)()
    if isinstance(user, str):
        sites.append(user)
    roots.update(sites)
    for folder in sites:
        try:
            names = [n for n in os.listdir(folder) if n.endswith(".pth")]
        except OSError:
            continue
        for name in names:
            try:
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    lines = f.read().splitlines()
            except (OSError, UnicodeDecodeError):
                continue
            for line in lines:
                line = line.strip()
                if line and not line.startswith(("#", "import ", "import\t")):
                    roots.add(os.path.join(folder, line))
    return frozenset(os.path.realpath(r) for r in roots)


_PACKAGE_DIRS = ("site-packages", "dist-packages")


def _under(path: str, roots) -> bool:
    path = os.path.realpath(path)
    return any(path == r or path.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def _installed_at(path: str) -> bool:
    """Whether ``path`` is part of a Python installation (see the module doc)."""
    parts = os.path.realpath(path).split(os.sep)
    return any(p in _PACKAGE_DIRS for p in parts) or _under(path, _install_dirs())


def _found_by_import_hook(name: str) -> bool:
    """Whether an installed meta-path finder other than the plain path search finds
    ``name`` (editable installs redirect through one)."""
    for finder in sys.meta_path:
        if finder is importlib.machinery.PathFinder or isinstance(finder, type):
            continue  # the path search itself, and the built-in/frozen importers
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            if find(name, None) is not None:
                return True
        except Exception:
            continue
    return False


def executors_lack(module_name: str) -> bool:
    """Whether ``module_name``'s top-level package came from a folder outside the Python
    installation, so that executors are not expected to import it (see the module doc)."""
    top = module_name.partition(".")[0]
    if top in _ALWAYS_INSTALLED or top in sys.builtin_module_names or \
            top in getattr(sys, "stdlib_module_names", ()):
        return False
    module = sys.modules.get(top)
    spec = getattr(module, "__spec__", None)
    if module is None or spec is None:
        return False
    if spec.submodule_search_locations:
        places = [os.path.dirname(p.rstrip(os.sep)) for p in spec.submodule_search_locations]
    elif spec.origin and os.path.isabs(spec.origin):
        places = [os.path.dirname(spec.origin)]
    else:
        return False  # built-in, frozen, or made at run time: nothing to judge by
    if any(_installed_at(p) for p in places):
        return False
    return not _found_by_import_hook(top)


def dumps_for_workers(obj: Any) -> bytes:
    """cloudpickle of ``obj`` in which the modules executors lack (:func:`executors_lack`)
    travel by value. Registrations made here are undone before returning; the user's own
    ``register_pickle_by_value`` calls are kept."""
    cloudpickle = _cloudpickle()
    blob, modules = modules_referenced(obj)
    registered: List[str] = []
    try:
        for _ in range(_ROUNDS):
            already = set(cloudpickle.list_registry_pickle_by_value())
            new = sorted({m.partition(".")[0] for m in modules if executors_lack(m)} -
                         already)
            if not new:
                break
            for top in new:
                cloudpickle.register_pickle_by_value(sys.modules[top])
                registered.append(top)
            try:
                blob, modules = modules_referenced(obj)
            except Exception as e:
                shown = ", ".join(registered)
                print(f"spark_dl: module(s) {shown} cannot travel to the workers by value "
                      f"({type(e).__name__}: {e}); the workers must import them: install "
                      "them there (spark.archives, --py-files or SparkContext.addPyFile)",
                      file=sys.stderr, flush=True)
                for top in registered:
                    cloudpickle.unregister_pickle_by_value(sys.modules[top])
                registered.clear()
                return modules_referenced(obj)[0]
        return blob
    finally:
        for top in registered:
            if top in sys.modules:
                cloudpickle.unregister_pickle_by_value(sys.modules[top])
