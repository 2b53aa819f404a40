"""amp_C's ops and multi_tensor_applier (apex_lite.apex_multi_tensor), called the way apex code
calls them: apex's tensor lists, argument order and return values, its int noop flag.

The kernels underneath are tested in test_multi_tensor.py and test_optimizer_kernels.py; here,
that each op maps apex's call onto them: against float64 references of apex's own formulas
(apex's csrc/multi_tensor_*.cu), with inf and NaN at the first, a middle and the last element
across chunk boundaries, on non-contiguous and empty tensors, and the noop flag in every form
apex code creates it. The suite runs once per backend (tools/test.sh).
"""
import math

import pytest
import torch

from apex_lite import apex_multi_tensor as amp_C
from apex_lite.apex_multi_tensor import MultiTensorApply, multi_tensor_applier

CHUNK = 65536
SHAPES = [(0,), (1,), (555,), (CHUNK,), (CHUNK + 1,), (77, 31)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU on this machine"))]
# The noop flag as apex code creates it: apex's IntTensor, fairseq's (1, 1) int, and others.
NOOPS = {
    "int32": lambda d: torch.zeros(1, dtype=torch.int, device=d),
    "int32 (1, 1)": lambda d: torch.zeros(1, 1, dtype=torch.int, device=d),
    "int64": lambda d: torch.zeros(1, dtype=torch.long, device=d),
    "bool": lambda d: torch.zeros(1, dtype=torch.bool, device=d),
    "float32": lambda d: torch.zeros(1, dtype=torch.float32, device=d),
}


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


def rand(shape, dtype, device, seed, non_contiguous=False):
    g = torch.Generator().manual_seed(seed)
    if non_contiguous:   # every other column of a wider tensor
        wide = torch.randn(*shape[:-1], 2 * shape[-1], generator=g)
        return wide.to(device=device, dtype=dtype)[..., ::2]
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def tensor_list(dtype, device, seed, non_contiguous=False):
    return [rand(shape, dtype, device, seed + i, non_contiguous)
            for i, shape in enumerate(SHAPES)]


def flag_value(noop) -> float:
    return float(noop.reshape(()).float())


def poison(tensors, position, value):
    """Writes ``value`` at the first, a middle or the last element of the chunk-crossing tensor."""
    t = tensors[4]   # CHUNK + 1 elements
    index = {"first": 0, "middle": CHUNK // 2, "last": t.numel() - 1}[position]
    t.view(-1)[index] = value


# ---- multi_tensor_applier ----------------------------------------------------------------------

def test_the_applier_calls_apex_ops_with_its_chunk_size():
    calls = []
    result = multi_tensor_applier(lambda *args: calls.append(args) or "out", "buf", [[1]], 2, 3)
    assert result == "out" and calls == [(2048 * 32, "buf", [[1]], 2, 3)]
    assert multi_tensor_applier.available and MultiTensorApply.available
    assert MultiTensorApply(1024).chunk_size == 1024
    multi_tensor_applier.check_avail()


# ---- scale, axpby, l2norm ----------------------------------------------------------------------

@pytest.mark.parametrize("non_contiguous", [False, True])
@pytest.mark.parametrize("in_dtype,out_dtype", [(i, o) for i in DTYPES for o in DTYPES])
def test_scale(device, in_dtype, out_dtype, non_contiguous):
    inputs = tensor_list(in_dtype, device, 1, non_contiguous)
    outputs = [torch.empty(t.shape, dtype=out_dtype, device=device) for t in inputs]
    noop = NOOPS["int32"](device)
    multi_tensor_applier(amp_C.multi_tensor_scale, noop, [inputs, outputs], 0.125)
    for x, out in zip(inputs, outputs):
        assert torch.equal(out, (x.double() * 0.125).to(out_dtype))   # exact: a power of two
    assert flag_value(noop) == 0.0


def test_scale_in_place_with_any_factor(device):
    tensors = tensor_list(torch.float32, device, 2)
    expected = [(t.double() * 0.3).float() for t in tensors]   # fp32 product, rounded once
    scale = 0.3
    noop = NOOPS["int32"](device)
    multi_tensor_applier(amp_C.multi_tensor_scale, noop, [tensors, tensors], scale)
    for t, e in zip(tensors, expected):
        torch.testing.assert_close(t, e, rtol=2 ** -23, atol=0)


@pytest.mark.parametrize("noop_kind", NOOPS)
@pytest.mark.parametrize("position", ["first", "middle", "last"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_scale_sets_the_noop_flag_for_inf_and_nan(device, noop_kind, position, value):
    inputs = tensor_list(torch.float16, device, 3)
    poison(inputs, position, value)
    outputs = [torch.empty_like(t, dtype=torch.float32) for t in inputs]
    noop = NOOPS[noop_kind](device)
    multi_tensor_applier(amp_C.multi_tensor_scale, noop, [inputs, outputs], 2.0)
    assert flag_value(noop) == 1.0 and noop.dtype == NOOPS[noop_kind](device).dtype


@pytest.mark.parametrize("noop_kind", NOOPS)
def test_a_set_flag_is_never_cleared(device, noop_kind):
    inputs = tensor_list(torch.float32, device, 4)
    noop = NOOPS[noop_kind](device)
    noop.fill_(1)
    multi_tensor_applier(amp_C.multi_tensor_scale, noop, [inputs, inputs], 1.0)
    multi_tensor_applier(amp_C.multi_tensor_l2norm, noop, [inputs], False)
    assert flag_value(noop) == 1.0


@pytest.mark.parametrize("arg_to_check", [-1, 0, 1])
@pytest.mark.parametrize("poisoned", ["xs", "ys", None])
def test_axpby_checks_what_arg_to_check_names(device, arg_to_check, poisoned):
    xs = tensor_list(torch.float16, device, 5)
    ys = tensor_list(torch.float32, device, 6)
    if poisoned:
        poison(xs if poisoned == "xs" else ys, "middle", math.nan)
    expected = [(2.0 * x.double() + (-0.5) * y.double()).float() for x, y in zip(xs, ys)]
    outputs = [torch.empty_like(y) for y in ys]
    noop = NOOPS["int32"](device)
    multi_tensor_applier(amp_C.multi_tensor_axpby, noop, [xs, ys, outputs], 2.0, -0.5,
                         arg_to_check)
    checked = {-1: {"xs", "ys"}, 0: {"xs"}, 1: {"ys"}}[arg_to_check]
    assert flag_value(noop) == (1.0 if poisoned in checked else 0.0)
    for out, e in zip(outputs, expected):
        torch.testing.assert_close(out, e, rtol=2 ** -23, atol=0, equal_nan=True)


def test_axpby_checks_before_writing_in_place(device):
    """Accumulation as apex's amp did it (out is ys, only xs checked): the flag is set by the
    input, not by what the sum leaves in ys."""
    xs = [torch.tensor([1.0, math.inf], device=device)]
    ys = [torch.tensor([1.0, 2.0], device=device)]
    noop = NOOPS["int32"](device)
    multi_tensor_applier(amp_C.multi_tensor_axpby, noop, [xs, ys, ys], 1.0, 1.0, 1)
    assert flag_value(noop) == 0.0 and ys[0][1] == math.inf
    multi_tensor_applier(amp_C.multi_tensor_axpby, noop, [xs, ys, ys], 1.0, 1.0, 0)
    assert flag_value(noop) == 1.0


@pytest.mark.parametrize("per_tensor", [None, False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("non_contiguous", [False, True])
def test_l2norm_returns_apex_values(device, per_tensor, dtype, non_contiguous):
    tensors = tensor_list(dtype, device, 7, non_contiguous)
    noop = NOOPS["int32"](device)
    args = () if per_tensor is None else (per_tensor,)
    total, norms = multi_tensor_applier(amp_C.multi_tensor_l2norm, noop, [tensors], *args)
    reference = [t.double().norm() for t in tensors]
    expected_total = torch.stack(reference).norm().reshape(1)
    assert total.dtype == torch.float32 and total.shape == (1,) and total.device == device
    torch.testing.assert_close(total.double(), expected_total.to(device), rtol=1e-4, atol=0)
    if per_tensor:
        assert norms.shape == (len(tensors),) and norms.dtype == torch.float32
        torch.testing.assert_close(norms.double(), torch.stack(reference).to(device),
                                   rtol=1e-4, atol=0)
    else:
        assert norms.shape == (0,) and norms.dtype == torch.float32
    assert flag_value(noop) == 0.0


@pytest.mark.parametrize("position", ["first", "middle", "last"])
@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_l2norm_sets_the_noop_flag_for_a_nonfinite_norm(device, position, value):
    tensors = tensor_list(torch.bfloat16, device, 8)
    poison(tensors, position, value)
    noop = NOOPS["int32 (1, 1)"](device)
    total, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, noop, [tensors], False)
    assert not torch.isfinite(total).item() and flag_value(noop) == 1.0


def test_empty_lists(device):
    noop = NOOPS["int32"](device)
    total, norms = multi_tensor_applier(amp_C.multi_tensor_l2norm, noop, [[]], True)
    assert total.tolist() == [0.0] and norms.shape == (0,) and total.device == device
    multi_tensor_applier(amp_C.multi_tensor_scale, noop, [[], []], 2.0)
    multi_tensor_applier(amp_C.multi_tensor_axpby, noop, [[], [], []], 1.0, 1.0, -1)
    multi_tensor_applier(amp_C.multi_tensor_sgd, noop, [[], [], []], 0.0, 0.9, 0.0, 0.1, False,
                         True, False)
    multi_tensor_applier(amp_C.multi_tensor_adam, noop, [[], [], [], []], 1e-3, 0.9, 0.999,
                         1e-8, 1, 1, 1, 0.0)
    assert flag_value(noop) == 0.0


# ---- the optimizer ops, against float64 references of apex's kernels ------------------------

def sgd_reference(grad, param, buf, *, wd, momentum, dampening, lr, nesterov, first_run,
                  wd_after_momentum, scale):
    g, p = grad.double() * scale, param.double()
    buf = None if buf is None else buf.double()
    if wd != 0 and not wd_after_momentum:
        g = g + wd * p
    if momentum != 0:
        buf = g.clone() if first_run else buf * momentum + (1 - dampening) * g
        g = g + momentum * buf if nesterov else buf
    if wd != 0 and wd_after_momentum:
        g = g + wd * p
    return p - lr * g, buf


def adam_reference(grad, param, m, v, *, lr, beta1, beta2, eps, step, mode, bias_correction,
                   weight_decay, beta3=None, max_grad_norm=None, grad_norm=None, lamb=False,
                   use_nvlamb=False):
    g, p, m, v = grad.double(), param.double(), m.double(), v.double()
    if max_grad_norm is not None and grad_norm > max_grad_norm:
        g = g / (grad_norm / max_grad_norm)
    if mode == 0:
        g = g + weight_decay * p
    m = beta1 * m + ((1 - beta1) if beta3 is None else beta3) * g
    v = beta2 * v + (1 - beta2) * g * g
    bc1 = 1 - beta1 ** step if bias_correction else 1.0
    bc2 = 1 - beta2 ** step if bias_correction else 1.0
    update = (m / bc1) / ((v / bc2).sqrt() + eps)
    if mode == 1:
        update = update + weight_decay * p
    ratio = lr
    if lamb and (use_nvlamb or weight_decay != 0):
        pn, un = p.norm(), update.norm()
        if pn != 0 and un != 0:
            ratio = lr * (pn / un)
    return p - ratio * update, m, v


# (grad dtype, param dtype, state dtype, with model params): apex's FusedSGD launch sets.
SGD_LISTS = [(torch.float32, torch.float32, torch.float32, False),
             (torch.float16, torch.float32, torch.float32, True),
             (torch.float16, torch.float16, torch.float16, False),
             (torch.bfloat16, torch.bfloat16, torch.float32, False)]
SGD_OPTIONS = [dict(wd=0.0, momentum=0.0, dampening=0.0, nesterov=False, wd_after_momentum=False),
               dict(wd=1e-2, momentum=0.9, dampening=0.0, nesterov=True, wd_after_momentum=False),
               dict(wd=1e-2, momentum=0.9, dampening=0.1, nesterov=False, wd_after_momentum=True)]


def _rounding(dtype):
    return {torch.float32: 2e-6, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[dtype]


def assert_rounded_close(actual, reference, dtype):
    """``actual`` (computed in fp32, stored in ``dtype``) is the float64 reference up to a few
    roundings of ``dtype`` at the size of the values involved (sums such as beta1*m + (1-beta1)*g
    cancel, so an element's error scales with the tensor's values, not with itself). A mapping
    mistake (a swapped argument, the wrong mode) is off by orders of magnitude more."""
    scale = max(1e-3, float(reference.abs().max())) if reference.numel() else 1.0
    torch.testing.assert_close(actual.double(), reference, rtol=_rounding(dtype),
                               atol=4 * _rounding(dtype) * scale)


@pytest.mark.parametrize("lists", SGD_LISTS)
@pytest.mark.parametrize("options", SGD_OPTIONS)
@pytest.mark.parametrize("first_run", [True, False])
@pytest.mark.parametrize("scale", [None, 0.25])   # apex's FusedSGD passes 1/loss_scale
def test_sgd(device, lists, options, first_run, scale):
    grad_dtype, param_dtype, state_dtype, with_models = lists
    grads = tensor_list(grad_dtype, device, 10, non_contiguous=False)
    params = [rand(g.shape, param_dtype, device, 20 + i, non_contiguous=i == 2)
              for i, g in enumerate(grads)]
    bufs = [rand(g.shape, state_dtype, device, 30 + i) for i, g in enumerate(grads)]
    models = [torch.empty(g.shape, dtype=torch.float16, device=device) for g in grads]
    expected = [sgd_reference(g, p, b, lr=0.1, first_run=first_run,
                              scale=1.0 if scale is None else scale, **options)
                for g, p, b in zip(grads, params, bufs)]
    args = [options["wd"], options["momentum"], options["dampening"], 0.1, options["nesterov"],
            first_run, options["wd_after_momentum"]] + ([] if scale is None else [scale])
    tensor_lists = [grads, params, bufs] + ([models] if with_models else [])
    multi_tensor_applier(amp_C.multi_tensor_sgd, NOOPS["int32"](device), tensor_lists, *args)
    for p, b, model, (p_ref, b_ref) in zip(params, bufs, models, expected):
        assert_rounded_close(p, p_ref, param_dtype)
        if b_ref is not None:
            assert_rounded_close(b, b_ref, state_dtype)
        if with_models:
            assert torch.equal(model, p.to(torch.float16))


@pytest.mark.parametrize("noop_kind", ["int32", "float32", "bool"])
def test_sgd_skips_on_a_set_noop_flag(device, noop_kind):
    """apex's SGD kernel returns at once when the flag is set (its optimizers' skip path)."""
    grads = tensor_list(torch.float32, device, 40)
    params = tensor_list(torch.float32, device, 41)
    bufs = tensor_list(torch.float32, device, 42)
    before = [t.clone() for t in params + bufs]
    noop = NOOPS[noop_kind](device)
    noop.fill_(1)
    multi_tensor_applier(amp_C.multi_tensor_sgd, noop, [grads, params, bufs], 0.0, 0.9, 0.0,
                         0.1, False, False, False)
    assert all(torch.equal(a, b) for a, b in zip(before, params + bufs))
    assert flag_value(noop) == 1.0


def ulp(x, dtype):
    """The spacing of ``dtype``'s values at ``|x|`` (elementwise, float64; subnormals flushed
    to the smallest normal's spacing, an over-estimate there)."""
    info = torch.finfo(dtype)
    _, exponent = torch.frexp(x.double().abs().clamp(min=info.tiny))
    return torch.ldexp(torch.full(x.shape, info.eps, dtype=torch.float64), exponent - 1)


def assert_one_rounding(actual, reference, dtype, magnitude):
    """``actual`` was computed in fp32 from the inputs of the float64 ``reference`` and stored
    in ``dtype`` once: elementwise within half a unit in the last place of ``dtype`` at the
    value (the rounding to ``dtype``; the larger ulp of the two, at a power of two) plus the fp32
    arithmetic's error, 16 fp32 epsilons of ``magnitude``, the size of the terms combined into
    the element (what a sum cancels). For half dtypes the first term dominates, so a wrong
    argument that moves an element by an ulp is seen, unlike a bound scaled by the tensor's
    largest value."""
    a, r = actual.double(), reference.double()
    bound = 0.5 * torch.maximum(ulp(a, dtype), ulp(r, dtype)) + \
        16 * torch.finfo(torch.float32).eps * magnitude.double()
    error = (a - r).abs()
    bad = ~(error <= bound)
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} elements beyond one rounding to "
                           f"{dtype}; worst {float((error / bound).max()):.3g} x the bound")


# lr * weight_decay (1e-2) is more than an ulp of bf16 (at most 2**-7 relative), so decoupled
# weight decay changes every stored half parameter; in mode 0 it moves the moments by ~1%.
ADAM_LR = 0.1
ADAM_OPTIONS = [dict(mode=0, bias_correction=1, weight_decay=0.0),
                dict(mode=0, bias_correction=1, weight_decay=0.1),
                dict(mode=1, bias_correction=1, weight_decay=0.1),
                dict(mode=1, bias_correction=0, weight_decay=0.0)]


@pytest.mark.parametrize("options", ADAM_OPTIONS)
@pytest.mark.parametrize("step", [1, 7])
@pytest.mark.parametrize("dtype,state_dtype", [(torch.float32, torch.float32),
                                               (torch.float16, torch.float32),
                                               (torch.float16, torch.float16),
                                               (torch.bfloat16, torch.bfloat16)],
                         ids=["fp32", "fp16-fp32_state", "fp16", "bf16"])
def test_adam(device, options, step, dtype, state_dtype):
    grads = tensor_list(dtype, device, 50)
    params = [rand(g.shape, dtype, device, 60 + i, non_contiguous=i == 3)
              for i, g in enumerate(grads)]
    m = [rand(g.shape, state_dtype, device, 70 + i) * 0.1 for i, g in enumerate(grads)]
    v = [rand(g.shape, state_dtype, device, 80 + i).abs() * 0.01 for i, g in enumerate(grads)]
    expected = [adam_reference(*ts, lr=ADAM_LR, beta1=0.9, beta2=0.999, eps=1e-8, step=step,
                               **options) for ts in zip(grads, params, m, v)]
    # The size of the terms each element combines: the old moment and the gradient (with its
    # L2 term); the parameter and its step, the step as large as the moment's terms make it
    # (beta1 * m + (1 - beta1) * g may cancel, and its rounding error goes into the step).
    wd, corrected = options["weight_decay"], options["bias_correction"]
    bc1, bc2 = (1 - 0.9 ** step, 1 - 0.999 ** step) if corrected else (1.0, 1.0)
    sizes = []
    for g, p, mi, vi, (_, _, v_ref) in zip(grads, params, m, v, expected):
        g_size = g.double().abs() + wd * p.double().abs()
        m_size, v_size = mi.double().abs() + g_size, vi.double().abs() + g_size * g_size
        step_size = ADAM_LR * (m_size / bc1 / ((v_ref / bc2).sqrt() + 1e-8) + wd * p.abs())
        sizes.append((p.double().abs() + step_size, m_size, v_size))
    noop = NOOPS["int32"](device)
    multi_tensor_applier(amp_C.multi_tensor_adam, noop, [grads, params, m, v], ADAM_LR, 0.9,
                         0.999, 1e-8, step, options["mode"], options["bias_correction"],
                         options["weight_decay"])
    for p, mi, vi, (p_ref, m_ref, v_ref), (p_size, m_size, v_size) in zip(
            params, m, v, expected, sizes):
        assert p.dtype == dtype and mi.dtype == state_dtype
        assert_one_rounding(p, p_ref, dtype, p_size)
        assert_one_rounding(mi, m_ref, state_dtype, m_size)
        assert_one_rounding(vi, v_ref, state_dtype, v_size)


def test_adam_and_lamb_do_not_read_the_noop_flag(device):
    """apex's Adam and LAMB kernels step whatever the flag says (their commented-out check)."""
    for op, extra in ((amp_C.multi_tensor_adam, (1e-2, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0)),
                      (amp_C.multi_tensor_lamb, (1e-2, 0.9, 0.999, 1e-6, 1, 1, 0.01, 1, 1,
                                                 torch.ones(1, device=device), 1.0))):
        grads, params = tensor_list(torch.float32, device, 90), tensor_list(torch.float32,
                                                                             device, 91)
        m = [torch.zeros_like(p) for p in params]
        v = [torch.zeros_like(p) for p in params]
        before = [p.clone() for p in params]
        noop = NOOPS["int32"](device)
        noop.fill_(1)
        multi_tensor_applier(op, noop, [grads, params, m, v], *extra)
        assert not torch.equal(params[2], before[2])


LAMB_OPTIONS = [dict(mode=1, weight_decay=1e-2, grad_averaging=1, use_nvlamb=False),
                dict(mode=0, weight_decay=1e-2, grad_averaging=0, use_nvlamb=False),
                dict(mode=1, weight_decay=0.0, grad_averaging=1, use_nvlamb=False),
                dict(mode=1, weight_decay=0.0, grad_averaging=1, use_nvlamb=True)]


@pytest.mark.parametrize("options", LAMB_OPTIONS)
@pytest.mark.parametrize("max_grad_norm", [1.0, 1e6])   # clipping on, off
@pytest.mark.parametrize("step", [1, 4])
def test_lamb(device, options, max_grad_norm, step):
    grads = tensor_list(torch.float32, device, 100)
    params = tensor_list(torch.float32, device, 110)
    m = [rand(g.shape, torch.float32, device, 120 + i) * 0.1 for i, g in enumerate(grads)]
    v = [rand(g.shape, torch.float32, device, 130 + i).abs() * 0.01
         for i, g in enumerate(grads)]
    noop = NOOPS["int32"](device)
    grad_norm, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, noop, [grads], False)
    beta3 = 0.1 if options["grad_averaging"] else 1.0
    expected = [adam_reference(*ts, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, step=step,
                               mode=options["mode"], bias_correction=1,
                               weight_decay=options["weight_decay"], beta3=beta3,
                               max_grad_norm=max_grad_norm, grad_norm=float(grad_norm),
                               lamb=True, use_nvlamb=options["use_nvlamb"])
                for ts in zip(grads, params, m, v)]
    grads_before = [g.clone() for g in grads]
    multi_tensor_applier(amp_C.multi_tensor_lamb, noop, [grads, params, m, v], 1e-2, 0.9,
                         0.999, 1e-6, step, 1, options["weight_decay"],
                         options["grad_averaging"], options["mode"], grad_norm, max_grad_norm,
                         options["use_nvlamb"])
    for p, mi, vi, (p_ref, m_ref, v_ref) in zip(params, m, v, expected):
        assert_rounded_close(p, p_ref, torch.float32)
        assert_rounded_close(mi, m_ref, torch.float32)
        assert_rounded_close(vi, v_ref, torch.float32)
    # apex overwrote the gradients with the update; apex_lite leaves them.
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_before))


# ---- what does not map, and misuse ---------------------------------------------------------

def _sgd_lists(device, n=2):
    t = lambda: [torch.zeros(3, device=device) for _ in range(n)]   # noqa: E731
    return [t(), t(), t()]


def _adam_lists(device, dtype=torch.float32):
    return [[torch.zeros(3, dtype=dtype, device=device)] for _ in range(4)]


BAD_CALLS = {
    "two lists for axpby": (lambda d: multi_tensor_applier(
        amp_C.multi_tensor_axpby, NOOPS["int32"](d), [[], []], 1.0, 1.0, -1),
        ValueError, "amp_C.multi_tensor_axpby takes the tensor lists [xs, ys, outputs], got 2"),
    "a tensor for the lists": (lambda d: multi_tensor_applier(
        amp_C.multi_tensor_l2norm, NOOPS["int32"](d), torch.zeros(3), False),
        ValueError, "takes the tensor lists [tensors], got a Tensor"),
    "arg_to_check 2": (lambda d: multi_tensor_applier(
        amp_C.multi_tensor_axpby, NOOPS["int32"](d), [[], [], []], 1.0, 1.0, 2),
        ValueError, "arg_to_check=2; apex's values are -1"),
    "a noop flag of 2 elements": (lambda d: multi_tensor_applier(
        amp_C.multi_tensor_scale, torch.zeros(2, dtype=torch.int, device=d),
        [[torch.ones(2, device=d)]] * 2, 1.0),
        TypeError, "noop_flag must be a 1-element tensor"),
    "a noop flag that is not a tensor": (lambda d: multi_tensor_applier(
        amp_C.multi_tensor_l2norm, 0, [[torch.ones(2, device=d)]], False),
        TypeError, "noop_flag must be a 1-element tensor"),
    "misaligned sgd lists": (lambda d: multi_tensor_applier(
        amp_C.multi_tensor_sgd, NOOPS["int32"](d),
        [[torch.zeros(3, device=d)]] + _sgd_lists(d)[1:], 0.0, 0.9, 0.0, 0.1, False, True,
        False), ValueError, "grads has 1 tensors but params has 2"),
    "a shape mismatch": (lambda d: multi_tensor_applier(
        amp_C.multi_tensor_adam, NOOPS["int32"](d),
        [[torch.zeros(4, device=d)]] + _adam_lists(d)[1:], 1e-3, 0.9, 0.999, 1e-8, 1, 1, 1, 0.),
        ValueError, "grads[0] has shape (4,) but params[0] has (3,)"),
    "double tensors": (lambda d: multi_tensor_applier(
        amp_C.multi_tensor_adam, NOOPS["int32"](d), _adam_lists(d, torch.float64), 1e-3, 0.9,
        0.999, 1e-8, 1, 1, 1, 0.), TypeError, "apex's double-precision path is not provided"),
    "adam's capturable lr": (lambda d: multi_tensor_applier(
        amp_C.multi_tensor_adam, NOOPS["int32"](d), _adam_lists(d), torch.tensor(1e-3), 0.9,
        0.999, 1e-8, 1, 1, 1, 0.), TypeError, "the capturable variants"),
    "adam's five lists": (lambda d: multi_tensor_applier(
        amp_C.multi_tensor_adam, NOOPS["int32"](d), _adam_lists(d) * 2, 1e-3, 0.9, 0.999, 1e-8,
        1, 1, 1, 0.), ValueError, "[grads, params, exp_avgs, exp_avg_sqs], got 8 lists"),
    "step 0": (lambda d: multi_tensor_applier(
        amp_C.multi_tensor_adam, NOOPS["int32"](d), _adam_lists(d), 1e-3, 0.9, 0.999, 1e-8, 0,
        1, 1, 0.), ValueError, "step=0; apex passes the number of the step being taken"),
    "adam mode 2": (lambda d: multi_tensor_applier(
        amp_C.multi_tensor_adam, NOOPS["int32"](d), _adam_lists(d), 1e-3, 0.9, 0.999, 1e-8, 1,
        2, 1, 0.), ValueError, "mode=2"),
    "lamb max_grad_norm 0": (lambda d: multi_tensor_applier(
        amp_C.multi_tensor_lamb, NOOPS["int32"](d), _adam_lists(d), 1e-3, 0.9, 0.999, 1e-6, 1,
        1, 0.01, 1, 1, torch.ones(1, device=d), 0.0), ValueError, "this does not map"),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_bad_calls_are_named(device, case):
    call, error, message = BAD_CALLS[case]
    with pytest.raises(error) as info:
        call(device)
    assert message in str(info.value)


def test_ops_apex_has_and_apex_lite_does_not_are_named():
    with pytest.raises(AttributeError, match="amp_C.multi_tensor_novograd is not provided by "
                       "apex_lite, whose amp_C has multi_tensor_scale, multi_tensor_axpby"):
        amp_C.multi_tensor_novograd
    with pytest.raises(AttributeError, match="use apex_lite.optimizers.FusedAdam"):
        amp_C.multi_tensor_adam_capturable
    assert not hasattr(amp_C, "multi_tensor_l2norm_scale")
    assert set(amp_C.AMP_C_OPS) <= set(amp_C.__all__)
