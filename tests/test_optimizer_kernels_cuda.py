"""The CUDA kernels of the fused optimizer steps (fused_sgd_, fused_adam_, fused_lamb_) against the
Python backend run on the CPU on the same inputs, and against the fp32 contract itself.

Why the CPU: the Python backend (apex_lite/multi_tensor/_python.py) is the reference, and on the
CPU torch computes its fp32 operations one by one, correctly rounded (sqrt through float64, see
_sqrt_fp32). (On
CUDA, torch divides by a Python scalar through its reciprocal, which is not the contract.)

What is expected bit for bit, and why the rest is not:
- fused_sgd_: everything (params, momentum buffers, model params): every operation is one
  correctly rounded fp32 operation on both sides.
- fused_adam_, fused_lamb_: exp_avg, exp_avg_sq and the step counts bit for bit. Parameters (and
  model parameters) are compared within one unit in the last place of their dtype plus a small
  fraction of the step (ADAM_STEP_RTOL, LAMB_STEP_RTOL): the device's double pow may differ from
  the host's in its last bit, and for LAMB the per-tensor norms of the trust ratio are summed in
  another order. (The Python backend's sqrt is correctly rounded, as __fsqrt_rn is, so Adam's
  parameters may well agree bit for bit; these tests have not run on a GPU yet, and the
  tolerance stays until a run shows it.)
- fused_adam_ against an emulation of the contract (every fp32 operation done in float64 and
  rounded to fp32, which gives the correctly rounded fp32 result, with a correctly rounded sqrt):
  everything bit for bit, over three steps. The bias corrections come from a double pow on both
  sides; the emulation checks that a few units in the last place of that pow (CUDA's is within 2)
  cannot change their fp32 value for the step counts used.

Also: found_inf set (1 or NaN) changes nothing at all, bit for bit; inf and NaN gradients at the
first, middle and last element of the first, middle and last tensor; shapes across chunk
boundaries and misaligned views (the kernels' scalar path); every dtype combination in one call;
non-contiguous tensors through the staged wrapper; empty tensors (their step counts still
advance); step counts advance by exactly one per call, also for tensors of several chunks and
lists that need several launches; no host synchronisation, current stream; error messages.
Not covered: a tensor of more than 2**31 elements (an Adam step on one needs ~30 GB; the 64-bit
offsets are the shared multi-tensor-apply's, tested by test_multi_tensor_cuda.py).

Skipped without a GPU, and without a CUDA build of the extension unless APEX_LITE_REQUIRE_EXT=1
(then that is a failure).
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from native_cuda import require_cuda_kernels

OP_NAMES = ("fused_sgd_", "fused_adam_", "fused_lamb_")
require_cuda_kernels(OP_NAMES)

from apex_lite.multi_tensor import _python  # noqa: E402
from apex_lite.multi_tensor._native_ops import STAGED_OPS  # noqa: E402  (needs apex_lite._C)

native = torch.ops.apex_lite

DEVICE = torch.device("cuda")
CPU = torch.device("cpu")
CHUNK = 65536
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPES = (F32, F16, BF16)
DTYPE_NAMES = {F32: "fp32", F16: "fp16", BF16: "bf16"}
BITS = {F32: torch.int32, F16: torch.int16, BF16: torch.int16}
# Shapes that cross the chunk boundary and leave unaligned tails (the kernels' scalar path).
SIZES = (0, 1, 555, CHUNK, CHUNK + 1, 7777 * 77)
# Step counts before the call, cycled over the tensors: each tensor has its own bias corrections.
STEP_COUNTS = (0.0, 1.0, 9.0, 99.0, 999.0, 9999.0)
# Gradients are stored multiplied by the loss scale; inv_scale = 1 / LOSS_SCALE.
LOSS_SCALE = 1024.0

# Parameters of Adam and LAMB: the CPU sqrt's one-ulp errors move the update direction by about
# 2**-22 relative, ~40 times below this; a wrong operation (approximate division, a missing bias
# correction or decay term) moves it by far more.
ADAM_STEP_RTOL = 1e-5
# LAMB: the CPU's fp32 norm of the largest tensor here (598829 elements) is off by ~6e-6 relative
# (measured against float64), so the trust ratio by up to ~1.2e-5; a wrong ratio (or none) is off
# by orders of magnitude.
LAMB_STEP_RTOL = 1e-4
STEP_RTOL = {"sgd": None, "adam": ADAM_STEP_RTOL, "lamb": LAMB_STEP_RTOL}

KINDS = ("sgd", "adam", "lamb")
STATE_LISTS = {"sgd": ("momentum_buffers",), "adam": ("exp_avgs", "exp_avg_sqs"),
               "lamb": ("exp_avgs", "exp_avg_sqs")}
# The ops' float and bool arguments, in schema order (csrc/ops.cpp), and the values used unless a
# test overrides them.
HYPER_NAMES = {
    "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov", "wd_after_momentum",
            "first_run"),
    "adam": ("lr", "beta1", "beta2", "eps", "weight_decay", "adam_w_mode", "bias_correction"),
    "lamb": ("lr", "beta1", "beta2", "eps", "weight_decay", "adam_w_mode", "bias_correction",
             "grad_averaging", "max_grad_norm", "use_nvlamb"),
}
DEFAULTS = {
    "sgd": dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01, nesterov=False,
                wd_after_momentum=False, first_run=False),
    "adam": dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adam_w_mode=True,
                 bias_correction=True),
    "lamb": dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, adam_w_mode=True,
                 bias_correction=True, grad_averaging=True, max_grad_norm=1.0, use_nvlamb=False),
}

# (param, grad, model param or None): fp32 training, the O2 forms, half parameters without master
# weights, and odd mixes.
DTYPE_CASES = [(F32, F32, None), (F32, F16, F16), (F32, BF16, BF16), (F16, F16, None),
               (BF16, BF16, None), (BF16, F32, F16), (F16, BF16, F32)]


def _dtype_case_id(case):
    return "-".join("none" if d is None else DTYPE_NAMES[d] for d in case)


# ---- inputs --------------------------------------------------------------------------------------

def _true_grad_norm(grads):
    """The fp32 norm of all true gradients (what FusedLAMB passes as grad_norm), [1]."""
    if not grads:
        return torch.zeros(1)
    norms = torch.stack([(g.double() / LOSS_SCALE).norm() for g in grads])
    return norms.norm().float().reshape(1)


def _make_state(sizes=SIZES, param_dtypes=(F32,), grad_dtypes=(F32,), model_dtypes=(), seed=0):
    """The inputs of one call, on the CPU: params, grads (multiplied by LOSS_SCALE), the state of
    every optimizer, model_params (none when model_dtypes is empty, else a sentinel the op
    overwrites), step counts and LAMB's grad_norm (a 1-element list). Each entry of `sizes` is a
    numel or a shape; the dtypes cycle over the tensors."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [tuple(n) if isinstance(n, tuple) else (n,) for n in sizes]

    def randn(shape, scale):
        return torch.randn(shape, generator=gen) * scale

    def dtype(dtypes, i):
        return dtypes[i % len(dtypes)]

    state = {
        "params": [randn(s, 1.0).to(dtype(param_dtypes, i)) for i, s in enumerate(shapes)],
        "grads": [randn(s, 0.1 * LOSS_SCALE).to(dtype(grad_dtypes, i))
                  for i, s in enumerate(shapes)],
        "momentum_buffers": [randn(s, 0.1) for s in shapes],
        "exp_avgs": [randn(s, 0.01) for s in shapes],
        "exp_avg_sqs": [torch.rand(s, generator=gen) * 1e-4 for s in shapes],
        "model_params": [torch.full(s, -7.0, dtype=dtype(model_dtypes, i))
                         for i, s in enumerate(shapes)] if model_dtypes else [],
        "steps": [torch.tensor(STEP_COUNTS[i % len(STEP_COUNTS)]) for i in range(len(shapes))],
    }
    state["grad_norm"] = [_true_grad_norm(state["grads"])]
    return state


def _state_for(case, **kwargs):
    param, grad, model = case
    return _make_state(param_dtypes=(param,), grad_dtypes=(grad,),
                       model_dtypes=(model,) if model is not None else (), **kwargs)


def _copy(state, device=None):
    """A deep copy of a state (on `device`; by default where each tensor is)."""
    return {name: [t.to(device, copy=True) if device is not None else t.clone() for t in tensors]
            for name, tensors in state.items()}


def _scalar(value, device):
    return torch.full((1,), value, dtype=torch.float32, device=device)


def _step(kind, ops, state, device, found=0.0, **overrides):
    """One step of `kind` through `ops` (torch.ops.apex_lite, the Python backend or the staged
    wrappers), in place on `state`, with inv_scale = 1 / LOSS_SCALE and found_inf = `found`."""
    hyper = {**DEFAULTS[kind], **overrides}
    args = [hyper[name] for name in HYPER_NAMES[kind]]
    inv_scale, found_inf = _scalar(1.0 / LOSS_SCALE, device), _scalar(found, device)
    s = state
    if kind == "sgd":
        buffers = s["momentum_buffers"] if hyper["momentum"] != 0.0 else []
        ops.fused_sgd_(s["params"], s["grads"], buffers, s["model_params"], inv_scale, found_inf,
                       *args)
    elif kind == "adam":
        ops.fused_adam_(s["params"], s["grads"], s["exp_avgs"], s["exp_avg_sqs"],
                        s["model_params"], s["steps"], inv_scale, found_inf, *args)
    else:
        ops.fused_lamb_(s["params"], s["grads"], s["exp_avgs"], s["exp_avg_sqs"],
                        s["model_params"], s["steps"], inv_scale, found_inf, s["grad_norm"][0],
                        *args)


def _cuda_and_python(kind, state, n_steps=1, on_cuda=None, ops=None, found=0.0, **overrides):
    """Runs n_steps steps through the CUDA op (`ops`, default torch.ops.apex_lite) on a CUDA copy of
    `state` (or on `on_cuda`, the same values laid out as the test wants) and through the Python
    backend on `state` itself, on the CPU. Returns (the state before, the CUDA result on the CPU,
    the Python result)."""
    before = _copy(state)
    on_cuda = _copy(state, DEVICE) if on_cuda is None else on_cuda
    for _ in range(n_steps):
        _step(kind, ops or native, on_cuda, DEVICE, found=found, **overrides)
        _step(kind, _python, state, CPU, found=found, **overrides)
    return before, _copy(on_cuda, CPU), state


# ---- comparisons ---------------------------------------------------------------------------------

def _assert_same_bits(actual, expected, what):
    """Same dtype and shape, NaN at the same places, identical bits elsewhere (-0.0 != 0.0)."""
    actual = actual.to(CPU)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan), f"{what}: NaN at other positions"
    a_bits = actual.contiguous().view(BITS[actual.dtype])[~nan]
    e_bits = expected.contiguous().view(BITS[expected.dtype])[~nan]
    if not torch.equal(a_bits, e_bits):
        where = (a_bits != e_bits).nonzero().flatten()[:5].tolist()
        raise AssertionError(f"{what}: bits differ at (non-NaN) positions {where}: "
                             f"{actual[~nan][where].tolist()} vs {expected[~nan][where].tolist()}")


def _assert_close_to_step(actual, expected, before, step_rtol, what):
    """Within one ulp of expected's dtype (finfo.eps * |expected|) plus step_rtol times the size of
    the step |expected - before|; NaN and inf at the same places."""
    actual = actual.to(CPU)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    a, e, b = (t.double().flatten() for t in (actual, expected, before))
    assert torch.equal(a.isnan(), e.isnan()), f"{what}: NaN at other positions"
    inf = e.isinf()
    assert torch.equal(a.isinf(), inf) and torch.equal(a[inf], e[inf]), f"{what}: inf differs"
    tolerance = torch.finfo(expected.dtype).eps * e.abs() + step_rtol * (e - b).abs()
    bad = ((a - e).abs() > tolerance) & e.isfinite()
    if bad.any():
        where = bad.nonzero().flatten()[:5]
        raise AssertionError(f"{what}: {int(bad.sum())} elements out of tolerance, e.g. at "
                             f"{where.tolist()}: {a[where].tolist()} vs {e[where].tolist()} "
                             f"(before {b[where].tolist()}, tolerance {tolerance[where].tolist()})")


def _assert_matches(kind, actual, expected, before, step_rtol=None):
    """State lists and step counts bit for bit; params and model params bit for bit when step_rtol
    is None, else within _assert_close_to_step of the params before the call."""
    for name in STATE_LISTS[kind] + ("steps",):
        assert len(actual[name]) == len(expected[name]), name
        for i, (a, e) in enumerate(zip(actual[name], expected[name])):
            _assert_same_bits(a, e, f"{name}[{i}]")
    for name in ("params", "model_params"):
        assert len(actual[name]) == len(expected[name]), name
        for i, (a, e) in enumerate(zip(actual[name], expected[name])):
            if step_rtol is None:
                _assert_same_bits(a, e, f"{name}[{i}]")
            else:
                _assert_close_to_step(a, e, before["params"][i], step_rtol, f"{name}[{i}]")


# ---- the fp32 contract of Adam, emulated exactly -------------------------------------------------

def _fp32(x):
    """x (float64) rounded to fp32, kept in float64: after one float64 operation on fp32 values,
    this is the correctly rounded fp32 operation (+, -, *, / and sqrt; 53 >= 2 * 24 + 2)."""
    return x.to(torch.float32).to(torch.float64)


def _sqrt_rn(x):
    """Correctly rounded fp32 sqrt of fp32 values (float64 in and out). torch's CPU sqrt is not
    correctly rounded even in float64, so its fp32 rounding is corrected with exact float64
    tests: the midpoints between adjacent fp32 values have 25 bits, their squares fit in 53."""
    r = torch.sqrt(x).to(torch.float32)
    up = torch.nextafter(r, torch.full_like(r, math.inf))
    down = torch.nextafter(r, torch.zeros_like(r))
    low = (r.double() + down.double()) / 2
    high = (r.double() + up.double()) / 2
    return torch.where(low * low > x, down, torch.where(high * high < x, up, r)).double()


def _fp32_value(value):
    return torch.tensor(value, dtype=torch.float32).item()


def _bias_correction(beta, count, of_power):
    """fp32(of_power(beta**count)) computed in double, as the kernel does. Asserts that a pow off
    by up to 3 units in the last place (CUDA's double pow is within 2) rounds to the same fp32
    value, so that the bitwise comparison does not depend on which pow computed it."""
    power = beta ** count
    low, high = power, power
    for _ in range(3):
        low, high = math.nextafter(low, 0.0), math.nextafter(high, math.inf)
    results = {_fp32_value(of_power(p)) for p in (low, power, high)}
    assert len(results) == 1, f"the correction of {beta}**{count} is too close to an fp32 " \
                              f"rounding boundary"
    return results.pop()


def _adam_contract_step(state, lr, beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction):
    """One step of the contract in csrc/cuda/adam_step.cuh on the CPU state, in place."""
    lr, b1, b2, b3, one_minus_b2, eps32, wd = map(
        _fp32_value, (lr, beta1, beta2, 1.0 - beta1, 1.0 - beta2, eps, weight_decay))
    inv_scale = _fp32_value(1.0 / LOSS_SCALE)
    for i, param in enumerate(state["params"]):
        p = param.double()
        g = _fp32(state["grads"][i].double() * inv_scale)
        m = state["exp_avgs"][i].double()
        v = state["exp_avg_sqs"][i].double()
        if weight_decay != 0.0 and not adam_w_mode:
            g = _fp32(g + _fp32(wd * p))
        m = _fp32(_fp32(b1 * m) + _fp32(b3 * g))
        v = _fp32(_fp32(b2 * v) + _fp32(_fp32(one_minus_b2 * g) * g))
        count = float(state["steps"][i]) + 1.0
        inv_bc1, inv_sqrt_bc2 = 1.0, 1.0
        if bias_correction:
            inv_bc1 = _bias_correction(beta1, count, lambda power: 1.0 / (1.0 - power))
            inv_sqrt_bc2 = _bias_correction(beta2, count,
                                            lambda power: 1.0 / math.sqrt(1.0 - power))
        denom = _fp32(_fp32(_sqrt_rn(v) * inv_sqrt_bc2) + eps32)
        u = _fp32(_fp32(m * inv_bc1) / denom)
        if weight_decay != 0.0 and adam_w_mode:
            u = _fp32(u + _fp32(wd * p))
        p = _fp32(p - _fp32(lr * u))
        state["exp_avgs"][i].copy_(m)
        state["exp_avg_sqs"][i].copy_(v)
        param.copy_(p)
        if state["model_params"]:
            state["model_params"][i].copy_(p)
        state["steps"][i].add_(1.0)


# ---- results against the references --------------------------------------------------------------

SGD_CONFIGS = {
    "plain": dict(momentum=0.0, weight_decay=0.0),
    "decay": dict(momentum=0.0),
    "momentum": {},
    "first_run": dict(first_run=True),
    "nesterov": dict(nesterov=True, dampening=0.0),
    "decay_after_momentum": dict(wd_after_momentum=True),
}


@pytest.mark.parametrize("config", SGD_CONFIGS)
@pytest.mark.parametrize("dtypes", DTYPE_CASES, ids=_dtype_case_id)
def test_sgd_matches_python_backend_bitwise(dtypes, config):
    before, actual, expected = _cuda_and_python("sgd", _state_for(dtypes), n_steps=2,
                                                **SGD_CONFIGS[config])
    _assert_matches("sgd", actual, expected, before)


ADAM_CONFIGS = {
    "adamw": {},
    "adam_l2": dict(adam_w_mode=False),
    "no_bias_correction": dict(bias_correction=False),
    "no_decay": dict(weight_decay=0.0),
}


@pytest.mark.parametrize("config", ADAM_CONFIGS)
@pytest.mark.parametrize("dtypes", DTYPE_CASES, ids=_dtype_case_id)
def test_adam_matches_python_backend(dtypes, config):
    before, actual, expected = _cuda_and_python("adam", _state_for(dtypes), **ADAM_CONFIGS[config])
    _assert_matches("adam", actual, expected, before, step_rtol=ADAM_STEP_RTOL)


@pytest.mark.parametrize("config", ADAM_CONFIGS)
@pytest.mark.parametrize("dtypes", DTYPE_CASES, ids=_dtype_case_id)
def test_adam_matches_fp32_contract_bitwise(dtypes, config):
    """Three steps (the step counts feed the next bias corrections), all of it bit for bit."""
    state = _state_for(dtypes)
    before = _copy(state)
    on_cuda = _copy(state, DEVICE)
    for _ in range(3):
        _step("adam", native, on_cuda, DEVICE, **ADAM_CONFIGS[config])
        _adam_contract_step(state, **{**DEFAULTS["adam"], **ADAM_CONFIGS[config]})
    _assert_matches("adam", _copy(on_cuda, CPU), state, before)


LAMB_CONFIGS = {
    "default": {},                                   # trust ratio, gradients clipped
    "no_clip_needed": dict(max_grad_norm=1e9),
    "clip_disabled": dict(max_grad_norm=0.0),
    "no_decay": dict(weight_decay=0.0),              # no trust ratio: one pass
    "nvlamb_no_decay": dict(weight_decay=0.0, use_nvlamb=True),
    "l2_mode": dict(adam_w_mode=False),
    "no_averaging_no_bias_correction": dict(grad_averaging=False, bias_correction=False),
}


@pytest.mark.parametrize("config", LAMB_CONFIGS)
@pytest.mark.parametrize("dtypes", DTYPE_CASES, ids=_dtype_case_id)
def test_lamb_matches_python_backend(dtypes, config):
    state = _state_for(dtypes)
    # The gradients' norm (~85) exceeds max_grad_norm (1.0): the default case clips.
    assert float(state["grad_norm"][0]) > 10 * DEFAULTS["lamb"]["max_grad_norm"]
    before, actual, expected = _cuda_and_python("lamb", state, **LAMB_CONFIGS[config])
    _assert_matches("lamb", actual, expected, before, step_rtol=LAMB_STEP_RTOL)


@pytest.mark.parametrize("kind", KINDS)
def test_every_dtype_combination_in_one_call(kind):
    """The 27 (param, grad, model param) dtype triples in one list: one call, 27 instantiations."""
    triples = list(itertools.product(DTYPES, DTYPES, DTYPES))
    sizes = [CHUNK + i if i % 3 == 0 else 555 + 37 * i for i in range(len(triples))]
    state = _make_state(sizes, [t[0] for t in triples], [t[1] for t in triples],
                        [t[2] for t in triples], seed=3)
    before, actual, expected = _cuda_and_python(kind, state)
    _assert_matches(kind, actual, expected, before, step_rtol=STEP_RTOL[kind])


# ---- skipped steps and non-finite gradients ------------------------------------------------------

SKIP_CASES = [("sgd", {}), ("sgd", {"first_run": True}), ("adam", {}), ("lamb", {}),
              ("lamb", {"weight_decay": 0.0})]


@pytest.mark.parametrize("found", (1.0, math.nan), ids=("one", "nan"))
@pytest.mark.parametrize("kind,config", SKIP_CASES,
                         ids=("sgd", "sgd_first_run", "adam", "lamb", "lamb_one_pass"))
def test_found_inf_set_changes_nothing(kind, config, found):
    state = _state_for((F32, F16, BF16))
    state["grads"][2][7] = math.inf  # what the caller's check flagged
    on_cuda = _copy(state, DEVICE)
    _step(kind, native, on_cuda, DEVICE, found=found, **config)
    after = _copy(on_cuda, CPU)
    for name, tensors in state.items():
        for i, (a, b) in enumerate(zip(after[name], tensors)):
            _assert_same_bits(a, b, f"{name}[{i}]")


POSITIONS = ("first", "middle", "last")
NONFINITE_SIZES = (555, CHUNK + 1, 7777 * 77)


def _position(n, where):
    return {"first": 0, "middle": n // 2, "last": n - 1}[where]


@pytest.mark.parametrize("value", (math.inf, -math.inf, math.nan), ids=("inf", "-inf", "nan"))
@pytest.mark.parametrize("tensor_where,element_where",
                         list(itertools.product(POSITIONS, POSITIONS)))
@pytest.mark.parametrize("kind", KINDS)
def test_nonfinite_gradients_as_in_python(kind, tensor_where, element_where, value):
    """With found_inf left 0 (the caller did not check), a non-finite gradient gives the Python
    backend's results, NaN and inf at the same places (for LAMB through grad_norm and the norms,
    the whole tensor); with found_inf set, nothing changes."""
    state = _make_state(NONFINITE_SIZES, (F32,), (F16, BF16, F32), (BF16,), seed=5)
    grad = state["grads"][_position(len(NONFINITE_SIZES), tensor_where)]
    grad[_position(grad.numel(), element_where)] = value
    state["grad_norm"] = [_true_grad_norm(state["grads"])]
    untouched = _copy(state)
    skipped = _copy(state, DEVICE)
    _step(kind, native, skipped, DEVICE, found=1.0)
    for name, tensors in untouched.items():
        for i, (a, b) in enumerate(zip(skipped[name], tensors)):
            _assert_same_bits(a, b, f"skipped {name}[{i}]")
    before, actual, expected = _cuda_and_python(kind, state)
    _assert_matches(kind, actual, expected, before, step_rtol=STEP_RTOL[kind])


# ---- layouts, empty tensors, step counts ---------------------------------------------------------

def _misaligned(t):
    """A contiguous copy of t that starts one element into its storage (no 16-byte alignment)."""
    base = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = base[1:].view(t.shape)
    view.copy_(t)
    return view


@pytest.mark.parametrize("kind", KINDS)
def test_misaligned_views_take_the_scalar_path(kind):
    state = _make_state((CHUNK * 2 + 9, 4099, 8), (F32, BF16), (F16,), (F16,), seed=6)
    on_cuda = _copy(state, DEVICE)
    for name in ("params", "grads", "model_params") + STATE_LISTS[kind]:
        on_cuda[name] = [_misaligned(t) for t in on_cuda[name]]
    before, actual, expected = _cuda_and_python(kind, state, on_cuda=on_cuda)
    _assert_matches(kind, actual, expected, before, step_rtol=STEP_RTOL[kind])


def _column_major(t):
    """t with the same shape and values, laid out transposed (not contiguous)."""
    return t.t().contiguous().t() if t.dim() == 2 else t


@pytest.mark.parametrize("found", (0.0, 1.0), ids=("step", "skip"))
@pytest.mark.parametrize("kind", KINDS)
def test_non_contiguous_tensors_through_the_staged_wrapper(kind, found):
    """apex_lite's CUDA backend (STAGED_OPS) stages non-contiguous tensors through contiguous
    copies and copies the results back into the caller's tensors; a skipped step leaves them as
    they were (issue 33: the model parameters were staged in uninitialised buffers)."""
    state = _make_state(((300, 257), (2, 3), (0, 4), (513, 129)), (F32, BF16), (F16,), (BF16,),
                        seed=7)
    on_cuda = _copy(state, DEVICE)
    for name in ("params", "grads", "model_params") + STATE_LISTS[kind]:
        on_cuda[name] = [_column_major(t) for t in on_cuda[name]]
    assert not on_cuda["params"][0].is_contiguous()
    before, actual, expected = _cuda_and_python(kind, state, on_cuda=on_cuda, ops=STAGED_OPS,
                                                found=found)
    _assert_matches(kind, actual, expected, before, step_rtol=STEP_RTOL[kind])
    if found:
        for name, tensors in before.items():
            for t, b in zip(actual[name], tensors):
                _assert_same_bits(t, b, name)


@pytest.mark.parametrize("found", (0.0, 1.0), ids=("step", "skip"))
@pytest.mark.parametrize("kind", KINDS)
def test_empty_tensors_and_empty_lists(kind, found):
    """An empty list is a no-op; empty tensors are skipped by the update but their step counts
    advance (as in the Python backend), unless the step is skipped."""
    _step(kind, native, _copy(_make_state(()), DEVICE), DEVICE, found=found)
    for sizes in ((0, 0), (0, 555, 0, CHUNK + 3)):
        state = _make_state(sizes, (F32, BF16), (F16,), (F16,), seed=len(sizes))
        before, actual, expected = _cuda_and_python(kind, state, found=found)
        _assert_matches(kind, actual, expected, before, step_rtol=STEP_RTOL[kind])
        if kind != "sgd":
            advance = 1.0 if found == 0.0 else 0.0
            assert [float(s) for s in actual["steps"]] == \
                [float(s) + advance for s in before["steps"]]


@pytest.mark.parametrize("kind,config",
                         [("adam", {}), ("lamb", {}), ("lamb", {"weight_decay": 0.0})],
                         ids=("adam", "lamb", "lamb_one_pass"))
def test_step_counts_advance_once_per_call(kind, config):
    """Each step count is read by every block of its tensor and incremented by the last one: a
    tensor of 4 chunks, and 151 tensors (several launches: at most 68 or 60 tensors per launch),
    advance by exactly one per call that is not skipped."""
    sizes = [CHUNK * 3 + 5] + [100 + i for i in range(150)]
    state = _make_state(sizes, (F32,), (BF16,), (F16,), seed=8)
    before, actual, expected = _cuda_and_python(kind, state, **config)
    _assert_matches(kind, actual, expected, before, step_rtol=STEP_RTOL[kind])
    on_cuda = _copy(state, DEVICE)
    _step(kind, native, on_cuda, DEVICE, found=1.0, **config)
    _step(kind, native, on_cuda, DEVICE, **config)
    _step(kind, native, on_cuda, DEVICE, **config)
    assert [float(s) for s in on_cuda["steps"]] == [float(s) + 3 for s in before["steps"]]


# ---- streams, synchronisation, errors ------------------------------------------------------------

def test_no_host_sync_and_current_stream():
    """The three ops on a side stream, queued behind a sleep and a write of the gradients: an op
    that ran on another stream would read the gradients before that write (and differ from the
    Python results). Under sync debug mode "error", a host synchronisation raises."""
    states = {kind: _make_state((CHUNK + 3, 555, 0), (F32,), (F16,), (BF16,), seed=9)
              for kind in KINDS}
    on_cuda = {kind: _copy(state, DEVICE) for kind, state in states.items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)
            for kind in KINDS:
                for grad in on_cuda[kind]["grads"]:
                    grad.neg_()
                _step(kind, native, on_cuda[kind], DEVICE)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.current_stream().wait_stream(side)
    for kind, state in states.items():
        for grad in state["grads"]:
            grad.neg_()  # grad_norm is unchanged by the sign
        before = _copy(state)
        _step(kind, _python, state, CPU)
        _assert_matches(kind, _copy(on_cuda[kind], CPU), state, before, step_rtol=STEP_RTOL[kind])


def test_refuses_bad_arguments_with_clear_errors():
    s = _copy(_make_state((8, 3)), DEVICE)
    inv_scale, found_inf = _scalar(1.0, DEVICE), _scalar(0.0, DEVICE)
    lists = ("params", "grads", "exp_avgs", "exp_avg_sqs", "model_params", "steps")

    def adam(**replaced):
        native.fused_adam_(*[replaced.get(name, s[name]) for name in lists],
                           replaced.get("inv_scale", inv_scale),
                           replaced.get("found_inf", found_inf), 1e-3, 0.9, 0.999, 1e-8, 0.0,
                           True, True)

    zeros4 = torch.zeros(4, device=DEVICE)
    with pytest.raises(RuntimeError, match=r"fused_adam_: params has 2 tensors but grads has 1"):
        adam(grads=s["grads"][:1])
    with pytest.raises(RuntimeError,
                       match=r"params\[1\] has shape \[3\] but exp_avgs\[1\] has \[4\]"):
        adam(exp_avgs=[s["exp_avgs"][0], zeros4])
    with pytest.raises(RuntimeError,
                       match=r"exp_avg_sqs\[0\] has dtype Half; optimizer state is float32"):
        adam(exp_avg_sqs=[s["exp_avg_sqs"][0].half(), s["exp_avg_sqs"][1]])
    with pytest.raises(RuntimeError, match=r"steps has 1 tensors but params has 2"):
        adam(steps=s["steps"][:1])
    with pytest.raises(RuntimeError, match=r"steps\[0\] is on cpu"):
        adam(steps=[torch.tensor(0.0), s["steps"][1]])
    with pytest.raises(RuntimeError, match=r"steps\[1\] must be a 1-element float32 tensor"):
        adam(steps=[s["steps"][0], torch.zeros(2, device=DEVICE)])
    with pytest.raises(RuntimeError, match=r"model_params has 1 tensors but params has 2"):
        adam(model_params=s["params"][:1])
    with pytest.raises(ValueError, match=r"fused_adam_: steps\[1\] shares its memory with "
                                         r"steps\[0\]: each parameter needs a step count"):
        adam(steps=[s["steps"][0], s["steps"][0].view(s["steps"][0].shape)])
    with pytest.raises(RuntimeError, match=r"params\[0\] has dtype Double"):
        adam(params=[s["params"][0].double(), s["params"][1]])
    with pytest.raises(RuntimeError, match=r"inv_scale must be a 1-element float32 tensor"):
        adam(inv_scale=torch.ones(2, device=DEVICE))
    with pytest.raises(RuntimeError, match=r"inv_scale is on cpu"):
        adam(inv_scale=torch.ones(1))
    with pytest.raises(RuntimeError, match="found_inf must be a CUDA tensor"):
        adam(found_inf=torch.zeros(1))

    transposed = torch.zeros(3, 4, device=DEVICE).t()
    with pytest.raises(RuntimeError, match=r"params\[0\] is not contiguous"):
        native.fused_adam_([transposed], [torch.zeros(4, 3, device=DEVICE)],
                           [torch.zeros(4, 3, device=DEVICE)], [torch.zeros(4, 3, device=DEVICE)],
                           [], [torch.zeros(1, device=DEVICE)], inv_scale, found_inf, 1e-3, 0.9,
                           0.999, 1e-8, 0.0, True, True)
    with pytest.raises(RuntimeError, match=r"momentum is 0.9 but momentum_buffers has 0 tensors"):
        native.fused_sgd_(s["params"], s["grads"], [], [], inv_scale, found_inf, 0.1, 0.9, 0.0,
                          0.0, False, False, False)
    with pytest.raises(RuntimeError, match=r"grad_norm is on cpu"):
        native.fused_lamb_(*[s[name] for name in lists], inv_scale, found_inf, torch.ones(1),
                           1e-3, 0.9, 0.999, 1e-6, 0.01, True, True, True, 1.0, False)
