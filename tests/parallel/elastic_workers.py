"""An elastic training script for tests/parallel/test_elastic.py, run by ``sdlrun``.

Linear regression with ``ElasticSampler`` and a commit after every step. The state
records, for every committed step, the batch each rank used (``history``), so that the
test can replay exactly the committed steps on one process and compare the final weights.

Options make membership change at a given committed step K (the number of committed
steps so far):
  --die W:WHERE:K   worker W kills itself (SIGKILL) at K: WHERE is ``step`` (before the
                    step), ``broadcast_object`` (between the two broadcasts of an object
                    broadcast) or ``sync`` (inside the state sync, after the model's
                    broadcast); may be repeated
  --probe           an object broadcast in every step (without --die too)
  --grow-at K --hosts-file F --grow-to H --grow-size S
                    rank 0 writes H to F at step K, then slows down until the job has S
                    workers
"""

import argparse
import json
import os
import signal
import time

import torch

import spark_dl.torch as hvd
from spark_dl.common import objects

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--n", type=int, default=96)
p.add_argument("--batch", type=int, default=4)
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--lr", type=float, default=0.05)
p.add_argument("--die", action="append", default=[])
p.add_argument("--probe", action="store_true", help="an object broadcast in every step")
p.add_argument("--grow-at", type=int, default=-1)
p.add_argument("--grow-to", default="")
p.add_argument("--grow-size", type=int, default=0)
p.add_argument("--hosts-file", default="")
p.add_argument("--step-sleep", type=float, default=0.0)
args = p.parse_args()

WORKER = os.environ["SDL_ELASTIC_WORKER_ID"]

hvd.init()
gen = torch.Generator().manual_seed(7)
X = torch.randn(args.n, 4, generator=gen)
w_true = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
Y = X @ w_true + 0.01 * torch.randn(args.n, 1, generator=gen)

model = torch.nn.Linear(4, 1, bias=False)
torch.nn.init.zeros_(model.weight)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr),
                                     named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(range(args.n), shuffle=True, seed=3)
state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, history=[],
                               losses=[], sizes=[])
resets = []
state.register_reset_callbacks([lambda: resets.append(hvd.size())])


DEATHS = {(where, int(k)) for w, where, k in (d.split(":") for d in args.die) if w == WORKER}


def maybe_die(where):
    if (where, len(state.history)) in DEATHS:
        os.kill(os.getpid(), signal.SIGKILL)


@hvd.elastic.run
def train(state):
    while state.epoch < args.epochs:
        shards = state.sampler._shards
        steps = -(-len(shards[0]) // args.batch)
        for b in range(steps):
            maybe_die("step")
            if args.die or args.probe:
                token = hvd.broadcast_object(len(state.history), 0, name="probe")
                assert token == len(state.history)
            mine = shards[hvd.rank()][b * args.batch:(b + 1) * args.batch]
            x, y = X[mine], Y[mine]
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            state.sampler.record_batch(b, args.batch)
            state.history.append({"epoch": state.epoch,
                                  "rows": [s[b * args.batch:(b + 1) * args.batch]
                                           for s in shards]})
            state.losses.append(float(hvd.allreduce(loss.detach(), name="loss")))
            state.sizes.append(hvd.size())
            if (args.grow_at >= 0 and hvd.rank() == 0 and len(state.history) == args.grow_at
                    and args.hosts_file):
                with open(args.hosts_file, "w") as f:
                    f.write(args.grow_to + "\n")
            if args.grow_size and hvd.size() < args.grow_size and args.grow_at >= 0 \
                    and len(state.history) >= args.grow_at:
                time.sleep(0.2)  # leave the newcomer time to start and join
            elif args.step_sleep:
                time.sleep(args.step_sleep)
            state.commit()
        state.epoch += 1
        state.sampler.set_epoch(state.epoch)
        state.commit()


# Dying inside sync(): after the model's broadcast, before the optimizer's.
_broadcast_parameters = hvd.elastic.broadcast_parameters


def _dying_broadcast_parameters(params, root_rank):
    _broadcast_parameters(params, root_rank)
    maybe_die("sync")


hvd.elastic.broadcast_parameters = _dying_broadcast_parameters

# Dying inside an object broadcast: between its size and its data.
_broadcast_ = objects._broadcast_


def _dying_broadcast_(array, root_rank, name, process_set):
    _broadcast_(array, root_rank, name, process_set)
    if name == "probe.size":
        maybe_die("broadcast_object")


objects._broadcast_ = _dying_broadcast_
train(state)
if hvd.rank() == 0:
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump({"weight": model.weight.detach().flatten().tolist(),
                   "history": state.history, "losses": state.losses, "sizes": state.sizes,
                   "resets": resets, "processed": len(state.sampler.processed_indices)}, f)
print(f"worker {WORKER} done as rank {hvd.rank()} of {hvd.size()}", flush=True)
