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


def _optimizer_lists(with_momentum=True):
    """A call's tensors: mixed dtypes, one chunk-crossing and one empty parameter, bf16 model."""
    params = [torch.randn(70000), torch.randn(3, 5).bfloat16(), torch.randn(0)]
    grads = [torch.randn(70000).bfloat16(), torch.randn(3, 5).half(), torch.randn(0)]
    state = [torch.rand(p.shape) for p in params]
    models = [torch.empty(p.shape, dtype=torch.bfloat16) for p in params]
    steps = [torch.zeros(1), torch.full((), 4.0), torch.zeros(1)]
    return params, grads, state, models, steps


def _fused_args(name, found_inf):
    params, grads, state, models, steps = _optimizer_lists()
    inv_scale = torch.full((1,), 0.25)
    if name == "fused_sgd_":
        return (params, grads, state, models, inv_scale, found_inf, 0.1, 0.9, 0.0, 1e-2, True,
                False, False)
    exp_avg_sqs = [torch.rand(p.shape) for p in params]
    if name == "fused_adam_":
        return (params, grads, state, exp_avg_sqs, models, steps, inv_scale, found_inf, 1e-3, 0.9,
                0.999, 1e-8, 1e-2, True, True)
    return (params, grads, state, exp_avg_sqs, models, steps, inv_scale, found_inf,
            torch.full((1,), 3.0), 1e-3, 0.9, 0.999, 1e-6, 1e-2, True, True, True, 1.0, False)


FUSED_OPS = ["fused_sgd_", "fused_adam_", "fused_lamb_"]


@pytest.mark.parametrize("name", FUSED_OPS)
def test_opcheck_fused_optimizers(ops, name):
    torch.library.opcheck(getattr(ops, name).default, _fused_args(name, torch.zeros(1)))


@pytest.mark.parametrize("name", FUSED_OPS)
def test_torch_compile_traces_a_fused_step(ops, name):
    # The step as a compiled graph writes what the eager op writes, bit for bit, and with
    # found_inf set writes nothing.
    op = getattr(torch.ops.apex_lite, name)

    def step(*args):
        op(*args)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    eager_args, compiled_args = _fused_args(name, torch.zeros(1)), _fused_args(name, torch.zeros(1))
    for a, b in zip(eager_args, compiled_args):   # the same values in both
        if isinstance(a, list):
            for x, y in zip(a, b):
                y.copy_(x)
    step(*eager_args)
    compiled(*compiled_args)
    for a, b in zip(eager_args, compiled_args):
        if isinstance(a, list):
            for x, y in zip(a, b):
                torch.testing.assert_close(y, x, rtol=0, atol=0)
    skipped = [[t.clone() for t in a] if isinstance(a, list) else a for a in compiled_args]
    compiled_args = list(compiled_args)
    compiled_args[7 if name != "fused_sgd_" else 5] = torch.ones(1)
    compiled(*compiled_args)
    for a, b in zip(skipped, compiled_args):
        if isinstance(a, list):
            for x, y in zip(a, b):
                torch.testing.assert_close(y, x, rtol=0, atol=0)


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
