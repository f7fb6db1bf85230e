"""Elastic Keras training for tests/parallel/test_elastic_keras.py, run under sdlrun.

A small regression model trains through ``model.fit`` inside ``@hvd.elastic.run`` with
the elastic callbacks. Each generation of the job splits the data among its ranks (equal
shares, so every rank runs the same number of steps). ``--die W:E:B``: worker W kills
itself (SIGKILL) right before batch B of epoch E, after every other callback of that
batch, so that the survivors' failure comes from inside the compiled train step.
``--grow-at E:B --grow-to H --hosts-file F --grow-size S``: before batch B of epoch E,
while the job has fewer than S workers, rank 0 writes H to F (the discovery script's
answer) and every rank commits every 0.1 s until the newcomer is there (the commit
raises HostsUpdatedInterrupt then). ``--broadcast-callback`` adds Horovod's
``BroadcastGlobalVariablesCallback(0)`` to the callbacks.

Rank 0 of the last generation writes OUT/result.json: the per-epoch losses (with the
size they ran at), the final ``state.epoch``, the sizes of the resets, and every
survivor's final weights (gathered).
"""

import argparse
import json
import os
import signal
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import spark_dl.keras as hvd  # noqa: E402

N, FEATURES, BATCH = 384, 8, 16

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--die", default="", metavar="W:E:B")
p.add_argument("--epochs", type=int, default=4)
p.add_argument("--batches-per-commit", type=int, default=2)
p.add_argument("--grow-at", default="", metavar="E:B")
p.add_argument("--grow-to", default="")
p.add_argument("--hosts-file", default="")
p.add_argument("--grow-size", type=int, default=0)
p.add_argument("--broadcast-callback", action="store_true")
args = p.parse_args()

if keras.backend.backend() == "tensorflow":
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
else:
    import torch

    torch.set_num_threads(1)
worker = os.environ["SDL_ELASTIC_WORKER_ID"]

rng = np.random.default_rng(7)
X = rng.normal(size=(N, FEATURES)).astype("float32")
Y = (X @ rng.normal(size=(FEATURES, 1)) + 0.05 * rng.normal(size=(N, 1))).astype("float32")

hvd.init()
model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(1)])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
state = hvd.elastic.KerasState(model, epoch=0, batch=0, losses=[])
resets = []
state.register_reset_callbacks([lambda: resets.append(hvd.size())])


class Record(keras.callbacks.Callback):
    """Appends (epoch, this rank's mean loss, size) to the state at every epoch's end."""

    def on_epoch_end(self, epoch, logs=None):
        state.losses.append([epoch, float(logs["loss"]), hvd.size()])


class Die(keras.callbacks.Callback):
    def __init__(self, spec):
        super().__init__()
        w, e, b = spec.split(":") if spec else ("", -1, -1)
        self.at = (int(e), int(b)) if w == worker else None
        self.epoch = -1

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            with open(os.path.join(args.out, "died_at"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)


class Recovered(keras.callbacks.Callback):
    """Notes when the first batch after the first reset ends (training again)."""

    at = None

    def on_train_batch_end(self, batch, logs=None):
        if resets and Recovered.at is None:
            Recovered.at = time.time()


class Grow(keras.callbacks.Callback):
    def __init__(self, spec):
        super().__init__()
        self.at = tuple(int(i) for i in spec.split(":")) if spec else None
        self.epoch = -1

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) != self.at or hvd.size() >= args.grow_size:
            return
        if hvd.rank() == 0:
            with open(args.hosts_file, "w") as f:
                f.write(args.grow_to + "\n")
        for _ in range(900):  # bounded: then the job goes on at this size
            time.sleep(0.1)
            state.commit()  # a collective: every rank raises HostsUpdatedInterrupt alike


callbacks = [hvd.elastic.CommitStateCallback(state, batches_per_commit=args.batches_per_commit),
             hvd.elastic.UpdateBatchStateCallback(state),
             hvd.elastic.UpdateEpochStateCallback(state), Record(), Grow(args.grow_at),
             Recovered(), Die(args.die)]
if args.broadcast_callback:
    callbacks.insert(0, hvd.callbacks.BroadcastGlobalVariablesCallback(0))


@hvd.elastic.run
def train(state):
    size, rank = hvd.size(), hvd.rank()
    share = N // size  # equal shares: the same number of steps on every rank
    x, y = X[rank::size][:share], Y[rank::size][:share]
    state.model.fit(x, y, batch_size=BATCH, initial_epoch=state.epoch, epochs=args.epochs,
                    callbacks=callbacks, verbose=0)


train(state)
weights = np.concatenate([w.ravel() for w in model.get_weights()]).tolist()
gathered = hvd.allgather_object(weights, name="final_weights")
print(f"worker {worker} done as rank {hvd.rank()} of {hvd.size()}", flush=True)
if hvd.rank() == 0:
    died = os.path.join(args.out, "died_at")
    # Seconds from a worker's death to the end of the survivors' first batch after it.
    recovery = None
    if os.path.exists(died) and Recovered.at is not None:
        with open(died) as f:
            recovery = Recovered.at - float(f.read())
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump({"losses": state.losses, "epoch": state.epoch, "resets": resets,
                   "size": hvd.size(), "weights": gathered, "recovery_s": recovery}, f)
