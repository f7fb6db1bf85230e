"""Reuse of prepared datasets across fits, keyed by what the data *is*, not which object.

The key of a prepared dataset is a SHA-256 over the DataFrame's plan fingerprint (Spark's
``semanticHash`` of the analyzed plan, which ignores expression ids, plus the canonicalized
plan text) and every ``prepare_data`` parameter that changes the written data. Two DataFrames
built the same way from the same source therefore share one prepared copy, while any change to
the query (a filter, a column, a seed) is a miss.

What the plan cannot see: a DataFrame read from files names the files, not their content; if
the files change under the same path within one session, call :func:`clear_training_cache`
(or ``TrainingDataCache.remove``). DataFrames made from local Python data or RDDs carry the
identity of that data, so each creation is a new key.

The cache lives in the driver process. It only records which dataset index holds which key;
the data is in the Store, and an entry whose metadata file has disappeared from the store is
treated as a miss.
"""

import hashlib
import json
import threading
from typing import Dict, Optional, Tuple

from spark_dl.spark.common.store_cleanup import dataset_paths


def plan_fingerprint(df) -> str:
    """Text that is equal for DataFrames with semantically equal analyzed plans."""
    parts = [f"semanticHash={df.semanticHash()}"]
    try:  # classic (py4j) sessions; Spark Connect has only semanticHash
        parts.append(df._jdf.queryExecution().analyzed().canonicalized().toString())
    except Exception:
        pass
    return "\n".join(parts)


def cache_key(df, store, params: dict) -> str:
    """SHA-256 hex digest of the plan fingerprint, the store prefix and ``params``."""
    doc = json.dumps({"plan": plan_fingerprint(df), "store": store.prefix_path,
                      "params": params}, sort_keys=True, default=str)
    return hashlib.sha256(doc.encode("utf-8")).hexdigest()


class TrainingDataCache:
    """key -> (store, dataset index) of the datasets prepared in this process."""

    def __init__(self):
        self._entries: Dict[str, Tuple[object, str]] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> Optional[str]:
        """The dataset index for ``key`` if it is still complete in its store, else None."""
        with self._lock:
            entry = self._entries.get(key)
        if entry is None:
            return None
        store, idx = entry
        if not store.exists(store.get_data_metadata_path(idx)):
            with self._lock:
                self._entries.pop(key, None)
            return None
        return idx

    def put(self, key: str, store, idx: str) -> None:
        with self._lock:
            self._entries[key] = (store, idx)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return self.get(key) is not None

    def remove(self, key: str, delete: bool = True) -> bool:
        """Forget ``key`` (and delete its data from the store when ``delete``). Returns whether
        it was cached."""
        with self._lock:
            entry = self._entries.pop(key, None)
        if entry is None:
            return False
        if delete:
            delete_dataset(*entry)
        return True

    def forget_dataset(self, store, idx) -> None:
        """Forget every key that points at dataset ``idx`` of ``store`` (data untouched)."""
        with self._lock:
            for k in [k for k, (s, i) in self._entries.items()
                      if i == idx and s.prefix_path == store.prefix_path]:
                del self._entries[k]

    def clear(self, delete: bool = True) -> None:
        """Forget every entry, deleting the prepared data from the stores when ``delete``."""
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
        if delete:
            for store, idx in entries:
                delete_dataset(store, idx)


def delete_dataset(store, idx) -> None:
    """Remove dataset ``idx`` from ``store``: metadata first (so a half-deleted dataset is
    never taken as complete), then the data directories. Missing parts are ignored."""
    for path in dataset_paths(store, idx):
        store.delete(path)
