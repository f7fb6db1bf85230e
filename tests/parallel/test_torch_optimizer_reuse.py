"""A DistributedOptimizer re-created over the same parameters does not collide with the old one."""

from harness import run_ranks


def test_recreated_optimizers_reduce_once():
    results = run_ranks("torch_workers:recreated_optimizers", 2, timeout=90)
    (w0, expected), (w1, _) = results
    assert w0 == w1
    assert all(abs(a - b) < 1e-5 for a, b in zip(w0, expected)), (w0, expected)
