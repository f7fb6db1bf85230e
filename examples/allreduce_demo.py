"""A first spark_dl program: every rank contributes, every rank gets the result.

Run on two local ranks:

    sdlrun -np 2 python examples/allreduce_demo.py
"""

import numpy as np

import spark_dl.numpy as sdl


def main():
    sdl.init()
    rank, size = sdl.rank(), sdl.size()
    print(f"rank {rank} of {size} (local rank {sdl.local_rank()}), transport: {sdl.transport()}")

    # Each rank holds its own gradient; Average gives every rank the mean.
    grad = np.full(4, float(rank + 1), dtype=np.float32)
    mean = sdl.allreduce(grad, name="grad", op=sdl.Average)
    print(f"rank {rank}: average of {grad.tolist()} over ranks = {mean.tolist()}")

    # Ranks may hold different numbers of rows: allgather concatenates them.
    rows = np.arange(rank + 1, dtype=np.int64)
    print(f"rank {rank}: allgather -> {sdl.allgather(rows, name='rows').tolist()}")

    # Rank 0's parameters win: broadcast them to everyone.
    params = sdl.broadcast(np.random.default_rng(rank).standard_normal(3), root_rank=0,
                           name="params")
    print(f"rank {rank}: parameters after broadcast = {np.round(params, 3).tolist()}")

    # Many small tensors in flight at once are fused into few collectives.
    handles = [sdl.allreduce_async(np.ones(256, np.float32), name=f"layer{i}", op=sdl.Sum)
               for i in range(50)]
    assert all((h.wait() == size).all() for h in handles)
    c = sdl.counters()
    print(f"rank {rank}: {c['tensors']} tensors in {c['collectives']} collectives")
    sdl.shutdown()


if __name__ == "__main__":
    main()
