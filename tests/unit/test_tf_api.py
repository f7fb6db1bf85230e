"""spark_dl.tensorflow in one process: Horovod's names, ops eagerly and in tf.function on a
1-rank job, argument errors before anything is traced, and the XLA refusal."""

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
tf = pytest.importorskip("tensorflow")

import spark_dl.tensorflow as hvd  # noqa: E402

pytestmark = pytest.mark.timeout(120)

HOROVOD_NAMES = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "mpi_threads_supported", "mpi_enabled",
    "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
    "cuda_built", "rocm_built", "start_timeline", "stop_timeline", "Average", "Sum", "Adasum",
    "Min", "Max", "Product",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "allreduce",
    "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "alltoall",
    "reducescatter", "grouped_reducescatter", "join", "barrier", "broadcast_variables",
    "broadcast_object", "allgather_object", "DistributedGradientTape", "Compression",
    "size_op", "rank_op", "local_size_op", "local_rank_op", "broadcast_",
    "process_set_included_op", "DistributedOptimizer", "broadcast_global_variables",
    "SyncBatchNormalization", "PartialDistributedGradientTape",
]


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    hvd.init()
    yield


def test_horovod_names():
    missing = [n for n in HOROVOD_NAMES if not hasattr(hvd, n)]
    assert not missing
    assert set(HOROVOD_NAMES) <= set(hvd.__all__)


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_ops_on_one_rank(mode):
    def run(fn, *a):
        return fn(*a) if mode == "eager" else tf.function(fn)(*a)
    x = tf.constant([[1.0, 2.0], [3.0, 4.0]])
    assert run(lambda t: hvd.allreduce(t, op=hvd.Sum, postscale_factor=2.0), x).numpy().tolist() \
        == [[2.0, 4.0], [6.0, 8.0]]
    assert run(hvd.allgather, x).shape == (2, 2)
    assert run(lambda t: hvd.broadcast(t, 0), x).numpy().tolist() == x.numpy().tolist()
    assert run(hvd.alltoall, x).numpy().tolist() == x.numpy().tolist()  # no splits: no tuple
    out, splits = run(lambda t: hvd.alltoall(t, splits=[2]), x)
    assert out.numpy().tolist() == x.numpy().tolist() and splits.numpy().tolist() == [2]
    a, b = run(lambda t: hvd.grouped_allreduce([t, tf.cast(t, tf.int32)], op=hvd.Max), x)
    assert b.dtype == tf.int32 and a.numpy().tolist() == x.numpy().tolist()
    assert int(run(hvd.join)) == 0


def test_static_shapes_inside_tf_function():
    seen = {}

    @tf.function
    def f(t):
        seen["allreduce"] = hvd.allreduce(t).shape.as_list()
        seen["allgather"] = hvd.allgather(t).shape.as_list()
        return t

    f(tf.zeros([3, 5]))
    assert seen == {"allreduce": [3, 5], "allgather": [None, 5]}


def test_bad_arguments_fail_before_any_work():
    x = tf.constant([1.0])
    with pytest.raises(hvd.InvalidArgumentError, match="Adasum"):
        hvd.allreduce(x, op=hvd.Adasum)
    with pytest.raises(hvd.InvalidArgumentError, match="average"):
        hvd.allreduce(x, average=True, op=hvd.Sum)
    with pytest.raises(hvd.InvalidArgumentError, match="root_rank 3"):
        hvd.broadcast(x, 3)
    with pytest.raises(hvd.InvalidArgumentError, match="scalar"):
        hvd.allgather(tf.constant(1.0))
    with pytest.raises(hvd.InvalidArgumentError, match="GradientTape"):
        hvd.DistributedGradientTape(object())


def test_xla_is_refused_at_trace_time():
    with pytest.raises(hvd.InvalidArgumentError, match="jit_compile=False"):
        tf.function(lambda t: hvd.allreduce(t), jit_compile=True)(tf.constant([1.0]))


def test_fp16_compression_round_trip():
    x = tf.constant([1.5, 2.25], tf.float32)
    wire, ctx = hvd.Compression.fp16.compress(x)
    assert wire.dtype == tf.float16
    assert hvd.Compression.fp16.decompress(wire, ctx).dtype == tf.float32
    ints, ctx = hvd.Compression.fp16.compress(tf.constant([1, 2]))
    assert ints.dtype == tf.int32 and ctx is None


def test_gradient_tape_on_one_rank_is_the_plain_gradient():
    v = tf.Variable(np.ones(3, np.float32))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(v * v)
    grads = hvd.DistributedGradientTape(tape).gradient(loss, [v])
    assert grads[0].numpy().tolist() == [2.0, 2.0, 2.0]


def test_errors_are_tensorflow_and_spark_dl_types():
    from spark_dl.common import exceptions as sdl_errors

    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        hvd.broadcast(tf.constant([1.0]), 3)
    assert isinstance(info.value, sdl_errors.InvalidArgumentError)
    assert issubclass(hvd.MismatchError, tf.errors.FailedPreconditionError)
    assert issubclass(hvd.MismatchError, sdl_errors.MismatchError)
    with pytest.raises(tf.errors.InvalidArgumentError):  # TensorFlow's own, inside tf.function
        tf.function(lambda t: hvd.alltoall(t, splits=[3]))(tf.ones([2]))
    import pickle
    e = pickle.loads(pickle.dumps(hvd.MismatchError("ranks differ")))
    assert isinstance(e, hvd.MismatchError) and str(e) == "ranks differ"


def test_size_op_of_the_global_set_and_an_unknown_one():
    assert int(hvd.size_op()) == 1 and int(hvd.process_set_included_op()) == 1
    with pytest.raises(hvd.InvalidArgumentError, match="process_set_id=5"):
        hvd.size_op(process_set_id=5)


def test_broadcast_global_variables_points_at_broadcast_variables_when_eager():
    with pytest.raises(RuntimeError, match="broadcast_variables"):
        hvd.broadcast_global_variables(0)
