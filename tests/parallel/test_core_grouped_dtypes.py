"""A grouped allreduce whose members have different dtypes: negotiated as one group, run
as one fused collective per dtype. (Packing every member as the first one's dtype
returned garbage and corrupted the heap.) Checked through spark_dl.numpy and
spark_dl.torch, on shared memory and Gloo, including the cached (steady-state) path."""

import pytest

from harness import run_ranks

DTYPES = ["float32", "int64", "float16", "float64", "int32", "float32"]


def mixed_groups():
    import numpy as np
    import torch

    import spark_dl.numpy as sdn
    import spark_dl.torch as hvd

    sdn.init()
    r, size = sdn.rank(), sdn.size()
    want = sum(range(1, size + 1))
    bad = []
    for step in range(6):  # later steps take the response cache
        arrays = [np.full(5 + 3 * i, r + 1, np.dtype(d)) for i, d in enumerate(DTYPES)]
        for i, (a, out) in enumerate(zip(arrays, sdn.grouped_allreduce(arrays, op=sdn.Sum,
                                                                       name="mixed.np"))):
            if out.dtype != a.dtype or out.shape != a.shape or not np.all(out == want):
                bad.append(("numpy", step, i, str(out.dtype), out.tolist()))
        tensors = [torch.full((4 + i,), float(r + 1)).to(getattr(torch, d))
                   for i, d in enumerate(DTYPES)]
        outs = hvd.grouped_allreduce(tensors, op=hvd.Sum, name="mixed.torch")
        for i, (t, out) in enumerate(zip(tensors, outs)):
            if out.dtype != t.dtype or not torch.all(out.double() == want):
                bad.append(("torch", step, i, str(out.dtype), out.tolist()))
    return bad


@pytest.mark.parametrize("env", [{"SDL_SHM": "1"}, {"SDL_SHM": "0", "SDL_CONTROLLER": "gloo"}],
                         ids=["shm", "gloo"])
def test_grouped_allreduce_of_mixed_dtypes(env):
    for bad in run_ranks("test_core_grouped_dtypes:mixed_groups", 2, env=env, timeout=120):
        assert bad == []
