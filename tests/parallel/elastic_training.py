"""The elastic training the elastic tests run (sdlrun: elastic_workers.py; Spark:
tests/spark/test_run_elastic.py), and the checks of its result.

Linear regression with ``ElasticSampler`` and a commit after every step. The state
records, for every committed step, the rows each rank used (``history``), so that
:func:`check_training` can replay exactly the committed steps on one process and compare
the final weights.

Membership changes at a given committed step K (the number of committed steps so far):

- ``die``: ``["W:WHERE:K", ...]``: worker W kills itself (SIGKILL) at K; WHERE is ``step``
  (before the step), ``broadcast_object`` (between the two broadcasts of an object
  broadcast), ``sync`` (inside the state sync, after the model's broadcast) or
  ``executor`` (it kills the Spark executor's JVM it runs under, before the step);
- ``probe``: an object broadcast in every step (implied by ``die``);
- ``grow_at`` K, ``hosts_file`` F, ``grow_to`` H: rank 0 writes H to F at K; with
  ``grow_size`` S, from then on the job waits (committing every ``grow_sleep`` seconds,
  for 120 s at most) until it has S workers;
- ``step_sleep``: seconds each step sleeps.
"""

import os
import signal
import time

import torch

N, LR, EPOCHS, BATCH = 96, 0.05, 3, 4
DEFAULTS = dict(n=N, batch=BATCH, epochs=EPOCHS, lr=LR, die=(), probe=False, grow_at=-1,
                grow_to="", grow_size=0, grow_sleep=0.2, hosts_file="", step_sleep=0.0)


def data(n=N):
    gen = torch.Generator().manual_seed(7)
    X = torch.randn(n, 4, generator=gen)
    w_true = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    return X, X @ w_true + 0.01 * torch.randn(n, 1, generator=gen)


def run_training(**options):
    """Trains as the worker ``SDL_ELASTIC_WORKER_ID``; returns the result on rank 0 of
    the last generation (weights, history, losses, sizes, resets), None elsewhere."""
    import spark_dl.torch as hvd
    from spark_dl.common import objects

    o = dict(DEFAULTS, **options)
    worker = os.environ["SDL_ELASTIC_WORKER_ID"]
    hvd.init()
    X, Y = data(o["n"])
    model = torch.nn.Linear(4, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=o["lr"]),
                                         named_parameters=model.named_parameters())
    # Batches of its own: every row exactly once per epoch (check_training checks it).
    sampler = hvd.elastic.ElasticSampler(range(o["n"]), shuffle=True, seed=3,
                                         batch_size=o["batch"])
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, history=[],
                                   losses=[], sizes=[])
    resets = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])
    deaths = {(where, int(k)) for w, where, k in (d.split(":") for d in o["die"])
              if w == worker}

    def maybe_die(where):
        if ("executor", len(state.history)) in deaths and where == "step":
            os.kill(_executor_jvm(), signal.SIGKILL)
            time.sleep(60)  # this worker ends with its task
        if (where, len(state.history)) in deaths:
            os.kill(os.getpid(), signal.SIGKILL)

    # Dying inside sync(): after the model's broadcast, before the optimizer's; inside an
    # object broadcast: between its size and its data.
    broadcast_parameters, broadcast_ = hvd.elastic.broadcast_parameters, objects._broadcast_

    def dying_broadcast_parameters(params, root_rank):
        broadcast_parameters(params, root_rank)
        maybe_die("sync")

    def dying_broadcast_(array, root_rank, name, process_set):
        broadcast_(array, root_rank, name, process_set)
        if name == "probe.size":
            maybe_die("broadcast_object")

    hvd.elastic.broadcast_parameters = dying_broadcast_parameters
    objects._broadcast_ = dying_broadcast_

    @hvd.elastic.run
    def train(state):
        B = o["batch"]
        while state.epoch < o["epochs"]:
            sampler, size = state.sampler, hvd.size()
            for b, mine in enumerate(list(sampler)):
                maybe_die("step")
                if o["die"] or o["probe"]:
                    token = hvd.broadcast_object(len(state.history), 0, name="probe")
                    assert token == len(state.history)
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(model(X[mine]), Y[mine])
                loss.backward()
                optimizer.step()
                state.history.append({"epoch": state.epoch,
                                      "rows": [sampler.batch(r, b) for r in range(size)]})
                sampler.record_batch(b, B)
                # Unnamed on purpose: newcomers and survivors must number unnamed ops alike.
                state.losses.append(float(hvd.allreduce(loss.detach())))
                state.sizes.append(hvd.size())
                grown = o["grow_at"] >= 0 and len(state.history) >= o["grow_at"]
                if grown and hvd.rank() == 0 and len(state.history) == o["grow_at"] \
                        and o["hosts_file"]:
                    with open(o["hosts_file"], "w") as f:
                        f.write(o["grow_to"] + "\n")
                if o["step_sleep"]:
                    time.sleep(o["step_sleep"])
                state.commit()
                if grown and hvd.size() < o["grow_size"]:
                    # Wait for the newcomer, committing (which raises HostsUpdatedInterrupt
                    # once it waits to join). Counted, not timed: every rank must make the
                    # same number of commits.
                    for _ in range(int(120 / o["grow_sleep"])):
                        time.sleep(o["grow_sleep"])
                        state.commit()
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()

    train(state)
    print(f"worker {worker} done as rank {hvd.rank()} of {hvd.size()}", flush=True)
    if hvd.rank() != 0:
        return None
    return {"weight": model.weight.detach().flatten().tolist(), "history": state.history,
            "losses": state.losses, "sizes": state.sizes, "resets": resets}


def _executor_jvm() -> int:
    """The pid of the Spark executor JVM this process runs under (its ancestors)."""
    pid = os.getppid()
    while pid > 1:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"CoarseGrainedExecutorBackend" in f.read():
                return pid
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    raise RuntimeError("not running under a Spark executor JVM")


class KillExecutorAt:
    """An estimator callback: worker ``worker`` kills the Spark executor JVM it runs under
    at batch ``batch`` of epoch ``epoch`` (0-based); every batch sleeps ``batch_sleep``."""

    def __init__(self, worker: str, epoch: int, batch: int, batch_sleep: float = 0.0):
        self.worker, self.at_epoch, self.at_batch = worker, epoch, batch
        self.batch_sleep = batch_sleep
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_batch_end(self, batch, logs=None):
        time.sleep(self.batch_sleep)
        if (os.environ.get("SDL_ELASTIC_WORKER_ID") == self.worker
                and (self.epoch, batch) == (self.at_epoch, self.at_batch)):
            os.kill(_executor_jvm(), signal.SIGKILL)
            time.sleep(60)  # this worker ends with its task


def replay(history, n=N, lr=LR):
    """The committed steps on one process: the same rows, the same order, SGD on the
    average of the ranks' gradients (as the DistributedOptimizer does)."""
    X, Y = data(n)
    w = torch.zeros(1, 4)
    for step in history:
        grads = []
        for rows in step["rows"]:
            wr = w.clone().requires_grad_(True)
            torch.nn.functional.mse_loss(X[rows] @ wr.T, Y[rows]).backward()
            grads.append(wr.grad)
        w = w - lr * torch.stack(grads).mean(0)
    return w.flatten()


def check_training(res, n=N, epochs=EPOCHS):
    """The final weights equal the replay's, the loss fell, and every epoch used every row
    exactly once, whatever the membership did."""
    torch.testing.assert_close(torch.tensor(res["weight"]), replay(res["history"], n),
                               rtol=1e-4, atol=1e-5)
    losses = res["losses"]
    assert sum(losses[-3:]) < 0.1 * sum(losses[:3]), losses
    for e in range(epochs):
        steps = [s for s in res["history"] if s["epoch"] == e]
        rows = [r for s in steps for rank_rows in s["rows"] for r in rank_rows]
        assert sorted(rows) == list(range(n)), f"epoch {e} did not use every row once"
