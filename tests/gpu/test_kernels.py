"""The batched pack/unpack/scale CUDA kernels against torch, on a GPU.

Skipped (with the reason) where spark_dl was built without CUDA or no GPU is
usable. Runs through the test-only binding _core._gpu_selftest_scaled_copy,
which takes device pointers as integers, launches the kernels on a private
stream and synchronizes it; torch's work is synchronized before each call.
"""

import pytest

torch = pytest.importorskip("torch")  # first: its CUDA runtime is the one spark_dl then shares

from spark_dl import _core  # noqa: E402


def _skip_reason():
    if not _core.build_info()["cuda"]:
        return "spark_dl was built without CUDA (no nvcc at build time)"
    info = _core.gpu_runtime_info()
    if not info["cuda_usable"]:
        return "CUDA is not usable here: " + info["cuda_reason"]
    if not torch.cuda.is_available():
        return "torch sees no CUDA device (a CPU build of torch?)"
    return ""


pytestmark = pytest.mark.skipif(bool(_skip_reason()), reason=_skip_reason() or "GPU present")

DTYPES = {
    "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16, "int32": torch.int32,
    "int64": torch.int64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float32": torch.float32, "float64": torch.float64,
}
# Odd sizes around the 16-byte vectors and the 16 KiB chunks, and one past 1 Mi elements.
SIZES = [1, 3, 7, 8, 9, 15, 17, 1023, 4097, 8191, 16387, 65537, (1 << 20) + 5]
# Integer values whose scaled results stay in range (out of range saturates on the device).
INT_RANGE = {"uint8": (0, 80), "int8": (-40, 40), "int16": (-1000, 1000),
             "int32": (-10**6, 10**6), "int64": (-10**12, 10**12)}
DEV = 0


def _tensor(name, n, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    dt = DTYPES[name]
    if name in INT_RANGE:
        lo, hi = INT_RANGE[name]
        t = torch.randint(lo, hi + 1, (n,), generator=g, dtype=torch.int64).to(dt)
    else:
        t = (torch.randn(n, generator=g, dtype=torch.float64) * 10).to(dt)
    return t.to(f"cuda:{DEV}")


def _scaled(name, t, scale):
    """The core's scaling rule (common/reduce.cc), computed by torch."""
    if scale == 1.0:
        return t.clone()
    if name in INT_RANGE:  # in double, truncated toward zero
        return (t.double() * scale).trunc().to(t.dtype)
    if name == "float64":
        return t * scale
    # float32 multiplies by the factor rounded to float; half types compute in float
    return (t.float() * torch.tensor(scale, dtype=torch.float32)).to(t.dtype)


def _copy(srcs, dsts, counts, name, scale, divisor=1):
    torch.cuda.synchronize(DEV)
    _core._gpu_selftest_scaled_copy(srcs, dsts, counts, name, scale, DEV, divisor)


def _fusion_layout(tensors):
    """Offsets (bytes, 64-byte aligned like the operations layer's) and the buffer."""
    offsets, off = [], 0
    for t in tensors:
        offsets.append(off)
        off += (t.numel() * t.element_size() + 63) // 64 * 64
    return offsets, torch.zeros(max(off, 1), dtype=torch.uint8, device=f"cuda:{DEV}")


def _slot(buf, offset, t):
    return buf[offset:offset + t.numel() * t.element_size()].view(t.dtype)


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("scale", [1.0, 0.5, 3.0])
def test_pack_then_unpack_matches_torch(name, scale):
    tensors = [_tensor(name, n, seed) for seed, n in enumerate(SIZES)]
    offsets, buf = _fusion_layout(tensors)
    counts = [t.numel() for t in tensors]
    # pack with prescale
    _copy([t.data_ptr() for t in tensors], [buf.data_ptr() + o for o in offsets], counts,
          name, scale)
    for t, o in zip(tensors, offsets):
        assert torch.equal(_slot(buf, o, t), _scaled(name, t, scale)), (name, t.numel())
    # unpack with postscale into fresh outputs
    outs = [torch.empty_like(t) for t in tensors]
    _copy([buf.data_ptr() + o for o in offsets], [o.data_ptr() for o in outs], counts,
          name, 0.5)
    for t, o, out in zip(tensors, offsets, outs):
        assert torch.equal(out, _scaled(name, _slot(buf, o, t), 0.5)), (name, t.numel())


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32", "int32", "int8"])
def test_scale_in_place(name):
    for n in SIZES:
        t = _tensor(name, n, n)
        want = _scaled(name, t, 0.25)
        _copy([t.data_ptr()], [t.data_ptr()], [n], name, 0.25)
        assert torch.equal(t, want), (name, n)


@pytest.mark.parametrize("name", ["float32", "float16", "int64", "uint8"])
def test_misaligned_tensors_take_the_element_path(name):
    # Views starting one element in: not 16-byte aligned, so no vector loads.
    for n in SIZES[:10]:
        base = _tensor(name, n + 1, n)
        src = base[1:]
        out = torch.zeros(n + 1, dtype=base.dtype, device=base.device)[1:]
        _copy([src.data_ptr()], [out.data_ptr()], [n], name, 3.0)
        assert torch.equal(out, _scaled(name, src, 3.0)), (name, n)


def test_many_small_tensors_span_several_launches():
    # 300 x 16 KiB float32 (more than 128 per launch) plus one 64 MiB tensor.
    tensors = [_tensor("float32", 4096, i) for i in range(300)] + [_tensor("float32", 1 << 24, 7)]
    offsets, buf = _fusion_layout(tensors)
    _copy([t.data_ptr() for t in tensors], [buf.data_ptr() + o for o in offsets],
          [t.numel() for t in tensors], "float32", 2.0)
    for t, o in zip(tensors, offsets):
        assert torch.equal(_slot(buf, o, t), t * 2.0)


def test_plain_copy_of_bool_and_refused_bool_scaling():
    t = torch.rand(1001, device=f"cuda:{DEV}") > 0.5
    out = torch.zeros_like(t)
    _copy([t.data_ptr()], [out.data_ptr()], [t.numel()], "bool", 1.0)
    assert torch.equal(out, t)
    with pytest.raises(_core.CoreError, match="bool tensors cannot be scaled"):
        _copy([t.data_ptr()], [out.data_ptr()], [t.numel()], "bool", 0.5)


def test_empty_and_zero_count_spans_are_skipped():
    t = _tensor("float32", 5, 1)
    out = torch.zeros_like(t)
    _copy([], [], [], "float32", 2.0)
    _copy([0, t.data_ptr()], [0, out.data_ptr()], [0, 5], "float32", 2.0)
    assert torch.equal(out, t * 2.0)


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_pack_binding_for_benchmarks_on_the_current_stream(scale):
    # cuda_pack_for_tests(tensors, buffer, unpack, scale, stream): back to back, no sync.
    xs = [torch.randn(n, device=f"cuda:{DEV}") for n in (4096, 7, 1, 65537)]
    flat = torch.empty(sum(x.numel() for x in xs), device=f"cuda:{DEV}")
    stream = torch.cuda.current_stream(DEV).cuda_stream
    _core.cuda_pack_for_tests(xs, flat, False, scale, stream)
    want = torch.cat(xs) * torch.tensor(scale, dtype=torch.float32)
    assert torch.equal(flat, want)  # same stream: ordered without a sync
    outs = [torch.empty_like(x) for x in xs]
    _core.cuda_pack_for_tests(outs, flat, True, 1.0, stream)
    assert torch.equal(torch.cat(outs), want)


@pytest.mark.parametrize("name", list(DTYPES))
def test_average_divisor_and_zero_sources(name):
    # An integer Average divides exactly by the rank count (300: wider than int8); floats
    # fold it into the factor. A span without a source writes zeros (a joined rank).
    tensors = [_tensor(name, n, n) for n in SIZES[:9]]
    outs = [torch.full_like(t, 7) for t in tensors]
    srcs = [0 if i % 3 == 0 else t.data_ptr() for i, t in enumerate(tensors)]
    _copy(srcs, [o.data_ptr() for o in outs], [t.numel() for t in tensors], name, 0.5, 300)
    for i, (t, o) in enumerate(zip(tensors, outs)):
        if i % 3 == 0:
            want = torch.zeros_like(t)
        elif name in INT_RANGE:
            q = torch.div(t.to(torch.int64), 300, rounding_mode="trunc")
            want = _scaled(name, q.to(t.dtype), 0.5)
        else:
            want = _scaled(name, t, 0.5 / 300)
        assert torch.equal(o, want), (name, t.numel(), i)
