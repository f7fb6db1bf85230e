"""The worker of an elastic Spark job: ``python -m spark_dl.spark.launch.elastic_worker``.

Started by a task of :func:`~spark_dl.spark.launch.elastic_run.run_elastic` with the
elastic worker's environment (its id, the caller's rendezvous server) but not the secret,
which arrives as the first line of stdin. stdin then stays open: its end of file means the
task is gone, and the worker ends its whole process group. The worker fetches the pickled
``(fn, args, kwargs)`` from the caller's rendezvous server, runs it (its ``init()`` joins
the job's generations) and posts the pickled return value (``elastic/result/<id>``), or
its error as JSON (``elastic/error/<id>``: summary and traceback), exiting 0 or 1.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import traceback

from spark_dl.common.elastic import SCOPE, WORKER_VAR


def _read_secret() -> str:
    data = bytearray()
    while not data.endswith(b"\n") and len(data) < 1024:
        chunk = os.read(0, 1)  # byte by byte: nothing after the line is consumed
        if not chunk:
            break
        data += chunk
    if not data.endswith(b"\n"):
        raise SystemExit("spark_dl elastic worker: no secret on stdin (this program is started "
                         "by a task of spark_dl.spark.run_elastic)")
    return data.decode("ascii").strip()


def _watch_stdin() -> None:
    def watch() -> None:
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        os.killpg(os.getpgrp(), signal.SIGKILL)  # the task is gone: so is its worker

    threading.Thread(target=watch, name="sdl-stdin-watch", daemon=True).start()


def main() -> int:
    os.environ["SDL_SECRET_KEY"] = _read_secret()
    _watch_stdin()
    from spark_dl.rendezvous.client import client_from_env
    from spark_dl.spark.launch import pickling

    wid = os.environ[WORKER_VAR]
    kv = client_from_env(os.environ)
    fn, args, kwargs = pickling.pickler().loads(kv.get(SCOPE, "code"))
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:  # reported to the caller, then the exit code says it
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        sys.stderr.write(text)
        kv.set(SCOPE, f"error/{wid}", json.dumps(
            {"summary": f"{type(exc).__name__}: {exc}", "traceback": text}).encode())
        return 1
    kv.set(SCOPE, f"result/{wid}", pickling.pickler().dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
