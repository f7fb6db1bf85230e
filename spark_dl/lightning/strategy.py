"""``SparkDLStrategy``: Lightning's data-parallel training over spark_dl's collectives.

Every process is started by a launcher (``sdlrun -np N``, ``spark_dl.spark.run``, or the
``LightningEstimator``) and runs the same ``Trainer.fit``; the strategy makes them one job:

- gradients are averaged while the backward pass runs, by
  :func:`spark_dl.torch.DistributedOptimizer` around each optimizer (per-parameter hooks,
  fusion in the core, ``compression``, and Lightning's ``accumulate_grad_batches`` as
  ``backward_passes_per_step``), so there is no ``DistributedDataParallel`` wrapper;
- at the start of ``fit`` every rank takes rank 0's parameters and optimizer state;
- ``reduce``/``all_gather``/``broadcast``/``barrier`` go through spark_dl, so ``self.log(...,
  sync_dist=True)``, ``reduce_boolean_decision`` (early stopping, checkpoint callbacks) and
  torchmetrics' synchronization work (the strategy gives every ``torchmetrics.Metric`` of the
  module spark_dl's gather, see :mod:`spark_dl.lightning.metrics`);
- Lightning's ``DataLoader`` s get a ``DistributedSampler`` over ``world_size`` ranks, and
  checkpoints are written by rank 0 only (the base class's rule, kept).

Lightning ships as two packages with separate class trees (``lightning.pytorch`` and
``pytorch_lightning``); a Trainer only accepts strategies of its own tree, so the class is
built once per package by :func:`strategy_class`. ``spark_dl.lightning.SparkDLStrategy`` is
the one for the package the program imported.
"""

import contextlib
import functools
import importlib
import sys
from typing import Any, Dict, Optional

import torch

__all__ = ["strategy_class", "default_package"]

_PACKAGES = ("lightning.pytorch", "pytorch_lightning")
_classes: Dict[str, type] = {}


def default_package() -> str:
    """The Lightning package this program uses: the one already imported (``lightning.pytorch``
    when both or neither are), else the one installed."""
    imported = [p for p in _PACKAGES if p in sys.modules]
    if len(imported) == 1:
        return imported[0]
    for name in _PACKAGES:
        try:
            importlib.import_module(name)
            return name
        except ImportError:
            continue
    raise ImportError("SparkDLStrategy needs Lightning 2.x: pip install 'spark_dl[lightning]' "
                      "(the lightning or pytorch-lightning package)")


def strategy_class(package: Optional[str] = None) -> type:
    """The ``SparkDLStrategy`` class deriving from ``package``'s ``ParallelStrategy``
    (``"lightning.pytorch"`` or ``"pytorch_lightning"``; default :func:`default_package`)."""
    package = package or default_package()
    if package == "lightning":
        package = "lightning.pytorch"
    if package not in _PACKAGES:
        raise ValueError(f"package must be one of {_PACKAGES}, got {package!r}")
    if package not in _classes:
        _classes[package] = _build(package)
    return _classes[package]


def _op(reduce_op):
    """spark_dl's op for Lightning's ``reduce_op`` (a string or ``torch.distributed.ReduceOp``)."""
    import spark_dl.torch as sdl

    name = "mean" if reduce_op is None else str(getattr(reduce_op, "name", reduce_op)).lower()
    name = name.rsplit(".", 1)[-1]
    table = {"mean": sdl.Average, "avg": sdl.Average, "average": sdl.Average, "sum": sdl.Sum,
             "max": sdl.Max, "min": sdl.Min, "prod": sdl.Product, "product": sdl.Product}
    if name not in table:
        raise ValueError(f"reduce_op {reduce_op!r} is not supported by SparkDLStrategy; use "
                         f"one of {sorted(table)}")
    return table[name]


def _track_steps(opt) -> None:
    """Marks ``opt.step`` the way an LR scheduler does when it is built (the scheduler now
    follows the wrapped optimizer, whose step it did not see), so that it neither warns that
    ``step()`` was overridden nor that it runs before the optimizer's."""
    if hasattr(opt.step, "_wrapped_by_lr_sched"):
        return
    step = opt.step

    @functools.wraps(step)
    def tracked(*args, **kwargs):
        opt._opt_called = True
        return step(*args, **kwargs)

    tracked._wrapped_by_lr_sched = True
    opt.step = tracked


def _build(package: str) -> type:
    pl = importlib.import_module(package)
    strategies = importlib.import_module(f"{package}.strategies")
    trainer_fn = importlib.import_module(f"{package}.trainer.states").TrainerFn
    from spark_dl.lightning import metrics as sdl_metrics

    environments = importlib.import_module(f"{package}.plugins.environments")

    class SparkDLEnvironment(environments.ClusterEnvironment):
        """The job's topology as spark_dl's launcher set it up. Given to Lightning so that
        it does not probe for other clusters: its MPI probe imports ``mpi4py.MPI``, which
        starts MPI as a singleton (an ``orted`` that outlives the fit) in every process
        that builds a Trainer."""

        @property
        def creates_processes_externally(self) -> bool:
            return True

        @property
        def main_address(self) -> str:
            return "127.0.0.1"  # unused: spark_dl's rendezvous connects the ranks

        @property
        def main_port(self) -> int:
            return 0

        @staticmethod
        def detect() -> bool:
            return False

        def world_size(self) -> int:
            return SparkDLStrategy._sdl().size()

        def set_world_size(self, size: int) -> None:
            pass  # fixed by the launcher

        def global_rank(self) -> int:
            return SparkDLStrategy._sdl().rank()

        def set_global_rank(self, rank: int) -> None:
            pass  # fixed by the launcher

        def local_rank(self) -> int:
            return SparkDLStrategy._sdl().local_rank()

        def node_rank(self) -> int:
            return SparkDLStrategy._sdl().cross_rank()

    class SparkDLStrategy(strategies.ParallelStrategy):
        """Data-parallel training over spark_dl (see :mod:`spark_dl.lightning.strategy`).

        Args:
            compression: gradient compression, e.g. ``spark_dl.torch.Compression.fp16``.
            backward_passes_per_step: backward passes accumulated before gradients are
                averaged; default: the Trainer's ``accumulate_grad_batches`` (which it must
                equal when given, unless the module optimizes manually and accumulates
                itself).
            op: ``spark_dl.torch.Average`` (default) or ``Sum`` of the gradients.
            gradient_predivide_factor, groups, sparse_as_dense: as in
                :func:`spark_dl.torch.DistributedOptimizer`.
            sync_torchmetrics: give the module's ``torchmetrics.Metric`` objects spark_dl's
                gather (default True; torchmetrics otherwise only syncs over
                ``torch.distributed``, which this strategy does not start).
            accelerator, parallel_devices, checkpoint_io, precision_plugin: as in Lightning's
                strategies (usually left to the Trainer).
            device: the CUDA device this process trains on when the Trainer's accelerator
                is a GPU (a ``torch.device`` or an ordinal). Default: the local rank's GPU
                (``local_rank % torch.cuda.device_count()``, Horovod's rule under sdlrun).
                The Spark estimator passes the device of its one GPU rule
                (:func:`spark_dl.spark.launch.task.devices.choose_gpu`: Spark's GPU for the
                task by its CUDA ordinal), so the strategy and the worker agree.
        """

        strategy_name = "spark_dl"

        def __init__(self, compression=None, backward_passes_per_step: Optional[int] = None,
                     op=None, gradient_predivide_factor: float = 1.0, groups=None,
                     sparse_as_dense: bool = False, sync_torchmetrics: bool = True,
                     accelerator=None, parallel_devices=None, checkpoint_io=None,
                     precision_plugin=None, device=None):
            super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                             cluster_environment=SparkDLEnvironment(),
                             checkpoint_io=checkpoint_io,
                             precision_plugin=precision_plugin)
            if backward_passes_per_step is not None and int(backward_passes_per_step) < 1:
                raise ValueError(f"backward_passes_per_step must be >= 1, got "
                                 f"{backward_passes_per_step}")
            self._compression = compression
            self._passes = backward_passes_per_step
            self._grad_op = op
            self._predivide = gradient_predivide_factor
            self._groups = groups
            self._sparse_as_dense = sparse_as_dense
            self._sync_torchmetrics = sync_torchmetrics
            if isinstance(device, int):
                device = torch.device("cuda", device)
            if device is not None and torch.device(device).type != "cuda":
                raise ValueError(f"SparkDLStrategy(device=...) names the GPU to train on, got "
                                 f"{device!r}; for the CPU use Trainer(accelerator='cpu')")
            self._device = None if device is None else torch.device(device)

        # ------------------------------------------------------------- topology

        @staticmethod
        def _sdl():
            import spark_dl.torch as sdl

            if not sdl.is_initialized():
                sdl.init()
            return sdl

        @property
        def global_rank(self) -> int:
            return self._sdl().rank()

        @property
        def local_rank(self) -> int:
            return self._sdl().local_rank()

        @property
        def node_rank(self) -> int:
            return self._sdl().cross_rank()

        @property
        def world_size(self) -> int:
            return self._sdl().size()

        @property
        def is_distributed(self) -> bool:
            # Read by the Trainer: DataLoaders get a DistributedSampler.
            return True

        @property
        def distributed_sampler_kwargs(self) -> Dict[str, Any]:
            return {"num_replicas": self.world_size, "rank": self.global_rank}

        @property
        def root_device(self) -> torch.device:
            devices = self.parallel_devices or [torch.device("cpu")]
            if devices[0].type == "cuda":
                if self._device is not None:
                    return self._device  # the Spark estimator's choice (choose_gpu)
                # One GPU per process: the local rank's.
                return torch.device("cuda", self.local_rank % torch.cuda.device_count())
            return devices[0]

        def setup_environment(self) -> None:
            self._sdl()
            if self.root_device.type == "cuda":
                torch.cuda.set_device(self.root_device)
            super().setup_environment()

        def model_to_device(self) -> None:
            assert self.model is not None
            self.model.to(self.root_device)

        # ------------------------------------------------------------- setup

        def setup(self, trainer) -> None:
            sdl = self._sdl()
            if self._layer_sync is not None and trainer.state.fn == trainer_fn.FITTING:
                # Trainer(sync_batchnorm=True): spark_dl's SyncBatchNorm (torch's needs
                # torch.distributed); the layers keep their parameter objects.
                self.model = sdl.SyncBatchNorm.convert_sync_batchnorm(self.model)
            super().setup(trainer)  # accelerator, precision, device, optimizers
            module = self.lightning_module
            sdl.broadcast_parameters(module.state_dict(), root_rank=0)
            if self._sync_torchmetrics:
                sdl_metrics.attach(module)
            if trainer.state.fn != trainer_fn.FITTING:
                return
            passes = trainer.accumulate_grad_batches
            if self._passes is not None and self._passes != passes:
                if module.automatic_optimization:
                    raise ValueError(
                        f"SparkDLStrategy(backward_passes_per_step={self._passes}) differs "
                        f"from Trainer(accumulate_grad_batches={passes}): set one of them "
                        "(they mean the same)")
                # Manual optimization accumulates in the user's code: the strategy's value.
                passes = self._passes
            wrapped = {}
            for opt in self.optimizers:
                sdl.broadcast_optimizer_state(opt, root_rank=0)
                kwargs = {"compression": self._compression or sdl.Compression.none,
                          "backward_passes_per_step": passes,
                          "gradient_predivide_factor": self._predivide,
                          "groups": self._groups, "sparse_as_dense": self._sparse_as_dense}
                if self._grad_op is not None:
                    kwargs["op"] = self._grad_op
                wrapped[id(opt)] = sdl.DistributedOptimizer(
                    opt, named_parameters=module.named_parameters(), **kwargs)
            # Schedulers move to the wrapped optimizers: a checkpoint restore replaces the
            # optimizer's param_groups, which must stay the ones the scheduler updates.
            for config in self.lr_scheduler_configs:
                sched = config.scheduler
                if id(getattr(sched, "optimizer", None)) in wrapped:
                    sched.optimizer = wrapped[id(sched.optimizer)]
                    _track_steps(sched.optimizer)
            self.optimizers = [wrapped[id(o)] for o in self.optimizers]

        # ------------------------------------------------------------- training

        def optimizer_step(self, optimizer, closure, model=None, **kwargs):
            # Lightning runs forward and backward inside ``optimizer.step(closure)``: the
            # gradients are complete only after the closure, so the closure synchronizes
            # and the step itself must not.
            inner = getattr(optimizer, "_optimizer", optimizer)
            sync = getattr(inner, "synchronize", None)
            if sync is None:
                return super().optimizer_step(optimizer, closure, model, **kwargs)

            def closure_then_sync():
                result = closure()
                sync()
                return result

            with inner.skip_synchronize():
                return super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)

        # ------------------------------------------------------------- collectives

        def reduce(self, tensor, group: Optional[Any] = None, reduce_op: Any = "mean"):
            """``tensor`` reduced over every rank (``reduce_op``: mean, sum, max, min, prod);
            anything but a tensor is returned unchanged, as Lightning's DDP does."""
            if not isinstance(tensor, torch.Tensor):
                return tensor
            sdl = self._sdl()
            op = _op(reduce_op)
            if op == sdl.Average and not tensor.is_floating_point():
                tensor = tensor.to(torch.get_default_dtype())
            return sdl.allreduce(tensor.detach(), op=op)

        def all_gather(self, tensor, group: Optional[Any] = None, sync_grads: bool = False):
            """Every rank's ``tensor`` stacked: shape ``(world_size, *tensor.shape)``."""
            sdl = self._sdl()
            ctx = contextlib.nullcontext() if sync_grads else torch.no_grad()
            with ctx:
                return sdl.allgather(tensor.unsqueeze(0))

        def broadcast(self, obj, src: int = 0):
            return self._sdl().broadcast_object(obj, root_rank=src)

        def barrier(self, name: Optional[str] = None) -> None:
            self._sdl().barrier()

        def teardown(self) -> None:
            # The DistributedOptimizers' hooks go with them; the runtime stays up (the
            # launcher owns it, and a later Trainer in the same process reuses it).
            super().teardown()

        @classmethod
        def register_strategies(cls, strategy_registry) -> None:
            strategy_registry.register("spark_dl", cls,
                                       description="data-parallel over spark_dl")

    SparkDLStrategy.__module__ = __name__
    SparkDLStrategy.__qualname__ = "SparkDLStrategy"
    registry = getattr(strategies, "StrategyRegistry", None)
    if registry is not None and "spark_dl" not in registry:
        SparkDLStrategy.register_strategies(registry)
    del pl
    return SparkDLStrategy


def __getattr__(name):
    # ``spark_dl.lightning.strategy.SparkDLStrategy`` (also how pickle finds the class).
    if name == "SparkDLStrategy":
        return strategy_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
