"""apex_lite.multi_tensor on every backend and device: results, flags, layouts, backend choice.

References are computed in float64 on the CPU and rounded the way the contract says (fp32 result
first, then the output dtype), so they are bit-exact for ``scale`` and ``axpby``; both backends
must match them, and each other, bit for bit. ``l2norm`` is compared with a float64 norm within
L2NORM_RTOL[backend] (fp32 accumulation).

Native cases are skipped, with the loader's reason, when the extension is not built; with
``APEX_LITE_REQUIRE_EXT=1`` they fail instead, so a CI run meant to test the extension cannot pass
by skipping. With ``APEX_LITE_DISABLE_EXT=1`` set for the run, native cases are skipped.
"""
from __future__ import annotations

import logging
import os
import sys
import types

import pytest
import torch

import apex_lite
from apex_lite import multi_tensor as mt
from apex_lite.multi_tensor import _backend, _native

# Elements per chunk of the CPU kernels (kChunkElems in csrc/cpu/multi_tensor_cpu.h); the CUDA
# kernels use the same size. Shapes below cross its boundaries.
CHUNK = 65536
SHAPES = [0, 1, 555, CHUNK, CHUNK + 1, 7777 * 77]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
PAIRS = [(i, o) for i in DTYPES for o in DTYPES]
# Relative error of an fp32-accumulated norm of up to a million elements against float64: the
# native kernels sum blocks of 2048 squares in fp32 and the blocks in double; the Python backend
# is torch's fp32 _foreach_norm, measured at 2.5e-5 on 600K elements.
L2NORM_RTOL = {"native": 1e-5, "python": 1e-4}


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


RUN_DISABLES_EXT = _env_flag("APEX_LITE_DISABLE_EXT")
RUN_REQUIRES_EXT = _env_flag("APEX_LITE_REQUIRE_EXT")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU on this machine"))]


class _Env:
    """Sets environment variables for one test and forgets the backend choices around it."""

    def __init__(self, **values):
        self.values = values
        self.saved = {}

    def __enter__(self):
        for name, value in self.values.items():
            self.saved[name] = os.environ.get(name)
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        _backend.reset()
        return self

    def __exit__(self, *exc):
        for name, value in self.saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        _backend.reset()


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture(params=["python", "native"])
def backend(request, device):
    """Makes apex_lite.multi_tensor use the requested backend on ``device`` for the test."""
    if request.param == "python":
        with _Env(APEX_LITE_DISABLE_EXT="1", APEX_LITE_REQUIRE_EXT=None):
            assert mt.backend(device)[0] == "python"
            yield "python"
        return
    if RUN_DISABLES_EXT:
        pytest.skip("APEX_LITE_DISABLE_EXT=1 is set for this run")
    ops, why = _native.ops_for(device.type)
    if ops is None:
        message = f"native kernels unavailable for {device.type}: {why}"
        if RUN_REQUIRES_EXT:
            pytest.fail(f"APEX_LITE_REQUIRE_EXT=1 but {message}")
        pytest.skip(message)
    with _Env(APEX_LITE_DISABLE_EXT=None):
        assert mt.backend(device)[0] == "native"
        yield "native"


def _fp32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


def ref_scale(x: torch.Tensor, scale: float, out_dtype: torch.dtype) -> torch.Tensor:
    """round_out(round_fp32(x * scale)): the float64 product of two fp32 values is exact."""
    return (x.cpu().double() * _fp32(scale)).float().to(out_dtype)


def ref_axpby(x, y, a, b, out_dtype):
    """round_out(round_fp32(round_fp32(a*x) + round_fp32(b*y))), exact in float64."""
    ax = (x.cpu().double() * _fp32(a)).float()
    by = (y.cpu().double() * _fp32(b)).float()
    return (ax.double() + by.double()).float().to(out_dtype)


def ref_nonfinite(tensors) -> bool:
    return any(not torch.isfinite(t.cpu().float()).all() for t in tensors)


def assert_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual.cpu(), expected, rtol=0, atol=0, equal_nan=True)


def rand(n: int, dtype, device, seed: int) -> torch.Tensor:
    """Values spread over many binades (rounding is exercised), finite in every dtype."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(n, generator=g, dtype=torch.float64)
    values = values * torch.exp2(torch.randint(-8, 8, (n,), generator=g).double())
    return values.to(dtype).to(device)


def tensor_list(n: int, dtype, device, seed: int):
    """A list around a tensor of ``n`` elements, so that each call spans several tensors."""
    return [rand(n, dtype, device, seed), rand(7, dtype, device, seed + 1),
            rand(0, dtype, device, seed + 2), rand(n, dtype, device, seed + 3)]


# --- scale ----------------------------------------------------------------------------------

@pytest.mark.parametrize("n", SHAPES)
@pytest.mark.parametrize("in_dtype,out_dtype", PAIRS)
def test_scale_out_of_place(backend, device, in_dtype, out_dtype, n):
    if n == SHAPES[-1] and (in_dtype, out_dtype) not in PAIRS[::4]:
        pytest.skip("the largest shape runs for the diagonal dtype pairs only (time)")
    inputs = tensor_list(n, in_dtype, device, seed=n)
    before = [t.clone() for t in inputs]
    outputs = [torch.full_like(t, 7.0, dtype=out_dtype) for t in inputs]
    found_inf = torch.zeros(1, device=device)
    mt.scale(inputs, outputs, 0.37, found_inf)
    for x, x_before, out in zip(inputs, before, outputs):
        assert_bits(out, ref_scale(x_before, 0.37, out_dtype))
        assert_bits(x, x_before.cpu())
    assert found_inf.item() == 0.0


@pytest.mark.parametrize("n", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_in_place(backend, device, dtype, n):
    tensors = tensor_list(n, dtype, device, seed=n + 11)
    expected = [ref_scale(t, 2.0 ** -13, dtype) for t in tensors]
    found_inf = torch.zeros(1, device=device)
    mt.scale(tensors, tensors, 2.0 ** -13, found_inf)
    for t, e in zip(tensors, expected):
        assert_bits(t, e)
    assert found_inf.item() == 0.0


def test_scale_mixed_dtypes_in_one_call(backend, device):
    inputs = [rand(CHUNK + 5, d_in, device, seed=i) for i, (d_in, _) in enumerate(PAIRS)]
    outputs = [torch.empty(CHUNK + 5, dtype=d_out, device=device) for _, d_out in PAIRS]
    found_inf = torch.zeros(1, device=device)
    mt.scale(inputs, outputs, 3.1, found_inf)
    for x, out, (_, d_out) in zip(inputs, outputs, PAIRS):
        assert_bits(out, ref_scale(x, 3.1, d_out))
    assert found_inf.item() == 0.0


def test_many_small_tensors(backend, device):
    tensors = [rand(1 + (i % 37), torch.float32, device, seed=i) for i in range(4000)]
    expected = [ref_scale(t, 0.125, torch.float32) for t in tensors]
    found_inf = torch.zeros(1, device=device)
    mt.scale(tensors, tensors, 0.125, found_inf)
    for t, e in zip(tensors, expected):
        assert_bits(t, e)
    assert found_inf.item() == 0.0


# --- axpby ----------------------------------------------------------------------------------

AXPBY_SIZES = [555, CHUNK + 1, 0, 1]


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("x_dtype,y_dtype", PAIRS)
def test_axpby_out_of_place(backend, device, x_dtype, y_dtype, out_dtype):
    xs = [rand(n, x_dtype, device, seed=n) for n in AXPBY_SIZES]
    ys = [rand(n, y_dtype, device, seed=n + 100) for n in AXPBY_SIZES]
    outs = [torch.empty(n, dtype=out_dtype, device=device) for n in AXPBY_SIZES]
    found_inf = torch.zeros(1, device=device)
    mt.axpby(xs, ys, outs, 0.3, -1.7, found_inf)
    for x, y, out in zip(xs, ys, outs):
        assert_bits(out, ref_axpby(x, y, 0.3, -1.7, out_dtype))
    assert found_inf.item() == 0.0


@pytest.mark.parametrize("into", ["ys", "xs"])
@pytest.mark.parametrize("x_dtype,y_dtype", PAIRS)
def test_axpby_in_place(backend, device, x_dtype, y_dtype, into):
    xs = [rand(n, x_dtype, device, seed=n) for n in AXPBY_SIZES]
    ys = [rand(n, y_dtype, device, seed=n + 100) for n in AXPBY_SIZES]
    target = ys if into == "ys" else xs
    expected = [ref_axpby(x, y, 1.25, 0.9, t.dtype) for x, y, t in zip(xs, ys, target)]
    found_inf = torch.zeros(1, device=device)
    mt.axpby(xs, ys, target, 1.25, 0.9, found_inf)
    for t, e in zip(target, expected):
        assert_bits(t, e)
    assert found_inf.item() == 0.0


@pytest.mark.parametrize("n", SHAPES)
@pytest.mark.parametrize("dtypes", [(torch.float32,) * 3,
                                    (torch.bfloat16, torch.float32, torch.float32),
                                    (torch.float16, torch.float16, torch.float16)])
def test_axpby_shapes(backend, device, dtypes, n):
    x_dtype, y_dtype, out_dtype = dtypes
    xs = tensor_list(n, x_dtype, device, seed=n)
    ys = tensor_list(n, y_dtype, device, seed=n + 1000)
    outs = [torch.empty(x.shape, dtype=out_dtype, device=device) for x in xs]
    found_inf = torch.zeros(1, device=device)
    mt.axpby(xs, ys, outs, -0.5, 3.0, found_inf)
    for x, y, out in zip(xs, ys, outs):
        assert_bits(out, ref_axpby(x, y, -0.5, 3.0, out_dtype))
    assert found_inf.item() == 0.0


# --- non-finite values ----------------------------------------------------------------------

# Five tensors; the poisoned ones are the first, the middle and the last. Chunk-sized ones put
# the middle and last elements in later chunks of the call.
FLAG_SIZES = [CHUNK + 3, 100, 77, 300, CHUNK + 5]


def _poisoned(dtype, device, tensor_index, position, value):
    tensors = [rand(n, dtype, device, seed=n) for n in FLAG_SIZES]
    target = tensors[tensor_index]
    index = {"first": 0, "middle": target.numel() // 2, "last": target.numel() - 1}[position]
    target[index] = value
    return tensors


POISON = pytest.mark.parametrize("value", [float("inf"), float("nan")])
WHERE = [pytest.mark.parametrize("tensor_index", [0, 2, 4]),
         pytest.mark.parametrize("position", ["first", "middle", "last"])]


def _where(fn):
    for mark in WHERE:
        fn = mark(fn)
    return fn


@_where
@POISON
@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_flags_nonfinite(backend, device, dtype, tensor_index, position, value):
    tensors = _poisoned(dtype, device, tensor_index, position, value)
    outputs = [torch.empty(t.shape, dtype=torch.float32, device=device) for t in tensors]
    found_inf = torch.zeros(1, device=device)
    mt.scale(tensors, outputs, 0.5, found_inf)
    assert found_inf.item() == 1.0
    # Values are checked where the poison is; the clean tensors are covered by the tests above.
    assert_bits(outputs[tensor_index], ref_scale(tensors[tensor_index], 0.5, torch.float32))
    expected = ref_scale(tensors[tensor_index], 0.5, dtype)
    found_inf = torch.zeros(1, device=device)
    mt.scale(tensors, tensors, 0.5, found_inf)
    assert found_inf.item() == 1.0
    assert_bits(tensors[tensor_index], expected)
    flags = mt.nonfinite_flags(tensors)
    assert flags.dtype == torch.bool
    assert flags.cpu().tolist() == [i == tensor_index for i in range(len(tensors))]


@_where
@POISON
@pytest.mark.parametrize("poisoned", ["xs", "ys"])
def test_axpby_flags_nonfinite(backend, device, poisoned, tensor_index, position, value):
    clean = [rand(n, torch.bfloat16, device, seed=n + 7) for n in FLAG_SIZES]
    dirty = _poisoned(torch.float32, device, tensor_index, position, value)
    xs, ys = (dirty, clean) if poisoned == "xs" else (clean, dirty)
    outs = [torch.empty(x.shape, dtype=torch.float16, device=device) for x in xs]
    found_inf = torch.zeros(1, device=device)
    mt.axpby(xs, ys, outs, 2.0, 0.5, found_inf)
    assert found_inf.item() == 1.0
    i = tensor_index
    assert_bits(outs[i], ref_axpby(xs[i], ys[i], 2.0, 0.5, torch.float16))


@pytest.mark.parametrize("op", ["scale", "axpby", "flags", "l2norm"])
def test_negative_infinity(backend, device, op):
    tensors = _poisoned(torch.bfloat16, device, 4, "last", float("-inf"))
    found_inf = torch.zeros(1, device=device)
    if op == "scale":
        mt.scale(tensors, tensors, 2.0, found_inf)
        assert found_inf.item() == 1.0 and tensors[4][-1].item() == float("-inf")
    elif op == "axpby":
        mt.axpby(tensors, tensors[::-1][::-1], [t.float() for t in tensors], 1.0, 1.0, found_inf)
        assert found_inf.item() == 1.0
    elif op == "flags":
        assert mt.nonfinite_flags(tensors).cpu().tolist() == [False] * 4 + [True]
    else:
        assert mt.l2norm(tensors).item() == float("inf")


def test_found_inf_is_never_written_zero(backend, device):
    tensors = tensor_list(CHUNK + 1, torch.float32, device, seed=3)
    found_inf = torch.ones(1, device=device)
    mt.scale(tensors, tensors, 1.5, found_inf)
    mt.scale(tensors, [torch.empty_like(t) for t in tensors], 1.5, found_inf)
    mt.axpby(tensors, tensors[::-1][::-1], [torch.empty_like(t) for t in tensors], 1.0, 1.0,
             found_inf)
    mt.axpby([t.clone() for t in tensors], tensors, tensors, 1.0, 1.0, found_inf)
    assert found_inf.item() == 1.0


def test_overflow_of_a_finite_product_is_not_flagged(backend, device):
    # The flag reports non-finite inputs; a finite input whose product overflows is not one.
    tensors = [torch.full((100,), 3e38, device=device)]
    outputs = [torch.empty(100, dtype=torch.float16, device=device)]
    found_inf = torch.zeros(1, device=device)
    mt.scale(tensors, outputs, 10.0, found_inf)
    assert found_inf.item() == 0.0
    assert torch.isinf(outputs[0]).all()


def test_nonfinite_flags_finite_and_empty(backend, device):
    tensors = [rand(n, d, device, seed=n) for n, d in zip([0, 5, CHUNK + 1, 0], DTYPES * 2)]
    assert mt.nonfinite_flags(tensors).cpu().tolist() == [False] * 4
    assert mt.nonfinite_flags([]).tolist() == []


# --- l2norm ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_l2norm(backend, device, dtype, n):
    tensors = tensor_list(n, dtype, device, seed=n + 5)
    total, per = mt.l2norm(tensors, per_tensor=True)
    alone = mt.l2norm(tensors)
    per_ref = torch.stack([t.cpu().double().pow(2).sum().sqrt() for t in tensors])
    total_ref = per_ref.pow(2).sum().sqrt().reshape(1)
    assert total.dtype == per.dtype == alone.dtype == torch.float32
    assert total.shape == alone.shape == (1,) and per.shape == (len(tensors),)
    rtol = L2NORM_RTOL[backend]
    torch.testing.assert_close(total.cpu().double(), total_ref, rtol=rtol, atol=0)
    torch.testing.assert_close(per.cpu().double(), per_ref, rtol=rtol, atol=0)
    assert_bits(alone, total.cpu())


def test_l2norm_nonfinite_and_empty(backend, device):
    tensors = _poisoned(torch.float32, device, 2, "middle", float("inf"))
    total, per = mt.l2norm(tensors, per_tensor=True)
    assert torch.isinf(total).all()
    assert torch.isinf(per).cpu().tolist() == [False, False, True, False, False]
    tensors[4][0] = float("nan")
    total, per = mt.l2norm(tensors, per_tensor=True)
    assert torch.isnan(total).all() and torch.isnan(per[4])
    total, per = mt.l2norm([torch.empty(0, device=device)] * 3, per_tensor=True)
    assert total.item() == 0.0 and per.cpu().tolist() == [0.0] * 3
    total, per = mt.l2norm([], per_tensor=True)
    assert total.item() == 0.0 and per.numel() == 0


# --- layouts and empty calls ----------------------------------------------------------------

def _strided(n, dtype, device, seed):
    """A non-contiguous view (every other column of a 2-D tensor, transposed)."""
    return rand(2 * n, dtype, device, seed).reshape(n // 5, 10)[:, ::2].t()


@pytest.mark.parametrize("in_dtype,out_dtype", PAIRS[::4] + [(torch.bfloat16, torch.float32)])
def test_non_contiguous_tensors(backend, device, in_dtype, out_dtype):
    n = 5 * (CHUNK // 5 + 1)
    xs = [_strided(n, in_dtype, device, 1), rand(n, in_dtype, device, 2).reshape(5, -1)]
    assert not xs[0].is_contiguous()
    outs = [torch.empty(n // 5, 5, dtype=out_dtype, device=device).t(),
            torch.empty(5, n // 5, dtype=out_dtype, device=device)]
    found_inf = torch.zeros(1, device=device)
    mt.scale(xs, outs, 0.75, found_inf)
    for x, out in zip(xs, outs):
        assert_bits(out, ref_scale(x, 0.75, out_dtype))
    ys = [_strided(n, out_dtype, device, 3), rand(n, out_dtype, device, 4).reshape(5, -1)]
    expected = [ref_axpby(x, y, 0.5, 2.0, out_dtype) for x, y in zip(xs, ys)]
    mt.axpby(xs, ys, ys, 0.5, 2.0, found_inf)
    for y, e in zip(ys, expected):
        assert_bits(y, e)
    expected = [ref_scale(x, 4.0, in_dtype) for x in xs]
    mt.scale(xs, xs, 4.0, found_inf)
    for x, e in zip(xs, expected):
        assert_bits(x, e)
    assert found_inf.item() == 0.0
    xs[0][1, 3] = float("nan")
    assert mt.nonfinite_flags(xs).cpu().tolist() == [True, False]
    xs[0][1, 3] = 1.0
    total = mt.l2norm(xs)
    torch.testing.assert_close(
        total.cpu().double(), torch.cat([x.cpu().double().flatten() for x in xs]).norm()
        .reshape(1), rtol=L2NORM_RTOL[backend], atol=0)


def test_empty_lists_and_empty_tensors(backend, device):
    found_inf = torch.zeros(1, device=device)
    mt.scale([], [], 2.0, found_inf)
    mt.axpby([], [], [], 1.0, 1.0, found_inf)
    empties = [torch.empty(0, dtype=d, device=device) for d in DTYPES]
    mt.scale(empties, empties, 2.0, found_inf)
    mt.scale(empties, [torch.empty(0, device=device) for _ in DTYPES], 2.0, found_inf)
    mt.axpby(empties, empties, empties, 1.0, 1.0, found_inf)
    assert found_inf.item() == 0.0
    assert mt.nonfinite_flags(empties).cpu().tolist() == [False] * 3


def _meta(*shape):
    return torch.ones(*shape, device="meta")


# One exception type and one message per bad call, the same on every backend (the Python backend
# is checked in Python before it runs; the native kernels check in C++ and, once they refuse a
# call, the Python checks name its arguments as the caller passed them).
BAD_CALLS = {
    "dtype": (lambda d: mt.scale([torch.ones(3, dtype=torch.float64, device=d)],
                                 [torch.ones(3, device=d)], 2.0, torch.zeros(1, device=d)),
              TypeError, r"inputs\[0\] has dtype torch.float64; multi-tensor kernels take"),
    "int dtype": (lambda d: mt.scale([torch.ones(3, dtype=torch.int32, device=d)],
                                     [torch.ones(3, device=d)], 2.0, torch.zeros(1, device=d)),
                  TypeError, r"inputs\[0\] has dtype torch.int32"),
    "shape": (lambda d: mt.scale([torch.ones(3, 2, device=d)], [torch.ones(2, 3, device=d)], 2.0,
                                 torch.zeros(1, device=d)),
              ValueError, r"inputs\[0\] has shape \(3, 2\) but outputs\[0\] has \(2, 3\)"),
    "axpby shape": (lambda d: mt.axpby([torch.ones(3, device=d)], [torch.ones(4, device=d)],
                                       [torch.ones(3, device=d)], 1.0, 1.0,
                                       torch.zeros(1, device=d)),
                    ValueError, r"xs\[0\] has shape \(3,\) but ys\[0\] has \(4,\)"),
    "lengths": (lambda d: mt.scale([torch.ones(3, device=d)], [], 2.0, torch.zeros(1, device=d)),
                ValueError, "inputs has 1 tensors but outputs has 0"),
    "found_inf": (lambda d: mt.scale([torch.ones(3, device=d)], [torch.ones(3, device=d)], 2.0,
                                     torch.zeros(2, device=d)),
                  TypeError, "found_inf must be a 1-element float32 tensor"),
    "not a list": (lambda d: mt.scale(torch.ones(3, device=d), [torch.ones(3, device=d)], 2.0,
                                      torch.zeros(1, device=d)),
                   TypeError, "inputs must be a list or tuple of tensors"),
    "l2norm dtype": (lambda d: mt.l2norm([torch.ones(3, device=d),
                                          torch.ones(3, dtype=torch.int32, device=d)]),
                     TypeError, r"tensors\[1\] has dtype torch.int32"),
    "None input": (lambda d: mt.scale([None], [torch.ones(3, device=d)], 2.0,
                                      torch.zeros(1, device=d)),
                   TypeError, r"inputs\[0\] is a NoneType, not a tensor"),
    "None output": (lambda d: mt.scale([torch.ones(3, device=d)], [None], 2.0,
                                       torch.zeros(1, device=d)),
                    TypeError, r"outputs\[0\] is a NoneType, not a tensor"),
    "None in axpby": (lambda d: mt.axpby([torch.ones(3, device=d)], [None],
                                         [torch.ones(3, device=d)], 1.0, 1.0,
                                         torch.zeros(1, device=d)),
                      TypeError, r"ys\[0\] is a NoneType, not a tensor"),
    "None in l2norm": (lambda d: mt.l2norm([torch.ones(3, device=d), None]),
                       TypeError, r"tensors\[1\] is a NoneType, not a tensor"),
    "None in nonfinite_flags": (lambda d: mt.nonfinite_flags([torch.ones(3, device=d), None]),
                                TypeError, r"tensors\[1\] is a NoneType, not a tensor"),
    # Mixed devices (issue row 9: the native kernels returned uninitialised memory or did
    # nothing): refused the same way on every backend.
    "scale devices": (lambda d: mt.scale([torch.ones(2, device=d), _meta(2)],
                                         [torch.ones(2, device=d), _meta(2)], 2.0,
                                         torch.zeros(1, device=d)),
                      ValueError, r"inputs\[1\] is on meta but found_inf is on .*all tensors "
                                  r"of a call must be on one device"),
    "scale output device": (lambda d: mt.scale([torch.ones(2, device=d)], [_meta(2)], 2.0,
                                               torch.zeros(1, device=d)),
                            ValueError, r"outputs\[0\] is on meta but found_inf is on"),
    "axpby devices": (lambda d: mt.axpby([torch.ones(2, device=d)], [_meta(2)],
                                         [torch.ones(2, device=d)], 1.0, 1.0,
                                         torch.zeros(1, device=d)),
                      ValueError, r"ys\[0\] is on meta but found_inf is on"),
    "l2norm devices": (lambda d: mt.l2norm([torch.ones(2, device=d), _meta(2)]),
                       ValueError, r"tensors\[1\] is on meta but tensors\[0\] is on"),
    "nonfinite_flags devices": (lambda d: mt.nonfinite_flags([torch.ones(2, device=d), _meta(2)]),
                                ValueError, r"tensors\[1\] is on meta but tensors\[0\] is on"),
    "axpby lengths": (lambda d: mt.axpby([torch.ones(3, device=d)], [torch.ones(3, device=d)] * 2,
                                         [torch.ones(3, device=d)], 1.0, 1.0,
                                         torch.zeros(1, device=d)),
                      ValueError, r"^xs has 1 tensors but ys has 2; they are used pairwise$"),
    "axpby output lengths": (lambda d: mt.axpby([torch.ones(3, device=d)],
                                                [torch.ones(3, device=d)], [], 1.0, 1.0,
                                                torch.zeros(1, device=d)),
                             ValueError, r"^xs has 1 tensors but outputs has 0"),
    "empty inputs, one output": (lambda d: mt.scale([], [torch.ones(3, device=d)], 2.0,
                                                    torch.zeros(1, device=d)),
                                 ValueError, r"^inputs has 0 tensors but outputs has 1"),
    "found_inf dtype": (lambda d: mt.axpby([torch.ones(3, device=d)], [torch.ones(3, device=d)],
                                           [torch.ones(3, device=d)], 1.0, 1.0,
                                           torch.zeros(1, dtype=torch.float64, device=d)),
                        TypeError, r"^found_inf must be a 1-element float32 tensor"),
    "found_inf with empty lists": (lambda d: mt.scale([], [], 2.0, torch.zeros(2, device=d)),
                                   TypeError, r"^found_inf must be a 1-element float32 tensor"),
    "found_inf device": (lambda d: mt.scale([torch.ones(2, device=d)], [torch.ones(2, device=d)],
                                            2.0, _meta(1)),
                         ValueError, r"^inputs\[0\] is on .* but found_inf is on meta"),
    # Empty tensors are checked like any other (they only have no memory to overlap).
    "empty tensor dtype": (lambda d: mt.scale([torch.empty(0, dtype=torch.float64, device=d)],
                                              [torch.empty(0, device=d)], 2.0,
                                              torch.zeros(1, device=d)),
                           TypeError, r"^inputs\[0\] has dtype torch.float64"),
    "empty tensor shape": (lambda d: mt.scale([torch.empty(0, device=d)],
                                              [torch.empty(0, 3, device=d)], 2.0,
                                              torch.zeros(1, device=d)),
                           ValueError, r"^inputs\[0\] has shape \(0,\) but outputs\[0\] has "
                                       r"\(0, 3\)$"),
    "empty tensor device": (lambda d: mt.axpby([torch.empty(0, device=d)] * 2,
                                               [torch.empty(0, device=d), _meta(0)],
                                               [torch.empty(0, device=d)] * 2, 1.0, 1.0,
                                               torch.zeros(1, device=d)),
                            ValueError, r"^ys\[1\] is on meta but found_inf is on"),
    "l2norm empty tensor dtype": (lambda d: mt.l2norm([torch.ones(2, device=d),
                                                       torch.empty(0, dtype=torch.int64,
                                                                   device=d)]),
                                  TypeError, r"^tensors\[1\] has dtype torch.int64"),
    # Non-contiguous views (on CUDA the native path checks them before it stages them).
    "non-contiguous dtype": (lambda d: mt.scale([torch.ones(3, 2, dtype=torch.float64,
                                                            device=d).t()],
                                                [torch.ones(2, 3, device=d)], 2.0,
                                                torch.zeros(1, device=d)),
                             TypeError, r"^inputs\[0\] has dtype torch.float64"),
    "non-contiguous shape": (lambda d: mt.axpby([torch.ones(3, 2, device=d).t()],
                                                [torch.ones(3, 2, device=d)],
                                                [torch.ones(2, 3, device=d)], 1.0, 1.0,
                                                torch.zeros(1, device=d)),
                             ValueError, r"^xs\[0\] has shape \(2, 3\) but ys\[0\] has "
                                         r"\(3, 2\)$"),
    "non-contiguous in-place dtype": (lambda d: (lambda t: mt.scale([t], [t], 2.0,
                                                                     torch.zeros(1, device=d)))(
        torch.ones(4, 4, dtype=torch.int32, device=d)[:, ::2]),
        TypeError, r"^inputs\[0\] has dtype torch.int32"),
    "non-contiguous device": (lambda d: mt.nonfinite_flags([torch.ones(2, 2, device=d).t(),
                                                            _meta(2, 2).t()]),
                              ValueError, r"^tensors\[1\] is on meta but tensors\[0\] is on"),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_arguments_are_named(backend, device, case):
    """Each backend refuses bad arguments with the same exception type and message, naming the
    argument and its index."""
    call, error, message = BAD_CALLS[case]
    with pytest.raises(Exception) as raised:
        call(device)
    assert type(raised.value) is error, f"{type(raised.value).__name__}: {raised.value}"
    assert raised.match(message)


def _each_backend(device):
    """Yields "python", then "native", with apex_lite.multi_tensor using that backend on
    ``device``; skips (or, with APEX_LITE_REQUIRE_EXT=1, fails) where native is unavailable."""
    for name in ("python", "native"):
        if name == "native" and (RUN_DISABLES_EXT or _native.ops_for(device.type)[0] is None):
            if RUN_REQUIRES_EXT and not RUN_DISABLES_EXT:
                pytest.fail(f"APEX_LITE_REQUIRE_EXT=1 but: {_native.ops_for(device.type)[1]}")
            pytest.skip("native kernels unavailable or disabled for this run")
        with _Env(APEX_LITE_DISABLE_EXT="1" if name == "python" else None):
            assert mt.backend(device)[0] == name
            yield name


def _raised(call, *args):
    """``(type, message)`` of what ``call(*args)`` raises, or None."""
    try:
        call(*args)
    except Exception as exc:  # noqa: BLE001 (comparing what each backend raises)
        return type(exc), str(exc)
    return None


def test_bad_arguments_give_the_same_error_on_both_backends(device):
    """The two backends side by side: the same type and text for every bad call."""
    errors = {case: [] for case in BAD_CALLS}
    for _ in _each_backend(device):
        for case, (call, _, _) in BAD_CALLS.items():
            errors[case].append(_raised(call, device))
    for case, raised in errors.items():
        assert raised[0] is not None and raised[0] == raised[1], case


# --- aliasing: outputs that overlap other tensors of the call (issue row 8) ---------------------

def _rows(device):
    """Three rows of one (3, 2) tensor, [[1, 2], [3, 4], [5, 6]]."""
    return list(torch.arange(1.0, 7.0, device=device).reshape(3, 2).unbind(0))


def _scale(d, inputs, outputs):
    return mt.scale, (inputs, outputs, 2.0, torch.zeros(1, device=d))


def _axpby(d, xs, ys, outputs):
    return mt.axpby, (xs, ys, outputs, 1.0, 1.0, torch.zeros(1, device=d))


# A call that is refused, as (function, arguments): built once, so that both backends can be
# given the same tensors (which pair a refusal names depends on their addresses).
ALIASED_CALLS = {
    # outputs[i] is inputs[i + 1]: each output overwrites the next pair's input before it is read.
    "scale shifted": lambda d: (lambda r: _scale(d, r, r[1:] + [torch.empty(2, device=d)]))(
        _rows(d)),
    # an in-place list that holds one tensor twice: it would be scaled twice.
    "scale twice in place": lambda d: (lambda t: _scale(d, [t, t], [t, t]))(
        torch.ones(3, device=d)),
    # overlapping views of one buffer.
    "scale overlapping views": lambda d: (lambda b: _scale(d, [b[0:4]], [b[2:6]]))(
        torch.arange(6.0, device=d)),
    # two outputs over the same memory.
    "scale outputs overlap": lambda d: (lambda b: _scale(
        d, [torch.ones(3, device=d), torch.ones(3, device=d)], [b[0:3], b[1:4]]))(
        torch.zeros(4, device=d)),
    # an expand()ed output writes one element from several places.
    "scale expanded output": lambda d: _scale(d, [torch.ones(2, 3, device=d)],
                                              [torch.zeros(3, device=d).expand(2, 3)]),
    "scale expanded in place": lambda d: (lambda e: _scale(d, [e], [e]))(
        torch.zeros(3, device=d).expand(2, 3)),
    # a strided output over an input (on CUDA the op sees a staged copy: checked before staging).
    "scale strided output over an input": lambda d: (lambda b: _scale(d, [b[0:4]], [b[::2]]))(
        torch.arange(8.0, device=d)),
    # an empty output has no memory, but the other outputs still must not overlap.
    "scale with an empty output": lambda d: (lambda b: _scale(
        d, [torch.ones(3, device=d), torch.ones(0, device=d), torch.ones(3, device=d)],
        [b[0:3], b[1:1], b[2:5]]))(torch.zeros(5, device=d)),
    "axpby strided output over another pair's x": lambda d: (lambda b: _axpby(
        d, [b[4:6], b[0:2]], [torch.ones(2, device=d)] * 2,
        [b[0:4:2], torch.empty(2, device=d)]))(torch.arange(8.0, device=d)),
    "axpby output is another pair's y": lambda d: (lambda xs, ys: _axpby(
        d, xs, ys, [ys[1], ys[0]]))([torch.ones(2, device=d), torch.ones(2, device=d)],
                                    [torch.ones(2, device=d), torch.ones(2, device=d)]),
    "axpby output is another pair's x": lambda d: (lambda r: _axpby(
        d, r[:2], [torch.ones(2, device=d)] * 2, [r[1], torch.empty(2, device=d)]))(_rows(d)),
    # into xs (the native kernels get axpby_(ys, xs)), xs[0] over ys[1].
    "axpby into xs over another pair's y": lambda d: (lambda b: (lambda xs: _axpby(
        d, xs, [torch.ones(2, device=d), b[1:3]], xs))([b[0:2], b[4:6]]))(
        torch.arange(8.0, device=d)),
}


@pytest.mark.parametrize("case", sorted(ALIASED_CALLS))
def test_partially_aliased_outputs_are_refused(backend, device, case):
    call, args = ALIASED_CALLS[case](device)
    with pytest.raises(ValueError, match=r"shares memory with|has elements that share memory"):
        call(*args)


def test_aliased_calls_give_the_same_error_on_both_backends(device):
    """The two backends side by side on the same tensors: the same type and text, naming the
    same pair."""
    calls = {case: make(device) for case, make in ALIASED_CALLS.items()}
    errors = {case: [] for case in calls}
    for _ in _each_backend(device):
        for case, (call, args) in calls.items():
            errors[case].append(_raised(call, *args))
    for case, raised in errors.items():
        assert raised[0] is not None and raised[0] == raised[1], case


def test_in_place_calls_are_refused_under_the_callers_names(backend, device):
    """The in-place forms reach the native kernels as scale_(tensors) and axpby_(ys, xs): the
    refusal still names the caller's arguments, as the Python backend does."""
    t = torch.ones(3, device=device)
    found_inf = torch.zeros(1, device=device)
    with pytest.raises(ValueError, match=r"^outputs\[0\] shares memory with outputs\[1\]"):
        mt.scale([t, t], [t, t], 2.0, found_inf)
    with pytest.raises(TypeError, match=r"^inputs\[1\] has dtype torch.int32"):
        mt.scale([t, t.int()], [t, t.int()], 2.0, found_inf)
    rows = _rows(device)
    with pytest.raises(ValueError, match=r"^outputs\[1\] shares memory with ys\[0\]"):
        mt.axpby(rows[:2], [rows[1], torch.ones(2, device=device)], rows[:2], 1.0, 1.0, found_inf)
    with pytest.raises(ValueError, match=r"^xs\[1\] has shape \(2,\) but ys\[1\] has \(3,\)$"):
        mt.axpby(rows[:2], [rows[0], t], rows[:2], 1.0, 1.0, found_inf)


def test_a_refused_aliased_call_writes_nothing(backend, device):
    rows = _rows(device)
    before = [r.clone() for r in rows]
    found_inf = torch.zeros(1, device=device)
    with pytest.raises(ValueError, match=r"outputs\[0\] shares memory with inputs\[1\]"):
        mt.scale(rows, rows[1:] + [torch.empty(2, device=device)], 2.0, found_inf)
    for r, b in zip(rows, before):
        assert_bits(r, b.cpu())


def test_outputs_that_are_their_own_inputs_are_allowed(backend, device):
    """In place, as a whole list or per pair, and through a second view of the same elements;
    rows of one buffer that do not overlap; inputs that share memory (they are only read)."""
    found_inf = torch.zeros(1, device=device)
    rows = _rows(device)
    mt.scale(rows, rows, 2.0, found_inf)
    mt.scale(rows, list(rows), 0.5, found_inf)
    mt.scale(rows, [r.view(2) for r in rows], 3.0, found_inf)
    assert [r.cpu().tolist() for r in rows] == [[3.0, 6.0], [9.0, 12.0], [15.0, 18.0]]
    x = torch.ones(2, device=device)
    outs = [torch.empty(2, device=device), torch.empty(2, device=device)]
    mt.scale([x, x], outs, 2.0, found_inf)                 # one input read twice
    ys = [torch.ones(2, device=device), torch.full((2,), 2.0, device=device)]
    xs = [ys[0], torch.ones(2, device=device)]              # xs[0] is ys[0], and the output
    mt.axpby(xs, ys, [ys[0], outs[1]], 1.0, 1.0, found_inf)
    assert ys[0].cpu().tolist() == [2.0, 2.0] and outs[1].cpu().tolist() == [3.0, 3.0]
    b = torch.ones(4, device=device)                         # an empty output inside another:
    mt.scale([b, torch.ones(0, device=device)], [b, b[2:2]], 2.0, found_inf)   # no memory
    mt.axpby([b[1:1], b], [b[3:3], b], [b[2:2], b], 1.0, 1.0, found_inf)
    assert b.cpu().tolist() == [4.0] * 4
    assert found_inf.item() == 0.0


def test_the_issue_example_is_refused_not_computed_differently_per_backend(backend, device):
    """Issue row 8: native gave [[2,4],[4,8],[8,16]], Python [[2,4],[2,4],[2,4]]; the right
    answer [[2,4],[6,8],[10,12]] needs the inputs cloned first, which is what the error says."""
    rows = _rows(device)
    with pytest.raises(ValueError, match="clone\\(\\) the inputs first"):
        mt.scale(rows, rows[1:] + [torch.empty(2, device=device)], 2.0,
                 torch.zeros(1, device=device))
    rows = _rows(device)
    inputs = [r.clone() for r in rows]
    outputs = [torch.empty(2, device=device)] + rows[:2]
    mt.scale(inputs, outputs, 2.0, torch.zeros(1, device=device))
    assert [o.cpu().tolist() for o in outputs] == [[2.0, 4.0], [6.0, 8.0], [10.0, 12.0]]


def test_the_native_kernels_check_in_cpp_alone(backend, device, monkeypatch):
    """A call the native kernels accept runs no Python check per tensor (those cost a Python loop
    per tensor on every call): the kernels check their own arguments, in C++."""
    if backend != "native":
        pytest.skip("the Python backend is checked in Python")

    def forbidden(*args, **kwargs):
        raise AssertionError("a Python per-tensor check ran on the native path")

    for name in ("check_tensors", "check_shapes", "check_no_overlap", "check_scale",
                 "check_axpby", "check_reduction"):
        monkeypatch.setattr(mt._checks, name, forbidden)
    xs = [torch.ones(5, device=device), torch.ones(3, 2, dtype=torch.bfloat16, device=device)]
    outs = [torch.empty_like(x) for x in xs]
    found_inf = torch.zeros(1, device=device)
    mt.scale(xs, xs, 2.0, found_inf)
    mt.scale(xs, outs, 2.0, found_inf)
    mt.axpby(xs, outs, outs, 1.0, 1.0, found_inf)
    mt.axpby(xs, outs, xs, 1.0, 1.0, found_inf)
    mt.axpby(xs, xs, outs, 1.0, 1.0, found_inf)
    assert mt.l2norm(xs).item() > 0 and mt.nonfinite_flags(xs).tolist() == [False, False]
    with pytest.raises(AssertionError, match="per-tensor check ran"):   # a refusal names its
        mt.scale(xs, xs[::-1], 2.0, found_inf)                           # arguments in Python


# --- meta tensors (issue row 18) -----------------------------------------------------------------

def test_meta_tensors_are_served_silently(backend, caplog):
    """Meta tensors (shapes only, as torch.compile traces them): the native install serves them
    with its fake kernels, without logging that native kernels are unavailable."""
    meta = torch.device("meta")
    with caplog.at_level(logging.DEBUG, logger="apex_lite"):
        name, why = mt.backend(meta)
        xs = [torch.ones(3, device=meta), torch.ones(2, 2, dtype=torch.bfloat16, device=meta)]
        found_inf = torch.zeros(1, device=meta)
        mt.scale(xs, xs, 2.0, found_inf)
        mt.scale(xs, [torch.empty_like(x) for x in xs], 2.0, found_inf)
        mt.axpby(xs, xs, xs, 1.0, 1.0, found_inf)
        total, norms = mt.l2norm(xs, per_tensor=True)
        flags = mt.nonfinite_flags(xs)
    assert name == backend, why
    assert (total.device, total.shape, norms.shape, flags.shape) == (meta, (1,), (2,), (2,))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_backends_agree_bit_for_bit(device):
    """The two backends on the same inputs, compared with each other directly."""
    results = {}
    for name in _each_backend(device):
        xs = [rand(n, d, device, seed=n) for n, d in zip(SHAPES, DTYPES * 2)]
        ys = [rand(n, d, device, seed=n + 9) for n, d in zip(SHAPES, DTYPES[::-1] * 2)]
        outs = [torch.empty(n, dtype=d, device=device) for n, d in zip(SHAPES, DTYPES[1:] * 3)]
        found_inf = torch.zeros(1, device=device)
        mt.scale(xs, outs, 1.0 / 3.0, found_inf)
        scaled = [o.clone() for o in outs]
        mt.axpby(xs, ys, outs, 0.1, 0.7, found_inf)
        results[name] = scaled + outs
    for p, n in zip(results["python"], results["native"]):
        assert_bits(n, p.cpu())


# --- backend choice -------------------------------------------------------------------------

def test_disable_ext_forces_python():
    with _Env(APEX_LITE_DISABLE_EXT="1"):
        assert mt.backend("cpu") == ("python", "APEX_LITE_DISABLE_EXT=1 is set")


@pytest.mark.parametrize("expected,level", [
    ("setup.py built apex_lite._C", logging.WARNING),   # asked for, and not there: a problem
    (None, logging.INFO),                               # a pure-Python install by choice
])
def test_fallback_is_logged_once_with_the_reason(monkeypatch, caplog, expected, level):
    monkeypatch.setattr(_native, "ops_for", lambda device_type: (None, "a reason for testing"))
    monkeypatch.setattr(_native, "native_expected", lambda: expected)
    with _Env(APEX_LITE_DISABLE_EXT=None, APEX_LITE_REQUIRE_EXT=None):
        with caplog.at_level(logging.DEBUG, logger="apex_lite"):
            assert mt.backend("cpu") == ("python", "a reason for testing")
            mt.scale([torch.ones(3)], [torch.ones(3)], 1.0, torch.zeros(1))
        records = [r for r in caplog.records if "a reason for testing" in r.getMessage()]
        assert [r.levelno for r in records] == [level]


def _pretend_never_built(monkeypatch):
    """No build record and no apex_lite._C: what a plain `pip install .` leaves."""
    monkeypatch.setitem(sys.modules, "apex_lite._build_info", None)
    monkeypatch.setitem(sys.modules, "apex_lite._C", None)
    for name in ("_build_info", "_C"):
        if hasattr(apex_lite, name):
            monkeypatch.delattr(apex_lite, name)
    for name in _native.REQUEST_VARS:
        monkeypatch.delenv(name, raising=False)


def test_pure_python_install_is_named_as_such(monkeypatch):
    _pretend_never_built(monkeypatch)
    assert _native.native_expected() is None
    loaded, why = _native._import_built()
    assert not loaded and "apex_lite._C was not built (a pure-Python install" in why
    assert "--cpp_ext" in why


@pytest.mark.parametrize("variable", _native.REQUEST_VARS)
def test_an_environment_variable_asking_for_native_makes_it_expected(monkeypatch, variable):
    _pretend_never_built(monkeypatch)
    monkeypatch.setenv(variable, "1")
    assert _native.native_expected() == f"{variable}=1 is set"


def test_a_build_record_makes_native_expected(monkeypatch):
    _pretend_never_built(monkeypatch)
    _fake_build_info(monkeypatch)
    assert "_build_info.py records it" in _native.native_expected()
    loaded, why = _native._import_built()
    assert not loaded and "apex_lite._C is not importable" in why


def test_require_ext_turns_a_fallback_into_an_error(monkeypatch):
    monkeypatch.setattr(_native, "ops_for", lambda device_type: (None, "a reason for testing"))
    with _Env(APEX_LITE_DISABLE_EXT=None, APEX_LITE_REQUIRE_EXT="1"):
        with pytest.raises(mt.NativeBackendUnavailable, match="a reason for testing"):
            mt.backend("cpu")


def test_native_backend_reports_its_library():
    if RUN_DISABLES_EXT:
        pytest.skip("APEX_LITE_DISABLE_EXT=1 is set for this run")
    ops, why = _native.ops_for("cpu")
    if ops is None:
        if RUN_REQUIRES_EXT:
            pytest.fail(f"APEX_LITE_REQUIRE_EXT=1 but: {why}")
        pytest.skip(f"native kernels unavailable: {why}")
    with _Env(APEX_LITE_DISABLE_EXT=None):
        name, why = mt.backend("cpu")
        assert name == "native" and ("apex_lite._C" in why or "JIT" in why)


def test_cuda_without_cuda_kernels_names_the_reason():
    if _native.ops_for("cpu")[0] is None:
        pytest.skip("the extension is not loaded")
    if torch._C._dispatch_has_kernel_for_dispatch_key("apex_lite::scale_", "CUDA"):
        pytest.skip("this build has CUDA kernels")
    ops, why = _native.ops_for("cuda")
    assert ops is None and "built without CUDA" in why


def _fake_build_info(monkeypatch, **fields):
    info = types.ModuleType("apex_lite._build_info")
    defaults = dict(TORCH_VERSION=torch.__version__, TORCH_CUDA_VERSION=None, WITH_CUDA=False,
                    NVCC_VERSION=None, CPU_ARCH="default")
    defaults.update(fields)
    info.__dict__.update(defaults)
    monkeypatch.setitem(sys.modules, "apex_lite._build_info", info)
    monkeypatch.setattr(apex_lite, "_build_info", info, raising=False)


def test_torch_version_mismatch_is_named(monkeypatch):
    _fake_build_info(monkeypatch, TORCH_VERSION="1.0.0")
    loaded, why = _native._import_built()
    assert not loaded
    assert "torch version mismatch" in why and "1.0.0" in why and torch.__version__ in why


def test_import_error_text_is_kept(monkeypatch):
    _fake_build_info(monkeypatch)
    monkeypatch.setitem(sys.modules, "apex_lite._C", None)  # makes the import fail
    if hasattr(apex_lite, "_C"):
        monkeypatch.delattr(apex_lite, "_C")
    loaded, why = _native._import_built()
    assert not loaded and "apex_lite._C is not importable" in why and "--cpp_ext" in why


def test_avx2_build_is_refused_on_a_cpu_without_avx2(monkeypatch):
    _fake_build_info(monkeypatch, CPU_ARCH="avx2")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    loaded, why = _native._import_built()
    assert not loaded and "AVX2" in why and "APEX_LITE_CPU_ARCH=default" in why


def test_jit_without_sources_fails_loudly(monkeypatch, caplog, tmp_path):
    from apex_lite.multi_tensor import _jit
    monkeypatch.setattr(_jit, "CSRC", str(tmp_path / "missing"))
    with caplog.at_level(logging.ERROR, logger="apex_lite"):
        loaded, why = _jit.build_and_load()
    assert not loaded and "APEX_LITE_JIT=1" in why and "missing" in why
    assert any(r.levelno == logging.ERROR and why in r.getMessage() for r in caplog.records)


# The JIT path reads the source tree beside the package. CI tests the pip-installed package
# (tools/test.sh), which has none beside it; the tests' own checkout does: point the JIT there.
REPO_CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")


def test_jit_compiler_error_is_reported_whole(monkeypatch, caplog):
    from torch.utils import cpp_extension

    from apex_lite.multi_tensor import _jit
    monkeypatch.setattr(_jit, "CSRC", REPO_CSRC)

    def failing_load(**kwargs):
        raise RuntimeError("Error building extension 'apex_lite_C_jit': l2norm.cpp:3: boom")

    monkeypatch.setattr(cpp_extension, "load", failing_load)
    with caplog.at_level(logging.ERROR, logger="apex_lite"):
        loaded, why = _jit.build_and_load()
    assert not loaded and "l2norm.cpp:3: boom" in why
    assert any(r.levelno == logging.ERROR and why in r.getMessage() for r in caplog.records)


def test_jit_build_compiles_every_source_with_setup_py_flags(monkeypatch, caplog):
    """The successful path up to the compiler (a real build takes minutes, more than CI's
    budget): every C++ source of csrc/ and csrc/cpu/, csrc/ on the include path, setup.py's
    flags for this CPU, a library that registers ops rather than a Python module."""
    from torch.utils import cpp_extension

    from apex_lite.multi_tensor import _jit
    monkeypatch.setattr(_jit, "CSRC", REPO_CSRC)
    calls = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    loaded, why = _jit.build_and_load()
    assert loaded and REPO_CSRC in why and len(calls) == 1
    call = calls[0]
    expected = sorted(name for sub in ("", "cpu") for name in os.listdir(
        os.path.join(REPO_CSRC, sub)) if name.endswith(".cpp"))
    assert len(expected) >= 5
    assert sorted(os.path.basename(s) for s in call["sources"]) == expected
    assert call["extra_include_paths"] == [REPO_CSRC] and call["is_python_module"] is False
    flags = _jit._setup_flags()
    assert call["extra_cflags"] == flags.cxx_flags(flags.cpu_arch())
    assert call["extra_ldflags"] == flags.LINK_FLAGS and call["with_cuda"] is False
