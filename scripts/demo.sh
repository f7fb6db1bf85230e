#!/usr/bin/env bash
# Sets up the machine (scripts/setup.sh) and runs the main demo: a TorchEstimator fit
# and transform on local Spark (local[2], a temporary LocalStore, Gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYSPARK_PYTHON="$PWD/.venv/bin/python"
export SPARK_CONF_DIR="${SPARK_CONF_DIR:-$PWD/conf}"  # conf/: Spark defaults and quiet logs for local runs
exec .venv/bin/python examples/spark/torch_estimator_demo.py
