"""Hierarchical allreduce of CUDA tensors (SDL_HIERARCHICAL_ALLREDUCE=1) on real GPUs.

The orchestration is checked without a GPU by native/tests/hierarchical_test.cc (threads,
a fake device, 2 hosts x 2 local ranks); here it runs on NCCL: with one GPU as the
degenerate 1-rank host (per-host reduce-scatter and allgather of one rank, no cross-host
step), and with two GPUs or more as one host of 2 ranks and as 2 fake hosts of 1 rank
(SDL_HOST_ID per rank: the shard crosses "hosts" over Gloo through pinned host memory).
Results are compared with a float64 reduction of every rank's inputs for every dtype, op
and odd size (gpu_workers.allreduce_matrix).
"""

import pytest
import torch

import gpu_workers
from harness import run_ranks

pytestmark = pytest.mark.timeout(600)

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_2_gpus = pytest.mark.skipif(GPUS < 2, reason="NCCL needs one GPU per rank: 2 GPUs")


def run(ranks, hosts):
    env = gpu_workers.rank_env({"SDL_HIERARCHICAL_ALLREDUCE": "1",
                                "SDL_TEST_FAKE_HOSTS": str(hosts)})
    errors = run_ranks("gpu_workers:hierarchical_allreduce", ranks, env=env, timeout=300)
    flat = [f"rank {r}: {e}" for r, errs in enumerate(errors) for e in errs]
    assert not flat, "\n".join(flat[:40])


def test_hierarchical_allreduce_one_rank_host():
    run(1, 1)


@needs_2_gpus
def test_hierarchical_allreduce_one_host_of_two_ranks():
    run(2, 1)


@needs_2_gpus
def test_hierarchical_allreduce_two_fake_hosts():
    run(2, 2)
