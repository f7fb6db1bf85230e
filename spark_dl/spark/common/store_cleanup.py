"""Prepared datasets in a store: listing them, their sizes, and deleting old copies
(:meth:`Store.prepared_datasets <spark_dl.spark.common.store.Store.prepared_datasets>`,
``dataset_size`` and ``cleanup`` call these; see docs/data.md, "Cleaning up")."""

import dataclasses
import json
import posixpath
import re
from typing import List, Sequence, Tuple

from spark_dl.spark.common import constants


@dataclasses.dataclass
class CleanupReport:
    """What :meth:`Store.cleanup` kept and removed: ``(dataset index, bytes)`` pairs, newest
    first. ``str()`` gives a one-paragraph summary."""

    kept: List[Tuple[str, int]]
    removed: List[Tuple[str, int]]
    dry_run: bool = False

    @property
    def kept_bytes(self) -> int:
        return sum(n for _, n in self.kept)

    @property
    def freed_bytes(self) -> int:
        """Bytes of the removed datasets (would be freed, for a dry run)."""
        return sum(n for _, n in self.removed)

    def __str__(self) -> str:
        verb = "would remove" if self.dry_run else "removed"
        text = (f"{verb} {len(self.removed)} prepared dataset(s), {_size(self.freed_bytes)}; "
                f"kept {len(self.kept)}, {_size(self.kept_bytes)}")
        if self.kept:
            text += ": " + ", ".join(f"{i} ({_size(n)})" for i, n in self.kept)
        return text


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


_METADATA_RE = re.compile(r"^" + re.escape(constants.METADATA_FILE) + r"\.(.+)\.json$")


def prepared_datasets(store) -> List[Tuple[str, float]]:
    """``(dataset index, creation time)`` of every complete prepared dataset in ``store``
    (its metadata document exists), newest first; the time is 0 when the metadata cannot
    be read."""
    if not store.exists(store.prefix_path):
        return []
    found = []
    for path in store.listdir(store.prefix_path):
        m = _METADATA_RE.match(posixpath.basename(path))
        if not m:
            continue
        try:
            created = float(json.loads(store.read_text(path)).get("created") or 0)
        except (OSError, ValueError, AttributeError):
            created = 0.0
        found.append((m.group(1), created))
    return sorted(found, key=lambda item: item[1], reverse=True)


def dataset_paths(store, idx) -> List[str]:
    """The paths of dataset ``idx``: metadata first (deleted first, so a dataset deleted
    half way is never taken as complete), then its data directories."""
    return [store.get_data_metadata_path(idx), store.get_train_data_path(idx),
            store.get_val_data_path(idx), store.get_test_data_path(idx)]


def cleanup(store, keep_last: int, keep: Sequence[str], dry_run: bool) -> CleanupReport:
    """:meth:`Store.cleanup <spark_dl.spark.common.store.Store.cleanup>`."""
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 0:
        raise ValueError(f"keep_last must be an int >= 0, got {keep_last!r}")
    if isinstance(keep, str):
        keep = [keep]
    keep = {str(k) for k in keep}
    kept, removed = [], []
    for rank, (idx, _) in enumerate(prepared_datasets(store)):
        size = store.dataset_size(idx)
        if rank < keep_last or idx in keep:
            kept.append((idx, size))
            continue
        removed.append((idx, size))
        if not dry_run:
            for path in dataset_paths(store, idx):
                store.delete(path)
    return CleanupReport(kept=kept, removed=removed, dry_run=dry_run)
