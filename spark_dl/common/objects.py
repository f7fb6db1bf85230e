"""Python objects between ranks: broadcast and allgather of anything cloudpickle serializes.

Framework-neutral (the payload travels as a NumPy byte array through the core), so every
front end and the estimators' worker loop use these same two functions. Both are
collective: every member of ``process_set`` calls them, in the same order as its other
collectives.
"""

import cloudpickle
import numpy as np

from spark_dl.common import ops
from spark_dl.common.basics import rank as _global_rank
from spark_dl.common.handles import synchronize
from spark_dl.common.process_sets import global_process_set

__all__ = ["broadcast_object", "allgather_object"]


def _dumps(obj) -> np.ndarray:
    return np.frombuffer(cloudpickle.dumps(obj), dtype=np.uint8).copy()


def _broadcast_(array: np.ndarray, root_rank, name, process_set) -> None:
    synchronize(ops.submit("broadcast", name, array, array, finish=lambda o, i: array,
                           process_set=process_set, root=root_rank))


def _allgather_async(array: np.ndarray, name, process_set):
    return ops.submit("allgather", name, array, process_set=process_set,
                      finish=lambda o, i: np.from_dlpack(ops.DLPackTensor(o[0])))


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Returns ``root_rank``'s ``obj`` on every member (serialized with cloudpickle).

    Args:
        obj: any object cloudpickle can serialize (only the root's is used).
        root_rank: the global rank that sends (a member of ``process_set``).
        name: names the two underlying broadcasts (default ``broadcast_object``; the
            same on every rank whatever ``obj`` is there, so non-root ranks may pass None).
    """
    name = name or "broadcast_object"
    ops.root_index(root_rank, process_set)  # checked before anything is sent
    is_root = _global_rank() == root_rank
    payload = _dumps(obj) if is_root else None
    length = np.array([payload.size if is_root else 0], dtype=np.int64)
    _broadcast_(length, root_rank, f"{name}.size", process_set)
    if not is_root:
        payload = np.empty(int(length[0]), dtype=np.uint8)
    _broadcast_(payload, root_rank, f"{name}.data", process_set)
    return obj if is_root else cloudpickle.loads(payload.tobytes())


def allgather_object(obj, name=None, process_set=global_process_set):
    """Returns the list of every member's ``obj``, in rank order (cloudpickle)."""
    name = name or "allgather_object"
    payload = _dumps(obj)
    # Both submitted before either is awaited: they are negotiated in one cycle.
    sizes_h = _allgather_async(np.array([payload.size], dtype=np.int64), f"{name}.sizes",
                               process_set)
    data_h = _allgather_async(payload, f"{name}.data", process_set)
    sizes = synchronize(sizes_h).tolist()
    data = synchronize(data_h).tobytes()
    out, offset = [], 0
    for n in sizes:
        out.append(cloudpickle.loads(data[offset:offset + n]))
        offset += n
    assert len(out) == ops.set_size(process_set)
    return out
