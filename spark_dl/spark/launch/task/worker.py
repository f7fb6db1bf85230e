"""The worker bootstrap: ``python -m spark_dl.spark.launch.task.worker --job ID --rank R``.

Started by a task service (see :mod:`spark_dl.spark.launch.task.service`) in a session of its
own, with the rank environment (``SDL_RANK`` ... without the secret) and
``SDL_SPARK_DRIVER`` (the driver service's endpoints). It

1. reads the job secret from the first line of stdin, then keeps reading stdin in a
   thread: end of file means the task service is gone or stopping the worker, and the
   worker then kills its whole process group (itself and whatever ``fn`` started);
2. puts the secret into this process's ``os.environ`` as ``SDL_SECRET_KEY``, where
   ``spark_dl``'s ``init()`` reads it (and removes it, so that processes ``fn`` starts
   afterwards do not inherit it). Changing the environment in-process does not change
   what ``ps e`` or ``/proc/<pid>/environ`` show (the environment the process was
   started with);
3. fetches the pickled ``(fn, args, kwargs)`` from the driver, runs it, and posts the
   pickled return value, or the exception (type, summary, traceback, and the pickled
   exception when it pickles); exits 0 after a result, 1 after an exception.

On the MPI path (``--mpi``, no ``--rank``) it is started by ``orted`` instead, with
``SDL_CONTROLLER=mpi``: the rank is MPI's (``OMPI_COMM_WORLD_RANK``); the secret comes
from the task's :class:`~spark_dl.spark.launch.handover.SecretHandover` (its stdin is not a pipe
from the task) and stays out of ``os.environ`` (MPI's ``init()`` needs none); the
variables of its own task (its GPUs) come with the function and are set in-process
before it is loaded; it kills its process group when its parent (``orted``) is gone;
and after an exception it exits at once, without ``MPI_Finalize`` (which would wait for
ranks that may never finalize), so that ``mpirun`` stops the job.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
import traceback
from typing import List, Optional

from spark_dl.spark.launch import pickling
from spark_dl.spark.launch.errors import CONSEQUENCES
from spark_dl.spark.launch.service import ServiceClient
from spark_dl.spark.launch.task.environment import DRIVER_VAR, parse_endpoints

__all__ = ["main"]

_MAX_SECRET_LINE = 1024
_MPI_RANK_VAR = "OMPI_COMM_WORLD_RANK"
_PARENT_POLL_S = 0.5
# On MPI, how long a rank whose exception is a consequence of another rank's failure (a
# lost peer) waits before it exits. mpirun stops the job at the first process that ends
# badly and names only that one: the lost rank (e.g. SIGKILLed) must come first, or the
# job's error names this rank's exit code 1 and not the cause's. mpirun kills this
# process at once when it sees the lost rank, so the wait is seldom paid in full.
_MPI_CONSEQUENCE_EXIT_S = 2.0


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


def _watch_parent() -> None:
    """MPI: ``orted`` (the parent) gone means the job is gone: so is everything here."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_S)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="sdl-parent-watch", daemon=True).start()


def _mpi_secret() -> str:
    from spark_dl.spark.launch.handover import HANDOVER_VAR, fetch_handover

    address = os.environ.get(HANDOVER_VAR)
    if not address:
        raise SystemExit(f"spark_dl worker: no {HANDOVER_VAR} (this program is started by "
                         "orted under a spark_dl task service)")
    return fetch_handover(address)["secret"]


def _load_function(pickler, code: dict):
    try:
        return pickler.loads(code["function"])
    except Exception as exc:
        raise RuntimeError(
            f"cannot load the function sent by the caller of spark_dl.spark.run ({exc}); it "
            f"was pickled with {code['pickler']} there, this worker has "
            f"{pickling.describe()}: the executors must run the caller's Python environment "
            "(set PYSPARK_PYTHON)"
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
    parser = argparse.ArgumentParser(prog="spark_dl.spark.launch.task.worker")
    parser.add_argument("--job", required=True)
    parser.add_argument("--rank", type=int)
    parser.add_argument("--mpi", action="store_true", help="started by orted")
    args = parser.parse_args(argv)
    if args.mpi:
        _watch_parent()
        args.rank = int(os.environ[_MPI_RANK_VAR])
        secret_hex = _mpi_secret()
    elif args.rank is None:
        parser.error("--rank is required without --mpi")
    else:
        secret_hex = _read_secret()
        _watch_stdin()
    if not args.mpi:
        os.environ["SDL_SECRET_KEY"] = secret_hex  # for init()'s rendezvous (Gloo only)
    client = ServiceClient("driver", bytes.fromhex(secret_hex),
                           parse_endpoints(os.environ[DRIVER_VAR]), timeout=60.0)
    pickler = pickling.pickler()
    code = client.call("code", rank=args.rank)
    client.close()  # no idle connection to the driver while fn runs (it reconnects)
    os.environ.update(code.get("env") or {})
    try:
        fn, fn_args, fn_kwargs = _load_function(pickler, code)
        value = pickler.dumps(fn(*fn_args, **fn_kwargs))
    except BaseException as exc:  # SystemExit and KeyboardInterrupt fail the job too
        sys.stdout.flush()
        sys.stderr.write(_format(exc))
        sys.stderr.flush()
        _report_error(client, args.rank, exc)
        if args.mpi:
            if type(exc).__name__ in CONSEQUENCES:
                time.sleep(_MPI_CONSEQUENCE_EXIT_S)
            # Skip MPI_Finalize (at exit): it waits for every rank, and the others may
            # never get there. Exiting without it makes mpirun stop the job at once.
            os._exit(1)
        return 1
    sys.stdout.flush()
    sys.stderr.flush()
    client.call("result", rank=args.rank, value=value)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
