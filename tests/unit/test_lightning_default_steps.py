"""The steps the Lightning estimator gives a module without its own: the loss is weighted
by ``loss_weights`` and ``sample_weight_col`` as the torch estimator weights it."""

import warnings

import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("pytorch_lightning")

from spark_dl.spark.lightning import util  # noqa: E402


class TwoHeads(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(3, 1)
        self.b = torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.a(x), self.b(x)


def _batch():
    g = torch.Generator().manual_seed(1)
    return {"x": torch.randn(5, 3, generator=g), "y1": torch.randn(5, generator=g),
            "y2": torch.randn(5, generator=g), "w": torch.tensor([0., 1., 2., 3., 4.])}


def _step(module, batch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log without a Trainer
        return module.training_step(batch, 0), module.validation_step(batch, 0)


def test_loss_weights_and_sample_weights_weight_the_default_loss():
    batch = _batch()
    module = TwoHeads()
    util.install_default_steps(module, [torch.nn.functional.mse_loss], None, ["x"],
                               ["y1", "y2"], loss_weights=[2.0, 0.5], sample_weight_col="w")
    train, val = _step(module, batch)
    a, b = module(batch["x"])
    w = batch["w"]
    want = (2.0 * (((a.reshape(-1) - batch["y1"]) ** 2) * w).mean()
            + 0.5 * (((b.reshape(-1) - batch["y2"]) ** 2) * w).mean())
    torch.testing.assert_close(train, want)
    torch.testing.assert_close(val, want)


def test_without_weights_the_loss_is_the_plain_sum():
    batch = _batch()
    module = TwoHeads()
    loss = torch.nn.MSELoss()
    util.install_default_steps(module, [loss], None, ["x"], ["y1", "y2"])
    train, _ = _step(module, batch)
    a, b = module(batch["x"])
    torch.testing.assert_close(train, loss(a.reshape(-1), batch["y1"]) +
                               loss(b.reshape(-1), batch["y2"]))
