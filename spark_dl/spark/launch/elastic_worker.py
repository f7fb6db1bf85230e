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
import sys
import traceback

from spark_dl.common.elastic import SCOPE, WORKER_VAR
# The same secret line and the same end-of-stdin rule as spark.run's workers.
from spark_dl.spark.launch.task.worker import _read_secret, _watch_stdin


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
    except SystemExit as exc:
        if not exc.code:  # e.g. the job finished before a generation took this worker
            return 0
        text = f"SystemExit({exc.code!r})"
        kv.set(SCOPE, f"error/{wid}", json.dumps({"summary": text, "traceback": text})
               .encode())
        return 1
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
