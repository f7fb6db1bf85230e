"""The operation x dtype x reduce-op matrix shared by the test module and its ranks."""

DTYPES = ["uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
          "float64", "bool"]
REDUCE_OPS = ["Average", "Sum", "Min", "Max", "Product"]


def _reduce_ok(dtype, op):
    return dtype != "bool" or op in ("Min", "Max", "Product")


def cases():
    """Case ids, e.g. 'allreduce-float32-Sum'."""
    out = []
    for dt in DTYPES:
        for op in REDUCE_OPS:
            if _reduce_ok(dt, op):
                out.append(f"allreduce-{dt}-{op}")
                out.append(f"reducescatter-{dt}-{op}")
        out.append(f"allgather-{dt}")
        out.append(f"broadcast-{dt}-root0")
        out.append(f"broadcast-{dt}-rootlast")
        out.append(f"alltoall-{dt}")
        out.append(f"alltoall-{dt}-even")
    for dt in ("float16", "float32", "float64", "int32"):
        out.append(f"allreduce_scaled-{dt}-Sum")
        out.append(f"allreduce_scaled-{dt}-Average")
    for dt in ("float32", "int64"):
        out.append(f"grouped_allreduce-{dt}-Sum")
        out.append(f"allreduce_inplace-{dt}-Sum")
    # In place (NumPy arrays): more dtypes, a 0-d array and an empty one.
    for dt, op in (("float16", "Sum"), ("bool", "Max"), ("uint8", "Min")):
        out.append(f"allreduce_inplace-{dt}-{op}")
    out.append("allreduce_inplace-float32-Average-scalar")
    out.append("allreduce_inplace-float64-Sum-empty")
    for dt in DTYPES:  # above the transports' small-message paths (Gloo: 64 KiB gathered)
        out.append(f"allreduce-{dt}-{'Max' if dt == 'bool' else 'Sum'}-large")
    for dt in ("float16", "float32", "int64"):  # several ring chunks, uneven blocks
        out.append(f"allreduce-{dt}-Sum-huge")
    out.append("allreduce-float32-Sum-empty")
    out.append("allgather-float32-zero_rows")
    out.append("allreduce-float32-Sum-scalar")
    out.append("allreduce-float32-Sum-noncontiguous")
    return out


def parse(case):
    """(kind, dtype, extra, variant) of a case id such as 'allreduce-float32-Sum-empty'."""
    parts = case.split("-") + ["", ""]
    return parts[0], parts[1], parts[2], parts[3]


def input_shape(variant):
    """The per-rank input shape of an allreduce case variant."""
    return {"empty": (0, 4), "scalar": (), "large": (20000, 3),
            "huge": (200003,)}.get(variant, (5, 3))
