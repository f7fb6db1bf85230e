"""sdlrun names a stopped (hung) rank as the cause when its peer fails waiting for it."""

import io
import os
import signal
import sys
import textwrap
import time

import pytest

from spark_dl.runner.launch import run_command

pytestmark = pytest.mark.timeout(60)

_WORKER = textwrap.dedent("""
    import os, signal, sys, time
    rank = int(os.environ["SDL_RANK"])
    ready = os.path.join(sys.argv[1], "stopping")
    if rank == 1:
        open(ready, "w").close()
        os.kill(os.getpid(), signal.SIGSTOP)  # hung: alive, but never answers
        time.sleep(60)
    deadline = time.monotonic() + 20
    while not os.path.exists(ready) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    print("PeerFailureError: rank 1 did not answer within SDL_TIMEOUT", file=sys.stderr)
    sys.exit(1)  # as a rank whose peer timed out
""")


def test_stopped_rank_is_named_as_the_cause(tmp_path):
    out, err = io.BytesIO(), io.BytesIO()
    start = time.monotonic()
    rc = run_command([sys.executable, "-c", _WORKER, str(tmp_path)], 2, kill_grace=1.0,
                     stdout=out, stderr=err)
    text = err.getvalue().decode()
    assert rc == 1, text
    assert ("rank 1 on localhost is stopped (SIGSTOP, or held by a debugger) and hung the "
            "job; as a consequence, rank 0 on localhost failed with exit code 1") in text
    assert time.monotonic() - start < 20
