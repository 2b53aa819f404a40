"""The ``torch.ops.apex_lite`` ops themselves: schemas and fake kernels (opcheck, torch.compile)
and the C++ argument checks. Runs where the native extension serves the CPU; skipped otherwise,
or failed with ``APEX_LITE_REQUIRE_EXT=1``.
"""
from __future__ import annotations

import os
import re

import pytest
import torch

from apex_lite import multi_tensor as mt
from apex_lite.multi_tensor import _backend, _checks, _native


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
    if name == "fused_novograd_":
        norms = [torch.rand(1), torch.rand(()), torch.rand(1)]
        return (params, grads, state, norms, models, steps, inv_scale, found_inf, 1e-3, 0.95,
                0.98, 1e-8, 1e-2, True, True, False, 2, False)
    if name == "fused_adagrad_":
        return (params, grads, state, models, steps, inv_scale, found_inf, 1e-2, 1e-10, 1e-2,
                True)
    exp_avg_sqs = [torch.rand(p.shape) for p in params]
    if name == "fused_adam_":
        return (params, grads, state, exp_avg_sqs, models, steps, inv_scale, found_inf, 1e-3, 0.9,
                0.999, 1e-8, 1e-2, True, True)
    return (params, grads, state, exp_avg_sqs, models, steps, inv_scale, found_inf,
            torch.full((1,), 3.0), 1e-3, 0.9, 0.999, 1e-6, 1e-2, True, True, True, 1.0, False)


FUSED_OPS = ["fused_sgd_", "fused_adam_", "fused_lamb_", "fused_novograd_", "fused_adagrad_"]
# Where found_inf is among each op's arguments.
FOUND_INF_INDEX = {"fused_sgd_": 5, "fused_adagrad_": 6}


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
    compiled_args[FOUND_INF_INDEX.get(name, 7)] = torch.ones(1)
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


# --- the C++ argument checks (csrc/multi_tensor_checks.h) ----------------------------------------
#
# The ops called directly, each refusal compared with what apex_lite/multi_tensor/_checks.py
# raises for the same call under the op's argument names: the same exception type and message.

def _python_check(name):
    """The Python checks of op ``name`` (``_checks``), under the op's argument names."""
    return {
        "scale_": lambda tensors, scale, found_inf: _checks.check_scale_(tensors, found_inf),
        "scale_out": lambda inputs, outputs, scale, found_inf: _checks.check_scale_out(
            inputs, outputs, found_inf),
        "axpby_": lambda xs, ys, a, b, found_inf: _checks.check_axpby_(xs, ys, found_inf),
        "axpby_out": lambda xs, ys, outputs, a, b, found_inf: _checks.check_axpby_out(
            xs, ys, outputs, found_inf),
        "l2norm": lambda tensors, per_tensor: _checks.check_reduction(tensors),
        "nonfinite_flags": lambda tensors: _checks.check_reduction(tensors),
    }[name]


def _raised(call):
    """``(type, message)`` of what ``call()`` raises, or None."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 (comparing what two implementations raise)
        return type(exc), str(exc)
    return None


# The CPU kernel itself, whatever the tensors' devices: the dispatcher sends a call with a meta
# tensor to the fake kernels, so the C++ device check is reached by redispatching to CPU.
_CPU_KERNEL = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def _cpu_kernel(name):
    return lambda *args: getattr(torch.ops.apex_lite, name).default.redispatch(_CPU_KERNEL, *args)


def _rows():
    """Three rows of one (3, 2) tensor."""
    return list(torch.arange(1.0, 7.0).reshape(3, 2).unbind(0))


def _meta(n):
    return torch.ones(n, device="meta")


# name: (op, arguments, exception, message, through): through "op" is the dispatcher (for meta
# tensors, the fake kernels), "cpu" the CPU kernel.
BAD_OP_CALLS = {
    "dtype": ("scale_out", lambda: ([torch.ones(3, dtype=torch.float64)], [torch.ones(3)], 2.0,
                                    torch.zeros(1)),
              TypeError, r"^inputs\[0\] has dtype torch.float64; multi-tensor kernels take "
                         r"float32, float16 and bfloat16 tensors only$", "op"),
    "int dtype": ("scale_", lambda: ([torch.ones(3), torch.ones(3, dtype=torch.int32)], 2.0,
                                     torch.zeros(1)),
                  TypeError, r"^tensors\[1\] has dtype torch.int32", "op"),
    "output dtype": ("axpby_out", lambda: ([torch.ones(3)], [torch.ones(3)],
                                           [torch.ones(3, dtype=torch.complex64)], 1.0, 1.0,
                                           torch.zeros(1)),
                     TypeError, r"^outputs\[0\] has dtype torch.complex64", "op"),
    "sizes": ("scale_out", lambda: ([torch.ones(3)], [torch.ones(4)], 2.0, torch.zeros(1)),
              ValueError, r"^inputs\[0\] has shape \(3,\) but outputs\[0\] has \(4,\)$", "op"),
    "shape": ("axpby_", lambda: ([torch.ones(3, 2)], [torch.ones(2, 3)], 1.0, 1.0,
                                 torch.zeros(1)),
              ValueError, r"^xs\[0\] has shape \(3, 2\) but ys\[0\] has \(2, 3\)$", "op"),
    "scalar shape": ("scale_out", lambda: ([torch.ones(())], [torch.ones(1)], 2.0,
                                           torch.zeros(1)),
                     ValueError, r"^inputs\[0\] has shape \(\) but outputs\[0\] has \(1,\)$",
                     "op"),
    "lengths": ("axpby_out", lambda: ([torch.ones(3)], [torch.ones(3)], [], 1.0, 1.0,
                                      torch.zeros(1)),
                ValueError, r"^xs has 1 tensors but outputs has 0; they are used pairwise$", "op"),
    "found_inf size": ("scale_", lambda: ([torch.ones(3)], 2.0, torch.zeros(2)),
                       TypeError, r"^found_inf must be a 1-element float32 tensor \(create it",
                       "op"),
    "found_inf dtype": ("axpby_", lambda: ([torch.ones(3)], [torch.ones(3)], 1.0, 1.0,
                                           torch.zeros(1, dtype=torch.float64)),
                        TypeError, r"^found_inf must be a 1-element float32 tensor", "op"),
    "axpby_ lengths": ("axpby_", lambda: ([torch.ones(3)], [torch.ones(3)] * 2, 1.0, 1.0,
                                          torch.zeros(1)),
                       ValueError, r"^xs has 1 tensors but ys has 2; they are used pairwise$",
                       "op"),
    "empty list, one output": ("scale_out", lambda: ([], [torch.ones(3)], 2.0, torch.zeros(1)),
                               ValueError, r"^inputs has 0 tensors but outputs has 1", "op"),
    "found_inf size, empty list": ("scale_", lambda: ([], 2.0, torch.zeros(0)),
                                   TypeError, r"^found_inf must be a 1-element float32", "op"),
    # Empty tensors are checked like any other; non-contiguous ones before they are staged.
    "empty tensor dtype": ("scale_", lambda: ([torch.empty(0, dtype=torch.float64)], 2.0,
                                              torch.zeros(1)),
                           TypeError, r"^tensors\[0\] has dtype torch.float64", "op"),
    "empty tensor shape": ("axpby_out", lambda: ([torch.empty(0)], [torch.empty(0)],
                                                 [torch.empty(0, 3)], 1.0, 1.0, torch.zeros(1)),
                           ValueError, r"^xs\[0\] has shape \(0,\) but outputs\[0\] has "
                                       r"\(0, 3\)$", "op"),
    "l2norm empty tensor dtype": ("l2norm", lambda: ([torch.ones(2),
                                                      torch.empty(0, dtype=torch.int64)], True),
                                  TypeError, r"^tensors\[1\] has dtype torch.int64", "op"),
    "non-contiguous dtype": ("axpby_out", lambda: ([torch.ones(2, 3)], [torch.ones(2, 3)],
                                                   [torch.ones(3, 2, dtype=torch.float64).t()],
                                                   1.0, 1.0, torch.zeros(1)),
                             TypeError, r"^outputs\[0\] has dtype torch.float64", "op"),
    "non-contiguous shape": ("axpby_", lambda: ([torch.ones(3, 2).t()], [torch.ones(3, 2)], 1.0,
                                                1.0, torch.zeros(1)),
                             ValueError, r"^xs\[0\] has shape \(2, 3\) but ys\[0\] has "
                                         r"\(3, 2\)$", "op"),
    "nonfinite_flags non-contiguous dtype": (
        "nonfinite_flags", lambda: ([torch.ones(4, 4, dtype=torch.int32)[:, ::2]],),
        TypeError, r"^tensors\[0\] has dtype torch.int32", "op"),
    # Issue 15 row 9: a list that mixes devices. Through the dispatcher the fake kernels refuse
    # it; the CPU kernel refuses it in C++.
    "devices": ("scale_out", lambda: ([torch.ones(2), _meta(2)], [torch.ones(2), _meta(2)], 2.0,
                                      torch.zeros(1)),
                ValueError, r"^inputs\[1\] is on meta but found_inf is on cpu; all tensors of a "
                            r"call must be on one device. Call once per device.$", "op"),
    "devices, CPU kernel": ("scale_out", lambda: ([torch.ones(2), _meta(2)],
                                                  [torch.ones(2), _meta(2)], 2.0, torch.zeros(1)),
                            ValueError, r"^inputs\[1\] is on meta but found_inf is on cpu", "cpu"),
    "output device, CPU kernel": ("axpby_out", lambda: ([torch.ones(2)], [torch.ones(2)],
                                                        [_meta(2)], 1.0, 1.0, torch.zeros(1)),
                                  ValueError, r"^outputs\[0\] is on meta but found_inf is on cpu",
                                  "cpu"),
    "found_inf device, CPU kernel": ("scale_", lambda: ([torch.ones(2)], 2.0, _meta(1)),
                                     ValueError, r"^tensors\[0\] is on cpu but found_inf is on "
                                                 r"meta", "cpu"),
    "empty tensor device, CPU kernel": ("axpby_", lambda: ([torch.empty(0)] * 2,
                                                           [torch.empty(0), _meta(0)], 1.0, 1.0,
                                                           torch.zeros(1)),
                                        ValueError, r"^ys\[1\] is on meta but found_inf is on cpu",
                                        "cpu"),
    "non-contiguous device, CPU kernel": (
        "nonfinite_flags", lambda: ([torch.ones(2, 2).t(), torch.ones(2, 2, device="meta").t()],),
        ValueError, r"^tensors\[1\] is on meta but tensors\[0\] is on cpu", "cpu"),
    "l2norm devices": ("l2norm", lambda: ([torch.ones(2), _meta(2)], False),
                       ValueError, r"^tensors\[1\] is on meta but tensors\[0\] is on cpu", "op"),
    "l2norm devices, CPU kernel": ("l2norm", lambda: ([torch.ones(2), _meta(2)], False),
                                   ValueError,
                                   r"^tensors\[1\] is on meta but tensors\[0\] is on cpu", "cpu"),
    "nonfinite_flags devices, CPU kernel": (
        "nonfinite_flags", lambda: ([torch.ones(2), _meta(2)],),
        ValueError, r"^tensors\[1\] is on meta but tensors\[0\] is on cpu", "cpu"),
    # Issue 15 row 8: outputs that overlap another tensor of the call.
    "output is the next input": ("scale_out", lambda: (lambda r: (r, r[1:] + [torch.empty(2)],
                                                                  2.0, torch.zeros(1)))(_rows()),
                                 ValueError, r"^outputs\[0\] shares memory with inputs\[1\]: the "
                                             r"kernels would read elements", "op"),
    "one tensor twice in place": ("scale_", lambda: (lambda t: ([t, t], 2.0, torch.zeros(1)))(
        torch.ones(3)), ValueError, r"^tensors\[0\] shares memory with tensors\[1\]", "op"),
    "overlapping views": ("scale_out", lambda: (lambda b: ([b[0:4]], [b[2:6]], 2.0,
                                                           torch.zeros(1)))(torch.arange(6.0)),
                          ValueError, r"^outputs\[0\] shares memory with inputs\[0\]", "op"),
    "outputs overlap": ("scale_out", lambda: (lambda b: ([torch.ones(3), torch.ones(3)],
                                                         [b[0:3], b[1:4]], 2.0, torch.zeros(1)))(
        torch.zeros(4)), ValueError, r"^outputs\[0\] shares memory with outputs\[1\]", "op"),
    "expanded output": ("scale_out", lambda: ([torch.ones(2, 3)], [torch.zeros(3).expand(2, 3)],
                                              2.0, torch.zeros(1)),
                        ValueError,
                        r"^outputs\[0\] has elements that share memory \(an expand\(\)ed", "op"),
    "strided output over an input": ("scale_out", lambda: (lambda b: ([b[0:4]], [b[::2]], 2.0,
                                                                      torch.zeros(1)))(
        torch.arange(8.0)), ValueError, r"^outputs\[0\] shares memory with inputs\[0\]", "op"),
    "axpby_ y is another pair's x": ("axpby_", lambda: (lambda r: (r[:2], [r[1], torch.ones(2)],
                                                                   1.0, 1.0, torch.zeros(1)))(
        _rows()), ValueError, r"^ys\[0\] shares memory with xs\[1\]", "op"),
    "expanded y in place": ("axpby_", lambda: ([torch.ones(2, 3)], [torch.zeros(3).expand(2, 3)],
                                              1.0, 1.0, torch.zeros(1)),
                            ValueError, r"^ys\[0\] has elements that share memory", "op"),
    "outputs overlap past an empty one": (
        "scale_out", lambda: (lambda b: ([torch.ones(3), torch.ones(0), torch.ones(3)],
                                         [b[0:3], b[1:1], b[2:5]], 2.0, torch.zeros(1)))(
            torch.zeros(5)),
        ValueError, r"^outputs\[0\] shares memory with outputs\[2\]", "op"),
    "axpby_out output is another pair's y": (
        "axpby_out", lambda: (lambda ys: ([torch.ones(2), torch.ones(2)], ys, [ys[1], ys[0]], 1.0,
                                          1.0, torch.zeros(1)))([torch.ones(2), torch.ones(2)]),
        ValueError, r"shares memory with ys\[", "op"),
}


@pytest.mark.parametrize("case", sorted(BAD_OP_CALLS))
def test_cpp_argument_checks(ops, case):
    """The op refuses the call in C++ (or, for meta tensors, in its fake kernel) with the
    exception type and message the Python checks give."""
    name, make_args, error, message, through = BAD_OP_CALLS[case]
    op = getattr(ops, name) if through == "op" else _cpu_kernel(name)
    # One set of tensors for both: which overlapping pair is named depends on their addresses.
    args = make_args()
    native = _raised(lambda: op(*args))
    assert native is not None, f"{case}: the op accepted the call"
    assert native[0] is error, native
    assert re.search(message, native[1]), native[1]
    assert _raised(lambda: _python_check(name)(*args)) == native


def test_a_refused_op_call_writes_nothing(ops):
    rows = _rows()
    before = [r.clone() for r in rows]
    found_inf = torch.zeros(1)
    rows[2][0] = float("inf")
    before[2][0] = float("inf")
    with pytest.raises(ValueError, match="shares memory"):
        ops.scale_out(rows, rows[1:] + [torch.empty(2)], 2.0, found_inf)
    for r, b in zip(rows, before):
        assert torch.equal(r, b)
    assert found_inf.item() == 0.0


@pytest.mark.parametrize("name", ["scale_out", "axpby_out", "axpby_", "scale_"])
def test_outputs_that_are_their_own_inputs_pass_the_cpp_checks(ops, name):
    """In place per pair (the same tensor, or a second view of its elements), inputs that share
    memory, rows of one buffer that do not overlap: accepted and computed."""
    rows = _rows()
    x = torch.ones(2)
    if name == "scale_out":
        ops.scale_out([rows[0], x, x], [rows[0].view(2), rows[1], rows[2]], 2.0, torch.zeros(1))
        expected = [[2.0, 4.0], [2.0, 2.0], [2.0, 2.0]]
    elif name == "axpby_out":
        ops.axpby_out([rows[0], x, rows[2]], [rows[0], x, rows[2]],
                      [rows[0], rows[1], rows[2].view(1, 2)[0]], 1.0, 1.0, torch.zeros(1))
        expected = [[2.0, 4.0], [2.0, 2.0], [10.0, 12.0]]
    elif name == "axpby_":
        ops.axpby_([rows[0].view(2), x, x], rows, 1.0, 1.0, torch.zeros(1))
        expected = [[2.0, 4.0], [4.0, 5.0], [6.0, 7.0]]
    else:
        ops.scale_(rows, 2.0, torch.zeros(1))
        expected = [[2.0, 4.0], [6.0, 8.0], [10.0, 12.0]]
    assert [r.tolist() for r in rows] == expected


def test_empty_tensors_inside_others_pass_the_cpp_checks(ops):
    """An empty view has no memory, wherever its address lies."""
    b = torch.ones(4)
    ops.scale_([b, b[2:2], b[0:0]], 2.0, torch.zeros(1))
    ops.scale_out([b, torch.ones(0)], [b, b[1:1]], 2.0, torch.zeros(1))
    ops.axpby_([b[3:3], b], [b[1:1], b], 1.0, 1.0, torch.zeros(1))
    ops.axpby_out([b[1:1], b], [b[3:3], b], [b[2:2], b], 1.0, 1.0, torch.zeros(1))
    assert b.tolist() == [16.0] * 4


def _random_view(buffer, generator):
    """A random view of ``buffer`` (64 fp32 elements): a slice, a strided slice, a 2-D block or
    its transpose, an expanded row, an empty slice; or a tensor of its own."""
    kind = int(torch.randint(9, (), generator=generator))
    start = int(torch.randint(0, 32, (), generator=generator))
    length = int(torch.randint(1, 17, (), generator=generator))
    if kind < 2:
        return buffer[start:start + length]
    if kind < 4:
        return buffer[start::3][:length]
    if kind == 4:
        return buffer[start:start + 16].view(4, 4)[:, :2]
    if kind == 5:
        return buffer[start:start + 16].view(4, 4).t()
    if kind == 6:
        return buffer[start:start + 4].expand(3, 4)
    if kind == 7:
        return buffer[start:start]
    return torch.zeros(length)


def test_the_cpp_overlap_check_decides_as_the_python_one(ops):
    """Random calls over views of two buffers: the C++ checks refuse exactly the calls the Python
    ones refuse, naming the same pair (the first refusal in sorted order), and accept the rest."""
    generator = torch.Generator().manual_seed(15)
    buffers = [torch.zeros(64), torch.zeros(64)]
    refused = 0
    for trial in range(400):
        n = int(torch.randint(1, 6, (), generator=generator))
        lists = [[_random_view(buffers[int(torch.randint(2, (), generator=generator))], generator)
                  for _ in range(n)] for _ in range(3)]
        # Give pairs the same shape (the shape check comes first), and make some pairs in place.
        xs, ys, outs = lists
        ys = [y if y.shape == x.shape else x.clone() for x, y in zip(xs, ys)]
        for i in range(n):
            choice = int(torch.randint(4, (), generator=generator))
            if choice == 0:
                outs[i] = xs[i]
            elif choice == 1:
                outs[i] = xs[i].view(xs[i].shape) if not xs[i].is_contiguous() else xs[i].view(-1) \
                    .view(xs[i].shape)
            elif outs[i].shape != xs[i].shape:
                outs[i] = torch.empty(xs[i].shape)
        name = ("scale_out", "axpby_out", "axpby_", "scale_")[trial % 4]
        args = {"scale_out": (xs, outs, 2.0, torch.zeros(1)),
                "axpby_out": (xs, ys, outs, 1.0, 1.0, torch.zeros(1)),
                "axpby_": (xs, outs, 1.0, 1.0, torch.zeros(1)),
                "scale_": (outs, 2.0, torch.zeros(1))}[name]
        expected = _raised(lambda: _python_check(name)(*args))
        refused += expected is not None
        # (An accepted call runs the kernel over the scratch buffers.)
        assert _raised(lambda: getattr(ops, name)(*args)) == expected, (trial, name)
    assert 100 < refused < 300


