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
    :class:`TorchState` holding the sampler commits, restores and syncs it. When the
    samples left are not a multiple of the number of ranks, the last ones are padded by
    repeating the first (at most ``size() - 1`` samples drawn twice per split, as torch's
    ``DistributedSampler`` does), so that every rank runs the same number of steps.

    Args:
        dataset: anything with ``len()``.
        shuffle: a new permutation per epoch (seeded by ``seed + epoch``).
        seed: the permutation's seed; the same on every rank.
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: set = set()
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Starts epoch ``epoch``: nothing processed, a new order."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Marks batch ``batch_idx`` (of ``batch_size``) of every rank as processed."""
        start, stop = batch_idx * batch_size, (batch_idx + 1) * batch_size
        for shard in self._shards:
            self.processed_indices.update(shard[start:stop])

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
        self.num_samples = math.ceil(len(remaining) / size) if remaining else 0
        padded = remaining + remaining[:self.num_samples * size - len(remaining)]
        self._shards: List[List[int]] = [padded[r::size] for r in range(size)]
        self.remaining_indices = remaining

    def __iter__(self) -> Iterator[int]:
        return iter(self._shards[self.rank])

    def __len__(self) -> int:
        return self.num_samples


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
