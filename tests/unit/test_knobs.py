"""One knob table for the core and the launchers, one value grammar on both sides.

- the table (``spark_dl/config/knobs.json``) holds the launchers' settings, and each
  default is the one every reader uses;
- the C++ parser (``_core.parse_knob``) and the Python parser agree on values and on
  rejections, string by string, for every type; a bad value names its variable (and
  fails ``init()``: ``test_core_single``);
- the core was built from the same table (its rows equal the file's core rows);
- every environment read in the package is a knob's variable or a declared launcher or
  platform input (found with :mod:`ast`, not by running anything).
"""

import ast
import os
import subprocess
import sys

import pytest

from spark_dl.config import knobs

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "spark_dl")
DOCS = os.path.join(os.path.dirname(PACKAGE), "docs", "core.md")


@pytest.fixture
def clean_env(monkeypatch):
    for k in knobs.table().values():
        for var in filter(None, (k.env, k.fallback_env)):
            monkeypatch.delenv(var, raising=False)
    return monkeypatch


# --- the table -----------------------------------------------------------------------------

def test_table_holds_the_launcher_settings():
    t = knobs.table()
    assert t["start_timeout_s"].env == "SDL_START_TIMEOUT"
    assert t["start_timeout_s"].type == "duration" and t["start_timeout_s"].scope == "both"
    spark = t["spark_start_timeout_s"]
    assert (spark.env, spark.fallback_env, spark.scope) == (
        "SDL_SPARK_START_TIMEOUT", "HOROVOD_SPARK_START_TIMEOUT", "launcher")
    assert t["controller"].type == "enum" and t["controller"].choices == ("auto", "gloo", "mpi")
    assert {k.type for k in t.values()} <= set(knobs.TYPES)


def test_reading_the_table_does_not_load_the_core():
    code = ("import sys; from spark_dl.config import knobs; import spark_dl.runner.launch; "
            "knobs.value('start_timeout_s'); assert 'spark_dl._core' not in sys.modules, "
            "sorted(m for m in sys.modules if m.startswith('spark_dl'))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr


def test_defaults_agree_everywhere(clean_env):
    from spark_dl.rendezvous.client import client_from_env
    from spark_dl.runner.launch import make_parser
    from spark_dl.runner.options import LaunchOptions
    from spark_dl.spark.launch.spark_run import _start_timeout

    start = knobs.table()["start_timeout_s"].default
    assert LaunchOptions().start_timeout == start
    assert make_parser().parse_args(["-np", "1", "true"]).start_timeout is None  # -> the knob
    client = client_from_env({"SDL_RENDEZVOUS_ADDR": "127.0.0.1", "SDL_RENDEZVOUS_PORT": "1",
                              "SDL_SECRET_KEY": "00" * 32})
    assert client.timeout == start
    assert _start_timeout(None) == knobs.table()["spark_start_timeout_s"].default


def test_launchers_read_their_settings_from_the_knobs(clean_env):
    from spark_dl.runner.launch import choose_controller
    from spark_dl.runner.options import LaunchOptions

    clean_env.setenv("SDL_START_TIMEOUT", "2m")
    assert LaunchOptions().start_timeout == 120.0
    assert LaunchOptions(start_timeout=5).start_timeout == 5
    assert choose_controller("auto", {"SDL_CONTROLLER": " Gloo "})[0] == "gloo"
    with pytest.raises(ValueError, match="SDL_CONTROLLER=nccl: expected one of auto, gloo, mpi"):
        choose_controller("auto", {"SDL_CONTROLLER": "nccl"})
    clean_env.setenv("SDL_START_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="SDL_START_TIMEOUT=soon: expected a duration"):
        LaunchOptions()


def test_fallback_variable(clean_env):
    read = knobs.table()["spark_start_timeout_s"].read
    assert read({"HOROVOD_SPARK_START_TIMEOUT": "7"}) == 7.0
    assert read({"SDL_SPARK_START_TIMEOUT": "1m", "HOROVOD_SPARK_START_TIMEOUT": "7"}) == 60.0
    assert read({"SDL_SPARK_START_TIMEOUT": " ", "HOROVOD_SPARK_START_TIMEOUT": "7"}) == 7.0
    with pytest.raises(ValueError, match="^HOROVOD_SPARK_START_TIMEOUT=x: expected a duration"):
        read({"HOROVOD_SPARK_START_TIMEOUT": "x"})


def test_misspelled_names_near_misses_and_renamed_variables_only():
    env = {"SDL_FUSION_TRESHOLD": "0", "SDL_CYCLETIME": "1", "SDL_STALL_WARNING": "5",
           "SDL_FUSION_THRESHOLD": "0", "HOROVOD_TIMELINE": "t.json", "SDL_GPU_CHECK_OUT": "x",
           "SDL_TEST_HOSTS": "a", "SDL_RANK": "0", "PATH": "/bin"}
    assert knobs.misspelled(env) == {"SDL_FUSION_TRESHOLD": "SDL_FUSION_THRESHOLD",
                                     "SDL_CYCLETIME": "SDL_CYCLE_TIME",
                                     "SDL_STALL_WARNING": "SDL_STALL_CHECK_TIME"}
    for old, new in knobs.RENAMED.items():
        assert new in {k.env for k in knobs.table().values()} and old not in knobs.LAUNCHER_INPUTS


def test_docs_carry_the_tables():
    with open(DOCS, encoding="utf-8") as f:
        text = f.read()
    hint = "python -c 'from spark_dl.config import knobs; print(knobs.{}())'"
    assert knobs.describe() in text, (
        f"docs/core.md's knob table is stale: paste {hint.format('describe')}")
    assert knobs.describe_inputs() in text, (
        f"docs/core.md's launcher inputs are stale: paste {hint.format('describe_inputs')}")


# --- the grammar on both sides -------------------------------------------------------------

CASES = {
    "bool": ["1", "0", "true", "FALSE", " Yes ", "no", "on", "OFF", "\ttrue\n", "maybe", "2",
             "t", "y", "truee", "on off", "-1", "1.0", "", "  ", "\u0131"],
    "int": ["0", "42", "-7", "+5", " 12 ", "007", "-0", "9223372036854775807",
            "-9223372036854775808", "9223372036854775808", "-9223372036854775809", "1e3",
            "1.0", "0x10", "1_000", "abc", "--1", "+-1", "+", "-", "1 2", "\uff11", ""],
    "double": ["1", "1.5", "-2.5", "+3", ".5", "5.", "1e3", "1E-3", "1.e3", "-0", "0e-400",
               "1e308", "1.7976931348623157e308", "4.9e-324", "2.5e-324", "1e309",
               "1.7976931348623159e308", "1e-400", "inf", "nan", "-inf", "infinity",
               "0x1p3", "1_0", "e3", ".", "1e", "1e+", "--1", "1.5.2", "\uff11", " 2.5 ",
               "1 ", "1d", ""],
    "duration": ["30", "1.5", "0", "500ms", "30s", "2m", "1h", "1.5 s", " 2 m ", "1e3ms",
                 ".5h", "0.001ms", "5e-324ms", "1e308", "-1", "+1", "1 d", "30 S", "1M", "ms",
                 "s", "1sec", "1e309", "1e308h", "1hh", "1 s s", "1e-400s", "1em", "1e", ""],
    "string": ["eth0", "  lo  ", "a b", "x=y", ""],
    "enum": ["auto", "gloo", "MPI", " Gloo ", "nccl", "mpi gloo", "gloo,mpi", "\uff41uto", ""],
}


def _core_knob_of_type(type_):
    return next(k for k in knobs.table().values() if k.type == type_ and k.scope != "launcher")


def _outcome(parse, text):
    try:
        v = parse(text)
    except ValueError as e:
        return "error", str(e)
    return type(v).__name__, repr(v)


@pytest.mark.parametrize("type_", knobs.TYPES)
def test_cpp_and_python_parsers_agree(type_):
    _core = pytest.importorskip("spark_dl._core")
    knob = _core_knob_of_type(type_)
    results = [(text, _outcome(knob.parse, text),
                _outcome(lambda t: _core.parse_knob(knob.name, t), text))
               for text in CASES[type_]]
    differ = [(text, py, cpp) for text, py, cpp in results if py != cpp]
    assert not differ, f"{knob.env}: (text, Python, C++) that differ: {differ}"
    # The list exercises both outcomes, and every rejection names the variable.
    outcomes = {py[0] for _, py, _ in results}
    assert "error" in outcomes or type_ == "string"
    assert len(outcomes - {"error"}) == 1
    for text, (kind, message), _ in results:
        if kind == "error":
            assert message.startswith(f"{knob.env}={text}: expected "), message


def test_grammar_examples():
    p = knobs.parse
    assert p("duration", "500ms", "X") == 0.5 and p("duration", "1h", "X") == 3600.0
    assert p("duration", " 1.5 s", "X") == 1.5 and p("duration", "2", "X") == 2.0
    assert p("bool", " On ", "X") is True and p("enum", "MPI", "X", ("auto", "mpi")) == "mpi"
    assert p("int", "", "X") is None  # blank: unset
    with pytest.raises(ValueError, match=r"^X=maybe: expected a boolean"):
        p("bool", "maybe", "X")


def test_the_core_was_built_from_this_table():
    _core = pytest.importorskip("spark_dl._core")
    built = {row["name"]: row for row in _core.knob_table()}
    want = {k.name: k for k in knobs.table().values() if k.scope != "launcher"}
    assert list(built) == list(want), "rebuild the core: its knob rows are not the table's"
    for name, k in want.items():
        row = built[name]
        assert (row["env"], row["type"], row["tunable"], row["doc"]) == (
            k.env, k.type, k.tunable, k.doc), name
        assert row["choices"] == "|".join(k.choices), name
        assert row["fallback_env"] == (k.fallback_env or ""), name
        assert k.parse(row["default"]) == k.default, name


# --- every environment read is declared ----------------------------------------------------

# The table's own reader: it reads the variables the table names.
_READERS = {os.path.join("config", "knobs.py")}


class _Module:
    """One source file: its module-level string constants and imported names."""

    def __init__(self, path):
        self.path = path
        with open(path, encoding="utf-8") as f:
            self.tree = ast.parse(f.read(), filename=path)
        self.constants = {}
        self.imports = {}
        for node in self.tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                    and isinstance(node.targets[0], ast.Name):
                self.constants[node.targets[0].id] = node.value
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                    and node.value is not None:
                self.constants[node.target.id] = node.value
        for node in ast.walk(self.tree):  # function-level imports too
            if isinstance(node, ast.ImportFrom) and node.module \
                    and node.module.startswith("spark_dl"):
                for alias in node.names:
                    self.imports[alias.asname or alias.name] = (node.module, alias.name)
        self.parents = {}
        for parent in ast.walk(self.tree):
            for child in ast.iter_child_nodes(parent):
                self.parents[child] = parent


_MODULES = {}


def _module(name):
    path = os.path.join(os.path.dirname(PACKAGE), *name.split("."))
    path = path + ".py" if os.path.isfile(path + ".py") else os.path.join(path, "__init__.py")
    if path not in _MODULES:
        _MODULES[path] = _Module(path)
    return _MODULES[path]


def _bindings(mod, node, name):
    """Expressions that a local ``name`` visible at ``node`` iterates over or is assigned
    (inside the enclosing function; module-level names are constants, see :func:`_names`)."""
    scope = node
    while not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        if isinstance(scope, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            own = [g.iter for g in scope.generators
                   if any(isinstance(t, ast.Name) and t.id == name for t in ast.walk(g.target))]
            if own:  # a comprehension's variable is its own
                return own
        if scope not in mod.parents:
            return []
        scope = mod.parents[scope]
    found = []
    for n in ast.walk(scope):
        if isinstance(n, ast.For):  # (comprehension variables stay in theirs, see above)
            if any(isinstance(t, ast.Name) and t.id == name for t in ast.walk(n.target)):
                found.append(n.iter)
        elif isinstance(n, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in n.targets):
            found.append(n.value)
    return found


def _names(mod, node, depth=0):
    """The variable names an expression can stand for, or None when it cannot be told."""
    if depth > 20:
        return None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        parts = [_names(mod, e, depth + 1) for e in node.elts]
    elif isinstance(node, ast.Dict):  # a table of variables: its values name them
        parts = [_names(mod, v, depth + 1) for v in node.values]
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr in ("items", "values"):
        return _names(mod, node.func.value, depth + 1)
    elif isinstance(node, ast.Name):
        bound = _bindings(mod, node, node.id)
        if bound:
            parts = [_names(mod, b, depth + 1) for b in bound]
        elif node.id in mod.constants:
            return _names(mod, mod.constants[node.id], depth + 1)
        elif node.id in mod.imports:
            source, name = mod.imports[node.id]
            other = _module(source)
            return _names(other, other.constants[name], depth + 1) \
                if name in other.constants else None
        else:
            return None
    else:
        return None
    if any(p is None for p in parts):
        return None
    return set().union(*parts)


def _is_environ(node):
    return any((isinstance(n, ast.Name) and n.id == "environ")
               or (isinstance(n, ast.Attribute) and n.attr == "environ") for n in ast.walk(node))


def _reads(tree):
    """(line, key expression) of every environment read: ``environ[k]``, ``environ.get(k)``,
    ``environ.pop(k)``, ``k in environ``, ``os.getenv(k)``."""
    for n in ast.walk(tree):
        if isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Load) and _is_environ(n.value):
            yield n.lineno, n.slice
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.args:
            if (n.func.attr in ("get", "pop") and _is_environ(n.func.value)) or (
                    n.func.attr == "getenv"):
                yield n.lineno, n.args[0]
        elif isinstance(n, ast.Compare):
            for op, right in zip(n.ops, n.comparators):
                if isinstance(op, (ast.In, ast.NotIn)) and _is_environ(right):
                    yield n.lineno, n.left


def _sources():
    for dirpath, dirnames, filenames in os.walk(PACKAGE):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


def test_every_environment_read_is_a_knob_or_a_declared_input():
    declared = {v for k in knobs.table().values() for v in (k.env, k.fallback_env) if v}
    declared |= set(knobs.LAUNCHER_INPUTS) | set(knobs.PLATFORM_INPUTS)
    bad, seen = [], set()
    for path in _sources():
        rel = os.path.relpath(path, PACKAGE)
        if rel in _READERS:
            continue
        mod = _MODULES.setdefault(path, _Module(path))
        for line, key in _reads(mod.tree):
            names = _names(mod, key)
            where = f"spark_dl/{rel}:{line}"
            if names is None:
                bad.append(f"{where}: reads a variable this test cannot name (use a literal "
                           "or a module-level constant)")
                continue
            seen |= names
            bad.extend(f"{where}: reads {n}, which is neither a knob (spark_dl/config/"
                       "knobs.json) nor in LAUNCHER_INPUTS/PLATFORM_INPUTS"
                       for n in sorted(names - declared))
    assert not bad, "undeclared environment reads:\n" + "\n".join(bad)
    # The walk found the reads it should (a broken walk would pass vacuously).
    assert {"SDL_RANK", "SDL_SECRET_KEY", "SDL_SPARK_HANDOVER", "OMPI_COMM_WORLD_SIZE"} <= seen


def test_the_audit_resolves_loops_constants_and_imports(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "import os\n"
        "VARS = {'a': ('SDL_RANK', 'HOROVOD_RANK')}\n"
        "def f(environ):\n"
        "    for field, names in VARS.items():\n"
        "        for name in names:\n"
        "            if name in environ:\n"
        "                return environ[name]\n"
        "    return os.environ.get(f'SDL_{field}')\n")
    mod = _Module(str(path))
    reads = sorted(_reads(mod.tree), key=lambda r: r[0])
    found = [(line, _names(mod, key)) for line, key in reads]
    assert found == [(6, {"SDL_RANK", "HOROVOD_RANK"}), (7, {"SDL_RANK", "HOROVOD_RANK"}),
                     (8, None)]
