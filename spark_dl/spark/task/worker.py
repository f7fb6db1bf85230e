"""The worker bootstrap: ``python -m spark_dl.spark.task.worker --job ID --rank R``.

Started by a task service (see :mod:`spark_dl.spark.task.service`) in a session of its
own, with the rank environment (``SDL_RANK`` ... without the secret) and
``SDL_SPARK_DRIVER`` (the driver service's endpoints). It

1. reads the job secret from the first line of stdin, then keeps reading stdin in a
   thread: end of file means the task service is gone or stopping the worker, and the
   worker then kills its whole process group (itself and whatever ``fn`` started);
2. puts the secret into this process's ``os.environ`` as ``SDL_SECRET_KEY``, where
   ``spark_dl``'s ``init()`` reads it. Changing the environment in-process does not
   change what ``ps e`` or ``/proc/<pid>/environ`` show (the environment the process
   was started with); processes ``fn`` itself starts do inherit it;
3. fetches the pickled ``(fn, args, kwargs)`` from the driver, runs it, and posts the
   pickled return value, or the exception (type, summary, traceback, and the pickled
   exception when it pickles); exits 0 after a result, 1 after an exception.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import traceback
from typing import List, Optional

from spark_dl.spark import pickling
from spark_dl.spark.service import ServiceClient
from spark_dl.spark.task.environment import DRIVER_VAR, parse_endpoints

__all__ = ["main"]

_MAX_SECRET_LINE = 1024


def _read_secret() -> str:
    data = bytearray()
    while not data.endswith(b"\n") and len(data) < _MAX_SECRET_LINE:
        chunk = os.read(0, 1)  # byte by byte: nothing after the line is consumed
        if not chunk:
            break
        data += chunk
    if not data.endswith(b"\n"):
        raise SystemExit("spark_dl worker: no secret on stdin (this program is started by a "
                         "spark_dl task service)")
    return data.decode("ascii").strip()


def _watch_stdin() -> None:
    def watch() -> None:
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        # The task service closed the pipe or died: nothing may outlive it.
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="sdl-stdin-watch", daemon=True).start()


def _load_function(pickler, code: dict):
    try:
        return pickler.loads(code["function"])
    except Exception as exc:
        raise RuntimeError(
            f"cannot load the function sent by the driver ({exc}); it was pickled with "
            f"{code['pickler']} on the driver, this worker has {pickling.describe()}: the "
            "executors must run the driver's Python environment (set PYSPARK_PYTHON)"
        ) from exc


def _format(exc: BaseException) -> str:
    """The traceback without the bootstrap's own frame."""
    tb = exc.__traceback__
    if tb is not None and tb.tb_frame.f_code.co_filename == __file__ and tb.tb_next:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _report_error(client: ServiceClient, rank: int, exc: BaseException) -> None:
    try:
        blob: Optional[bytes] = pickling.pickler().dumps(exc)
    except Exception:
        blob = None
    summary = f"rank {rank} raised {type(exc).__name__}: {exc}"
    exc_type = f"{type(exc).__module__}.{type(exc).__qualname__}"
    client.call("error", rank=rank, exc_type=exc_type, summary=summary,
                traceback=_format(exc), exception=blob)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="spark_dl.spark.task.worker")
    parser.add_argument("--job", required=True)
    parser.add_argument("--rank", type=int, required=True)
    args = parser.parse_args(argv)
    secret_hex = _read_secret()
    _watch_stdin()
    os.environ["SDL_SECRET_KEY"] = secret_hex
    client = ServiceClient("driver", bytes.fromhex(secret_hex),
                           parse_endpoints(os.environ[DRIVER_VAR]), timeout=60.0)
    pickler = pickling.pickler()
    code = client.call("code", rank=args.rank)
    client.close()  # no idle connection to the driver while fn runs (it reconnects)
    try:
        fn, fn_args, fn_kwargs = _load_function(pickler, code)
        value = pickler.dumps(fn(*fn_args, **fn_kwargs))
    except BaseException as exc:  # SystemExit and KeyboardInterrupt fail the job too
        sys.stdout.flush()
        sys.stderr.write(_format(exc))
        sys.stderr.flush()
        _report_error(client, args.rank, exc)
        return 1
    sys.stdout.flush()
    sys.stderr.flush()
    client.call("result", rank=args.rank, value=value)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
