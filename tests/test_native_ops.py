"""The ``torch.ops.apex_lite`` ops themselves: schemas and fake kernels (opcheck, torch.compile)
and the C++ argument checks. Runs where the native extension serves the CPU; skipped otherwise,
or failed with ``APEX_LITE_REQUIRE_EXT=1``.
"""
from __future__ import annotations

import os

import pytest
import torch

from apex_lite import multi_tensor as mt
from apex_lite.multi_tensor import _backend, _native


def _native_ops_or_skip():
    ops, why = _native.ops_for("cpu")
    if ops is None or os.environ.get("APEX_LITE_DISABLE_EXT", "") == "1":
        reason = why if ops is None else "APEX_LITE_DISABLE_EXT=1 is set"
        if os.environ.get("APEX_LITE_REQUIRE_EXT", "") == "1" and ops is None:
            pytest.fail(f"APEX_LITE_REQUIRE_EXT=1 but the native kernels are unavailable: {why}")
        pytest.skip(f"native kernels unavailable: {reason}")
    return torch.ops.apex_lite


@pytest.fixture
def ops():
    return _native_ops_or_skip()


def _lists():
    xs = [torch.randn(70000), torch.randn(3, 5).bfloat16(), torch.randn(0).half()]
    ys = [torch.randn(70000).half(), torch.randn(3, 5), torch.randn(0)]
    outs = [torch.empty(70000).bfloat16(), torch.empty(3, 5).half(), torch.empty(0)]
    return xs, ys, outs


OPCHECK_CASES = {
    "scale_": lambda xs, ys, outs, f: (xs, 0.5, f),
    "scale_out": lambda xs, ys, outs, f: (xs, outs, 0.5, f),
    "axpby_": lambda xs, ys, outs, f: (xs, ys, 0.5, 2.0, f),
    "axpby_out": lambda xs, ys, outs, f: (xs, ys, outs, 0.5, 2.0, f),
    "l2norm": lambda xs, ys, outs, f: (xs, True),
    "nonfinite_flags": lambda xs, ys, outs, f: (xs,),
}


@pytest.mark.parametrize("name", sorted(OPCHECK_CASES))
def test_opcheck(ops, name):
    xs, ys, outs = _lists()
    args = OPCHECK_CASES[name](xs, ys, outs, torch.zeros(1))
    torch.library.opcheck(getattr(ops, name).default, args)


def test_torch_compile_traces_an_unscale_and_clip_step(ops):
    def step(grads, masters, found_inf, inv_scale):
        torch.ops.apex_lite.scale_out(grads, masters, inv_scale, found_inf)
        total, _ = torch.ops.apex_lite.l2norm(masters, False)
        return total * 2.0

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    grads = [torch.randn(1000).bfloat16(), torch.randn(70000).bfloat16()]
    masters_eager = [torch.empty(g.shape) for g in grads]
    masters_compiled = [torch.empty(g.shape) for g in grads]
    found_eager, found_compiled = torch.zeros(1), torch.zeros(1)
    expected = step(grads, masters_eager, found_eager, 0.25)
    actual = compiled(grads, masters_compiled, found_compiled, 0.25)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    for a, e in zip(masters_compiled, masters_eager):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    grads[1][5] = float("inf")
    compiled(grads, masters_compiled, found_compiled, 0.25)
    assert found_compiled.item() == 1.0


def test_torch_compile_through_the_public_api(ops):
    _backend.reset()

    def step(grads, found_inf):
        mt.scale(grads, grads, 0.5, found_inf)
        return mt.l2norm(grads)

    grads = [torch.randn(100), torch.randn(70000)]
    expected_grads = [g * 0.5 for g in grads]
    expected = torch.cat(expected_grads).double().norm().float().reshape(1)
    found_inf = torch.zeros(1)
    total = torch.compile(step, backend="aot_eager")(grads, found_inf)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=0)
    assert found_inf.item() == 0.0


def test_params_that_require_grad_are_written_under_no_grad(ops):
    # The O2 master-to-model copy writes into leaf parameters, under torch.no_grad().
    params = [torch.nn.Parameter(torch.randn(10, 3).t().bfloat16()),
              torch.nn.Parameter(torch.randn(7).bfloat16())]
    masters = [torch.randn(3, 10), torch.randn(7)]
    with torch.no_grad():
        ops.scale_out(masters, params, 1.0, torch.zeros(1))
    for p, m in zip(params, masters):
        assert torch.equal(p.detach(), m.bfloat16())


@pytest.mark.parametrize("case,message", [
    ("dtype", "has dtype Double"),
    ("sizes", "inputs\\[0\\] has shape \\[3\\] but outputs\\[0\\] has \\[4\\]"),
    ("shape", "inputs\\[0\\] has shape \\[3, 2\\] but outputs\\[0\\] has \\[2, 3\\]"),
    ("lengths", "inputs has 1 tensors but outputs has 2"),
    ("found_inf", "found_inf must be a 1-element float32 CPU tensor"),
])
def test_cpp_argument_checks(ops, case, message):
    x, out, found_inf = [torch.ones(3)], [torch.ones(3)], torch.zeros(1)
    if case == "dtype":
        x = [torch.ones(3, dtype=torch.float64)]
    elif case == "sizes":
        out = [torch.ones(4)]
    elif case == "shape":
        x, out = [torch.ones(3, 2)], [torch.ones(2, 3)]
    elif case == "lengths":
        out = [torch.ones(3), torch.ones(3)]
    else:
        found_inf = torch.zeros(2)
    with pytest.raises(RuntimeError, match=message):
        ops.scale_out(x, out, 2.0, found_inf)
