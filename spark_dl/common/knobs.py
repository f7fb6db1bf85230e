"""The configuration knobs, read from the core's one table.

The table lives in ``native/src/common/knobs.def``; this module only exposes it,
so C++ and Python never disagree on a name, variable or default::

    >>> from spark_dl.common import knobs
    >>> knobs.value("fusion_threshold")        # environment, else default
    134217728
"""

import dataclasses
import os

from spark_dl import _core

__all__ = ["Knob", "table", "value", "describe"]

_PARSE = {
    "bool": lambda s: s.strip().lower() in ("1", "true", "yes", "on"),
    "int64": int,
    "double": float,
    "string": str,
}


@dataclasses.dataclass(frozen=True)
class Knob:
    """One configuration knob: field name, environment variable, type, default, doc."""

    name: str
    env: str
    type: str
    default: object
    tunable: bool
    doc: str

    def parse(self, text):
        """Converts text (as found in the environment) to the knob's type."""
        try:
            return _PARSE[self.type](text)
        except ValueError:
            kind = "an integer" if self.type == "int64" else "a number"
            raise ValueError(f"{self.env}={text}: expected {kind}") from None


def _load():
    knobs = {}
    for row in _core.knob_table():
        parse = _PARSE[row["type"]]
        knobs[row["name"]] = Knob(row["name"], row["env"], row["type"], parse(row["default"]),
                                  row["tunable"], row["doc"])
    return knobs


_TABLE = _load()


def table():
    """Returns ``{name: Knob}`` in table order."""
    return dict(_TABLE)


def value(name, environ=None):
    """The knob's effective value at init: its environment variable, else its default."""
    knob = _TABLE[name]
    text = (os.environ if environ is None else environ).get(knob.env)
    return knob.default if text is None else knob.parse(text)


def describe():
    """A Markdown table of every knob (used by the docs)."""
    lines = ["| variable | type | default | tunable | meaning |", "|---|---|---|---|---|"]
    for k in _TABLE.values():
        lines.append(f"| `{k.env}` | {k.type} | `{k.default!r}` | {'yes' if k.tunable else 'no'} | {k.doc} |")
    return "\n".join(lines)
