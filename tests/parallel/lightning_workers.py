"""Functions run on spawned ranks by tests/parallel/test_lightning_*.py (see harness.py).

Every rank builds the whole data set from a seed, so it can compute the single-process
reference (training on the union of both ranks' batches) by itself.
"""

import os
import shutil
import tempfile
import warnings

import torch
import torch.nn.functional as F

torch.set_num_threads(1)  # ranks share a small machine
warnings.filterwarnings("ignore")

N_TRAIN, N_VAL, BATCH, EPOCHS, LR = 64, 32, 4, 2, 0.05


def _data():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N_TRAIN + N_VAL, 3, generator=g)
    y = x @ torch.tensor([[1.5], [-2.0], [0.5]]) + 0.3 + 0.1 * torch.randn(len(x), 1, generator=g)
    return (x[:N_TRAIN], y[:N_TRAIN]), (x[N_TRAIN:], y[N_TRAIN:])


def _net():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)


def _module_class():
    import lightning.pytorch as pl
    import torchmetrics

    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _net()
            self.val_mse = torchmetrics.MeanSquaredError()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.mse_loss(self(x), y)
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            out = self(x)
            self.log("val_loss", F.mse_loss(out, y), sync_dist=True)
            self.val_mse(out, y)
            self.log("val_mse", self.val_mse)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    return Regression


def _reference(accumulate):
    """One process, plain PyTorch, each step on the union of both ranks' batches: Lightning
    gives the training DataLoader a shuffling DistributedSampler (seed 0) over
    ``distributed_sampler_kwargs``; the same samplers give the reference its order."""
    from torch.utils.data import DistributedSampler

    (x, y), _ = _data()
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    rows = BATCH * accumulate
    for epoch in range(EPOCHS):
        order = []
        for rank in range(2):
            sampler = DistributedSampler(range(N_TRAIN), num_replicas=2, rank=rank, seed=0)
            sampler.set_epoch(epoch)
            order.append(list(sampler))
        for start in range(0, N_TRAIN // 2, rows):
            idx = order[0][start:start + rows] + order[1][start:start + rows]
            opt.zero_grad()
            F.mse_loss(net(x[idx]), y[idx]).backward()
            opt.step()
    return net


class _CountingIO:
    """Wraps a CheckpointIO and counts the checkpoints this rank wrote."""

    def __init__(self, inner):
        self.inner, self.saved = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def save_checkpoint(self, *args, **kwargs):
        self.saved += 1
        return self.inner.save_checkpoint(*args, **kwargs)


def fit_two_ranks(accumulate=1):
    """Trains the module with SparkDLStrategy; returns weights, synced val metrics, the
    reference's, and how many checkpoints this rank wrote."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    import spark_dl.torch as sdl
    from spark_dl.lightning import SparkDLStrategy

    sdl.init()
    (x, y), (vx, vy) = _data()
    ckpt_dir = os.path.join(tempfile.gettempdir(), f"sdl-pl-ckpt-{os.environ['SDL_JOB_ID']}")
    strategy = SparkDLStrategy()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", max_epochs=EPOCHS,
                         accumulate_grad_batches=accumulate, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0,
                         callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True)])
    counting = _CountingIO(strategy.checkpoint_io)
    strategy.checkpoint_io = counting
    module = _module_class()()
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False),
                DataLoader(TensorDataset(vx, vy), batch_size=BATCH, shuffle=False))
    ref = _reference(accumulate)
    with torch.no_grad():
        ref_val = float(F.mse_loss(ref(vx), vy))
    files = sorted(os.listdir(ckpt_dir)) if os.path.isdir(ckpt_dir) else []
    sdl.allreduce(torch.zeros(1), name="ckpt_listed")  # every rank has looked
    if sdl.rank() == 0:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    return {
        "weights": [p.detach().clone() for p in module.net.parameters()],
        "ref_weights": [p.detach().clone() for p in ref.parameters()],
        "init_weights": [p.detach().clone() for p in _net().parameters()],
        "val_loss": float(trainer.callback_metrics["val_loss"]),
        "val_mse": float(trainer.callback_metrics["val_mse"]),
        "ref_val": ref_val, "saved": counting.saved, "files": files,
        "world_size": trainer.world_size, "global_step": trainer.global_step,
    }


def fit_accumulate():
    return fit_two_ranks(accumulate=2)


def collectives():
    """reduce / all_gather / broadcast / reduce_boolean_decision / torchmetrics gather."""
    import spark_dl.torch as sdl
    from spark_dl.lightning import SparkDLStrategy
    from spark_dl.lightning.metrics import gather_all_tensors

    sdl.init()
    s = SparkDLStrategy()
    r = sdl.rank()
    t = torch.tensor([1.0 + r, 10.0 * r])
    return {
        "mean": s.reduce(t.clone(), reduce_op="mean").tolist(),
        "sum": s.reduce(t.clone(), reduce_op="sum").tolist(),
        "max": s.reduce(t.clone(), reduce_op="max").tolist(),
        "int_mean": s.reduce(torch.tensor(r + 1), reduce_op="mean").item(),
        "not_tensor": s.reduce(3.5),
        "gather": s.all_gather(t).tolist(),
        "bcast": s.broadcast({"from": r}, src=1),
        "any": s.reduce_boolean_decision(r == 1, all=False),
        "all": s.reduce_boolean_decision(r == 1, all=True),
        "ragged": [g.tolist() for g in gather_all_tensors(torch.arange(r + 2.0))],
        "ragged2d": [list(g.shape) for g in gather_all_tensors(torch.zeros(r + 1, r + 2))],
    }


def fit_pytorch_lightning():
    """The strategy built for the ``pytorch_lightning`` package's class tree."""
    import pytorch_lightning as ptl
    from torch.utils.data import DataLoader, TensorDataset

    import spark_dl.torch as sdl
    from spark_dl.lightning import strategy_class

    sdl.init()

    class Module(ptl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _net()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    (x, y), _ = _data()
    # Different data per rank: only the averaged gradients keep the weights equal.
    x = x + sdl.rank()
    strategy = strategy_class("pytorch_lightning")()
    trainer = ptl.Trainer(strategy=strategy, accelerator="cpu", max_epochs=1, logger=False,
                          enable_progress_bar=False, enable_model_summary=False,
                          enable_checkpointing=False)
    module = Module()
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=BATCH))
    return {"weights": [p.detach().clone() for p in module.parameters()],
            "base": [c.__module__.split(".")[0] for c in type(strategy).__mro__[1:3]],
            "steps": trainer.global_step}


def fit_sync_batchnorm():
    """Trainer(sync_batchnorm=True): BatchNorm statistics over both ranks' batches."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    import spark_dl.torch as sdl
    from spark_dl.lightning import SparkDLStrategy

    sdl.init()

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4),
                                           torch.nn.Linear(4, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    (x, y), _ = _data()
    x = x * (1 + 3 * sdl.rank())  # different statistics per rank
    trainer = pl.Trainer(strategy=SparkDLStrategy(), accelerator="cpu", max_epochs=1,
                         sync_batchnorm=True, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    module = Module()
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=BATCH))
    bn = module.net[1]
    return {"type": type(bn).__module__, "running_var": bn.running_var.clone(),
            "weights": [p.detach().clone() for p in module.parameters()]}


def fit_manual_accumulate():
    """Manual optimization accumulating 2 batches per step in the module's own code, with
    SparkDLStrategy(backward_passes_per_step=2); same reference as fit_accumulate."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    import spark_dl.torch as sdl
    from spark_dl.lightning import SparkDLStrategy

    sdl.init()

    class Manual(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.net = _net()

        def training_step(self, batch, batch_idx):
            x, y = batch
            opt = self.optimizers()
            self.manual_backward(F.mse_loss(self.net(x), y) / 2)
            if batch_idx % 2 == 1:
                opt.step()
                opt.zero_grad()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    (x, y), _ = _data()
    trainer = pl.Trainer(strategy=SparkDLStrategy(backward_passes_per_step=2),
                         accelerator="cpu", max_epochs=EPOCHS, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False)
    module = Manual()
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False))
    return {"weights": [p.detach().clone() for p in module.net.parameters()],
            "ref_weights": [p.detach().clone() for p in _reference(2).parameters()]}
