"""The configuration knobs: one table for the core and the launchers, one value grammar.

The table is the data file ``knobs.json`` beside this module. The native core is built
from the same file (CMake turns its ``core`` and ``both`` rows into the C++ ``SDL_KNOB``
rows at configure time), so a name, a variable or a default is written once. This module
needs only the standard library: launchers read their settings here without loading the
native extension::

    >>> from spark_dl.config import knobs
    >>> knobs.value("fusion_threshold")        # environment, else default
    134217728
    >>> knobs.value("start_timeout_s", {"SDL_START_TIMEOUT": "2m"})
    120.0

Grammar of a value, the same in C++ (``native/src/common/config.cc``), which the tests
check by feeding both parsers the same strings:

- surrounding whitespace (space, tab, newline, CR, FF, VT) is ignored; a value that is
  empty after that counts as unset (the default, or ``fallback_env``, applies);
- ``bool``: ``1 0 true false yes no on off``, in any case;
- ``int``: ``[+-]digits``, within 64 bits;
- ``double``: a decimal number, ``[+-]`` digits with an optional fraction and exponent
  (``1``, ``-2.5``, ``.5``, ``1e-3``); no ``inf``, ``nan``, hexadecimal or ``_``; a value
  beyond the range of a double (or one that rounds to zero from a non-zero mantissa) is
  an error;
- ``duration``: an unsigned decimal number of seconds, optionally followed by a unit
  ``ms``, ``s``, ``m`` or ``h`` (lower case, optional space before it): ``30``, ``1.5s``,
  ``500ms``, ``2m``, ``1h``; the value is in seconds;
- ``string``: the text as given (trimmed);
- ``enum``: one of the row's ``choices``, in any case; the value is the choice as listed.

Anything else is an error naming the variable, the text and what was expected, e.g.
``SDL_START_TIMEOUT=soon: expected a duration (...)``: a :class:`ValueError` here, the
same message from ``init()`` when the core reads it.

Besides the knobs, the package reads variables that its launchers set for each worker
(:data:`LAUNCHER_INPUTS`) and a few the platform sets (:data:`PLATFORM_INPUTS`); a test
checks that no other variable is read anywhere in ``spark_dl``.
"""

import dataclasses
import json
import math
import os
import re
from typing import Dict, Mapping, Optional, Tuple

__all__ = ["Knob", "TYPES", "SCOPES", "LAUNCHER_INPUTS", "PLATFORM_INPUTS", "parse", "table",
           "value", "describe", "describe_inputs", "example_env", "RENAMED", "misspelled"]

TYPES = ("bool", "int", "double", "duration", "string", "enum")
SCOPES = ("core", "launcher", "both")

_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "knobs.json")

# Variables the launchers (sdlrun, spark_dl.spark.run, mpirun) set for the workers they
# start; the package reads them to learn its place in the job. Not settings: a user sets
# them only to start a worker by hand.
LAUNCHER_INPUTS: Dict[str, str] = {
    "SDL_RANK": "this worker's rank (also SDL_SIZE, SDL_LOCAL_RANK, SDL_LOCAL_SIZE, "
                "SDL_CROSS_RANK, SDL_CROSS_SIZE)",
    "SDL_SIZE": "the number of ranks",
    "SDL_ELASTIC_WORKER_ID": "an elastic job's worker id (sdlrun --min-np, "
                             "spark_dl.spark.run_elastic): init() then takes its rank from the "
                             "launcher's current generation (docs/elastic.md)",
    "SDL_LOCAL_RANK": "the rank among the ranks on this host",
    "SDL_LOCAL_SIZE": "the number of ranks on this host",
    "SDL_CROSS_RANK": "the index of this host among the hosts",
    "SDL_CROSS_SIZE": "the number of hosts",
    "HOROVOD_RANK": "Horovod's names of the six topology values, read when the SDL_ ones "
                    "are unset (scripts launched by horovodrun)",
    "HOROVOD_SIZE": "see HOROVOD_RANK",
    "HOROVOD_LOCAL_RANK": "see HOROVOD_RANK",
    "HOROVOD_LOCAL_SIZE": "see HOROVOD_RANK",
    "HOROVOD_CROSS_RANK": "see HOROVOD_RANK",
    "HOROVOD_CROSS_SIZE": "see HOROVOD_RANK",
    "OMPI_COMM_WORLD_RANK": "Open MPI's topology under mpirun (also OMPI_COMM_WORLD_SIZE, "
                            "_LOCAL_RANK, _LOCAL_SIZE, _NODE_RANK)",
    "OMPI_COMM_WORLD_SIZE": "see OMPI_COMM_WORLD_RANK; its presence means 'under mpirun'",
    "OMPI_COMM_WORLD_LOCAL_RANK": "see OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "see OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_NODE_RANK": "see OMPI_COMM_WORLD_RANK",
    "PMI_RANK": "the rank under other MPI launchers (PMI)",
    "PMI_SIZE": "the size under other MPI launchers; its presence means 'under mpirun'",
    "SDL_HOSTNAME": "the address peers use to reach this worker",
    "SDL_RENDEZVOUS_ADDR": "the rendezvous server's address, as reachable from the worker",
    "SDL_RENDEZVOUS_PORT": "the rendezvous server's port",
    "SDL_SECRET_KEY": "the per-job secret (hex) authenticating the rendezvous; removed from "
                      "the environment on first use",
    "SDL_JOB_ID": "random per job",
    "SDL_SPARK_DRIVER": "spark.run: the driver service's endpoints (host:port,...)",
    "SDL_SPARK_HANDOVER": "spark.run: the socket over which a worker receives its secret",
    "SDL_SPARK_AGENT_HANDOVER": "spark.run with MPI: the socket of the rsh agent's secret",
    "SDL_SPARK_PYTHON": "spark.run: the executor's Python interpreter",
    "SDL_AVAILABLE_DEVICES": "spark.run: the GPUs Spark assigned to the task (comma-separated)",
    "CUDA_VISIBLE_DEVICES": "spark.run: the same GPUs, for CUDA",
}

# Variables the platform sets, which the package reads but never sets.
PLATFORM_INPUTS: Dict[str, str] = {
    "PYTHONPATH": "forwarded to remote workers (sdlrun over ssh)",
    "JAVA_HOME": "checked before using an HDFS store (Hadoop's native client needs it)",
    "HADOOP_HOME": "checked before using an HDFS store",
    "CLASSPATH": "checked before using an HDFS store",
    "PYSPARK_PYTHON": "the executors' Python as the user chose it: when unset on a local "
                      "master, spark_dl runs the executors on the driver's interpreter",
    "TF_NUM_INTRAOP_THREADS": "TensorFlow's own thread setting: when set, KerasEstimator's "
                              "workers keep it instead of sharing the host's cores between "
                              "its ranks",
    "MLFLOW_EXPERIMENT_NAME": "MLflow's own setting: the experiment an estimator's MLflow run "
                              "goes to when mlflow_experiment is unset",
    "MLFLOW_EXPERIMENT_ID": "MLflow's own setting, as MLFLOW_EXPERIMENT_NAME",
}

# Variables an earlier release read under another name: setting one does nothing now, so
# init() says what to set instead (see misspelled()).
RENAMED: Dict[str, str] = {
    "SDL_STALL_WARNING": "SDL_STALL_CHECK_TIME",
}

_SPACE = " \t\n\r\f\v"
_UNSIGNED = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
_INT = re.compile(r"[+-]?[0-9]+\Z")
_DOUBLE = re.compile(r"[+-]?" + _UNSIGNED + r"\Z")
_DURATION = re.compile(r"(" + _UNSIGNED + r")[ \t\n\r\f\v]*(ms|s|m|h)?\Z")
_UNIT_SECONDS = {"s": 1.0, "m": 60.0, "h": 3600.0}  # ms divides by 1000, as in C++
_BOOLS = {"1": True, "true": True, "yes": True, "on": True,
          "0": False, "false": False, "no": False, "off": False}
_INT64 = (-2 ** 63, 2 ** 63 - 1)
_EXPECTED = {
    "bool": "a boolean (1/0, true/false, yes/no, on/off)",
    "int": "an integer",
    "double": "a number",
    "duration": "a duration (seconds, or a number with a unit: 500ms, 30s, 2m, 1h)",
}


def _lower(text: str) -> str:
    # ASCII only, as in C++: a non-ASCII letter never matches a choice.
    return text.lower() if text.isascii() else text


def _number(text: str) -> Optional[float]:
    """A decimal text (already checked by the grammar) as a finite double, else None."""
    v = float(text)
    if math.isinf(v):
        return None
    mantissa = re.split(r"[eE]", text)[0]
    if v == 0.0 and mantissa.strip("+-.0"):
        return None  # underflow to zero, which C++'s from_chars refuses too
    return v


def parse(type_: str, text: str, var: str, choices: Tuple[str, ...] = ()):
    """Parses a non-empty value of one type (see the module's grammar).

    Args:
        type_: one of :data:`TYPES`.
        text: the text as found in the environment.
        var: the variable's name, for the error message.
        choices: the allowed values of an ``enum``.

    Returns:
        bool, int, float (seconds for a duration) or str; None when ``text`` is blank.

    Raises:
        ValueError: ``VAR=text: expected ...``.
    """
    s = text.strip(_SPACE)
    if not s:
        return None
    result = None
    if type_ == "bool":
        result = _BOOLS.get(_lower(s))
    elif type_ == "int":
        if _INT.match(s) and _INT64[0] <= int(s) <= _INT64[1]:
            result = int(s)
    elif type_ == "double":
        if _DOUBLE.match(s):
            result = _number(s)
    elif type_ == "duration":
        m = _DURATION.match(s)
        v = _number(m.group(1)) if m else None
        if v is not None:
            unit = m.group(2) or "s"
            v = v / 1000.0 if unit == "ms" else v * _UNIT_SECONDS[unit]
            result = None if math.isinf(v) else v
    elif type_ == "string":
        result = s
    elif type_ == "enum":
        result = next((c for c in choices if c == _lower(s)), None)
    else:
        raise ValueError(f"{var}: unknown knob type {type_!r}")
    if result is None:
        expected = f"one of {', '.join(choices)}" if type_ == "enum" else _EXPECTED[type_]
        raise ValueError(f"{var}={text}: expected {expected}")
    return result


@dataclasses.dataclass(frozen=True)
class Knob:
    """One row of the table (see ``knobs.json`` for what each field means)."""

    name: str
    env: str
    type: str
    default: object
    tunable: bool
    doc: str
    scope: str = "core"
    choices: Tuple[str, ...] = ()
    fallback_env: Optional[str] = None

    def parse(self, text: str, var: Optional[str] = None):
        """Converts text (as found in the environment) to the knob's type; blank text
        gives the default. ``var`` names the variable in errors (default: ``env``)."""
        v = parse(self.type, text, var or self.env, self.choices)
        return self.default if v is None else v

    def read(self, environ: Optional[Mapping[str, str]] = None):
        """The value in ``environ`` (default ``os.environ``): ``env``, else
        ``fallback_env``, else the default."""
        environ = os.environ if environ is None else environ
        for var in filter(None, (self.env, self.fallback_env)):
            text = environ.get(var)
            if text is not None and text.strip(_SPACE):
                return parse(self.type, text, var, self.choices)
        return self.default


_FIELDS = {"name", "env", "type", "default", "scope", "tunable", "doc", "choices",
           "fallback_env", "why"}


def _load(path: str = _PATH) -> Dict[str, Knob]:
    with open(path, encoding="utf-8") as f:
        rows = json.load(f)["knobs"]
    knobs = {}
    for row in rows:
        where = f"{path}: knob {row.get('name')!r}"
        unknown = set(row) - _FIELDS
        if unknown or row["type"] not in TYPES or row["scope"] not in SCOPES:
            raise ValueError(f"{where}: bad row (unknown fields {sorted(unknown)}, "
                             f"type {row['type']!r} or scope {row['scope']!r})")
        if (row["type"] == "enum") != bool(row.get("choices")):
            raise ValueError(f"{where}: choices are for enum knobs, and enum knobs need them")
        default = row["default"]
        if row["type"] in ("double", "duration") and isinstance(default, int) \
                and not isinstance(default, bool):
            default = float(default)
        want = {"bool": bool, "int": int, "double": float, "duration": float, "string": str,
                "enum": str}[row["type"]]
        if type(default) is not want or (row["type"] == "enum" and default not in row["choices"]):
            raise ValueError(f"{where}: default {default!r} is not a {row['type']}")
        knobs[row["name"]] = Knob(row["name"], row["env"], row["type"], default,
                                  bool(row["tunable"]), row["doc"], row["scope"],
                                  tuple(row.get("choices", ())), row.get("fallback_env"))
    return knobs


_TABLE = _load()


def table() -> Dict[str, Knob]:
    """Returns ``{name: Knob}`` in table order."""
    return dict(_TABLE)


def value(name: str, environ: Optional[Mapping[str, str]] = None):
    """The knob's effective value: its variable (then its ``fallback_env``) in ``environ``
    (default ``os.environ``), else its default.

    Raises:
        ValueError: a set value does not parse; the message names the variable.
    """
    return _TABLE[name].read(environ)


def misspelled(environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """``{variable: what to set instead}`` for the ``SDL_`` variables in ``environ`` (default
    ``os.environ``) that nothing reads but that look meant for a setting: a name from
    :data:`RENAMED`, or one a character or two away from a knob or launcher variable
    (``SDL_FUSION_TRESHOLD``). Other undeclared ``SDL_`` names (a build's or a benchmark's
    own) are left alone: only near misses are reported, so the list has no false alarms.
    """
    import difflib

    environ = os.environ if environ is None else environ
    known = set(LAUNCHER_INPUTS)
    for k in _TABLE.values():
        known.update(filter(None, (k.env, k.fallback_env)))
    targets = sorted(known)
    found = {}
    for var in environ:
        if not var.startswith("SDL_") or var in known:
            continue
        if var in RENAMED:
            found[var] = RENAMED[var]
            continue
        close = difflib.get_close_matches(var, targets, n=1, cutoff=0.85)
        if close:
            found[var] = close[0]
    return found


def _text(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v) if v != "" else '""'


def describe() -> str:
    """A Markdown table of every knob (docs/core.md carries it verbatim)."""
    lines = ["| variable | type | default | read by | tunable | meaning |",
             "|---|---|---|---|---|---|"]
    for k in _TABLE.values():
        var = f"`{k.env}`" + (f" (else `{k.fallback_env}`)" if k.fallback_env else "")
        kind = f"enum: {', '.join(k.choices)}" if k.type == "enum" else k.type
        lines.append(f"| {var} | {kind} | `{_text(k.default)}` | {k.scope} | "
                     f"{'yes' if k.tunable else 'no'} | {k.doc} |")
    return "\n".join(lines)


def describe_inputs() -> str:
    """A Markdown table of :data:`LAUNCHER_INPUTS` and :data:`PLATFORM_INPUTS` (docs/core.md)."""
    lines = ["| variable | set by | meaning |", "|---|---|---|"]
    for who, inputs in (("launcher", LAUNCHER_INPUTS), ("platform", PLATFORM_INPUTS)):
        lines.extend(f"| `{name}` | {who} | {meaning} |" for name, meaning in inputs.items())
    return "\n".join(lines)


def example_env() -> str:
    """An environment file listing every knob, commented out at its default
    (``conf/sdlrun.env`` is this text; docs/sdlrun.md shows how to use it)."""
    import textwrap

    lines = ["# spark_dl settings for sdlrun jobs: every knob of the one table",
             "# (spark_dl/config/knobs.json), commented out at its default.",
             "# Uncomment what you change, then export the file into the launching shell:",
             "#     set -a; . conf/sdlrun.env; set +a; .venv/bin/sdlrun -np 2 python train.py",
             "# sdlrun passes its environment, these variables included, to every worker, local",
             "# or remote (a worker's init() reads the core's knobs from it).",
             "# Generated by spark_dl.config.knobs.example_env(); tests check it is current."]
    for k in _TABLE.values():
        lines.append("")
        doc = k.doc + (f" ({k.fallback_env} is read when this is unset.)"
                       if k.fallback_env else "")
        lines += textwrap.wrap(doc, 92, initial_indent="# ", subsequent_indent="# ")
        kind = f"one of {', '.join(k.choices)}" if k.type == "enum" else k.type
        lines.append(f"# type: {kind}; read by: {k.scope}")
        default = _text(k.default)
        lines.append(f"#{k.env}={'' if default == chr(34) * 2 else default}")
    return "\n".join(lines) + "\n"
