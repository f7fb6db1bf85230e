"""Synthetic training throughput of a small CNN with spark_dl.torch (Horovod's benchmark, on CPU).

Every rank trains the same convolutional network on random 32x32 images with
DistributedOptimizer and reports images per second, per rank and in total::

    python -m spark_dl.runner -np 2 python examples/pytorch_synthetic_benchmark.py
    sdlrun -np 2 python examples/pytorch_synthetic_benchmark.py --fp16-allreduce

The script is a Horovod script with one changed import: ``import spark_dl.torch as hvd``.
"""

import argparse
import os
import timeit

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import spark_dl.torch as hvd


class SmallCNN(nn.Module):
    """Three 3x3 conv/ReLU/max-pool stages and two fully connected layers (~0.6 M parameters
    at the default width, 32x32 RGB input)."""

    def __init__(self, num_classes=10, width=32, image_size=32):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.conv3 = nn.Conv2d(2 * width, 4 * width, 3, padding=1)
        side = image_size // 8
        self.fc1 = nn.Linear(4 * width * side * side, 256)
        self.fc2 = nn.Linear(256, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.max_pool2d(F.relu(self.conv3(x)), 2)
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="PyTorch synthetic benchmark (spark_dl)",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--fp16-allreduce", action="store_true", help="send gradients as float16")
    p.add_argument("--batch-size", type=int, default=32, help="images per batch and rank")
    p.add_argument("--image-size", type=int, default=32, help="height and width of the images")
    p.add_argument("--width", type=int, default=32, help="channels of the first conv layer")
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--num-warmup-batches", type=int, default=5)
    p.add_argument("--num-batches-per-iter", type=int, default=5)
    p.add_argument("--num-iters", type=int, default=10)
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per rank (0: this host's cores divided among its ranks)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    hvd.init()
    threads = args.threads or max(1, (os.cpu_count() or 1) // hvd.local_size())
    torch.set_num_threads(threads)
    torch.manual_seed(1234)

    model = SmallCNN(args.num_classes, args.width, args.image_size)
    # Learning rate scaled by the number of ranks, as the Horovod examples do.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    target = torch.randint(0, args.num_classes, (args.batch_size,))

    def benchmark_step():
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()

    def log(text):
        if hvd.rank() == 0:
            print(text, flush=True)

    n_params = sum(p.numel() for p in model.parameters())
    log(f"Model: SmallCNN ({n_params / 1e6:.2f} M parameters, {args.image_size}x"
        f"{args.image_size} images)")
    log(f"Batch size: {args.batch_size}")
    log(f"Number of CPUs: {hvd.size()} ({threads} torch thread(s) per rank)")
    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    log("Running benchmark...")
    img_secs = []
    for i in range(args.num_iters):
        seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / seconds
        log(f"Iter #{i}: {img_sec:.1f} img/sec per CPU")
        img_secs.append(img_sec)

    mean, conf = np.mean(img_secs), 1.96 * np.std(img_secs)
    log(f"Img/sec per CPU: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {hvd.size()} CPU(s): {hvd.size() * mean:.1f} +-{hvd.size() * conf:.1f}")
    return img_secs


if __name__ == "__main__":
    main()
