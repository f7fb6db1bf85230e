"""Reuse of prepared datasets across fits, keyed by what the data *is*, not which object.

The key of a prepared dataset is a SHA-256 over the DataFrame's plan fingerprint and every
``prepare_data`` parameter that changes the written data. Two DataFrames built the same way
from the same source therefore share one prepared copy, while any change to the query (a
filter, a column, a seed) is a miss. The fingerprint:

- classic sessions: Spark's ``semanticHash`` of the analyzed plan plus the canonicalized
  analyzed plan's text (both ignore expression ids);
- Spark Connect: the SHA-256 of the plan the client sends, canonicalized (plan ids
  renumbered in order of appearance, call-site origins dropped) and serialized
  deterministically, plus the server's ``semanticHash`` of the analyzed plan. The client's
  plan names temporary views and SQL text without their definitions, so a plan that holds
  SQL text, names a temporary view, or refers to other session state (catalog listings,
  server-side ML objects, opaque extensions) is not cached (:class:`UncacheablePlan`):
  each such ``prepare_data`` writes afresh rather than risk returning another query's data.

What the plan cannot see: a DataFrame read from files (or a table) names the files, not
their content; if the files change under the same path within one session, call
:func:`clear_training_cache` (or ``TrainingDataCache.remove``). DataFrames made from local
Python data carry that data (Connect) or the identity of its RDD (classic, so each creation
is a new key).

The cache lives in the driver process. It only records which dataset index holds which key;
the data is in the Store, and an entry whose metadata file has disappeared from the store is
treated as a miss.
"""

import hashlib
import json
import threading
from typing import Dict, List, Optional, Tuple

from spark_dl.spark.common.store_cleanup import dataset_paths


class UncacheablePlan(Exception):
    """The DataFrame's plan cannot key the cache (the message says why)."""


def plan_fingerprint(df) -> str:
    """Text that is equal for DataFrames with semantically equal plans (see the module doc).

    Raises:
        UncacheablePlan: the plan depends on state it does not show.
    """
    from spark_dl.spark.common.session import is_connect

    if is_connect(df):
        return _connect_fingerprint(df)
    try:
        plan = df._jdf.queryExecution().analyzed().canonicalized().toString()
    except Exception as e:  # a py4j failure: semanticHash alone (32 bits) is too weak
        raise UncacheablePlan(f"the analyzed plan is not readable ({type(e).__name__}: "
                              f"{e})") from e
    return f"semanticHash={df.semanticHash()}\n{plan}"


def cache_key(df, store, params: dict) -> str:
    """SHA-256 hex digest of the plan fingerprint, the store prefix and ``params``.

    Raises:
        UncacheablePlan: from :func:`plan_fingerprint`.
    """
    doc = json.dumps({"plan": plan_fingerprint(df), "store": store.prefix_path,
                      "params": params}, sort_keys=True, default=str)
    return hashlib.sha256(doc.encode("utf-8")).hexdigest()


# ----------------------------------------------------------------------------- Spark Connect

#: Relations whose meaning lives in session state the plan does not carry.
_SESSION_STATE_RELATIONS = {
    "sql": "SQL text (it may name temporary views, functions or variables)",
    "catalog": "a catalog listing", "ml_relation": "a server-side ML object",
    "extension": "a server extension", "unknown": "an unknown relation",
}
#: Messages whose debugging fields (call sites) differ between equal plans.
_COMMON_MESSAGES = ("spark.connect.RelationCommon", "spark.connect.ExpressionCommon")
_DEBUG_FIELDS = ("origin", "source_info")


def _connect_fingerprint(df) -> str:
    spark = df.sparkSession
    # The relation the client sends (to_proto's Plan may hold it zstd-compressed), copied:
    # canonicalizing rewrites it.
    built = df._plan.plan(spark.client)
    plan = type(built)()
    plan.CopyFrom(built)
    tables: List[str] = []
    _canonicalize(plan, {}, tables)
    for name in sorted(set(tables)):
        try:
            temporary = spark.catalog.getTable(name).isTemporary
        except Exception as e:
            raise UncacheablePlan(f"table {name!r} cannot be looked up ({type(e).__name__}: "
                                  f"{e})") from e
        if temporary:
            raise UncacheablePlan(f"it reads the temporary view {name!r}, which the session "
                                  "may redefine")
    digest = hashlib.sha256(plan.SerializeToString(deterministic=True)).hexdigest()
    return f"connect-plan-sha256={digest}\nsemanticHash={df.semanticHash()}"


def _canonicalize(msg, ids: Dict[int, int], tables: List[str]) -> None:
    """Rewrites a Connect plan message in place so that equal queries serialize equally:
    plan ids (fresh per DataFrame on the client) are renumbered from 1 in order of
    appearance, in relations and in the expressions that refer to them alike; call sites
    are dropped. Collects the names of tables read; raises UncacheablePlan for relations
    that depend on session state."""
    desc = msg.DESCRIPTOR
    if desc.full_name == "spark.connect.Relation":
        kind = msg.WhichOneof("rel_type")
        if kind in _SESSION_STATE_RELATIONS:
            raise UncacheablePlan(f"it holds {_SESSION_STATE_RELATIONS[kind]}")
    elif desc.full_name in ("spark.connect.Read.NamedTable", "spark.connect.RelationChanges"):
        tables.append(msg.unparsed_identifier)
    elif desc.full_name in _COMMON_MESSAGES:
        for name in _DEBUG_FIELDS:
            if name in desc.fields_by_name:
                msg.ClearField(name)
    # A plan_id without presence has no "unset": its 0 is an id like any other.
    if "plan_id" in desc.fields_by_name and _set_or_plain(msg, "plan_id"):
        msg.plan_id = ids.setdefault(msg.plan_id, len(ids) + 1)
    for field, value in msg.ListFields():
        if field.type != field.TYPE_MESSAGE:
            continue
        if field.message_type.GetOptions().map_entry:
            if field.message_type.fields_by_name["value"].type != field.TYPE_MESSAGE:
                continue
            children = [value[k] for k in sorted(value)]
        elif _is_repeated(field):
            children = value
        else:
            children = [value]
        for child in children:
            _canonicalize(child, ids, tables)


def _set_or_plain(msg, name: str) -> bool:
    """Whether field ``name`` is set, or has no presence (a plain proto3 scalar)."""
    try:
        return msg.HasField(name)
    except ValueError:  # "has no presence": HasField is only for optional fields
        return True


def _is_repeated(field) -> bool:
    repeated = getattr(field, "is_repeated", None)  # protobuf >= 5; older ones have label
    return repeated if repeated is not None else field.label == field.LABEL_REPEATED


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
