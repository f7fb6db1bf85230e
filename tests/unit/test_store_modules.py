"""The store modules import in one direction and keep the public names of
``spark_dl.spark.common.store``.

Order: ``store`` (public face) -> ``store_databricks`` / ``store_hdfs`` -> ``store_filesystem``
-> ``store_base`` -> ``remote_store``. Unlike tests/unit/test_import_layers.py, which lets
``if TYPE_CHECKING:`` imports close a circle, no import of any kind may point back here.
"""

import ast
import os
import pickle
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = "spark_dl.spark.common"
COMMON = os.path.join(ROOT, *PACKAGE.split("."))
STORE_MODULES = sorted(name[:-len(".py")] for name in os.listdir(COMMON)
                       if name.endswith(".py") and (name.startswith("store")
                                                    or name == "remote_store.py"))


def _store_imports(module: str):
    """The store modules that ``module`` imports anywhere in its file (module level, inside
    functions, under ``if TYPE_CHECKING:``)."""
    with open(os.path.join(COMMON, module + ".py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module if not node.level else f"{PACKAGE}.{node.module}"
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(name[len(PACKAGE) + 1:] for name in names
                     if name.startswith(PACKAGE + ".")
                     and name[len(PACKAGE) + 1:] in STORE_MODULES)
    return found - {module}


GRAPH = {module: _store_imports(module) for module in STORE_MODULES}


def _fresh_python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)


def test_the_split_is_there():
    assert {"store", "store_base", "store_filesystem", "store_hdfs", "store_databricks",
            "remote_store"} <= set(STORE_MODULES)
    assert "store_base" in GRAPH["store_filesystem"]  # the parse sees the edges


def test_no_cycle_among_the_store_modules():
    order, state = [], {}

    def visit(module, path):
        if state.get(module) == "done":
            return
        assert state.get(module) != "open", "import cycle: " + " -> ".join(path + [module])
        state[module] = "open"
        for target in sorted(GRAPH[module]):
            visit(target, path + [module])
        state[module] = "done"
        order.append(module)

    for module in STORE_MODULES:
        visit(module, [])
    assert GRAPH["remote_store"] == set(), "remote_store must import no store module"
    assert GRAPH["store_base"] <= {"remote_store", "store_cleanup"}, \
        "the abstract Store must not name its implementations"
    assert not any("store" in GRAPH[m] for m in STORE_MODULES if m != "store"), \
        "only users import the public face"


@pytest.mark.parametrize("first", ["remote_store", "store", "store_base", "store_filesystem",
                                   "store_databricks", "store_hdfs"])
def test_any_store_module_imports_first_in_a_fresh_interpreter(first):
    code = (f"import {PACKAGE}.{first}\n"
            f"from {PACKAGE}.store import Store, VolumesLocalStore\n"
            f"print(type(Store.create('/Volumes/c/s/v')).__name__)\n")
    out = _fresh_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "VolumesLocalStore"


def test_create_without_the_public_module_names_it():
    # A worker that unpickled a LocalStore has imported store_filesystem only.
    code = (f"from {PACKAGE}.store_filesystem import LocalStore\n"
            f"LocalStore.create('/tmp/x')\n")
    out = _fresh_python(code)
    assert out.returncode != 0
    assert "RuntimeError: Store.create has no implementations" in out.stderr
    assert f"{PACKAGE}.store" in out.stderr


def test_public_names_stay_importable_from_store():
    from spark_dl.spark.common import store
    from spark_dl.spark.common.remote_store import RemoteStore
    from spark_dl.spark.common.store_cleanup import CleanupReport

    for name in store.__all__:
        assert getattr(store, name) is not None, name
    assert {"Store", "LocalStore", "FilesystemStore", "HDFSStore", "DBFSLocalStore",
            "VolumesLocalStore", "StoreCapabilities", "CleanupReport",
            "RemoteStore"} <= set(store.__all__)
    assert store.RemoteStore is RemoteStore and store.CleanupReport is CleanupReport
    for name in ["LocalStore", "FilesystemStore", "HDFSStore", "DBFSLocalStore",
                 "VolumesLocalStore"]:
        assert issubclass(getattr(store, name), store.Store), name


def test_a_store_pickled_before_the_split_still_loads(tmp_path):
    """Pickles made when every class lived in ``store`` name ``store.LocalStore``; the
    re-export resolves them. Protocol 0 writes module names as text lines, so the old
    pickle can be made by renaming the module in a new one."""
    from spark_dl.spark.common.store import LocalStore

    st = LocalStore(str(tmp_path))
    st.write("a", b"1")
    new = pickle.dumps(st.to_remote("r"), protocol=0)
    assert b"spark_dl.spark.common.store_filesystem\n" in new
    old = new.replace(b"spark_dl.spark.common.store_filesystem\n",
                      b"spark_dl.spark.common.store\n")
    remote = pickle.loads(old)
    assert type(remote.store) is LocalStore and remote.read("a") == b"1"
