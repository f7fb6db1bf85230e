"""Stores on Databricks storage through the local FUSE paths every cluster node mounts: DBFS
(``/dbfs``) and Unity Catalog volumes (``/Volumes``).

Both are :class:`~spark_dl.spark.common.store_filesystem.LocalStore` subclasses that only
translate ``dbfs:/`` URIs to the FUSE path; nothing is checked at construction, so on a
machine without the mount the store is a plain local directory of that name (and writes fail
where it cannot be created), as on Databricks before the mount is ready.
"""

import os
import posixpath

from spark_dl.spark.common.store_base import PathLike
from spark_dl.spark.common.store_filesystem import LocalStore


class DBFSLocalStore(LocalStore):
    """A store on the Databricks File System through its local FUSE mount ``/dbfs``.

    ``dbfs:/dir`` and ``/dbfs/dir`` name the same store; paths are returned in the ``/dbfs/``
    form, which every process on a Databricks cluster can open. Use :meth:`to_dbfs_uri` for
    Spark readers that want ``dbfs:/``. ``dbfs:/Volumes/...`` names a Unity Catalog volume,
    not a DBFS directory: :meth:`Store.create <spark_dl.spark.common.store_base.Store.create>`
    gives a :class:`VolumesLocalStore` for it.
    """

    DBFS_PREFIX = "dbfs:/"
    FUSE_ROOT = "/dbfs"

    def __init__(self, prefix_path: PathLike, **kwargs):
        super().__init__(self.to_fuse_path(os.fspath(prefix_path)), **kwargs)

    @classmethod
    def matches(cls, path: str) -> bool:
        """True for ``dbfs:/...`` URLs (but ``dbfs:/Volumes/...``) and ``/dbfs/...`` paths."""
        if VolumesLocalStore.matches(path):
            return False
        return path.startswith(cls.DBFS_PREFIX) or path == cls.FUSE_ROOT or \
            path.startswith(cls.FUSE_ROOT + "/")

    @classmethod
    def to_fuse_path(cls, path: str) -> str:
        """``dbfs:/a/b`` -> ``/dbfs/a/b``; ``/dbfs/...`` is returned unchanged."""
        if path.startswith(cls.DBFS_PREFIX):
            return posixpath.join(cls.FUSE_ROOT, path[len(cls.DBFS_PREFIX):].lstrip("/"))
        return path

    @classmethod
    def to_dbfs_uri(cls, path: str) -> str:
        """``/dbfs/a/b`` -> ``dbfs:/a/b``."""
        if path.startswith(cls.FUSE_ROOT + "/"):
            return cls.DBFS_PREFIX + path[len(cls.FUSE_ROOT) + 1:]
        return path


class VolumesLocalStore(LocalStore):
    """A store in a Databricks Unity Catalog volume through its FUSE path ``/Volumes``.

    ``/Volumes/<catalog>/<schema>/<volume>/dir`` and ``dbfs:/Volumes/<catalog>/<schema>/
    <volume>/dir`` name the same store; paths are returned in the ``/Volumes/`` form, which
    every process of a Unity Catalog cluster allowed to use the volume can open, and which
    Spark on Databricks reads as it is. :meth:`to_dbfs_uri` gives the ``dbfs:/Volumes/`` form.

    Raises:
        ValueError: when the path does not name a volume: ``/Volumes/`` must be followed by a
            catalog, a schema and a volume.
    """

    DBFS_PREFIX = DBFSLocalStore.DBFS_PREFIX
    DBFS_DIR = "/Volumes"  # where volumes are in the dbfs:/ namespace
    FUSE_ROOT = "/Volumes"  # where they are mounted

    def __init__(self, prefix_path: PathLike, **kwargs):
        prefix_path = os.fspath(prefix_path)
        fuse_path = self.to_fuse_path(prefix_path)
        if not self._names_a_volume(fuse_path):
            raise ValueError(
                f"{prefix_path!r} does not name a Unity Catalog volume: expected "
                f"{self.FUSE_ROOT}/<catalog>/<schema>/<volume>[/<dir>...] or "
                f"{self.DBFS_PREFIX}{self.DBFS_DIR.lstrip('/')}/<catalog>/<schema>/<volume>"
                f"[/<dir>...]; for a local directory under {self.FUSE_ROOT} that is not a "
                f"volume (e.g. a macOS disk), use LocalStore(path) or a file:// URL")
        super().__init__(fuse_path, **kwargs)

    @classmethod
    def matches(cls, path: str) -> bool:
        """True for ``/Volumes/...`` paths and ``dbfs:/Volumes/...`` URLs (well formed or
        not: the constructor names what a malformed one lacks)."""
        fuse = cls.to_fuse_path(path)
        return fuse == cls.FUSE_ROOT or fuse.startswith(cls.FUSE_ROOT + "/")

    @classmethod
    def to_fuse_path(cls, path: str) -> str:
        """``dbfs:/Volumes/c/s/v/d`` -> ``/Volumes/c/s/v/d``; other paths are returned
        unchanged."""
        if not path.startswith(cls.DBFS_PREFIX):
            return path
        dbfs_path = "/" + path[len(cls.DBFS_PREFIX):].lstrip("/")
        if dbfs_path == cls.DBFS_DIR or dbfs_path.startswith(cls.DBFS_DIR + "/"):
            return cls.FUSE_ROOT + dbfs_path[len(cls.DBFS_DIR):]
        return path

    @classmethod
    def to_dbfs_uri(cls, path: str) -> str:
        """``/Volumes/c/s/v/d`` -> ``dbfs:/Volumes/c/s/v/d``."""
        if path.startswith(cls.FUSE_ROOT + "/"):
            return cls.DBFS_PREFIX + cls.DBFS_DIR.lstrip("/") + path[len(cls.FUSE_ROOT):]
        return path

    @classmethod
    def _names_a_volume(cls, fuse_path: str) -> bool:
        # normpath drops empty and '.' parts and resolves '..', so what is left under the
        # root are real names (and a path that climbs out of the root is refused).
        normal = posixpath.normpath(fuse_path)
        root = cls.FUSE_ROOT + "/"
        return normal.startswith(root) and len(normal[len(root):].split("/")) >= 3
