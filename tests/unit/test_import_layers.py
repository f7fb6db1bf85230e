"""The package's import graph respects its layers and has no cycles.

Every module of ``spark_dl`` is parsed (not imported) with :mod:`ast`; its imports, at
module level and inside functions alike, plus ``importlib.import_module("...")`` calls
with a literal name, are the edges of the module graph. Two rules:

(a) a module imports only its own group or groups of strictly lower layers
    (:data:`LAYERS`: groups of one layer are peers and do not import each other);
(b) the graph has no cycles (a function-level import that closes a circle counts too:
    it only hides the circle from the interpreter, not from the reader). Imports under
    ``if TYPE_CHECKING:`` never run, so they count for (a) but not for (b).

An import of a ``spark_dl`` module that does not exist fails too (a stale path after a
move). Exceptions go into :data:`ALLOWED` with a comment saying why; keep it short.
"""

import ast
import os
from typing import Dict, List, Optional, Set, Tuple

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                    "spark_dl")

# Package prefix -> layer, bottom (0) to top. A module belongs to the longest prefix that
# equals its name or names a package above it.
LAYERS: Dict[str, int] = {
    "spark_dl._core": 0,             # the native extension
    "spark_dl._core_nompi": 0,       # the same without MPI (spark_dl.common.native picks)
    "spark_dl.config": 0,            # the knob table (stdlib only, no _core)
    "spark_dl.rendezvous": 1,        # rendezvous client, wire protocol, message auth
    "spark_dl.common": 2,            # framework-neutral runtime over _core
    "spark_dl.numpy": 3,             # framework bindings ...
    "spark_dl.torch": 3,
    "spark_dl.tensorflow": 3,        # TensorFlow ops (tf.function-safe) over DLPack
    "spark_dl.runner": 3,            # ... and sdlrun with the rendezvous server
    "spark_dl.keras": 4,             # Keras 3 over spark_dl.tensorflow or spark_dl.torch
    "spark_dl.lightning": 4,         # the Lightning strategy over spark_dl.torch
    "spark_dl.spark.launch": 4,      # spark_dl.spark.run: driver, tasks, services, MPI
    "spark_dl.spark.common": 5,      # the framework-neutral estimator layer
    "spark_dl.spark.torch": 6,       # per-framework estimators
    "spark_dl.spark.keras": 6,
    "spark_dl.spark.lightning": 7,   # Lightning's estimator reuses the torch one's losses
}

# Public names that only re-export from below (exact modules, not prefixes): the top.
FACADES: Dict[str, int] = {
    "spark_dl": 9,                   # the package itself
    "spark_dl.spark": 9,             # ``spark_dl.spark.run`` (lazy)
    "spark_dl.spark.task": 9,        # Horovod's name for get_available_devices
    "spark_dl.tensorflow.keras": 9,  # Horovod's path for spark_dl.keras
}

# (importer, imported) pairs exempt from both rules, each with the reason. Keep it short.
ALLOWED: Set[Tuple[str, str]] = {
    # Horovod's horovod.tensorflow names that are Keras objects: hvd.DistributedOptimizer
    # hands a Keras optimizer to the Keras wrapper, and SyncBatchNormalization is a Keras
    # layer (imported on first use). Both point up, at spark_dl.keras, for Horovod's API.
    ("spark_dl.tensorflow.optimizer", "spark_dl.keras"),
    ("spark_dl.tensorflow", "spark_dl.keras.sync_batch_norm"),
    # horovod.tensorflow.elastic.TensorFlowKerasState is a Keras state: the one of
    # spark_dl.keras.elastic (imported on first use).
    ("spark_dl.tensorflow.elastic", "spark_dl.keras.elastic"),
}


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(ROOT))[:-len(".py")]
    parts = rel.split(os.sep)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> Dict[str, str]:
    """Module name -> file, for every ``.py`` under ``spark_dl/``."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                found[_module_name(path)] = path
    return found


MODULES = _modules()
KNOWN = set(MODULES) | {"spark_dl._core", "spark_dl._core_nompi"}


def _in_package(target: str) -> bool:
    return target == "spark_dl" or target.startswith("spark_dl.")


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _typing_only_nodes(tree: ast.AST) -> Set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` bodies."""
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for stmt in node.body:
                inside.update(id(n) for n in ast.walk(stmt))
    return inside


def _imports(module: str, path: str) -> List[Tuple[str, int, bool]]:
    """(imported module, line, typing only) for every spark_dl import in one file."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    is_package = os.path.basename(path) == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    typing_only = _typing_only_nodes(tree)
    edges = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                edges.append((alias.name, node.lineno, id(node) in typing_only))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                # ``from pkg import mod`` imports the submodule; ``from mod import name``
                # imports the module.
                edges.append((sub if sub in KNOWN else source, node.lineno,
                              id(node) in typing_only))
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id == "import_module"))):
            edges.append((node.args[0].value, node.lineno, False))
    return [(t, line, typing) for t, line, typing in edges if _in_package(t)]


GRAPH: Dict[str, Dict[str, int]] = {}  # importer -> {imported: first line}
RUNTIME: Dict[str, Dict[str, int]] = {}  # the same without ``if TYPE_CHECKING:`` imports
for _name, _path in MODULES.items():
    GRAPH[_name], RUNTIME[_name] = {}, {}
    for _target, _line, _typing in sorted(_imports(_name, _path), key=lambda e: e[1]):
        GRAPH[_name].setdefault(_target, _line)
        if not _typing:
            RUNTIME[_name].setdefault(_target, _line)


def _group(module: str) -> Optional[Tuple[str, int]]:
    """(group, layer) of a module, or None when the tables do not place it."""
    if module in FACADES:
        return module, FACADES[module]
    best = None
    for prefix, layer in LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, layer)
    return best


def _where(importer: str, imported: str, graph: Dict[str, Dict[str, int]] = GRAPH) -> str:
    path = os.path.relpath(MODULES[importer], os.path.dirname(ROOT))
    return f"{path}:{graph[importer][imported]}"


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in KNOWN if _group(m) is None)
    assert not unplaced, (f"modules outside the layer table: {unplaced}; add their package "
                          f"to LAYERS in {__file__}")


def test_imports_name_existing_modules():
    stale = [f"{_where(a, b)}: {a} imports {b}, which is not a module of spark_dl"
             for a, targets in sorted(GRAPH.items()) for b in sorted(targets)
             if b not in KNOWN]
    assert not stale, "\n".join(stale)


def test_no_module_imports_a_higher_or_peer_layer():
    bad = []
    for importer, targets in sorted(GRAPH.items()):
        src = _group(importer)
        for imported in sorted(targets):
            dst = _group(imported)
            if src is None or dst is None or src[0] == dst[0] or (importer, imported) in ALLOWED:
                continue
            if dst[1] >= src[1]:
                kind = "a higher" if dst[1] > src[1] else "a peer"
                bad.append(f"{_where(importer, imported)}: {importer} (layer {src[1]}, "
                           f"{src[0]}) imports {imported} (layer {dst[1]}, {dst[0]}): {kind} "
                           f"layer")
    assert not bad, "imports against the layers (see LAYERS in this test):\n" + "\n".join(bad)


def _cycles() -> List[List[str]]:
    """One cycle path per strongly connected component of more than one module (Tarjan)."""
    graph = {a: sorted(b for b in targets if b in GRAPH and b != a and (a, b) not in ALLOWED)
             for a, targets in RUNTIME.items()}
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    components: List[List[str]] = []
    counter = [0]

    def connect(v: str) -> None:
        # Iterative Tarjan (the graph is small, but recursion depth is not ours to assume).
        work = [(v, iter(graph[v]))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        while work:
            node, children = work[-1]
            advanced = False
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(graph[w])))
                    advanced = True
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)

    paths = []
    for comp in components:
        members = set(comp)
        start = comp[0]
        # Shortest way back to ``start`` inside the component (breadth first).
        parents = {start: None}
        queue = [start]
        end = None
        while queue and end is None:
            node = queue.pop(0)
            for w in graph[node]:
                if w == start:
                    end = node
                    break
                if w in members and w not in parents:
                    parents[w] = node
                    queue.append(w)
        path = [start]
        node = end
        while node is not None and node != start:
            path.insert(1, node)
            node = parents[node]
        paths.append(path + [start])
    return paths


def test_no_import_cycles():
    cycles = _cycles()
    lines = []
    for path in cycles:
        steps = [f"{a} -> {b} ({_where(a, b, RUNTIME)})" for a, b in zip(path, path[1:])]
        lines.append(" -> ".join(path) + "\n    " + "\n    ".join(steps))
    assert not cycles, "import cycles:\n" + "\n".join(lines)


@pytest.mark.parametrize("module", ["spark_dl.torch", "spark_dl.numpy", "spark_dl.common"])
def test_framework_bindings_do_not_import_spark(module):
    reach, todo = set(), [m for m in GRAPH if m == module or m.startswith(module + ".")]
    while todo:
        m = todo.pop()
        if m in reach or m not in GRAPH:
            continue
        reach.add(m)
        todo.extend(GRAPH[m])
    spark = sorted(m for m in reach if m == "spark_dl.spark" or m.startswith("spark_dl.spark."))
    assert not spark, f"{module} reaches {spark} through its imports"


def test_the_tables_see_the_package():
    # A broken walk (wrong root) would pass every rule above vacuously.
    assert "spark_dl.common.basics" in GRAPH and "spark_dl.spark.launch.spark_run" in GRAPH
    assert "spark_dl.rendezvous.client" in GRAPH["spark_dl.common.basics"]


def test_public_names_survive_the_moves():
    import spark_dl.spark
    from spark_dl.spark.launch import errors, spark_run
    from spark_dl.spark.launch.task import devices
    from spark_dl.spark.task import get_available_devices  # Horovod's module name

    assert get_available_devices is devices.get_available_devices
    assert spark_dl.spark.run is spark_run.run
    assert issubclass(errors.WorkerFailedError, errors.RunError)
    assert issubclass(errors.NotEnoughSlotsError, errors.RunError)
