"""``STAGED_OPS``, the wrapper that the CUDA backend runs its kernels through, run here over the CPU
kernels: the only part of the CUDA path this machine executes.

The wrapper stages non-contiguous tensors through contiguous copies in Python and copies the
results back. The CPU kernels take any strides themselves, so the op called directly on identical
tensors is the unstaged result. For every op, with tensors contiguous and not (channels_last,
transposed, sliced) in one list or in all, and ``found_inf`` clear, set before the call or raised
by it: every tensor of the call ends bit for bit as the unstaged call leaves it, in its own layout.
A fused step skipped by ``found_inf`` changes nothing at all (issue 33: the model parameters were
staged in uninitialised buffers and copied back on skipped steps too).

Runs where the native extension serves the CPU; skipped otherwise, or failed with
``APEX_LITE_REQUIRE_EXT=1``.
"""
from __future__ import annotations

import os
from typing import Callable, Dict, List, Tuple

import pytest
import torch

from apex_lite.multi_tensor import _native

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
INT_OF_SIZE = {4: torch.int32, 2: torch.int16, 1: torch.int8}


@pytest.fixture
def staged():
    """``(STAGED_OPS, torch.ops.apex_lite)``: the wrapper and the ops it wraps."""
    ops, why = _native.ops_for("cpu")
    if ops is None or os.environ.get("APEX_LITE_DISABLE_EXT", "") == "1":
        reason = why if ops is None else "APEX_LITE_DISABLE_EXT=1 is set"
        if os.environ.get("APEX_LITE_REQUIRE_EXT", "") == "1" and ops is None:
            pytest.fail(f"APEX_LITE_REQUIRE_EXT=1 but the native kernels are unavailable: {why}")
        pytest.skip(f"native kernels unavailable: {reason}")
    from apex_lite.multi_tensor._native_ops import STAGED_OPS
    return STAGED_OPS, torch.ops.apex_lite


@pytest.fixture(autouse=True)
def poisoned_empty(monkeypatch):
    """torch.empty's memory holds whatever was freed there, which may by chance be the values a
    test expects: here it holds a value no test tensor holds, so that a buffer the wrapper leaves
    unwritten shows (the op's C++ allocations are not affected)."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        return empty(*args, **kwargs).fill_(-1234.5)

    monkeypatch.setattr(torch, "empty", poisoned)


# --- tensors in a layout ----------------------------------------------------------------------

def _values(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values over many binades (rounding is exercised), finite in every dtype; zeros for fp32
    state would hide nothing, so state gets them too (positive where it must be)."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, generator=g, dtype=torch.float64)
    return (v * torch.exp2(torch.randint(-6, 6, (n,), generator=g).double())).to(dtype)


# layout -> how to lay out 120 values (shape and strides)
LAYOUTS: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "channels_last": lambda t: t.reshape(2, 3, 4, 5).contiguous(
        memory_format=torch.channels_last),
    "transposed": lambda t: t.reshape(5, 24).t().contiguous().t(),
    "sliced": lambda t: torch.cat([t.reshape(24, 5), torch.zeros_like(t.reshape(24, 5))], 1)
    [:, :5],
}
LAID_OUT = ("channels_last", "transposed", "sliced")


def _tensors(layout: Tuple[str, bool], dtype: torch.dtype, seed: int, positive: bool = False
             ) -> List[torch.Tensor]:
    """One list of a call: a 120-element tensor shaped as ``layout`` says (and laid out so where
    its flag is True, else contiguous), a contiguous one and an empty one; the same tensors for
    the same arguments."""
    first = _values(120, dtype, seed)
    second = _values(7, dtype, seed + 1)
    if positive:
        first, second = first.abs(), second.abs()
    name, strided = layout
    first = LAYOUTS[name](first)
    if not strided:
        first = first.contiguous()
    assert first.is_contiguous() != strided
    return [first, second, torch.empty(0, dtype=dtype)]


def _same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    assert actual.stride() == expected.stride(), f"{what}: layout changed"
    as_int = INT_OF_SIZE[actual.element_size()]
    assert torch.equal(actual.view(as_int), expected.view(as_int)), f"{what}: bits differ"


def _snapshot(args) -> list:
    """Clones of every tensor among ``args`` (in lists or not), in their layouts."""
    out = []
    for a in args:
        if isinstance(a, list):
            out.append([torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).copy_(t)
                        for t in a])
        elif isinstance(a, torch.Tensor):
            out.append(a.clone())
        else:
            out.append(a)
    return out


def _assert_args_equal(actual_args, expected_args) -> None:
    for k, (a, e) in enumerate(zip(actual_args, expected_args)):
        if isinstance(a, list):
            assert len(a) == len(e)
            for i, (x, y) in enumerate(zip(a, e)):
                _same_bits(x, y, f"argument {k}, tensor {i}")
        elif isinstance(a, torch.Tensor):
            _same_bits(a, e, f"argument {k}")


# --- the calls ------------------------------------------------------------------------------
# Each builder takes (layout of a list by name, found_inf) and returns the op's arguments; the
# lists' names are those of csrc/ops.cpp.

def _scale_(lay, found_inf):
    return [_tensors(lay("tensors"), BF16, 1), 0.37, found_inf]


def _scale_out(lay, found_inf):
    return [_tensors(lay("inputs"), F32, 1), _tensors(lay("outputs"), BF16, 2), 0.37, found_inf]


def _axpby_(lay, found_inf):
    return [_tensors(lay("xs"), F16, 1), _tensors(lay("ys"), F32, 2), 0.3, -1.7, found_inf]


def _axpby_out(lay, found_inf):
    return [_tensors(lay("xs"), BF16, 1), _tensors(lay("ys"), F32, 2),
            _tensors(lay("outputs"), F16, 3), 0.3, -1.7, found_inf]


def _l2norm(lay, found_inf):
    return [_tensors(lay("tensors"), BF16, 1), True]


def _nonfinite_flags(lay, found_inf):
    return [_tensors(lay("tensors"), F16, 1)]


# (param, grad, model param) dtypes: amp's O2 (fp32 masters, half gradients and model
# parameters), and half parameters stepped without master weights (no model parameters).
COMBOS = {"O2": (F32, BF16, BF16), "half": (F16, F16, None)}


def _step_lists(lay, combo, state_names):
    param_dtype, grad_dtype, model_dtype = COMBOS[combo]
    lists = {"params": _tensors(lay("params"), param_dtype, 1),
             "grads": _tensors(lay("grads"), grad_dtype, 2)}
    for k, name in enumerate(state_names):
        lists[name] = _tensors(lay(name), F32, 3 + k, positive=name == "exp_avg_sqs")
    lists["model_params"] = ([] if model_dtype is None
                             else _tensors(lay("model_params"), model_dtype, 9))
    return lists


def _fused_sgd_(lay, found_inf, combo):
    lists = _step_lists(lay, combo, ["momentum_buffers"])
    return [lists["params"], lists["grads"], lists["momentum_buffers"], lists["model_params"],
            torch.full((1,), 0.3), found_inf, 0.05, 0.9, 0.1, 1e-2, False, False, False]


def _adam_lists(lay, combo):
    lists = _step_lists(lay, combo, ["exp_avgs", "exp_avg_sqs"])
    steps = [torch.full((), 3.0), torch.full((), 5.0), torch.full((), 1.0)]
    return [lists["params"], lists["grads"], lists["exp_avgs"], lists["exp_avg_sqs"],
            lists["model_params"], steps]


def _fused_adam_(lay, found_inf, combo):
    return _adam_lists(lay, combo) + [torch.full((1,), 0.3), found_inf, 1e-3, 0.9, 0.999, 1e-8,
                                      1e-2, True, True]


def _fused_lamb_(lay, found_inf, combo):
    # Trust ratios (weight_decay != 0) and an active clip (grad_norm above max_grad_norm).
    return _adam_lists(lay, combo) + [torch.full((1,), 0.3), found_inf, torch.full((1,), 2.0),
                                      1e-3, 0.9, 0.999, 1e-6, 1e-2, True, True, True, 1.0, False]


def _fused_novograd_(lay, found_inf, combo):
    lists = _step_lists(lay, combo, ["exp_avgs"])
    # NovoGrad's second moment is one fp32 value per parameter (never laid out).
    norms = [torch.full((1,), 0.5), torch.full((1,), 0.25), torch.full((1,), 0.0)]
    steps = [torch.full((), 3.0), torch.full((), 5.0), torch.full((), 1.0)]
    return [lists["params"], lists["grads"], lists["exp_avgs"], norms, lists["model_params"],
            steps, torch.full((1,), 0.3), found_inf, 1e-3, 0.95, 0.98, 1e-8, 1e-2, True, True,
            False, 2, False]


def _fused_adagrad_(lay, found_inf, combo):
    lists = _step_lists(lay, combo, ["sums"])
    steps = [torch.full((), 3.0), torch.full((), 5.0), torch.full((), 1.0)]
    return [lists["params"], lists["grads"], [t.abs() for t in lists["sums"]],
            lists["model_params"], steps, torch.full((1,), 0.3), found_inf, 1e-2, 1e-10, 1e-2,
            True]


MULTI_TENSOR_OPS = {"scale_": (_scale_, ["tensors"]),
                    "scale_out": (_scale_out, ["inputs", "outputs"]),
                    "axpby_": (_axpby_, ["xs", "ys"]),
                    "axpby_out": (_axpby_out, ["xs", "ys", "outputs"])}
REDUCTIONS = {"l2norm": _l2norm, "nonfinite_flags": _nonfinite_flags}
FUSED_OPS = {"fused_sgd_": (_fused_sgd_, ["params", "grads", "momentum_buffers",
                                          "model_params"]),
             "fused_adam_": (_fused_adam_, ["params", "grads", "exp_avgs", "exp_avg_sqs",
                                            "model_params"]),
             "fused_lamb_": (_fused_lamb_, ["params", "grads", "exp_avgs", "exp_avg_sqs",
                                            "model_params"]),
             "fused_novograd_": (_fused_novograd_, ["params", "grads", "exp_avgs",
                                                    "model_params"]),
             "fused_adagrad_": (_fused_adagrad_, ["params", "grads", "sums", "model_params"])}


def _cases(table):
    """(op, layout, which list is laid out: one by name, or "all")."""
    for name, (_, lists) in table.items():
        for layout in LAID_OUT:
            for strided in ["all"] + lists:
                yield pytest.param(name, layout, strided, id=f"{name}-{layout}-{strided}")


def _layout_of(layout: str, strided: str) -> Callable[[str], Tuple[str, bool]]:
    """The layout of each list by name: ``layout``, non-contiguous in the list ``strided`` names
    (or in all), contiguous (of the same shape) in the others."""
    return lambda name: (layout, strided in ("all", name))


def _run_both(staged, name, build):
    """The op through the wrapper and directly, on identical arguments; both results."""
    wrapper, direct = staged
    staged_args, direct_args = build(), build()
    staged_out = getattr(wrapper, name)(*staged_args)
    direct_out = getattr(direct, name).default(*direct_args)
    return staged_args, staged_out, direct_args, direct_out


@pytest.mark.parametrize("flag", ["clear", "set", "raised"])
@pytest.mark.parametrize("name,layout,strided", list(_cases(MULTI_TENSOR_OPS)))
def test_multi_tensor_ops_match_the_unstaged_op(staged, name, layout, strided, flag):
    """scale_, scale_out, axpby_, axpby_out: outputs written in full whatever found_inf holds,
    bit for bit as the unstaged op writes them; found_inf set before the call stays set, and one
    raised by an inf input is raised alike."""
    builder = MULTI_TENSOR_OPS[name][0]

    def build():
        args = builder(_layout_of(layout, strided), torch.full((1,), float(flag == "set")))
        if flag == "raised":
            args[0][0][1, 1] = float("inf")   # an input of the laid-out tensor (its 2-D view)
        return args

    staged_args, _, direct_args, _ = _run_both(staged, name, build)
    _assert_args_equal(staged_args, direct_args)
    assert float(staged_args[-1]) == float(flag != "clear")


@pytest.mark.parametrize("layout", LAID_OUT)
@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_reductions_match_the_unstaged_op(staged, name, layout):
    staged_args, staged_out, direct_args, direct_out = _run_both(
        staged, name, lambda: REDUCTIONS[name](_layout_of(layout, "all"), None))
    _assert_args_equal(staged_args, direct_args)
    for a, e in zip(staged_out if isinstance(staged_out, tuple) else [staged_out],
                    direct_out if isinstance(direct_out, tuple) else [direct_out]):
        assert torch.equal(a, e)


@pytest.mark.parametrize("combo", sorted(COMBOS))
@pytest.mark.parametrize("flag", ["clear", "set"])
@pytest.mark.parametrize("name,layout,strided", list(_cases(FUSED_OPS)))
def test_fused_steps_match_the_unstaged_op(staged, name, layout, strided, flag, combo):
    """The fused steps: a step taken writes what the unstaged op writes, bit for bit, into every
    list in its own layout; a step skipped by found_inf changes nothing (parameters, state,
    model parameters, step counts), however the lists are laid out."""
    builder = FUSED_OPS[name][0]
    found = float(flag == "set")

    def build():
        return builder(_layout_of(layout, strided), torch.full((1,), found), combo)

    before = _snapshot(build())
    staged_args, _, direct_args, _ = _run_both(staged, name, build)
    _assert_args_equal(staged_args, direct_args)
    if flag == "set":
        _assert_args_equal(staged_args, before)
    else:
        # The step was taken: the laid-out parameter moved (the comparison above is not between
        # two untouched calls).
        assert not torch.equal(staged_args[0][0], before[0][0])
