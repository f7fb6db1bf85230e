"""Elastic Keras / TensorFlow in one process: the API at Horovod's paths, KerasState's
commit/restore/sync/reset, the callbacks' bookkeeping in a real ``fit``, and the
translation of a peer failure raised inside ``tf.function`` (multi-process:
tests/parallel/test_elastic_keras.py)."""

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import spark_dl.keras as hvd  # noqa: E402
import spark_dl.tensorflow as hvd_tf  # noqa: E402
from spark_dl.common.exceptions import PeerFailureError, ShutdownError  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    hvd.init()
    yield


def _model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.05)), loss="mse")
    return model


def test_the_api_is_at_horovods_paths():
    import spark_dl.tensorflow.keras as hvd_tfk
    import spark_dl.tensorflow.keras.elastic as tfk_elastic

    e = hvd.elastic
    for name in ("run", "State", "ObjectState", "KerasState", "TensorFlowKerasState",
                 "HostsUpdatedInterrupt", "CommitStateCallback", "UpdateBatchStateCallback",
                 "UpdateEpochStateCallback"):
        assert hasattr(e, name), name
    assert tfk_elastic is e and hvd_tfk.elastic is e
    assert e.KerasState is e.TensorFlowKerasState is hvd_tf.elastic.TensorFlowKerasState
    for name in ("run", "State", "ObjectState", "TensorFlowState", "HostsUpdatedInterrupt"):
        assert hasattr(hvd_tf.elastic, name), name
    assert e.HostsUpdatedInterrupt is hvd_tf.elastic.HostsUpdatedInterrupt
    assert issubclass(e.CommitStateCallback, keras.callbacks.Callback)


def test_keras_state_builds_the_optimizer_commits_restores_and_resets():
    model = _model()
    state = hvd.elastic.KerasState(model, epoch=0, batch=0)
    assert state.optimizer is model.optimizer
    x, y = np.ones((8, 3), "float32"), np.zeros((8, 1), "float32")
    model.fit(x, y, batch_size=4, verbose=0)
    state.epoch = 1
    state.commit()
    committed = [w.copy() for w in model.get_weights()]
    slots = [v.numpy() for v in model.optimizer.variables]
    model.fit(x, y, batch_size=4, verbose=0)
    state.epoch = 2
    assert not np.allclose(model.get_weights()[0], committed[0])
    state.restore()
    assert state.epoch == 1
    for a, b in zip(model.get_weights(), committed):
        np.testing.assert_array_equal(a, b)
    for v, s in zip(model.optimizer.variables, slots):
        np.testing.assert_array_equal(v.numpy(), s)
    assert model.train_function is not None and model.optimizer._sdl_active is not None
    state.reset()  # the next fit retraces for the new membership
    assert model.train_function is None and model.optimizer._sdl_active is None
    state.sync()   # one rank: rank 0's values are its own
    np.testing.assert_array_equal(model.get_weights()[0], committed[0])


def test_a_newcomers_unbuilt_optimizer_is_built_before_anything_is_saved():
    model = _model()
    assert not model.optimizer.built  # never applied, as on a worker that just joined
    hvd.elastic.KerasState(model, epoch=0)
    # iteration, learning rate, and Adam's two slots per trainable variable
    assert len(model.optimizer.variables) == 2 + 2 * len(model.trainable_variables)


class _Recorder:
    """A stand-in state: records (epoch, batch) at every commit."""

    def __init__(self):
        self.epoch, self.batch, self.commits = 0, 0, []

    def commit(self):
        self.commits.append((self.epoch, self.batch))


@pytest.mark.parametrize("order", ["commit_first", "commit_last"])
def test_callbacks_keep_epoch_and_batch_and_commit_after_every_update(order):
    model = _model()
    state = _Recorder()
    updates = [hvd.elastic.UpdateBatchStateCallback(state),
               hvd.elastic.UpdateEpochStateCallback(state)]
    commit = hvd.elastic.CommitStateCallback(state, batches_per_commit=2)
    callbacks = [commit] + updates if order == "commit_first" else updates + [commit]
    x, y = np.ones((20, 3), "float32"), np.zeros((20, 1), "float32")   # 5 batches of 4
    model.fit(x, y, batch_size=4, epochs=2, callbacks=callbacks, verbose=0)
    # Every 2 batches, and at each epoch's end (after the epoch count moved on), whatever
    # the callbacks' order.
    assert state.commits == [(0, 2), (0, 4), (1, 0), (1, 2), (1, 4), (2, 0)]
    # A re-entered fit resumes at state.epoch, with initial_epoch or Horovod's epochs=E-e.
    model.fit(x, y, batch_size=4, initial_epoch=state.epoch, epochs=3, callbacks=callbacks,
              verbose=0)
    assert state.epoch == 3 and state.commits[-1] == (3, 0)
    model.fit(x, y, batch_size=4, epochs=4 - state.epoch, callbacks=callbacks, verbose=0)
    assert state.epoch == 4
    with pytest.raises(hvd.InvalidArgumentError, match="batches_per_commit"):
        hvd.elastic.CommitStateCallback(state, batches_per_commit=0)


@pytest.mark.parametrize("cls", [PeerFailureError, ShutdownError])
def test_a_failure_inside_tf_function_counts_as_the_one_it_names(cls):
    def body(x):
        raise cls("rank 2 is gone (test)")

    @tf.function
    def step(x):
        return tf.numpy_function(body, [x], tf.float32, stateful=True)

    with pytest.raises(tf.errors.OpError) as info:
        step(tf.constant(1.0))
    error = hvd_tf.elastic.recoverable_error(info.value)
    assert type(error) is cls and str(error) == "rank 2 is gone (test)"
    assert hvd_tf.elastic.recoverable_error(tf.errors.UnknownError(None, None, "other")) is None
    assert hvd_tf.elastic.recoverable_error(ValueError("PeerFailureError: x")) is None


def test_tensorflow_state_commits_restores_and_syncs():
    v = tf.Variable([1.0, 2.0])
    state = hvd_tf.elastic.TensorFlowState([v], step=0)
    v.assign([5.0, 6.0])
    state.step = 3
    state.restore()
    np.testing.assert_array_equal(v.numpy(), [1.0, 2.0])
    assert state.step == 0
    v.assign([7.0, 8.0])
    state.commit()
    state.sync()
    np.testing.assert_array_equal(v.numpy(), [7.0, 8.0])
    with pytest.raises(ValueError, match="needs the variables"):
        hvd_tf.elastic.TensorFlowState()
