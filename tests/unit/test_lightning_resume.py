"""Resuming a Lightning fit from the checkpoint the estimator's worker takes when an epoch
starts (the crash-recovery checkpoint of every epoch but the last): the resumed fit runs
every remaining epoch in full and ends where an uninterrupted fit ends. One process, a real
Trainer with SparkDLStrategy."""

import io
import logging
import tempfile
import types
import warnings

import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("lightning.pytorch")

import spark_dl.torch as sdl  # noqa: E402
from spark_dl.lightning.strategy import strategy_class  # noqa: E402
from spark_dl.spark.lightning.adapter import LightningWorker  # noqa: E402

pytestmark = pytest.mark.timeout(120)
STEPS = 4


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, i):
        return (self.net(batch[0]) - batch[1]).pow(2).mean()

    def validation_step(self, batch, i):
        self.log("val_loss", (self.net(batch[0]) - batch[1]).pow(2).mean())

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]


class Feed:
    """STEPS batches, the same ones every epoch; counts what Lightning asks for."""

    def __init__(self, kind, log):
        self.kind, self.log = kind, log

    def __len__(self):
        return STEPS

    def __iter__(self):
        g = torch.Generator().manual_seed(7)
        for _ in range(STEPS):
            self.log.append(self.kind)
            x = torch.randn(8, 4, generator=g)
            yield x, x.sum(1, keepdim=True)


class Tap(pl.Callback):
    """The worker's checkpoint as epoch 3 starts (after epochs 1 and 2)."""

    def __init__(self, worker):
        self.worker, self.starts, self.saved = worker, 0, None

    def on_train_epoch_start(self, trainer, module):
        self.starts += 1
        if self.starts == 3:
            LightningWorker.take_checkpoint(self.worker, trainer, at_epoch_start=True)
            # Written now, as the worker's save_checkpoint does before training goes on
            # (the dict shares the model's tensors).
            buf = io.BytesIO()
            torch.save(self.worker.checkpoint, buf)
            self.saved = buf.getvalue()


def _trainer(epochs, callbacks=()):
    return pl.Trainer(strategy=strategy_class("lightning.pytorch")(), accelerator="cpu",
                      devices=1, max_epochs=epochs, callbacks=list(callbacks), logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0,
                      default_root_dir=tempfile.mkdtemp())


@pytest.fixture(scope="module", autouse=True)
def runtime():
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    sdl.init()
    yield
    sdl.shutdown()


@pytest.mark.parametrize("validate", [True, False], ids=["validation", "no_validation"])
def test_resume_from_an_epoch_start_checkpoint_runs_every_remaining_epoch(validate, tmp_path):
    def fit(trainer, module, log, **kw):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, Feed("t", log), Feed("v", log) if validate else None, **kw)

    full_log, worker = [], types.SimpleNamespace(rank=0, checkpoint=None)
    tap = Tap(worker)
    full, whole = Net(), _trainer(4, [tap])
    fit(whole, full, full_log)
    assert tap.saved is not None
    path = tmp_path / "after_epoch_2.ckpt"
    path.write_bytes(tap.saved)

    resumed_log, resumed = [], Net()
    again = _trainer(4)
    fit(again, resumed, resumed_log, ckpt_path=str(path))
    per_epoch = STEPS * (2 if validate else 1)
    assert len(resumed_log) == 2 * per_epoch, "epochs 3 and 4 should run in full"
    assert resumed_log.count("t") == 2 * STEPS
    assert again.global_step == whole.global_step == 4 * STEPS
    for a, b in zip(resumed.parameters(), full.parameters()):
        torch.testing.assert_close(a, b)
