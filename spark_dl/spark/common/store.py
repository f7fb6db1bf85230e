"""Where a run's artifacts live: prepared Parquet data, metadata, checkpoints and logs.

A :class:`Store` is a prefix on some filesystem plus a fixed layout under it::

    <prefix>/intermediate_train_data.<idx>/part-00000.parquet ...   prepared training data
    <prefix>/intermediate_val_data.<idx>/...                        prepared validation data
    <prefix>/intermediate_metadata.<idx>.json                       dataset metadata (commit mark)
    <prefix>/runs/<run_id>/checkpoint                               latest checkpoint of a run
    <prefix>/runs/<run_id>/logs/                                    logs of a run

``Store.create(prefix)`` picks the implementation from the prefix, trying the rows in order:

=============================================  ================================================
prefix                                         store
=============================================  ================================================
``hdfs://``, ``viewfs://``                     :class:`HDFSStore` (``pyarrow.fs.HadoopFileSystem``)
``/Volumes/<catalog>/<schema>/<volume>/...``,  :class:`VolumesLocalStore` (a Unity Catalog
``dbfs:/Volumes/...``                          volume through its FUSE path)
``dbfs:/``, ``/dbfs/``                         :class:`DBFSLocalStore` (Databricks FUSE mount)
``/path``, ``relative/path``, ``file://``      :class:`LocalStore` (``pyarrow.fs.LocalFileSystem``)
anything else (``s3://``, ``gs://``,           :class:`FilesystemStore` over the fsspec
``abfs://``, ``memory://`` ...)                filesystem of the URL, or over one you pass
=============================================  ================================================

Every method that takes a path accepts a path this store returned (a URL under the prefix), a
filesystem path under the prefix, or a path relative to the prefix. Every implementation reads
and writes through one ``pyarrow.fs.FileSystem`` (fsspec filesystems are wrapped with
``pyarrow.fs.FSSpecHandler``), so the Parquet reader and writer use the same object. Writes
are atomic (see :mod:`.store_filesystem` for how, per kind of filesystem).

This module is the public face; one concern per module behind it:

- :mod:`.store_base` -- the abstract :class:`Store` (layout, I/O contract, ``create``) and
  :class:`StoreCapabilities`;
- :mod:`.store_filesystem` -- :class:`FilesystemStore`, :class:`LocalStore` and the
  atomic-write helpers; :mod:`.store_hdfs` -- :class:`HDFSStore`; :mod:`.store_databricks` --
  :class:`DBFSLocalStore`, :class:`VolumesLocalStore`;
- :mod:`.remote_store` -- :class:`RemoteStore`, what travels to the workers;
  :mod:`.store_cleanup` -- listing and deleting prepared datasets.

Stores pickled when all classes lived in this module still load: the names stay here.
"""

from spark_dl.spark.common.remote_store import RemoteStore
from spark_dl.spark.common.store_base import PathLike, Store, StoreCapabilities
from spark_dl.spark.common.store_cleanup import CleanupReport
from spark_dl.spark.common.store_databricks import DBFSLocalStore, VolumesLocalStore
from spark_dl.spark.common.store_filesystem import FilesystemStore, LocalStore
from spark_dl.spark.common.store_hdfs import HDFSStore

__all__ = ["CleanupReport", "DBFSLocalStore", "FilesystemStore", "HDFSStore", "LocalStore",
           "PathLike", "RemoteStore", "Store", "StoreCapabilities", "VolumesLocalStore"]

# The rows of the table above. Each class but the last claims the prefixes of its row only
# (DBFSLocalStore leaves dbfs:/Volumes to VolumesLocalStore); LocalStore takes every path
# without a scheme, so the Databricks mounts come before it; FilesystemStore takes the rest.
Store._set_implementations(HDFSStore, VolumesLocalStore, DBFSLocalStore, LocalStore,
                           FilesystemStore)
