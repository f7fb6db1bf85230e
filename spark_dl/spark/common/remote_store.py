"""The worker side of a :class:`~spark_dl.spark.common.store.Store`.

:class:`RemoteStore` is the picklable, run-bound view of a store that the driver hands to
training workers (``Store.to_remote``), together with the picklable callables that
``get_local_output_dir_fn`` and ``sync_fn`` return. It is the bottom of the store modules:
it only calls a store's methods and imports none of them, not even for type hints, so
``store_base`` and ``store_filesystem`` import from it and no circle closes.
"""

import contextlib
import os
import posixpath
import shutil
import tempfile
from typing import ContextManager, List, Optional

import pyarrow.fs as pafs


class RemoteStore:
    """Picklable, run-bound view of a store handed to training workers.

    Attributes mirror Horovod's remote store: ``train_data_path``, ``val_data_path``,
    ``test_data_path``, ``data_metadata_path`` (None without a dataset index), ``runs_path``,
    ``run_path``, ``checkpoint_path``, ``logs_path`` (None without a run id or when the store
    does not save runs), ``checkpoint_filename``, ``logs_subdir``, ``saving_runs``, ``store``
    (the :class:`~spark_dl.spark.common.store.Store` itself).
    """

    def __init__(self, store, run_id: Optional[str] = None, dataset_idx=None):
        self.store = store
        self.run_id = run_id
        self.dataset_idx = dataset_idx
        self.prefix_path = store.prefix_path
        self.train_data_path = store.get_train_data_path(dataset_idx)
        self.val_data_path = store.get_val_data_path(dataset_idx)
        self.test_data_path = store.get_test_data_path(dataset_idx)
        self.data_metadata_path = (store.get_data_metadata_path(dataset_idx)
                                   if dataset_idx is not None else None)
        self.saving_runs = store.saving_runs()
        self.runs_path = store.get_runs_path()
        self.checkpoint_filename = store.get_checkpoint_filename()
        self.logs_subdir = store.get_logs_subdir()
        bound = run_id is not None
        self.run_path = store.get_run_path(run_id) if bound else None
        self.checkpoint_path = store.get_checkpoint_path(run_id) if bound else None
        self.logs_path = store.get_logs_path(run_id) if bound else None

    def __repr__(self):
        return f"RemoteStore({self.store!r}, run_id={self.run_id!r}, " \
               f"dataset_idx={self.dataset_idx!r})"

    def get_filesystem(self) -> pafs.FileSystem:
        return self.store.get_filesystem()

    def get_data_metadata_path(self, idx=None):
        return self.store.get_data_metadata_path(self.dataset_idx if idx is None else idx)

    def get_fs_path(self, path):
        return self.store.get_fs_path(path)

    def exists(self, path) -> bool:
        return self.store.exists(path)

    def read(self, path) -> bytes:
        return self.store.read(path)

    def write(self, path, data) -> None:
        self.store.write(path, data)

    def remove_run_temporaries(self) -> List[str]:
        """Deletes what interrupted atomic writes (e.g. a checkpoint write killed part way)
        left in this run's directory; call it when the run starts, before anything writes
        there. Returns the removed paths."""
        return self.store.remove_temporaries(self.store.get_run_path(self._need_run()))

    def get_local_output_dir(self) -> ContextManager[str]:
        """Context manager yielding the local directory for this run's outputs."""
        return self.store.get_local_output_dir_fn(self._need_run())()

    def sync(self, local_dir: str) -> None:
        """Publish new or changed files of ``local_dir`` into this run's directory."""
        if not hasattr(self, "_sync"):
            self._sync = self.store.sync_fn(self._need_run())
        self._sync(local_dir)

    def _need_run(self) -> str:
        if self.run_id is None:
            raise ValueError("this RemoteStore has no run_id: create it with "
                             "store.to_remote(run_id=...)")
        return self.run_id


# Picklable callables returned by get_local_output_dir_fn / sync_fn (closures do not pickle
# with the standard pickler that Spark may use for task results).

class _LocalRunDir:
    def __init__(self, path: str):
        self.path = path

    @contextlib.contextmanager
    def __call__(self):
        os.makedirs(self.path, exist_ok=True)  # several workers on one host may race: fine
        yield self.path


class _TempRunDir:
    @contextlib.contextmanager
    def __call__(self):
        path = tempfile.mkdtemp(prefix="spark_dl_run_")
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)


def _noop_sync(local_dir: str) -> None:
    del local_dir


class _Syncer:
    def __init__(self, store, run_path: str):
        self.store = store
        self.run_path = run_path
        self.uploaded = {}  # local path -> (mtime_ns, size) at last upload

    def __call__(self, local_dir: str) -> None:
        for dirpath, _, files in os.walk(local_dir):
            rel_dir = os.path.relpath(dirpath, local_dir)
            for name in files:
                local = os.path.join(dirpath, name)
                st = os.stat(local)
                stamp = (st.st_mtime_ns, st.st_size)
                if self.uploaded.get(local) == stamp:
                    continue
                rel = name if rel_dir == "." else posixpath.join(rel_dir.replace(os.sep, "/"),
                                                                 name)
                self.store.upload(local, posixpath.join(self.run_path, rel))
                self.uploaded[local] = stamp
