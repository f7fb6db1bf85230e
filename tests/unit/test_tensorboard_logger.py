"""TensorBoardLogger starts its writer (and the tensorboard import) only once training has
started: the first step or epoch event, or close() with epochs to write."""

import os

from spark_dl.spark.common.store import Store
from spark_dl.spark.common.tensorboard import TensorBoardLogger


def _events(store, run_id):
    path = store.get_fs_path(store.get_logs_path(run_id))
    return [f for f in os.listdir(path) if f.startswith("events.")] if os.path.isdir(path) else []


def test_writer_starts_at_the_first_step_and_writes_epochs(tmp_path):
    store = Store.create(str(tmp_path))
    board = TensorBoardLogger(store, "r1")
    board.on_event({"kind": "start", "start_epoch": 0})
    assert board._thread is None  # nothing imported while the data is prepared
    board.on_event({"kind": "step", "epoch": 1, "step": 1})
    assert board._thread is not None
    board.on_event({"kind": "epoch", "epoch": 1, "logs": {"loss": 0.5}})
    assert board.close() is None
    assert len(_events(store, "r1")) == 1


def test_no_event_file_when_training_reported_nothing(tmp_path):
    store = Store.create(str(tmp_path))
    board = TensorBoardLogger(store, "r2")
    assert board.close() is None and _events(store, "r2") == []


def test_history_without_live_events_is_written_at_close(tmp_path):
    store = Store.create(str(tmp_path))
    board = TensorBoardLogger(store, "r3")
    assert board.close({"epoch": [1, 2], "loss": [0.5, 0.4]}) is None
    assert len(_events(store, "r3")) == 1
