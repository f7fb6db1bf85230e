#!/usr/bin/env bash
# CI's Spark 3.5 mode: the Spark tests that matter, on pyspark 3.5, in a second venv.
#
# .venv-spark35 holds only what must differ from the main .venv (scripts/setup.sh makes
# that one first): pyspark 3.5 and the py4j it asks for. A .pth file in its site-packages
# then adds the main venv's site-packages behind its own, so torch, pyarrow, pandas, numpy,
# the frameworks and the editable spark_dl (whose finder is a .pth there too) come from
# the main venv, unchanged and not reinstalled, while `import pyspark` finds 3.5.
# Set-up is skipped when nothing it depends on changed (the pyspark version and the main
# venv's path, in a stamp in the venv, as in setup.sh) and the venv still imports pyspark
# 3.5 and this checkout's spark_dl; SPARK35_FORCE=1 redoes it.
#
# Spark Connect is not tested here: pip's pyspark 3.5 does not ship the Connect server's
# jar (4.x does), and it cannot be had without Maven, so the Connect tests skip under 3.5.
#
# Extra arguments go to pytest (e.g. -k allreduce -x); test paths among them are run
# instead of the default list below. pytest's "no tests collected" (exit 5) fails.
set -uo pipefail
cd "$(dirname "$0")/.."

# The newest 3.5 release on the package registry when this was written; bump it here.
PYSPARK_VERSION=3.5.9
VENV=.venv-spark35
# What runs on 3.5: spark.run on local[2] and on local-cluster, the executor-python probe,
# prepare_data, the Torch, Keras and Lightning estimators' fit, transform and ML
# persistence (Keras's transform inside its persistence test), and one Connect module,
# which must skip (see above). About 4.5 minutes on a quiet 2-core machine, twice that
# while a C++ build shares it.
T=tests/spark
TESTS=(
  $T/test_run_local.py
  $T/test_run_cluster.py::test_ranks_allreduce_gpus_across_executors
  $T/test_run_cluster.py::test_killed_worker_in_another_executor_ends_run
  $T/test_startup_executor_python.py
  $T/test_prepare_data.py
  $T/test_torch_estimator.py::test_fit_learns_reports_and_checkpoints
  $T/test_torch_estimator.py::test_transform_matches_local_model_on_double_vectors
  $T/test_transform.py::test_arrow_udf_and_map_in_arrow_give_the_same_rows
  $T/test_transform.py::test_a_frame_with_a_name_twice_transforms
  $T/test_transform.py::test_names_with_dots_and_spaces_transform
  $T/test_torch_estimator.py::test_model_persistence_round_trip
  $T/test_torch_estimator.py::test_pipeline_with_estimator_saves_and_loads
  $T/test_keras_estimator.py::test_fit_learns_reports_and_checkpoints
  $T/test_keras_estimator.py::test_model_and_pipeline_persistence
  $T/test_lightning_estimator.py::test_fit_learns_with_own_optimizer_and_scheduler
  $T/test_lightning_estimator.py::test_transform_save_load_and_pipeline
  $T/test_connect_run.py
)

[ -x .venv/bin/python ] || { echo "spark35: .venv is missing: run scripts/setup.sh first" >&2; exit 1; }
MAIN_SITE="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
  || exit 1
STAMP="$VENV/.spark_dl_spark35_stamp"
PTH=_spark_dl_main_venv.pth

# What the set-up depends on (editing the test list does not redo it).
stamp_value() {
  echo "pyspark==$PYSPARK_VERSION over $MAIN_SITE"
}
# pyspark must be the 3.5 release from this venv, and spark_dl this checkout's, with its
# native core (imported through the main venv's editable finder).
venv_ok() {
  "$VENV/bin/python" - "$PWD" "$PYSPARK_VERSION" <<'PY' >/dev/null 2>&1
import os, sys
import pyspark, spark_dl, spark_dl._core
assert pyspark.__version__ == sys.argv[2], pyspark.__version__
assert os.path.realpath(pyspark.__file__).startswith(os.path.realpath(sys.prefix) + os.sep)
assert os.path.realpath(spark_dl.__file__).startswith(os.path.realpath(sys.argv[1]) + os.sep)
PY
}

if [ "${SPARK35_FORCE:-0}" = 1 ] || [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$(stamp_value)" ] \
   || ! venv_ok; then
  echo "spark35: setting up $VENV (pyspark $PYSPARK_VERSION over the main .venv)"
  rm -f "$STAMP"
  # The same base interpreter as the main venv: its compiled packages must load here.
  BASE_PYTHON="$(.venv/bin/python -c 'import sys; print(sys._base_executable)')" || exit 1
  [ -x "$VENV/bin/python" ] || "$BASE_PYTHON" -m venv "$VENV" || exit 1
  SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    || exit 1
  # pip must not see the main venv while it installs (it would find pyspark 4 there).
  rm -f "$SITE/$PTH"
  PIP_DISABLE_PIP_VERSION_CHECK=1 "$VENV/bin/python" -m pip install -q "pyspark==$PYSPARK_VERSION" \
    || exit 1
  # site.addsitedir appends, so this venv's own packages stay first; it also runs the
  # main venv's .pth files (the editable spark_dl's finder).
  printf 'import site; site.addsitedir(%s)\n' "'$MAIN_SITE'" > "$SITE/$PTH"
  venv_ok || { echo "spark35: $VENV does not import pyspark $PYSPARK_VERSION and spark_dl" >&2; exit 1; }
  stamp_value > "$STAMP"
fi

export PYSPARK_PYTHON="$PWD/$VENV/bin/python"
export PYSPARK_DRIVER_PYTHON="$PYSPARK_PYTHON"
for arg in "$@"; do  # an argument naming a test file or folder replaces the default list
  [ "${arg#-}" = "$arg" ] && [ -e "${arg%%::*}" ] && TESTS=()
done
"$VENV/bin/python" -c 'import pyspark, pyarrow, pandas, numpy; print(f"spark35: pyspark {pyspark.__version__}, pyarrow {pyarrow.__version__}, pandas {pandas.__version__}, numpy {numpy.__version__}")'
"$VENV/bin/python" -m pytest "${TESTS[@]}" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "spark35: pytest collected no tests; failing" >&2
  exit 1
fi
exit "$rc"
