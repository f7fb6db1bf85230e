#!/usr/bin/env bash
# Sets up the machine (scripts/setup.sh) and runs the whole test suite.
# Extra arguments go to pytest. pytest's "no tests collected" (exit 5) fails.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
export PYSPARK_PYTHON="$PWD/.venv/bin/python"
.venv/bin/python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "test: pytest collected no tests; failing" >&2
  exit 1
fi
exit "$rc"
