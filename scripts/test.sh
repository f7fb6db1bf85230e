#!/usr/bin/env bash
# Sets up the machine (scripts/setup.sh) and runs the whole test suite, then the Spark 3.5
# mode (scripts/spark35.sh: the Spark tests that matter, on pyspark 3.5 in a second venv).
# Extra arguments go to the main pytest run only. pytest's "no tests collected" (exit 5)
# fails. The run fails if either part fails. SKIP_SPARK35=1 skips the Spark 3.5 mode;
# PYTEST_WORKERS sets the number of pytest-xdist workers (default 2, 0 for none).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
export PYSPARK_PYTHON="$PWD/.venv/bin/python"
# Byte-compile the project's own modules once: where PYTHONDONTWRITEBYTECODE is set (as on
# this project's development machines), Python never caches them, and every rank, Spark Python
# worker and test process would compile spark_dl's sources again (about 0.2 s of CPU for
# the estimator's imports, in every one of them). A failure is pytest's to report.
.venv/bin/python -m compileall -q -j 0 spark_dl tests benchmarks examples >/dev/null 2>&1 || true
# Two pytest-xdist workers (PYTEST_WORKERS; 0: one process, as before). Many tests mostly
# wait (JVM and interpreter start-up, rendezvous, timeouts that must expire), so a second
# worker fills a 2-core machine. loadfile with tests/conftest.py's groups keeps each module
# on one worker (its Spark session and rank worlds are made once) and the modules that share
# machine-wide state (tests/cluster's namespaces, the native build folder) in sequence;
# --no-loadscope-reorder keeps conftest's long-groups-first order.
WORKERS="${PYTEST_WORKERS:-2}"
xdist=()
[ "$WORKERS" != 0 ] && xdist=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder)
.venv/bin/python -m pytest "${xdist[@]}" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "test: pytest collected no tests; failing" >&2
  rc=1
fi
if [ "${SKIP_SPARK35:-0}" = 1 ]; then
  echo "test: SKIP_SPARK35=1: the Spark 3.5 mode is skipped"
  exit "$rc"
fi
bash scripts/spark35.sh
rc35=$?
[ "$rc35" -ne 0 ] && echo "test: the Spark 3.5 mode (scripts/spark35.sh) failed (exit $rc35)" >&2
[ "$rc" -ne 0 ] && exit "$rc"
exit "$rc35"
