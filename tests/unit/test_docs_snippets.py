"""The code in README.md and docs/*.md, checked so that the docs cannot drift from the code.

The convention is in docs/architecture.md ("Code in the docs"): every fenced ```python and
```bash block carries a marker comment on the line above its fence; Python blocks must
compile, shell blocks must pass ``bash -n`` and name only repository paths that exist, and
blocks marked ``run`` are executed from the repository root (Python through .venv's
interpreter, shell through bash), each under a timeout. Indented blocks that look like
commands must be fenced, so that they are checked too.
"""

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
KINDS = ("run", "slow", "fragment", "template", "cluster", "gpu", "needs")
MARKER = re.compile(r"^<!--\s*snippet:\s*([a-z]+)\b(.*?)-->\s*$")
FENCE = re.compile(r"^```\s*([A-Za-z0-9_+-]*)\s*$")
CHECKED = {"python": "python", "py": "python", "bash": "bash", "sh": "bash",
           "shell": "bash", "console": "bash"}
# Repository paths a command may name; each must exist.
REPO_PATH = re.compile(r"^(?:\./)?((?:\.venv/bin|scripts|examples|benchmarks|conf|tests|docs)"
                       r"/[\w./-]+)")
# The start of an indented line that is a command rather than output or a layout.
COMMAND = re.compile(r"^(\.venv/bin/|bash |scripts/|PYTHONPATH=|PYSPARK_PYTHON=|SPARK_CONF_DIR="
                     r"|python3? |sdlrun |spark-submit |pip |mpirun |source )")
RUN_TIMEOUT_S = 150


class Snippet:
    def __init__(self, doc: Path, line: int, lang: str, code: str, kind: str):
        self.doc, self.line, self.lang, self.code, self.kind = doc, line, lang, code, kind

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def _snippets(doc: Path):
    """(snippets, problems) of one Markdown file."""
    lines = doc.read_text().split("\n")
    found, problems = [], []
    i, in_list_or_fence_gap = 0, False
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            prev_blank = i == 0 or not lines[i - 1].strip()
            if (lines[i].startswith("    ") and prev_blank and not in_list_or_fence_gap
                    and COMMAND.match(lines[i].strip())):
                problems.append(f"{doc.relative_to(ROOT)}:{i + 1}: an indented command; fence "
                                f"it as ```bash with a snippet marker: {lines[i].strip()!r}")
            if lines[i].strip():
                # Indented lines continuing a list item are not code blocks.
                in_list_or_fence_gap = bool(re.match(r"^\s*([-*+]|\d+\.)\s", lines[i])) or (
                    in_list_or_fence_gap and lines[i].startswith("  "))
            i += 1
            continue
        lang = m.group(1).lower()
        end = i + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        code = "\n".join(lines[i + 1:end]) + "\n"
        if lang in CHECKED:
            marker = MARKER.match(lines[i - 1].strip()) if i else None
            if marker is None or marker.group(1) not in KINDS:
                problems.append(f"{doc.relative_to(ROOT)}:{i + 1}: a ```{lang} block without a "
                                f"'<!-- snippet: KIND -->' line above it (KIND one of "
                                f"{', '.join(KINDS)}; see docs/architecture.md)")
            else:
                found.append(Snippet(doc, i + 1, CHECKED[lang], code, marker.group(1)))
        i = end + 1
    return found, problems


ALL, PROBLEMS = [], []
for _doc in DOCS:
    _found, _problems = _snippets(_doc)
    ALL.extend(_found)
    PROBLEMS.extend(_problems)
PYTHON = [s for s in ALL if s.lang == "python"]
SHELL = [s for s in ALL if s.lang == "bash"]
RUN = [s for s in ALL if s.kind == "run"]


def test_every_code_block_is_fenced_and_marked():
    assert ALL, "no snippets found: is the extraction broken?"
    assert not PROBLEMS, "\n".join(PROBLEMS)


@pytest.mark.parametrize("snippet", PYTHON, ids=[s.where for s in PYTHON])
def test_python_snippet_compiles(snippet):
    try:
        ast.parse(snippet.code, filename=snippet.where)
    except SyntaxError as e:
        pytest.fail(f"{snippet.where} (+{e.lineno}): {e.msg}: {e.text!r}")


def _commands(code: str):
    """The words of each command line of a shell snippet (continuations joined)."""
    joined = re.sub(r"\\\n", " ", code)
    for line in joined.split("\n"):
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            try:
                yield shlex.split(line, comments=True)
            except ValueError:
                yield line.split()


@pytest.mark.parametrize("snippet", SHELL, ids=[s.where for s in SHELL])
def test_shell_snippet_parses_and_names_existing_paths(snippet):
    proc = subprocess.run(["bash", "-n"], input=snippet.code, text=True, capture_output=True,
                          timeout=30)
    assert proc.returncode == 0, f"{snippet.where}: bash -n: {proc.stderr}"
    missing = []
    for words in _commands(snippet.code):
        for word in words:
            m = REPO_PATH.match(word.split("=", 1)[-1])
            if m and not (ROOT / m.group(1).rstrip(".")).exists():
                missing.append(m.group(1))
    assert not missing, f"{snippet.where}: names paths that do not exist: {missing}"


def test_docs_use_venv_programs_not_bare_ones():
    """Without an activated virtualenv, bare `python`/`sdlrun`/`spark-submit` are not
    .venv's: commands say .venv/bin/... or scripts/spark-submit (templates included)."""
    bad = []
    for s in SHELL:
        for words in _commands(s.code):
            for prog in _programs(words):
                if prog in ("python", "python3", "sdlrun", "spark-submit", "pip", "pytest"):
                    bad.append(f"{s.where}: {' '.join(words)}")
    assert not bad, "\n".join(bad)


def _programs(words):
    """The programs a command line starts: the first word after VAR=value assignments, and
    what sdlrun/mpirun/-m launchers start in turn (their first non-option word)."""
    words = [w for w in words if not re.match(r"^[A-Z_][A-Z0-9_]*=", w)]
    if not words:
        return
    yield words[0]
    if os.path.basename(words[0]) in ("sdlrun", "mpirun") or words[1:3] == ["-m",
                                                                           "spark_dl.runner"]:
        rest, skip = words[1:], False
        for w in rest:
            if skip:
                skip = False
            elif w.startswith("-"):
                skip = "=" not in w and w in ("-np", "-H", "-n", "--hosts", "--mpi-args",
                                              "--host", "-x", "--mca", "-m")
            else:
                if w != "spark_dl.runner":
                    yield w
                    return


def _env():
    env = dict(os.environ)
    env["PYSPARK_PYTHON"] = str(ROOT / ".venv" / "bin" / "python")
    venv_bin = str(ROOT / ".venv" / "bin")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p != venv_bin)   # as in a shell without activation
    env.pop("VIRTUAL_ENV", None)
    return env


def _run_params():
    """RUN as pytest params; those that start Spark carry the ``spark`` marker."""
    for s in RUN:
        spark = "SparkSession" in s.code or "spark-submit" in s.code
        yield pytest.param(s, id=s.where, marks=[pytest.mark.spark] if spark else [])


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
@pytest.mark.parametrize("snippet", list(_run_params()))
def test_run_snippet(snippet, tmp_path):
    python = ROOT / ".venv" / "bin" / "python"
    if not python.exists():
        pytest.skip("no .venv: run bash scripts/setup.sh")
    if snippet.lang == "python":
        script = tmp_path / "snippet.py"
        script.write_text(snippet.code)
        cmd = [str(python), str(script)]
    else:
        cmd = ["bash", "-euo", "pipefail", "-c", snippet.code]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{snippet.where}: still running after {RUN_TIMEOUT_S}s; mark it slow or "
                    f"make it quicker\n{(e.output or '')[-3000:]}")
    assert proc.returncode == 0, f"{snippet.where} exited {proc.returncode}:\n" \
                                 f"{proc.stdout[-4000:]}"


def test_extraction_sees_markers_fences_and_indented_commands(tmp_path):
    """The checker itself: a marked block is found, an unmarked one and an indented
    command are problems, a list item's indented continuation and a text block are not."""
    doc = tmp_path / "page.md"
    doc.write_text("intro\n\n<!-- snippet: run -->\n```python\nprint(1)\n```\n\n"
                   "```bash\nls\n```\n\n    .venv/bin/python x.py\n\n"
                   "- a list item\n\n    continued text\n\n```text\nout\n```\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found, problems = _snippets(doc)
    finally:
        ROOT = saved
    assert [(s.line, s.lang, s.kind, s.code) for s in found] == [(4, "python", "run",
                                                                   "print(1)\n")]
    assert len(problems) == 2 and "without a" in problems[0] and "indented" in problems[1]
    assert list(_programs(["PYTHONPATH=.", ".venv/bin/sdlrun", "-np", "2", "python",
                           "t.py"])) == [".venv/bin/sdlrun", "python"]
