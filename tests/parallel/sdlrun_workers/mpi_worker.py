"""A spark_dl worker for ``sdlrun --mpi``: init, one allreduce, then one JSON report line.

Environment knobs of the test: FAIL_RANK exits that rank with FAIL_CODE after the
allreduce (the others sleep, so that only mpirun ends them); KILL_RANK makes that rank
SIGKILL itself while the others wait in a second allreduce; SLEEP_S keeps every rank up
(after reporting) for signal tests.
"""

import json
import os
import signal
import sys
import time

import numpy as np

import spark_dl.numpy as sdl

sdl.init()
rank, size = sdl.rank(), sdl.size()
total = sdl.allreduce(np.array([rank + 1.0]), op=sdl.Sum, name="sum")
report = {"rank": rank, "size": size, "sum": float(total[0]), "pid": os.getpid(),
          "mpi_enabled": sdl.mpi_enabled(),
          "env": {k: v for k, v in os.environ.items()
                  if k.startswith(("SDL_", "HOROVOD_", "TEST_"))}}
print(json.dumps(report), flush=True)
print(f"rank {rank} to stderr", file=sys.stderr, flush=True)

if os.environ.get("FAIL_RANK") == str(rank):
    time.sleep(0.3)
    sys.stdout.flush()
    os._exit(int(os.environ["FAIL_CODE"]))  # no atexit shutdown: fail like a crash
if os.environ.get("FAIL_RANK"):
    time.sleep(30)
if os.environ.get("KILL_RANK") == str(rank):
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGKILL)
if os.environ.get("KILL_RANK"):
    sdl.allreduce(np.ones(2), name="never")  # fails or is stopped: rank KILL_RANK is gone
time.sleep(float(os.environ.get("SLEEP_S", "0")))
