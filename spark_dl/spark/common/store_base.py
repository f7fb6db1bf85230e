"""The abstract :class:`Store`: the layout of a run's artifacts under a prefix, and the
I/O contract every implementation keeps.

Users import it from :mod:`spark_dl.spark.common.store`, which also holds the implementations
and the table :meth:`Store.create` chooses from. This module imports none of them (they
subclass :class:`Store`, so they import it), which keeps the module graph one-directional:
``store`` -> ``store_filesystem`` / ``store_hdfs`` / ``store_databricks`` -> ``store_base``
-> ``remote_store``.
"""

import abc
import dataclasses
import os
import posixpath
import re
import uuid
from typing import Callable, ContextManager, List, Optional, Sequence, Tuple, Type, Union

import pyarrow.fs as pafs

from spark_dl.spark.common import constants, store_cleanup
from spark_dl.spark.common.remote_store import RemoteStore
from spark_dl.spark.common.store_cleanup import CleanupReport

PathLike = Union[str, "os.PathLike[str]"]

_RUN_ID_RE = re.compile(r"^[A-Za-z0-9_.\-=+@]+$")


@dataclasses.dataclass(frozen=True)
class StoreCapabilities:
    """What a store's filesystem guarantees; the generic test suite branches on these flags.

    Attributes:
        atomic_rename: ``rename`` atomically replaces an existing target (local, HDFS). When
            False, atomic writes upload a complete local spool file as one object instead.
        shared_across_processes: other processes (Spark executors, training workers) see the
            same files. False for ``memory://``, which lives in one Python process; such a
            store cannot receive data written by Spark executors.
        local_paths: paths are ordinary paths of this machine's filesystem (LocalStore,
            DBFSLocalStore): training code may open them with plain ``open``.
        real_directories: directories exist on their own (local, HDFS, memory). On object
            stores a directory exists only while some object lies under it.
    """

    atomic_rename: bool
    shared_across_processes: bool
    local_paths: bool
    real_directories: bool


def _check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not _RUN_ID_RE.match(run_id) or run_id in (".", ".."):
        raise ValueError(
            f"run_id {run_id!r} is not a valid run name: use letters, digits and '_.-=+@' only "
            "(no '/', not '.' or '..'), e.g. 'run_2024_01_01'")
    return run_id


def _checked_prefix(prefix_path: PathLike) -> str:
    prefix_path = os.fspath(prefix_path)
    if not prefix_path:
        raise ValueError("store prefix_path is empty: pass a directory or URL, "
                         "e.g. '/tmp/spark_dl' or 's3://bucket/spark_dl'")
    return prefix_path



class Store(abc.ABC):
    """Interface of every store. Layout methods are implemented here; I/O by subclasses.

    Args:
        prefix_path: root of the store, as given by the user (URL or path). Trailing slashes
            are dropped. Nothing is created until something is written.
        train_path, val_path, test_path: override where prepared data goes (used as the stem;
            the dataset index is appended as ``.<idx>``). Default: under the prefix.
        runs_path: override where per-run directories go. Default: ``<prefix>/runs``.
        save_runs: when False, :meth:`get_checkpoint_path` and :meth:`get_logs_path` return
            None and estimators keep no checkpoints or logs in the store.
        checkpoint_filename: file name of a run's checkpoint inside its run directory.
    """

    # The implementations :meth:`create` chooses from, in the order it tries them. They
    # subclass this class, so this module cannot name them; spark_dl.spark.common.store,
    # which imports them all, sets this once (see ``_set_implementations``).
    _implementations: Tuple[Type["Store"], ...] = ()

    def __init__(self, prefix_path: PathLike, train_path: Optional[str] = None,
                 val_path: Optional[str] = None, test_path: Optional[str] = None,
                 runs_path: Optional[str] = None, save_runs: bool = True,
                 checkpoint_filename: str = constants.DEFAULT_CHECKPOINT_FILENAME):
        self.prefix_path = _checked_prefix(prefix_path).rstrip("/") or "/"
        self._train_path = train_path or self._join(constants.TRAIN_DATA_DIR)
        self._val_path = val_path or self._join(constants.VAL_DATA_DIR)
        self._test_path = test_path or self._join(constants.TEST_DATA_DIR)
        self._runs_path = runs_path or self._join(constants.RUNS_DIR)
        self._save_runs = save_runs
        self._checkpoint_filename = checkpoint_filename

    def __repr__(self):
        return f"{type(self).__name__}({self.prefix_path!r})"

    # ---------------------------------------------------------------- factory

    @staticmethod
    def create(prefix_path: PathLike, *args, **kwargs) -> "Store":
        """Return the store implementation that fits ``prefix_path`` (see the table in
        :mod:`spark_dl.spark.common.store`): the first implementation whose :meth:`matches`
        accepts it.

        Extra arguments go to the chosen class's constructor (e.g. ``storage_options`` for
        ``FilesystemStore``, ``user`` for ``HDFSStore``).

        Raises:
            ValueError: for an empty prefix, or one the chosen class refuses (e.g. a
                ``/Volumes/`` path without catalog, schema and volume).
        """
        prefix_path = _checked_prefix(prefix_path)
        if not Store._implementations:
            raise RuntimeError("Store.create has no implementations to choose from: import "
                               "Store from spark_dl.spark.common.store, which registers them")
        for cls in Store._implementations:
            if cls.matches(prefix_path):
                return cls(prefix_path, *args, **kwargs)
        raise ValueError(f"no store implementation accepts {prefix_path!r}")

    @classmethod
    def matches(cls, path: str) -> bool:
        """True if :meth:`create` should build this class for prefix ``path``."""
        del path
        return False

    @staticmethod
    def _set_implementations(*classes: Type["Store"]) -> None:
        """Sets the implementations :meth:`create` tries, most specific first (called once,
        by :mod:`spark_dl.spark.common.store`)."""
        Store._implementations = classes

    # ---------------------------------------------------------------- layout

    def _join(self, *parts: str) -> str:
        return posixpath.join(self.prefix_path, *parts)

    @staticmethod
    def _indexed(path: str, idx) -> str:
        return path if idx is None else f"{path}.{idx}"

    def get_train_data_path(self, idx=None) -> str:
        """Directory of the training Parquet files of dataset ``idx`` (the stem when None)."""
        return self._indexed(self._train_path, idx)

    def get_val_data_path(self, idx=None) -> str:
        """Directory of the validation Parquet files of dataset ``idx``."""
        return self._indexed(self._val_path, idx)

    def get_test_data_path(self, idx=None) -> str:
        """Directory of the test Parquet files of dataset ``idx``."""
        return self._indexed(self._test_path, idx)

    def get_data_metadata_path(self, idx) -> str:
        """JSON metadata of dataset ``idx``; ``prepare_data`` writes it last, so its existence
        means the dataset is complete."""
        return self._join(f"{constants.METADATA_FILE}.{idx}.json")

    def saving_runs(self) -> bool:
        """Whether checkpoints and logs of runs are kept in this store."""
        return self._save_runs

    def get_runs_path(self) -> str:
        """Directory holding one sub-directory per run."""
        return self._runs_path

    def get_run_path(self, run_id: str) -> str:
        """Directory of run ``run_id``. Raises ValueError for names with '/' or '..'."""
        return posixpath.join(self._runs_path, _check_run_id(run_id))

    def get_checkpoint_filename(self) -> str:
        """File name of a run's checkpoint inside its run directory."""
        return self._checkpoint_filename

    def get_logs_subdir(self) -> str:
        """Name of the logs directory inside a run directory."""
        return constants.LOGS_SUBDIR

    def get_checkpoint_path(self, run_id: str) -> Optional[str]:
        """Path of run ``run_id``'s checkpoint, or None when the store does not save runs."""
        if not self._save_runs:
            return None
        return posixpath.join(self.get_run_path(run_id), self.get_checkpoint_filename())

    def get_logs_path(self, run_id: str) -> Optional[str]:
        """Logs directory of run ``run_id``, or None when the store does not save runs."""
        if not self._save_runs:
            return None
        return posixpath.join(self.get_run_path(run_id), self.get_logs_subdir())

    def get_checkpoints(self, run_id: str, suffix: str = "") -> List[str]:
        """Sorted paths of the files in run ``run_id``'s directory whose names start with the
        checkpoint file name and end with ``suffix``. Empty when the run has none (or the run
        directory does not exist)."""
        run_path = self.get_run_path(run_id)
        if not self.exists(run_path):
            return []
        stem = self.get_checkpoint_filename()
        return sorted(p for p in self.listdir(run_path)
                      if posixpath.basename(p).startswith(stem) and p.endswith(suffix))

    # ---------------------------------------------------------------- prepared datasets

    def prepared_datasets(self) -> List[Tuple[str, float]]:
        """``(dataset index, creation time)`` of every complete prepared dataset in this
        store, newest first (the time is 0 when its metadata cannot be read)."""
        return store_cleanup.prepared_datasets(self)

    def disk_usage(self, path: PathLike) -> int:
        """Bytes of the files at or under ``path`` (0 when nothing is there)."""
        fs, fs_path = self.get_filesystem(), self.get_fs_path(path)
        info = fs.get_file_info(fs_path)
        if info.type == pafs.FileType.File:
            return int(info.size or 0)
        if info.type != pafs.FileType.Directory:
            return 0
        infos = fs.get_file_info(pafs.FileSelector(fs_path, recursive=True))
        return sum(int(i.size or 0) for i in infos if i.type == pafs.FileType.File)

    def dataset_size(self, idx) -> int:
        """Bytes of prepared dataset ``idx``: its data directories and metadata."""
        return sum(self.disk_usage(p) for p in store_cleanup.dataset_paths(self, idx))

    def cleanup(self, keep_last: int = 1, keep: Sequence[str] = (),
                dry_run: bool = False) -> CleanupReport:
        """Deletes all but the newest ``keep_last`` prepared datasets of this store.

        Every fit on a DataFrame built anew (new local data, a changed query) prepares a new
        copy of the data in the store, and nothing deletes old copies on its own; this does.
        Run checkpoints and logs (``runs/``) are not touched.

        Args:
            keep_last: how many of the newest datasets to keep (by creation time; 0 deletes
                every one).
            keep: dataset indices to keep as well (e.g. one a later ``fit_on_parquet`` uses).
            dry_run: report what would be removed, delete nothing.

        Returns:
            a :class:`CleanupReport` (``print`` it for a summary with sizes).

        Do not call it while a fit or ``prepare_data`` uses this store: a dataset being
        trained on may be among those deleted. Each dataset's metadata goes first, so a
        dataset interrupted half way through deletion is never taken as complete.
        """
        return store_cleanup.cleanup(self, keep_last, keep, dry_run)

    # ---------------------------------------------------------------- I/O primitives

    @property
    @abc.abstractmethod
    def capabilities(self) -> StoreCapabilities:
        """The :class:`StoreCapabilities` of this store's filesystem."""

    @abc.abstractmethod
    def get_filesystem(self) -> pafs.FileSystem:
        """The ``pyarrow.fs.FileSystem`` every read and write goes through (picklable)."""

    @abc.abstractmethod
    def get_fs_path(self, path: PathLike) -> str:
        """The path of ``path`` inside :meth:`get_filesystem` (no scheme).

        Raises ValueError for a URL of another scheme or another root than this store.
        """

    @abc.abstractmethod
    def exists(self, path: PathLike) -> bool:
        """True if a file or directory exists at ``path``. Never raises for a missing path."""

    @abc.abstractmethod
    def read(self, path: PathLike) -> bytes:
        """Whole content of the file at ``path``.

        Raises FileNotFoundError if it does not exist, IsADirectoryError if it is a directory.
        """

    @abc.abstractmethod
    def write(self, path: PathLike, data: Union[bytes, str]) -> None:
        """Atomically create or replace the file at ``path`` with ``data`` (str is UTF-8).

        Parent directories are created as needed. Readers see the old content or the new one,
        never a mix; a writer that dies part way leaves the old content in place. Raises
        IsADirectoryError if ``path`` is a directory.
        """

    @abc.abstractmethod
    def open_atomic(self, path: PathLike) -> ContextManager:
        """Context manager yielding a binary file object; on a clean exit its content
        atomically replaces ``path`` (as :meth:`write`); on an exception nothing changes."""

    @abc.abstractmethod
    def remove_temporaries(self, path: PathLike) -> List[str]:
        """Deletes the temporary files that interrupted atomic writes left in the
        directory ``path`` (not recursively); returns their paths. Call it only while
        nothing writes into that directory (e.g. at the start of a run, for its run
        directory): a temporary being written is indistinguishable from a stale one.
        Succeeds (returns ``[]``) if the directory does not exist."""

    @abc.abstractmethod
    def delete(self, path: PathLike) -> None:
        """Remove the file, or the directory with everything under it, at ``path``.

        Succeeds (does nothing) if nothing exists there.
        """

    @abc.abstractmethod
    def makedirs(self, path: PathLike) -> None:
        """Create directory ``path`` and its parents. Succeeds if it already exists; raises
        FileExistsError if a file is there. On object stores this may create nothing visible.
        """

    @abc.abstractmethod
    def listdir(self, path: PathLike) -> List[str]:
        """Sorted full paths (as this store returns them) of the direct children of directory
        ``path``. Raises FileNotFoundError if it does not exist, NotADirectoryError if it is a
        file."""

    @abc.abstractmethod
    def upload(self, local_path: str, path: PathLike) -> None:
        """Atomically copy the local file ``local_path`` to ``path`` (as :meth:`write`)."""

    @abc.abstractmethod
    def get_local_output_dir_fn(self, run_id: str) -> Callable[[], ContextManager[str]]:
        """A picklable function returning a context manager that yields a local directory
        where a worker writes run ``run_id``'s outputs before :meth:`sync_fn` publishes them.
        For local stores it is the run directory itself; otherwise a temporary directory that
        is removed on exit."""

    @abc.abstractmethod
    def sync_fn(self, run_id: str) -> Callable[[str], None]:
        """A picklable function ``fn(local_dir)`` that copies files of ``local_dir`` that are
        new or changed since its last call into run ``run_id``'s directory (no-op for local
        stores, where the local directory is the run directory)."""

    # ---------------------------------------------------------------- helpers

    def read_text(self, path: PathLike) -> str:
        """:meth:`read` decoded as UTF-8."""
        return self.read(path).decode("utf-8")

    def write_text(self, path: PathLike, text: str) -> None:
        """:meth:`write` of ``text`` encoded as UTF-8 (atomic)."""
        self.write(path, text.encode("utf-8"))

    def is_parquet_dataset(self, path: PathLike) -> bool:
        """True if ``path`` is a directory holding at least one ``.parquet`` file."""
        try:
            return any(p.endswith(".parquet") for p in self.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return False

    def check_writable(self) -> None:
        """Write and delete a small probe file under the prefix.

        Raises PermissionError naming the prefix and the underlying error when that fails.
        """
        probe = self._join(f".spark_dl_write_probe-{uuid.uuid4().hex}")
        try:
            self.write(probe, b"probe")
            self.delete(probe)
        except Exception as e:  # any backend error means the same thing to the caller
            raise PermissionError(
                f"store {self.prefix_path!r} is not writable ({type(e).__name__}: {e}); "
                "choose a prefix this process (and the Spark executors) can write to, or fix "
                "its permissions/credentials") from e

    def to_remote(self, run_id: Optional[str] = None, dataset_idx=None) -> "RemoteStore":
        """A picklable view of this store for workers, with the paths of one run and one
        prepared dataset resolved (see :class:`RemoteStore`)."""
        return RemoteStore(self, run_id, dataset_idx)

