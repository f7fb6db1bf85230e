"""Where spark_dl.tensorflow / spark_dl.keras follow Horovod's TensorFlow API, on 2 ranks (one
launch): uint16 in every front end, error types, size_op of a process set, alltoall's return
value, broadcast_, broadcast_global_variables, tf DistributedOptimizer, SyncBatchNormalization,
local variables (Partial* / register_local_*), and optimizer.iterations with
backward_passes_per_step."""

import pytest

from harness import run_once, run_ranks

pytestmark = pytest.mark.timeout(400)
_results = {}


def _case(name):
    per_rank = [r[name] for r in run_once(_results, "compat", lambda: run_ranks(
        "tf_compat_workers:compat", 2, env={"KERAS_BACKEND": "tensorflow"}, timeout=360))]
    for rank, r in enumerate(per_rank):
        assert "error" not in r, f"rank {rank}: {r['error']}"
    return per_rank


def test_uint16_in_every_collective_and_front_end():
    for rank, r in enumerate(_case("uint16")):
        gather, total = r["want_gather"], r["want_sum"]
        for mode in ("eager", "graph"):
            assert r[f"allgather/{mode}"] == ("uint16", gather)
            assert r[f"broadcast/{mode}"] == ("uint16", gather[3:6])  # rank 1's
            assert r[f"alltoall/{mode}"] == ("uint16", [1000, 2000])
            assert r[f"allreduce/{mode}"] == ("uint16", total)
            assert r[f"grouped_allgather/{mode}"] == [("uint16", gather),
                                                      ("uint16", [1000, 2000])]
        assert r["allgather/process_set"] == ("uint16", gather)
        assert r["broadcast/process_set"] == ("uint16", gather[:3])
        assert r["numpy_allgather"] == ("uint16", gather)
        assert r["torch_allgather"] == ("torch.uint16", gather)
        assert r["torch_broadcast"] == ("torch.uint16", gather[3:6])


@pytest.mark.parametrize("case", ["shape/eager", "dtype/eager", "root/eager", "op/eager"])
def test_mismatch_is_failed_precondition_and_spark_dl_mismatch(case):
    for r in _case("errors"):
        e = r[case]
        assert e is not None, f"{case} raised nothing"
        assert e["tf_failed_precondition"] and e["sdl_mismatch"] and e["hvd_mismatch"], e


def test_mismatch_inside_tf_function_is_a_tf_op_error():
    for r in _case("errors"):
        e = r["shape/graph"]
        assert e["tf_op_error"] and "MismatchError" in e["message"], e


@pytest.mark.parametrize("case", ["splits/eager", "splits/graph", "process_set/eager"])
def test_bad_argument_is_tf_invalid_argument(case):
    for r in _case("errors"):
        e = r[case]
        assert e is not None and e["tf_invalid_argument"], (case, e)
        if case.endswith("eager"):
            assert e["sdl_invalid_argument"], e


@pytest.mark.parametrize("case", ["sparse_Min", "sparse_Max", "sparse_Product", "sparse_Adasum",
                                  "sparse_prescale", "sparse_postscale"])
def test_indexed_slices_refusals_are_not_implemented(case):
    for r in _case("errors"):
        assert r[case] is not None and r[case]["not_implemented"], r[case]
        assert r["after"] == 2.0


def test_size_op_honours_the_process_set():
    for rank, r in enumerate(_case("size_op_alltoall")):
        assert r["size_op"] == 1 and r["size_op_graph"] == 1
        assert r["size_op_global"] == 2
        assert r["included"] == (1 if rank == 1 else 0)
        assert r["included_global"] == 1
        assert r["size_op_unknown"]["tf_invalid_argument"]


def test_alltoall_returns_the_tensor_alone_without_splits():
    for r in _case("size_op_alltoall"):
        assert r["alltoall_plain"] == (True, [0.0, 1.0])
        assert r["alltoall_plain_graph"] == (True, [0.0, 1.0])
        assert r["alltoall_splits"] == (True, 2, [1, 1])


def test_broadcast_in_place_and_broadcast_global_variables():
    for r in _case("broadcast_in_place"):
        assert r["eager"] == ([1.0, 11.0], 1, [[1.0, 11.0], 1])
        assert r["graph"] == ([0.0, 20.0], [0.0, 20.0])
        e = r["global_eager"]
        assert e["type"] == "RuntimeError" and "broadcast_variables" in e["message"]


def test_tensorflow_distributed_optimizer_keras_and_v1():
    a, b = _case("tf_distributed_optimizer")
    assert a["keras_is_distributed"]
    assert a["keras_weights"] == b["keras_weights"]
    for r in (a, b):
        assert r["legacy_grad"] == [1.5, 1.5]  # (1 + 2) / 2
        assert r["legacy_value"] == [0.25, 0.25]


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_sync_batch_norm_matches_one_layer_over_the_union(mode):
    for r in _case("sync_batch_norm"):
        assert r["local_y_differs_by"] > 0.1  # the check below can tell the difference
        for key, diff in r[mode].items():
            assert diff < 1e-4, f"{key} differs from the union's by {diff}"


def test_sync_batch_norm_trains_equal_replicas():
    a, b = _case("sync_batch_norm")
    assert a["fit_weights"] == b["fit_weights"]


def test_partial_distributed_gradient_tape():
    a, b = _case("local_variables")
    for r in (a, b):
        for name, (got, own) in r["tape"].items():
            if name.startswith("head/"):  # local: this rank's gradient / size
                assert got == pytest.approx([[v / 2 for v in row] if isinstance(row, list)
                                             else row / 2 for row in own])
    for name in a["tape"]:
        if name.startswith("shared/"):
            assert a["tape"][name][0] == pytest.approx(b["tape"][name][0])
    for rank, r in enumerate((a, b)):
        # v is averaged ((1 + 2) / 2); u is local and unscaled.
        assert r["register_local_source"] == ([1.5], [float(rank + 1)])


def test_partial_distributed_optimizer_and_local_variables_in_the_broadcast():
    a, b = _case("local_variables")
    assert a["fit_shared"] == b["fit_shared"]
    assert a["fit_head"] != b["fit_head"]
    assert a["fit_head_init"] != b["fit_head_init"]  # not broadcast: each rank's own start
    assert len(a["optimizer_variables"]) == 2, a["optimizer_variables"]  # iteration, lr
    assert a["register_local_var_shared"] == b["register_local_var_shared"]
    assert a["register_local_var_head"] != b["register_local_var_head"]


def test_iterations_count_backward_passes_as_horovod():
    for r in _case("iterations"):
        assert r["iterations"] == r["batches"] == 12
        assert r["updates"] == 4


def test_sync_batch_norm_on_the_torch_backend():
    for r in run_ranks("keras_workers:sync_batch_norm_torch", 2, env={"KERAS_BACKEND": "torch"},
                       timeout=240):
        assert r.pop("backend") == "torch"
        for key, diff in r.items():
            assert diff < 1e-4, f"{key} differs from the union's by {diff}"
