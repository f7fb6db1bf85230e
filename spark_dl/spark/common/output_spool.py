"""The workers' output through the Store, for callers the executors cannot reach.

A fit's training job is coordinated by its task 0, which sends the workers' output (and
so the progress lines) to the caller over a connection where it can. A Spark Connect
client (a Databricks notebook, a laptop) is often unreachable from the cluster; then task
0 writes that output as numbered pieces into the run's folder in the Store, and the
estimator follows them while the job runs (:mod:`spark_dl.spark.launch.link`). The Store
is the one place both sides reach by construction: the workers read their data from it.
"""

import posixpath
import secrets
import time
from typing import List

from spark_dl.spark.launch.link import Spool

__all__ = ["StoreSpool"]


class StoreSpool(Spool):
    """Pieces of output in a folder of a Store (any Store: local, DBFS/Volumes, S3 ...).

    Args:
        store: the Store (it travels to task 0 pickled).
        path: the folder, made on first write.
    """

    def __init__(self, store, path: str):
        self._store = store
        self.path = path

    @classmethod
    def for_run(cls, store, run_id: str) -> "StoreSpool":
        """A new folder ``<run>/output/<time>_<hex>`` (a resumed run gets its own)."""
        name = f"{time.strftime('%Y%m%d_%H%M%S')}_{secrets.token_hex(3)}"
        return cls(store, posixpath.join(store.get_run_path(run_id), "output", name))

    def __repr__(self):
        return f"StoreSpool({self.path!r})"

    def put(self, name: str, data: bytes) -> None:
        self._store.write(posixpath.join(self.path, name), data)  # atomic in every Store

    def get(self, name: str) -> bytes:
        return self._store.read(posixpath.join(self.path, name))

    def names(self) -> List[str]:
        try:
            return [posixpath.basename(p) for p in self._store.listdir(self.path)]
        except FileNotFoundError:
            return []
