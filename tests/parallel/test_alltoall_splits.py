"""alltoall with bad splits on 2 ranks, through the torch, NumPy and TensorFlow front ends:
float (list, array, tensor), boolean, string, negative, wrong-length, two-dimensional splits
and splits that do not add up to the first dimension raise spark_dl's InvalidArgumentError
(a ValueError and a RuntimeError, what Horovod's tests catch) on every rank, from the one
check the front ends share, before anything is sent: a good alltoall afterwards completes
on both ranks."""

import pytest

from alltoall_splits_workers import bad_cases
from harness import run_once, run_ranks

pytestmark = pytest.mark.timeout(300)
_results = {}

NEEDLES = {
    "float_list": "must be integers",
    "fractional_list": "must be integers",
    "float_array": "must be integers",
    "float_tensor": "must be integers",
    "float_tensor_async": "must be integers",
    "bool_list": "must be integers",
    "string_list": "must be integers",
    "negative": "must be >= 0",
    "wrong_length": "one split per rank of the process set (2), got 1",
    "sum_too_big": "sum to 3 but the first dimension is 2",
    "sum_too_small": "sum to 2 but the first dimension is 3",
    "two_dims": "one-dimensional",
}


def _launch(front_end):
    if front_end == "tensorflow":
        pytest.importorskip("tensorflow")
    return run_once(_results, front_end, lambda: run_ranks(
        "alltoall_splits_workers:bad_splits", 2, timeout=240, args=(front_end,)))


def _cases(front_end):
    cases = list(bad_cases(2))
    if front_end == "torch":
        cases.append("float_tensor_async")
    if front_end == "tensorflow":
        cases = [c for c in cases if c != "string_list"] + ["float_tensor"]
    return cases


@pytest.mark.parametrize("front_end", ["torch", "numpy", "tensorflow"])
def test_bad_splits_raise_invalid_argument_on_every_rank(front_end):
    per_rank = _launch(front_end)
    for case in _cases(front_end):
        for rank, r in enumerate(per_rank):
            got = r[case]
            assert got is not None, f"{front_end} {case}: rank {rank} raised nothing"
            assert got["invalid_argument"] and got["value_error"] and got["runtime_error"], \
                f"{front_end} {case}: rank {rank} raised {got['type']}: {got['message']}"
            assert NEEDLES[case] in got["message"], (front_end, case, rank, got["message"])


@pytest.mark.parametrize("front_end", ["torch", "numpy", "tensorflow"])
def test_nothing_was_sent_a_good_alltoall_completes_after(front_end):
    per_rank = _launch(front_end)
    for rank, r in enumerate(per_rank):
        out, received = r["good"]
        assert out == [0.0, 1.0] and received == [1, 1], (front_end, rank, r["good"])


def test_float_splits_inside_tf_function_are_refused_by_the_same_check():
    for rank, r in enumerate(_launch("tensorflow")):
        got = r["tf_function_float"]
        assert got is not None and "alltoall splits must be integers" in got["message"], \
            (rank, got)
