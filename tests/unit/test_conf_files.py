"""conf/sdlrun.env lists every knob at its default, and exporting it changes nothing."""

import os
import subprocess

from spark_dl.config import knobs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV_FILE = os.path.join(ROOT, "conf", "sdlrun.env")


def test_sdlrun_env_is_current_with_the_knob_table():
    with open(ENV_FILE) as f:
        text = f.read()
    assert text == knobs.example_env(), (
        "conf/sdlrun.env is stale: run .venv/bin/python -c \"from spark_dl.config.knobs "
        "import example_env; print(example_env(), end='')\" > conf/sdlrun.env")
    for knob in knobs.table().values():
        assert f"\n#{knob.env}=" in text


def test_every_commented_default_parses_and_sourcing_the_file_sets_nothing():
    with open(ENV_FILE) as f:
        lines = [ln[1:] for ln in f.read().splitlines()
                 if ln.startswith("#SDL_") and "=" in ln]
    table = {k.env: k for k in knobs.table().values()}
    for line in lines:
        var, _, text = line.partition("=")
        if text:
            assert table[var].parse(text) == table[var].default, line
    out = subprocess.run(["bash", "-c", f"env -i bash -c 'set -a; . {ENV_FILE}; set +a; env'"],
                         capture_output=True, text=True, check=True).stdout
    assert "SDL_" not in out
