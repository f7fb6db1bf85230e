#!/bin/sh
# Spark's GPU discovery script (spark.worker.resource.gpu.discoveryScript, or
# spark.driver.resource.gpu.discoveryScript): prints this host's GPUs as Spark's resource
# JSON, {"name": "gpu", "addresses": ["0", "1", ...]}, with CUDA's device indices, which
# is what spark_dl's workers expect (docs/gpu.md). No GPU (or no nvidia-smi): an empty
# list, so that Spark reports too few GPUs instead of inventing one.
set -u
addresses=""
if command -v nvidia-smi >/dev/null 2>&1; then
    # One index per line; skip anything that is not a number (an error text).
    for i in $(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null); do
        case "$i" in
            ''|*[!0-9]*) ;;
            *) addresses="${addresses:+$addresses,}\"$i\"" ;;
        esac
    done
fi
printf '{"name": "gpu", "addresses": [%s]}\n' "$addresses"
