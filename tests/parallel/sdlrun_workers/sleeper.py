"""A worker that stays up: rank 0 exits with the code given in FAIL_CODE once every other
rank is ready (unless FAIL_CODE is empty); the others start a grandchild, report their pids,
write a ready file and sleep. With IGNORE_TERM=1 they ignore SIGTERM."""

import os
import signal
import subprocess
import sys
import time

rank = int(os.environ["SDL_RANK"])
size = int(os.environ["SDL_SIZE"])
ready_dir = os.environ["READY_DIR"]
fail_code = os.environ.get("FAIL_CODE", "")

if rank == 0 and fail_code:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(ready_dir, f"ready.{r}")) for r in range(1, size)):
            break
        time.sleep(0.05)
    print("rank 0 failing", flush=True)
    sys.exit(int(fail_code))

if os.environ.get("IGNORE_TERM") == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen(["sleep", "60"])
print(f"pids {os.getpid()} {child.pid}", flush=True)
with open(os.path.join(ready_dir, f"ready.{rank}"), "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
time.sleep(60)
