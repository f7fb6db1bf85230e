#!/usr/bin/env bash
# Sets up the machine (scripts/setup.sh) and runs the main demo on 2 local ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYSPARK_PYTHON="$PWD/.venv/bin/python"
exec .venv/bin/sdlrun -np 2 .venv/bin/python examples/allreduce_demo.py
