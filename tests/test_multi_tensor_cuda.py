"""The CUDA kernels of apex_lite._C against the Python backend, on the same CUDA tensors.

CUDA-only cases (the general kernel table, tests/test_multi_tensor.py, covers both backends on
every device): ``scale`` and ``axpby`` agree with the Python backend bit for bit over every dtype
combination and shapes that cross chunk boundaries; inf and NaN are flagged wherever they are;
a tensor of more than 2**31 elements is processed to its last element (64-bit offsets); the ops run
on the current stream and never synchronise with the host. Skipped without a GPU, and without a
CUDA build of the extension unless APEX_LITE_REQUIRE_EXT=1 (then that is a failure).
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from native_cuda import require_cuda_kernels

require_cuda_kernels(("scale_", "scale_out", "axpby_", "axpby_out", "l2norm", "nonfinite_flags"))

from apex_lite.multi_tensor import _python  # noqa: E402

native = torch.ops.apex_lite

DEVICE = torch.device("cuda")
CHUNK = 65536
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# Sizes that cross the chunk boundary and leave unaligned tails (scalar fallback).
SIZES = (0, 1, 555, CHUNK, CHUNK + 1, 7777 * 77)
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _ids(value):
    """Test ids for a dtype or a tuple of dtypes."""
    if isinstance(value, torch.dtype):
        return DTYPE_IDS[value]
    return "-".join(DTYPE_IDS[d] for d in value)


def _random_list(dtypes, sizes=SIZES, seed=0, magnitude=1000.0):
    """One tensor per size, cycling through ``dtypes``; values spread so that rounding matters."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    out = []
    for i, n in enumerate(sizes):
        dtype = dtypes[i % len(dtypes)]
        out.append((torch.randn(n, generator=gen, device=DEVICE) * magnitude).to(dtype))
    return out


def _found_inf():
    return torch.zeros(1, dtype=torch.float32, device=DEVICE)


def _assert_bitwise_equal(actual, expected):
    """Same dtype, same NaN positions, identical bits everywhere else (so -0.0 != 0.0)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan)
    a_bits = actual.contiguous().view(BITS[actual.dtype])[~nan]
    e_bits = expected.contiguous().view(BITS[expected.dtype])[~nan]
    if not torch.equal(a_bits, e_bits):
        mismatch = (a_bits != e_bits).nonzero()[:5].flatten().tolist()
        raise AssertionError(f"bits differ at (non-NaN) positions {mismatch}: "
                             f"{actual[~nan][mismatch].tolist()} vs "
                             f"{expected[~nan][mismatch].tolist()}")


# Scales: a power of two, inexact ones, exactly 1 (the O2 master-to-model copy) and one that
# overflows fp16 outputs (found_inf must stay 0: only inputs are checked).
SCALES = (2.0 ** -16, 0.1, 3.0, 1.0, 65536.0)


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_scale_inplace_matches_python_bitwise(dtype, scale):
    tensors = _random_list([dtype])
    originals = [t.clone() for t in tensors]
    expected = [torch.empty_like(t) for t in tensors]
    found_native, found_python = _found_inf(), _found_inf()
    native.scale_(tensors, scale, found_native)
    # The reference is the out-of-place form (same contract): the Python backend's in-place scale_
    # calls torch's CUDA unscale kernel, which has no bf16 implementation.
    _python.scale_out(originals, expected, scale, found_python)
    for actual, ref in zip(tensors, expected):
        _assert_bitwise_equal(actual, ref)
    assert found_native.item() == found_python.item() == 0.0


@pytest.mark.parametrize("scale", (2.0 ** -16, 0.1, 1.0, 65536.0))
@pytest.mark.parametrize("in_dtype,out_dtype", list(itertools.product(DTYPES, DTYPES)), ids=_ids)
def test_scale_out_matches_python_bitwise(in_dtype, out_dtype, scale):
    inputs = _random_list([in_dtype], seed=1)
    originals = [t.clone() for t in inputs]
    outputs = [torch.full_like(t, 7.0, dtype=out_dtype) for t in inputs]
    expected = [torch.full_like(t, 7.0, dtype=out_dtype) for t in inputs]
    found_native, found_python = _found_inf(), _found_inf()
    native.scale_out(inputs, outputs, scale, found_native)
    _python.scale_out(inputs, expected, scale, found_python)
    for actual, ref in zip(outputs, expected):
        _assert_bitwise_equal(actual, ref)
    for t, original in zip(inputs, originals):
        _assert_bitwise_equal(t, original)
    assert found_native.item() == found_python.item() == 0.0


def test_scale_out_mixed_dtypes_in_one_call():
    """A list mixing every (in, out) dtype pair: one call, several kernel instantiations."""
    pairs = list(itertools.product(DTYPES, DTYPES))
    sizes = [SIZES[i % len(SIZES)] + i for i in range(len(pairs) * 2)]
    inputs = [t.to(pairs[i % len(pairs)][0]) for i, t in enumerate(_random_list([torch.float32],
                                                                                 sizes, seed=2))]
    outputs = [torch.empty_like(t, dtype=pairs[i % len(pairs)][1]) for i, t in enumerate(inputs)]
    expected = [torch.empty_like(o) for o in outputs]
    found_native, found_python = _found_inf(), _found_inf()
    native.scale_out(inputs, outputs, 0.3, found_native)
    _python.scale_out(inputs, expected, 0.3, found_python)
    for actual, ref in zip(outputs, expected):
        _assert_bitwise_equal(actual, ref)


# a = 1/3 and b = 0.7 make a fused multiply-add differ from the contract on many elements.
AXPBY_FACTORS = ((1.0 / 3.0, 0.7), (1.0, 2.0 ** -16), (0.5, 1.0), (-1.25, 0.0))


@pytest.mark.parametrize("a,b", AXPBY_FACTORS)
@pytest.mark.parametrize("x_dtype,y_dtype", list(itertools.product(DTYPES, DTYPES)), ids=_ids)
def test_axpby_inplace_matches_python_bitwise(x_dtype, y_dtype, a, b):
    xs = _random_list([x_dtype], seed=3)
    ys = _random_list([y_dtype], seed=4)
    expected = [y.clone() for y in ys]
    found_native, found_python = _found_inf(), _found_inf()
    native.axpby_(xs, ys, a, b, found_native)
    _python.axpby_(xs, expected, a, b, found_python)
    for actual, ref in zip(ys, expected):
        _assert_bitwise_equal(actual, ref)
    assert found_native.item() == found_python.item() == 0.0


@pytest.mark.parametrize("dtypes", list(itertools.product(DTYPES, DTYPES, DTYPES)), ids=_ids)
def test_axpby_out_matches_python_bitwise(dtypes):
    x_dtype, y_dtype, out_dtype = dtypes
    a, b = 1.0 / 3.0, 0.7
    xs = _random_list([x_dtype], seed=5)
    ys = _random_list([y_dtype], seed=6)
    outputs = [torch.empty_like(x, dtype=out_dtype) for x in xs]
    expected = [torch.empty_like(o) for o in outputs]
    found_native, found_python = _found_inf(), _found_inf()
    native.axpby_out(xs, ys, outputs, a, b, found_native)
    _python.axpby_out(xs, ys, expected, a, b, found_python)
    for actual, ref in zip(outputs, expected):
        _assert_bitwise_equal(actual, ref)
    assert found_native.item() == found_python.item() == 0.0


def test_axpby_differs_from_fused_multiply_add():
    """Guards the bitwise axpby tests: on these inputs fma(a, x, b*y) (one rounding of a*x + b*y)
    differs from the contract's round(round(a*x) + round(b*y)), so a kernel that let the compiler
    fuse would fail them."""
    x = _random_list([torch.float32], sizes=(7777 * 77,), seed=5)[0]
    y = _random_list([torch.float32], sizes=(7777 * 77,), seed=6)[0]
    a = torch.tensor(1.0 / 3.0, dtype=torch.float32, device=DEVICE)
    b = torch.tensor(0.7, dtype=torch.float32, device=DEVICE)
    by = y * b
    contract = x * a + by
    # a*x is exact in float64 (24-bit by 24-bit significands); the sum is then rounded to fp32.
    fused = (x.double() * a.double() + by.double()).float()
    assert not torch.equal(contract, fused)


POSITIONS = ("first", "middle", "last")
NONFINITE_SIZES = (555, CHUNK + 1, 7777 * 77)


def _position(n, where):
    return {"first": 0, "middle": n // 2, "last": n - 1}[where]


def _inject(tensors, tensor_where, element_where, value):
    index = _position(len(tensors), tensor_where)
    t = tensors[index]
    t[_position(t.numel(), element_where)] = value
    return index


@pytest.mark.parametrize("value", (float("inf"), float("-inf"), float("nan")))
@pytest.mark.parametrize("tensor_where,element_where", list(itertools.product(POSITIONS, POSITIONS)))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_nonfinite_inputs_flagged_everywhere(dtype, tensor_where, element_where, value):
    inputs = _random_list([dtype], sizes=NONFINITE_SIZES, seed=7)
    flagged = _inject(inputs, tensor_where, element_where, value)

    found_native, found_python = _found_inf(), _found_inf()
    outputs = [torch.empty_like(t, dtype=torch.float32) for t in inputs]
    expected = [torch.empty_like(o) for o in outputs]
    native.scale_out(inputs, outputs, 0.5, found_native)
    _python.scale_out(inputs, expected, 0.5, found_python)
    assert found_native.item() == found_python.item() == 1.0
    for actual, ref in zip(outputs, expected):
        _assert_bitwise_equal(actual, ref)

    clean = _random_list([dtype], sizes=NONFINITE_SIZES, seed=8)
    for xs, ys in ((inputs, clean), (clean, inputs)):  # a non-finite x, then a non-finite y
        found = _found_inf()
        native.axpby_out(xs, ys, [torch.empty_like(t) for t in xs], 0.5, 2.0, found)
        assert found.item() == 1.0

    flags = native.nonfinite_flags(inputs)
    assert flags.dtype == torch.bool and flags.device.type == DEVICE.type
    assert flags.tolist() == [i == flagged for i in range(len(inputs))]
    assert torch.equal(flags, _python.nonfinite_flags(inputs))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_found_inf_is_never_written_zero(dtype):
    found = torch.ones(1, device=DEVICE)
    native.scale_(_random_list([dtype]), 0.5, found)
    native.axpby_(_random_list([dtype]), _random_list([dtype], seed=1), 0.5, 0.5, found)
    assert found.item() == 1.0
    found.zero_()
    native.scale_(_random_list([dtype]), 0.5, found)
    assert found.item() == 0.0


def test_outputs_that_overflow_do_not_flag():
    """found_inf reports non-finite inputs, not products that overflow the output dtype."""
    inputs = [torch.full((1000,), 60000.0, device=DEVICE)]
    outputs = [torch.empty(1000, dtype=torch.float16, device=DEVICE)]
    found = _found_inf()
    native.scale_out(inputs, outputs, 2.0, found)
    assert found.item() == 0.0
    assert torch.isinf(outputs[0]).all()


# fp32 accumulation of ~600K squares against a float64 reference; a lost chunk of even 555 of
# them moves the total by ~5e-4 and a per-tensor norm entirely.
L2NORM_RTOL = 1e-4


@pytest.mark.parametrize("per_tensor", (False, True))
@pytest.mark.parametrize("dtypes", ((torch.float32,), (torch.float16,), (torch.bfloat16,), DTYPES),
                         ids=_ids)
def test_l2norm_matches_float64_reference(dtypes, per_tensor):
    tensors = _random_list(list(dtypes), magnitude=3.0, seed=9)
    total, norms = native.l2norm(tensors, per_tensor)
    ref_norms = torch.stack([t.double().norm() for t in tensors])
    ref_total = ref_norms.norm().reshape(1)
    assert total.dtype == torch.float32 and total.shape == (1,)
    torch.testing.assert_close(total.double(), ref_total, rtol=L2NORM_RTOL, atol=0)
    if per_tensor:
        assert norms.dtype == torch.float32 and norms.shape == (len(tensors),)
        torch.testing.assert_close(norms.double(), ref_norms, rtol=L2NORM_RTOL, atol=0)
        assert norms[SIZES.index(0)].item() == 0.0
    else:
        assert norms.numel() == 0
    python_total, _ = _python.l2norm(tensors, per_tensor)
    torch.testing.assert_close(total, python_total, rtol=L2NORM_RTOL, atol=0)


def test_l2norm_is_deterministic_and_handles_only_empty_tensors():
    tensors = _random_list([torch.float32], sizes=(CHUNK * 40 + 3, 555, CHUNK), seed=10)
    first = native.l2norm(tensors, True)
    second = native.l2norm(tensors, True)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    empty_total, empty_norms = native.l2norm([torch.empty(0, device=DEVICE)] * 3, True)
    assert empty_total.tolist() == [0.0] and empty_norms.tolist() == [0.0, 0.0, 0.0]


def test_many_tensors_need_several_launches():
    """4000 small tensors: more than one kernel-argument struct holds, so the op launches again."""
    sizes = [2500 + (i % 7) for i in range(4000)]
    inputs = _random_list([torch.float16, torch.float32], sizes=sizes, seed=11)
    outputs = [torch.empty_like(t, dtype=torch.float32) for t in inputs]
    expected = [torch.empty_like(o) for o in outputs]
    found_native, found_python = _found_inf(), _found_inf()
    native.scale_out(inputs, outputs, 1.0 / 1024, found_native)
    _python.scale_out(inputs, expected, 1.0 / 1024, found_python)
    for actual, ref in zip(outputs, expected):
        _assert_bitwise_equal(actual, ref)
    flags = native.nonfinite_flags(inputs)
    assert not flags.any().item()


def test_misaligned_views_use_the_scalar_path():
    """Contiguous views starting one element in: not 16-byte aligned, same results."""
    base = _random_list([torch.float32, torch.bfloat16], sizes=(CHUNK * 2 + 9, 4099), seed=12)
    inputs = [t[1:] for t in base]
    outputs = [torch.empty_like(t) for t in inputs]
    expected = [torch.empty_like(t) for t in inputs]
    found_native, found_python = _found_inf(), _found_inf()
    native.scale_out(inputs, outputs, 0.1, found_native)
    _python.scale_out(inputs, expected, 0.1, found_python)
    for actual, ref in zip(outputs, expected):
        _assert_bitwise_equal(actual, ref)


def test_refuses_bad_arguments_with_clear_errors():
    # The checks shared with the CPU kernels (csrc/multi_tensor_checks.h: the Python backend's
    # exception types and messages), then contiguity, which only the CUDA kernels need.
    x = torch.ones(8, 8, device=DEVICE)
    with pytest.raises(RuntimeError, match=r"tensors\[0\] is not contiguous"):
        native.scale_([x.t()], 2.0, _found_inf())
    with pytest.raises(ValueError, match=r"tensors\[0\] is on cuda:\d+ but found_inf is on cpu"):
        native.scale_([x], 2.0, torch.zeros(1))
    with pytest.raises(TypeError, match="found_inf must be a 1-element float32 tensor"):
        native.scale_([x], 2.0, torch.zeros(2, device=DEVICE))
    with pytest.raises(ValueError, match=r"inputs has 1 tensors but outputs has 2"):
        native.scale_out([x], [x.clone(), x.clone()], 2.0, _found_inf())
    with pytest.raises(ValueError, match=r"xs\[0\] has shape \(8, 8\) but ys\[0\] has \(4,\)"):
        native.axpby_([x], [torch.ones(4, device=DEVICE)], 1.0, 1.0, _found_inf())
    with pytest.raises(TypeError, match="has dtype torch.float64"):
        native.scale_([torch.ones(3, dtype=torch.float64, device=DEVICE)], 2.0, _found_inf())
    with pytest.raises(ValueError, match=r"tensors\[1\] is on cpu but tensors\[0\] is on cuda"):
        native.l2norm([x, torch.ones(3)], False)
    rows = list(torch.arange(6.0, device=DEVICE).reshape(3, 2).unbind(0))
    before = [r.clone() for r in rows]
    with pytest.raises(ValueError, match=r"outputs\[0\] shares memory with inputs\[1\]"):
        native.scale_out(rows, rows[1:] + [torch.empty(2, device=DEVICE)], 2.0, _found_inf())
    with pytest.raises(ValueError, match=r"outputs\[0\] has elements that share memory"):
        native.scale_out([x], [torch.ones(8, device=DEVICE).expand(8, 8)], 2.0, _found_inf())
    for r, b in zip(rows, before):
        assert torch.equal(r, b)


def test_empty_lists_and_empty_tensors_are_no_ops():
    found = _found_inf()
    native.scale_([], 2.0, found)
    native.axpby_out([], [], [], 1.0, 1.0, found)
    empties = [torch.empty(0, device=DEVICE, dtype=d) for d in DTYPES]
    native.scale_(empties, 2.0, found)
    assert found.item() == 0.0


def test_runs_on_the_current_stream_without_host_sync():
    """Every op on a side stream, queued behind a sleep and a write to its input: if an op ran on
    another stream it would read the input before the write. No op may synchronise."""
    side = torch.cuda.Stream()
    n = CHUNK * 3 + 5
    x = torch.ones(n, device=DEVICE, dtype=torch.bfloat16)
    y = torch.ones(n, device=DEVICE, dtype=torch.float16)
    scaled = torch.empty(n, device=DEVICE)
    combined = torch.empty(n, device=DEVICE)
    found = _found_inf()
    side.wait_stream(torch.cuda.current_stream())
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)
            x.fill_(2.0)
            y.fill_(float("inf"))
            native.scale_out([x], [scaled], 0.25, found)
            native.axpby_out([x], [x], [combined], 1.5, 0.5, found)
            native.scale_([x], 0.5, found)
            native.axpby_([x], [y], 1.0, 1.0, found)
            total, norms = native.l2norm([x, scaled], True)
            flags = native.nonfinite_flags([x, y])
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.current_stream().wait_stream(side)
    assert scaled.eq(0.5).all().item() and combined.eq(4.0).all().item()
    assert x.eq(1.0).all().item() and torch.isinf(y).all().item()
    assert found.item() == 1.0
    torch.testing.assert_close(norms, torch.tensor([math.sqrt(n), 0.5 * math.sqrt(n)],
                                                   device=DEVICE), rtol=1e-5, atol=0)
    torch.testing.assert_close(total, torch.tensor([math.sqrt(1.25 * n)], device=DEVICE),
                               rtol=1e-5, atol=0)
    assert flags.tolist() == [False, True]


LARGE_NUMEL = 2 ** 31 + 3 * CHUNK + 17  # past 2**31 elements and across the per-launch block cap


@pytest.mark.skipif(torch.cuda.mem_get_info()[0] < 16 * 2 ** 30,
                    reason="the >2**31-element case needs 16 GB of free GPU memory")
def test_tensor_above_2_pow_31_elements():
    """bf16, 4.3 GB: with 32-bit offsets the elements past 2**31 would be skipped or wrap."""
    x = torch.full((LARGE_NUMEL,), 1.5, dtype=torch.bfloat16, device=DEVICE)
    x[-1000:] = 3.0
    tail = LARGE_NUMEL - 1000

    total, norms = native.l2norm([x], True)
    expected_norm = math.sqrt(tail * 1.5 ** 2 + 1000 * 3.0 ** 2)
    torch.testing.assert_close(total.item(), expected_norm, rtol=1e-4, atol=0)
    torch.testing.assert_close(norms.item(), expected_norm, rtol=1e-4, atol=0)
    assert native.nonfinite_flags([x]).tolist() == [False]

    x[-1] = float("inf")
    assert native.nonfinite_flags([x]).tolist() == [True]
    found = _found_inf()
    native.scale_([x], 0.5, found)
    assert found.item() == 1.0
    assert x[:tail].eq(0.75).all().item()
    assert x[tail:-1].eq(1.5).all().item()
    assert x[-1].item() == float("inf")


# ---- tensors on a GPU that is not the current device (issue 44) ---------------------------------

def _two_gpus():
    count = torch.cuda.device_count()
    if count < 2:
        pytest.skip(f"needs two CUDA GPUs (this host has {count}): the device guards for tensors "
                    f"on a non-current device stay unchecked")


def test_ops_on_a_non_current_cuda_device_run_there():
    """Each op runs on its tensors' device whatever the current device is (the kernels' device
    guards): the same results on cuda:1 with cuda:0 current as on cuda:0."""
    _two_gpus()

    def run(device):
        g = torch.Generator().manual_seed(0)
        xs = [torch.randn(n, generator=g).to(device) for n in (555, CHUNK + 1, 3)]
        xs[1][7] = float("inf")
        found_inf = torch.zeros(1, device=device)
        outs = [torch.empty_like(x) for x in xs]
        native.scale_out(xs, outs, 0.5, found_inf)
        native.axpby_(xs, outs, 2.0, -1.0, found_inf)
        total, per_tensor = native.l2norm(outs[:1] + outs[2:], True)
        flags = native.nonfinite_flags(xs)
        return [t.cpu() for t in outs + [found_inf, total, per_tensor, flags]]

    on_current = run(torch.device("cuda:0"))
    with torch.cuda.device(0):
        elsewhere = run(torch.device("cuda:1"))
    for a, b in zip(elsewhere, on_current):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
