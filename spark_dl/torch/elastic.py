"""Elastic training for PyTorch: Horovod's ``horovod.torch.elastic`` (docs/elastic.md).

::

    import spark_dl.torch as hvd

    hvd.init()
    model, optimizer = ..., hvd.DistributedOptimizer(...)
    sampler = hvd.elastic.ElasticSampler(dataset)
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch, (x, y) in enumerate(loader, start=state.batch):  # resumes
                ...
                state.sampler.record_batch(state.batch, 32)
                if state.batch % 10 == 0:
                    state.commit()
            state.batch = 0
            state.sampler.set_epoch(state.epoch + 1)

    train(hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0))

and the job is started with ``sdlrun --min-np 2 --max-np 4 ...``.
"""

from __future__ import annotations

import copy
import math
from typing import Iterator, List, Optional

import torch

from spark_dl.common import basics
from spark_dl.common.elastic import (HostsUpdatedInterrupt, ObjectState, State,  # noqa: F401
                                     run_fn)
from spark_dl.torch.functions import (allgather_object, broadcast_object,
                                      broadcast_optimizer_state, broadcast_parameters)

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler",
           "HostsUpdatedInterrupt"]


def _reset() -> None:
    basics.shutdown()
    basics.init()


def run(func):
    """Decorator: runs ``func(state, ...)`` and, when the job's membership changes,
    rolls back to the last commit (after a failure), re-forms the job and calls it again
    on every worker (newcomers included) after syncing ``state`` from rank 0."""
    return run_fn(func, _reset)


class ElasticSampler(torch.utils.data.Sampler):
    """Splits a data set among the current ranks and, after a membership change, splits
    what this epoch has not processed yet among the new ones.

    Record progress with :meth:`record_batch` (every rank's indices of that batch are
    marked, as every rank computes them the same way) or :meth:`record_indices`; a
    :class:`TorchState` holding the sampler commits, restores and syncs it.

    Two ways to use it; every rank runs the same number of steps in both:

    - ``DataLoader(dataset, batch_size=B, sampler=ElasticSampler(dataset))`` (Horovod's):
      it yields indices. When the rows left are not a multiple of the number of ranks,
      the last ones are padded by repeating the first (at most ``size() - 1`` rows drawn
      twice per split, as torch's ``DistributedSampler`` does).
    - ``DataLoader(dataset, batch_sampler=ElasticSampler(dataset, batch_size=B))``: it
      yields batches, every row exactly once per epoch. The ranks' shares differ by one
      row at most, and a rank with fewer rows gets a smaller last batch (or two) so that
      the number of batches is equal. Only when fewer rows are left than that needs
      (fewer than ranks, near the end of an epoch) does it pad as above.

    Args:
        dataset: anything with ``len()``.
        shuffle: a new permutation per epoch (seeded by ``seed + epoch``).
        seed: the permutation's seed; the same on every rank.
        batch_size: yield batches of at most this many rows (a batch sampler), each row
            once per epoch; None: yield indices.
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0,
                 batch_size: Optional[int] = None):
        if batch_size is not None and int(batch_size) < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.batch_size = None if batch_size is None else int(batch_size)
        self.epoch = 0
        self.processed_indices: set = set()
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Starts epoch ``epoch``: nothing processed, a new order."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Marks batch ``batch_idx`` of every rank as processed (``batch_size`` is the
        DataLoader's; with a ``batch_size`` of the sampler's own, its batches count)."""
        for rank in range(self.num_replicas):
            self.processed_indices.update(self.batch(rank, batch_idx, batch_size))

    def batch(self, rank: int, batch_idx: int, batch_size: Optional[int] = None) -> List[int]:
        """The indices of batch ``batch_idx`` of ``rank`` in the current split."""
        if self._batches is not None:
            plan = self._batches[rank]
            return plan[batch_idx] if batch_idx < len(plan) else []
        start = batch_idx * batch_size
        return self._shards[rank][start:start + batch_size]

    def record_indices(self, indices) -> None:
        """Marks ``indices`` (this rank's, or any) as processed."""
        self.processed_indices.update(int(i) for i in indices)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = state["epoch"]
        self.processed_indices = set(state["processed_indices"])
        self.reset()

    def reset(self) -> None:
        """Splits the samples of this epoch not yet processed among the current ranks."""
        order = list(range(len(self.dataset)))
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(order), generator=generator).tolist()
        remaining = [i for i in order if i not in self.processed_indices]
        size = basics.size() if basics.is_initialized() else 1
        rank = basics.rank() if basics.is_initialized() else 0
        self.num_replicas, self.rank = size, rank
        self.remaining_indices = remaining
        self._batches: Optional[List[List[List[int]]]] = None
        B, n = self.batch_size, len(remaining)
        steps = -(-(-(-n // size)) // B) if B else 0  # batches of the largest share
        if B and n // size >= steps:
            # Exactly once: shares differing by one row at most, the same number of
            # batches each (rows taken from a share's last batches, each kept >= 1 row).
            shares = [remaining[r * n // size:(r + 1) * n // size] for r in range(size)]
            self._batches = [_equal_batches(share, B, steps) for share in shares]
            self._shards = shares
            self.num_samples = max(len(share) for share in shares)
            return
        self.num_samples = math.ceil(n / size) if remaining else 0
        padded = remaining + remaining[:self.num_samples * size - n]
        self._shards: List[List[int]] = [padded[r::size] for r in range(size)]
        if B:
            self._batches = [[shard[i:i + B] for i in range(0, len(shard), B)]
                             for shard in self._shards]

    def __iter__(self) -> Iterator:
        if self._batches is not None:
            return iter(self._batches[self.rank])
        return iter(self._shards[self.rank])

    def __len__(self) -> int:
        return len(self._batches[self.rank]) if self._batches is not None else self.num_samples


def _equal_batches(rows: List[int], batch_size: int, steps: int) -> List[List[int]]:
    """``rows`` cut into ``steps`` batches of at most ``batch_size`` (len(rows) >= steps)."""
    sizes = [batch_size] * steps
    short = steps * batch_size - len(rows)
    k = steps - 1
    while short > 0:
        take = min(short, sizes[k] - 1)
        sizes[k] -= take
        short -= take
        k -= 1
    out, start = [], 0
    for size in sizes:
        out.append(rows[start:start + size])
        start += size
    return out


class TorchState(ObjectState):
    """The state of a PyTorch job: a model's parameters and buffers, an optimizer's
    state, :class:`ElasticSampler` objects and any picklable attributes (``epoch``,
    ``batch``, ...) given as keywords.

    ``commit()`` copies them in memory (no file), ``restore()`` loads the copies back,
    ``sync()`` broadcasts rank 0's to every rank (the samplers' processed indices are
    first united across ranks).
    """

    def __init__(self, model: Optional[torch.nn.Module] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None, **kwargs):
        self.model = model
        self.optimizer = optimizer
        self._samplers = {k: v for k, v in kwargs.items() if isinstance(v, ElasticSampler)}
        plain = {k: v for k, v in kwargs.items() if k not in self._samplers}
        for name, sampler in self._samplers.items():
            setattr(self, name, sampler)
        super().__init__(broadcast_object, basics.rank, **plain)
        self._saved_model = self._saved_optimizer = None
        self._saved_samplers = {}
        self._save_objects()

    def _save_objects(self) -> None:
        if self.model is not None:
            self._saved_model = copy.deepcopy(self.model.state_dict())
        if self.optimizer is not None:
            self._saved_optimizer = copy.deepcopy(self.optimizer.state_dict())
        self._saved_samplers = {k: s.state_dict() for k, s in self._samplers.items()}

    def save(self) -> None:
        self._save_objects()
        super().save()

    def restore(self) -> None:
        if self.model is not None:
            self.model.load_state_dict(self._saved_model)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(self._saved_optimizer)
        for name, sampler in self._samplers.items():
            sampler.load_state_dict(self._saved_samplers[name])
        super().restore()

    def reset(self) -> None:
        # The new membership: the optimizer forgets the step in flight, the samplers
        # re-split what is left among the new ranks.
        if self.optimizer is not None and hasattr(self.optimizer, "_sdl_reset_step"):
            self.optimizer._sdl_reset_step()
        for sampler in self._samplers.values():
            sampler.reset()

    def sync(self) -> None:
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        for name, sampler in self._samplers.items():
            state = sampler.state_dict()
            union = set().union(*allgather_object(state["processed_indices"],
                                                  name=f"elastic.sampler.{name}"))
            state["processed_indices"] = union
            sampler.load_state_dict(broadcast_object(state, 0,
                                                     name=f"elastic.sampler.{name}.state"))
        super().sync()
        self._save_objects()
