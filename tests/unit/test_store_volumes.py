"""Databricks Unity Catalog volumes: ``Store.create`` gives a VolumesLocalStore for
``/Volumes/<catalog>/<schema>/<volume>/...`` and ``dbfs:/Volumes/...``, refuses paths that
name no volume, and leaves the DBFS and local cases as they were.

``/Volumes`` is not mounted here: the I/O test points the class's FUSE root at a temporary
directory, as a Databricks node's mount would be, and nothing may touch the real ``/Volumes``.
"""

import os
import pickle

import pytest

from spark_dl.spark.common.store import DBFSLocalStore, LocalStore, Store, VolumesLocalStore


@pytest.mark.parametrize("given, prefix", [
    ("/Volumes/main/default/vol", "/Volumes/main/default/vol"),
    ("/Volumes/main/default/vol/exp/", "/Volumes/main/default/vol/exp"),
    ("dbfs:/Volumes/main/default/vol/exp", "/Volumes/main/default/vol/exp"),
    ("dbfs:///Volumes/main/default/vol/exp", "/Volumes/main/default/vol/exp"),
])
def test_create_picks_the_volume_store(given, prefix):
    existed = os.path.exists("/Volumes")
    store = Store.create(given)
    assert type(store) is VolumesLocalStore and isinstance(store, LocalStore)
    assert store.prefix_path == prefix
    assert store.capabilities.local_paths and store.capabilities.atomic_rename
    assert os.path.exists("/Volumes") == existed  # construction creates nothing


def test_volume_paths_and_uris():
    store = Store.create("dbfs:/Volumes/main/default/vol/exp")
    assert store.get_train_data_path(2) == "/Volumes/main/default/vol/exp/intermediate_train_data.2"
    assert store.get_checkpoint_path("r1") == "/Volumes/main/default/vol/exp/runs/r1/checkpoint"
    assert VolumesLocalStore.to_dbfs_uri(store.get_run_path("r1")) == \
        "dbfs:/Volumes/main/default/vol/exp/runs/r1"
    remote = pickle.loads(pickle.dumps(store.to_remote("r1", dataset_idx=3)))
    assert remote.checkpoint_path == store.get_checkpoint_path("r1")
    assert remote.val_data_path == "/Volumes/main/default/vol/exp/intermediate_val_data.3"


@pytest.mark.parametrize("bad", [
    "/Volumes", "/Volumes/", "/Volumes/main", "/Volumes/main/default",
    "dbfs:/Volumes/main/default", "/Volumes/main//default",
    "/Volumes/main/default/vol/..", "/Volumes/../etc/a/b/c/d",
])
def test_a_path_without_catalog_schema_and_volume_is_refused(bad):
    with pytest.raises(ValueError, match=r"does not name a Unity Catalog volume: expected "
                                         r"/Volumes/<catalog>/<schema>/<volume>") as e:
        Store.create(bad)
    assert repr(bad) in str(e.value) and "LocalStore(path)" in str(e.value)


def test_dbfs_and_local_paths_are_unchanged():
    assert type(Store.create("dbfs:/ml/exp")) is DBFSLocalStore
    assert Store.create("/dbfs/ml/exp").prefix_path == "/dbfs/ml/exp"
    assert not DBFSLocalStore.matches("dbfs:/Volumes/main/default/vol")
    for path in ["/Volumesx/a", "/data/Volumes/a/b/c", "file:///Volumes/Disk"]:
        assert type(Store.create(path)) is LocalStore, path
    assert Store.create("file:///Volumes/Disk").prefix_path == "/Volumes/Disk"


def test_volume_io_through_a_mount(tmp_path, monkeypatch):
    root = str(tmp_path / "Volumes")
    monkeypatch.setattr(VolumesLocalStore, "FUSE_ROOT", root)
    store = Store.create("dbfs:/Volumes/main/default/vol/exp")
    assert type(store) is VolumesLocalStore and store.prefix_path == f"{root}/main/default/vol/exp"
    store.write(store.get_checkpoint_path("r1"), b"ckpt")
    assert os.path.isfile(f"{root}/main/default/vol/exp/runs/r1/checkpoint")
    remote = pickle.loads(pickle.dumps(store.to_remote("r1")))
    assert remote.read(remote.checkpoint_path) == b"ckpt"
    with remote.get_local_output_dir() as local:  # the run directory itself, on a mount
        assert local == store.get_fs_path(store.get_run_path("r1"))
    assert Store.create(f"{root}/main/default/vol/exp").listdir(store.get_run_path("r1")) == \
        [store.get_checkpoint_path("r1")]
