"""scripts/setup.sh's no-op path: a second run with nothing changed takes seconds, and any
change to what it installs from (native sources, packaging, itself) makes it work again."""

import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "scripts" / "setup.sh"

pytestmark = pytest.mark.timeout(120)


def _tree(tmp_path: Path) -> Path:
    """A checkout's inputs to setup: the script, packaging files, native sources."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(SETUP, tmp_path / "scripts" / "setup.sh")
    for name in ("pyproject.toml", "setup.cfg", "constraints.txt"):
        (tmp_path / name).write_text(f"{name}\n")
    (tmp_path / "native" / "src").mkdir(parents=True)
    (tmp_path / "native" / "CMakeLists.txt").write_text("project(x)\n")
    (tmp_path / "native" / "src" / "a.cc").write_text("int a;\n")
    return tmp_path


def _hash(tree: Path) -> str:
    script = ('source <(sed -n "/^inputs_hash()/,/^}/p" scripts/setup.sh); inputs_hash')
    out = subprocess.run(["bash", "-c", script], cwd=tree, capture_output=True, text=True,
                         timeout=30, check=True).stdout.strip()
    assert len(out) == 64, out
    return out


def test_inputs_hash_follows_contents_of_native_packaging_and_itself(tmp_path):
    tree = _tree(tmp_path)
    first = _hash(tree)
    assert _hash(tree) == first
    src = tree / "native" / "src" / "a.cc"
    src.touch()                                  # a new mtime alone changes nothing
    assert _hash(tree) == first
    src.write_text("int a = 1;\n")
    changed = _hash(tree)
    assert changed != first
    (tree / "native" / "src" / "b.h").write_text("")     # a new source file
    assert _hash(tree) != changed
    (tree / "native" / "src" / "b.h").unlink()
    assert _hash(tree) == changed
    for name in ("pyproject.toml", "constraints.txt", "scripts/setup.sh"):
        path = tree / name
        path.write_text(path.read_text() + "\n# edited\n")
        assert _hash(tree) != changed, name
        changed = _hash(tree)


def test_check_mode_reports_work_on_a_fresh_tree_and_changes_nothing(tmp_path):
    tree = _tree(tmp_path)
    proc = subprocess.run(["bash", "scripts/setup.sh", "--check"], cwd=tree,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "setup: would install" in proc.stdout
    assert not (tree / ".venv").exists()


def test_setup_with_nothing_changed_takes_seconds():
    check = subprocess.run(["bash", str(SETUP), "--check"], capture_output=True, text=True,
                           timeout=60)
    if check.returncode != 0:
        pytest.skip(f"setup has work to do here ({check.stdout.strip()}); "
                    "run bash scripts/setup.sh first")
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "nothing changed since the last setup" in proc.stdout
    assert took < 15, f"a no-op setup took {took:.1f}s"
