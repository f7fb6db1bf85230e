"""The elastic training of elastic_training.py as a script, for sdlrun
(tests/parallel/test_elastic.py); rank 0 writes its result to OUT/result.json."""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from elastic_training import run_training  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--die", action="append", default=[], metavar="W:WHERE:K")
p.add_argument("--probe", action="store_true")
p.add_argument("--grow-at", type=int, default=-1)
p.add_argument("--grow-to", default="")
p.add_argument("--grow-size", type=int, default=0)
p.add_argument("--hosts-file", default="")
p.add_argument("--step-sleep", type=float, default=0.0)
args = vars(p.parse_args())
out = args.pop("out")
result = run_training(**args)
if result is not None:
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f)
