"""What importing spark_dl costs on top of the framework: ``import torch`` against ``import
torch, spark_dl.torch`` (and the same for Keras), each in a new interpreter.

    .venv/bin/python benchmarks/import_time.py                   # 9 rounds, this Python
    .venv/bin/python benchmarks/import_time.py --python /path/to/venv/bin/python --keras

Each round starts the baseline and the spark_dl import in fresh processes, in alternating
order (a noisy machine slows both alike), and times each from the parent (process start
included: the same for both). Prints medians, min-max, and the median of the per-round
differences, which is spark_dl's cost. Target (issue 32): under 1 s beyond torch's own import.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time

CASES = {
    "torch": ("import torch", "import torch, spark_dl.torch"),
    "keras": ("import keras, tensorflow", "import keras, tensorflow, spark_dl.keras"),
}


def _time(python, code):
    start = time.perf_counter()
    proc = subprocess.run([python, "-c", code], timeout=300, stdin=subprocess.DEVNULL, cwd="/",
                          capture_output=True, text=True)
    took = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{python} -c {code!r} failed:\n{proc.stderr[-3000:]}")
    return took


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--keras", action="store_true", help="also time Keras on TensorFlow")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    cases = ["torch"] + (["keras"] if args.keras else [])
    report = {}
    for case in cases:
        base_code, ours_code = CASES[case]
        _time(args.python, ours_code)  # warm the page cache for both
        base, ours, diff = [], [], []
        for r in range(args.rounds):
            if r % 2 == 0:
                b, o = _time(args.python, base_code), _time(args.python, ours_code)
            else:
                o, b = _time(args.python, ours_code), _time(args.python, base_code)
            base.append(b)
            ours.append(o)
            diff.append(o - b)
        report[case] = {"baseline_s": statistics.median(base), "with_spark_dl_s":
                        statistics.median(ours), "spark_dl_s": statistics.median(diff),
                        "spark_dl_min_max_s": [min(diff), max(diff)]}
        print(f"{base_code!r:42} {statistics.median(base):6.2f} s "
              f"({min(base):.2f}-{max(base):.2f})")
        print(f"{ours_code!r:42} {statistics.median(ours):6.2f} s "
              f"({min(ours):.2f}-{max(ours):.2f})")
        print(f"{'spark_dl on top (median of differences)':42} {statistics.median(diff):6.2f} s "
              f"({min(diff):.2f}-{max(diff):.2f}); target < 1 s: "
              f"{'met' if statistics.median(diff) < 1.0 else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
