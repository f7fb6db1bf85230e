"""spark_dl.torch on CUDA tensors: every collective, streams, training, SyncBatchNorm.

- one rank per GPU (NCCL; with one GPU, one rank: the same code path as N ranks);
- two ranks sharing one GPU: NCCL refuses that, so the core must stage CUDA tensors
  through host memory (shm/Gloo) on its own, with the same results. Where the host has two
  GPUs or more, two ranks get one each and NCCL carries them.

The workers are in gpu_workers.py; each returns its list of errors.
"""

import pytest
import torch

import gpu_workers
from harness import run_ranks

pytestmark = pytest.mark.timeout(600)

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
# (ranks, what carries them): one per GPU, and two sharing GPU 0 where there is one GPU.
LAYOUTS = [pytest.param(1, id="1rank"),
           pytest.param(2, id="2ranks-" + ("2gpus" if GPUS >= 2 else "shared-gpu"))]


def run(function, ranks, timeout=300):
    errors = run_ranks(f"gpu_workers:{function}", ranks, env=gpu_workers.rank_env(),
                       timeout=timeout)
    flat = [f"rank {r}: {e}" for r, errs in enumerate(errors) for e in errs]
    assert not flat, "\n".join(flat[:40])


@pytest.mark.parametrize("ranks", LAYOUTS)
def test_allreduce_every_dtype_op_and_odd_size(ranks):
    run("allreduce_matrix", ranks)


@pytest.mark.parametrize("ranks", LAYOUTS)
def test_allgather_broadcast_alltoall_reducescatter_grouped_process_sets(ranks):
    run("other_ops", ranks)


@pytest.mark.parametrize("ranks", LAYOUTS)
def test_core_reads_after_the_frameworks_stream(ranks):
    run("stream_order", ranks)


@pytest.mark.parametrize("ranks", LAYOUTS)
def test_core_does_not_wait_for_work_queued_after_the_enqueue(ranks):
    run("stream_overlap", ranks)


@pytest.mark.parametrize("ranks", LAYOUTS)
def test_distributed_optimizer_on_cuda_matches_cpu(ranks):
    run("training_matches_cpu", ranks)


@pytest.mark.parametrize("ranks", LAYOUTS)
def test_optimizer_state_and_sparse_gradients_on_cuda(ranks):
    run("optimizer_state_on_cuda", ranks)


@pytest.mark.parametrize("ranks", LAYOUTS)
def test_sync_batch_norm_on_cuda(ranks):
    run("sync_batch_norm_matches", ranks)
