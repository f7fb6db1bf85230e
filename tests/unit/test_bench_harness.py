"""benchmarks/_harness.py: a worker's result survives a launcher that tags and cuts long lines."""

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _harness():
    spec = importlib.util.spec_from_file_location(
        "_bench_harness", os.path.join(ROOT, "benchmarks", "_harness.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _printed(H, payload, capsys, mark=None):
    H.print_result(payload, *([mark] if mark else []))
    return capsys.readouterr().out


def test_long_result_round_trips_through_tagged_lines(capsys):
    H = _harness()
    payload = {"samples": [i * 1e-6 for i in range(20000)], "peer": "spark_dl"}  # ~400 KB
    out = _printed(H, payload, capsys)
    lines = out.splitlines()
    assert len(lines) > 1 and all(len(line) < 64 * 1024 for line in lines)
    # sdlrun puts a rank tag before each line and other output between them.
    tagged = "\n".join(f"[0]<stdout>:{line}\n[1]<stderr>:warming up" for line in lines)
    assert H.parse_result("noise\n" + tagged) == payload


def test_small_result_and_own_mark(capsys):
    H = _harness()
    out = _printed(H, {"a": 1}, capsys, mark="SDL_X_BENCH ")
    assert H.parse_result(out, "SDL_X_BENCH ") == {"a": 1}
    assert H.parse_result(out) is None  # another script's mark


def test_missing_part_is_no_result(capsys):
    H = _harness()
    out = _printed(H, {"x": "y" * 50000}, capsys)
    lines = out.splitlines()
    assert H.parse_result("\n".join(lines[:-1])) is None
    assert H.parse_result("") is None
    assert json.dumps(H.parse_result(out))  # complete: parses
