"""Can the executors reach the store? One tiny job says, before any data is prepared.

A store must be one place for the caller and every executor: the caller writes nothing
the workers cannot read, and the workers' checkpoints come back through it. A local path
(``/tmp/run``) on a notebook's machine, or on a laptop holding a Spark Connect session,
names another, empty folder on each executor: without a check, ``prepare_data`` writes
the training data onto the executors' own disks and the fit fails later with a missing
file. :func:`check_store_reachable` writes a marker file into the store from the caller
and has ``tasks`` executor tasks read it back; a task that cannot gets one clear error
naming its host, the store and what to use instead.

Cost: nothing where the caller and the executors share the machine (a classic session
on a local master, or a Connect server with a local master on this machine); elsewhere
one small job (a ``mapInArrow`` of ``tasks`` tasks) per store and session.
"""

import posixpath
import secrets
import threading

__all__ = ["StoreUnreachableError", "check_store_reachable"]

_checked = set()
_lock = threading.Lock()
_SCHEMA = "host string, ok boolean, problem string"


class StoreUnreachableError(ValueError):
    """The executors cannot read what the caller wrote into the store."""


def _same_machine(spark) -> bool:
    from spark_dl.spark.common.session import is_local_master

    return is_local_master(spark)


def _reader(store, path: str, token: bytes):
    """The probe's ``mapInArrow`` function: reads the marker through the store."""

    def read(batches):
        import socket

        import pyarrow as pa

        for _ in batches:
            pass
        try:
            ok = store.read(path) == token
            problem = None if ok else "the file there has other contents"
        except BaseException as exc:  # reported to the caller
            ok, problem = False, f"{type(exc).__name__}: {exc}"
        yield pa.RecordBatch.from_pydict(
            {"host": [socket.gethostname()], "ok": [ok], "problem": [problem]},
            schema=pa.schema([("host", pa.string()), ("ok", pa.bool_()),
                              ("problem", pa.string())]))

    return read


def check_store_reachable(spark, store, tasks: int = 1, timeout: float = 120.0) -> None:
    """Raises when the executors cannot read what this process writes into ``store``.

    Skipped where the caller and the executors share the machine, and after a check that
    passed for the same store and session. A probe that does not finish within
    ``timeout`` (no executor free yet) is cancelled and the check passes.

    Raises:
        StoreUnreachableError: an executor cannot read the marker; names the host, the
            store, what it saw, and what to use instead.
    """
    if _same_machine(spark):
        return
    key = (getattr(spark, "session_id", None) or id(spark), store.prefix_path)
    with _lock:
        if key in _checked:
            return
    from spark_dl.spark.launch.barrier import SparkJob

    token = secrets.token_hex(16).encode()
    path = posixpath.join(store.prefix_path, f".spark_dl_reach_{token[:12].decode()}")
    store.write(path, token)
    try:
        tasks = max(1, int(tasks))
        reader = _reader(store, path, token)
        job = SparkJob(spark, lambda session: session.range(0, tasks, 1, tasks).mapInArrow(
            reader, _SCHEMA), f"spark_dl-store-{token[:8].decode()}",
            "spark_dl: can the executors reach the store?")
        job.start()
        if not job.join(timeout):
            job.cancel()
            return
        if job.error is not None:
            raise job.error
        bad = sorted({(r[0], r[2]) for r in job.rows if not r[1]})
    finally:
        try:
            store.delete(path)
        except Exception:
            pass
    if bad:
        where = "\n  ".join(f"on {host}: {problem}" for host, problem in bad)
        raise StoreUnreachableError(
            f"the Spark executors cannot read the store {store.prefix_path!r} that this "
            f"process writes to:\n  {where}\nA store must be storage that this process and "
            "every executor reach: DBFS or a Unity Catalog Volume on Databricks "
            "(/dbfs/..., /Volumes/<catalog>/<schema>/<volume>/...), HDFS, S3/GCS/ABFS, or a "
            "shared file system mounted at the same path everywhere; a local path of a "
            "notebook or a Spark Connect client is not.")
    with _lock:
        _checked.add(key)
