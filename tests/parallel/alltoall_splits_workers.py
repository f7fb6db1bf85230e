"""Functions run on spawned ranks by tests/parallel/test_alltoall_splits.py (see harness.py).

Every rank passes the same bad splits to alltoall through one front end (torch, numpy or
TensorFlow) and reports what was raised; then every rank runs a good alltoall, which only
completes if no bad call enqueued anything on any rank.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402


def bad_cases(size):
    """name -> (rows of the tensor, splits as a list or NumPy array); every rank the same."""
    return {
        "float_list": (size, [1.0] * size),
        "fractional_list": (size, [1.5] + [0.5] * (size - 1) if size > 1 else [1.5]),
        "float_array": (size, np.ones(size, np.float32)),
        "bool_list": (size, [True] * size),
        "string_list": (size, ["1"] * size),
        "negative": (size, [-1] + [1] * (size - 2) + [2]),
        "wrong_length": (size, [size]),
        "sum_too_big": (size, [1] * (size - 1) + [2]),
        "sum_too_small": (size + 1, [1] * size),
        "two_dims": (size, [[1] * size]),
    }


def _outcome(call):
    try:
        call()
    except Exception as e:  # noqa: BLE001 - reported
        return {"type": type(e).__name__, "message": str(e),
                "invalid_argument": _is_invalid_argument(e),
                "value_error": isinstance(e, ValueError),
                "runtime_error": isinstance(e, RuntimeError)}
    return None


def _is_invalid_argument(e):
    from spark_dl.common.exceptions import InvalidArgumentError

    return isinstance(e, InvalidArgumentError)


def _torch_calls(rank, size):
    import torch

    import spark_dl.torch as hvd

    calls = {}
    for case, (rows, splits) in bad_cases(size).items():
        x = torch.ones(rows, 2)
        if isinstance(splits, np.ndarray):  # a float32 tensor: its dtype must be refused
            splits = torch.from_numpy(splits)
        calls[case] = lambda x=x, s=splits: hvd.alltoall(x, s)
    calls["float_tensor_async"] = lambda: hvd.alltoall_async(
        torch.ones(size), torch.ones(size, dtype=torch.float64))

    def good():
        x = torch.full((size,), float(rank))
        out, received = hvd.alltoall(x, torch.ones(size, dtype=torch.int32), name="good.torch")
        return out.tolist(), received.tolist()
    return calls, good


def _numpy_calls(rank, size):
    import spark_dl.numpy as sn

    calls = {case: (lambda rows=rows, s=splits: sn.alltoall(np.ones((rows, 2)), s))
             for case, (rows, splits) in bad_cases(size).items()}

    def good():
        out, received = sn.alltoall(np.full(size, float(rank)), [1] * size, name="good.numpy")
        return out.tolist(), received.tolist()
    return calls, good


def _tf_calls(rank, size):
    import tensorflow as tf

    import spark_dl.tensorflow as hvd

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    calls = {case: (lambda rows=rows, s=splits: hvd.alltoall(tf.ones((rows, 2)), s))
             for case, (rows, splits) in bad_cases(size).items()
             if case != "string_list"}  # TensorFlow cannot take strings into the op
    calls["float_tensor"] = lambda: hvd.alltoall(tf.ones(size), tf.ones(size))

    def good():
        out, received = hvd.alltoall(tf.fill([size], float(rank)), [1] * size, name="good.tf")
        return out.numpy().tolist(), received.numpy().tolist()
    return calls, good


def _tf_function_float_splits(size):
    """Float splits inside tf.function: refused by the same check before anything is sent
    (the exception type there is TensorFlow's wrapping, not checked here)."""
    import tensorflow as tf

    import spark_dl.tensorflow as hvd

    @tf.function
    def fn(x, s):
        return hvd.alltoall(x, s)

    return _outcome(lambda: fn(tf.ones(size), tf.ones(size)))


FRONT_ENDS = {"torch": _torch_calls, "numpy": _numpy_calls, "tensorflow": _tf_calls}


def bad_splits(front_end):
    """{case: outcome of the bad call}, plus "good": the good alltoall's result."""
    import spark_dl.common as sdl

    sdl.init()
    rank, size = sdl.rank(), sdl.size()
    calls, good = FRONT_ENDS[front_end](rank, size)
    out = {case: _outcome(call) for case, call in calls.items()}
    if front_end == "tensorflow":
        out["tf_function_float"] = _tf_function_float_splits(size)
    out["good"] = good()
    return out
