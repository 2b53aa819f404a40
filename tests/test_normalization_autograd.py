"""apex_lite.normalization beyond the first derivative: second and third order (gradient
penalties, Hessian-vector products) through every norm and option against torch's own
layer_norm / rms_norm, gradgradcheck in fp64, torch.jit.script and trace of models holding the
norms, torch.func (vmap, grad, jacrev, jvp) and forward-mode AD."""
import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch.autograd import gradcheck, gradgradcheck
from torch.func import functional_call

from apex_lite.normalization import (FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm,
                                     MixedFusedRMSNorm)
from apex_lite.normalization import _autograd
from apex_lite.normalization import fused_layer_norm as fln

# Every norm with every option: (class, keyword arguments).
VARIANTS = [(cls, kwargs)
            for cls in (FusedLayerNorm, FusedRMSNorm)
            for kwargs in ({}, {"memory_efficient": True}, {"elementwise_affine": False},
                           {"elementwise_affine": False, "memory_efficient": True})] + [
    (cls, kwargs) for cls in (MixedFusedLayerNorm, MixedFusedRMSNorm)
    for kwargs in ({}, {"memory_efficient": True})]


def _id(value):
    if isinstance(value, type):
        return value.__name__
    return ",".join(f"{k}={v}" for k, v in value.items()) or "default"


def make(cls, kwargs, shape=(5,), dtype=torch.float64):
    """The module with parameters well away from 0 (memory_efficient divides by the weight)."""
    module = cls(shape, **kwargs).to(dtype)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name == "weight":
                p.uniform_(0.5, 1.5).mul_(torch.sign(torch.randn_like(p)))
            else:
                p.uniform_(-0.5, 0.5)
    return module


def is_rms(module):
    return isinstance(module, FusedRMSNorm)


def torch_norm(module, x, params):
    """torch's own op with ``module``'s maths, statistics in fp32 at least, the output in the
    dtype ``module`` gives: the reference."""
    w, b = params.get("weight"), params.get("bias")
    dtype = torch.promote_types(x.dtype, torch.float32)
    xs, ws, bs = (None if t is None else t.to(dtype) for t in (x, w, b))
    if is_rms(module):
        out = F.rms_norm(xs, module.normalized_shape, ws, module.eps)
    else:
        out = F.layer_norm(xs, module.normalized_shape, ws, bs, module.eps)
    mixed = isinstance(module, (MixedFusedLayerNorm, MixedFusedRMSNorm))
    return out.to(w.dtype if mixed else x.dtype)


def apply(module, x, params, reference=False):
    if reference:
        return torch_norm(module, x, params)
    return functional_call(module, params, (x,))


def leaves(module, x):
    x = x.detach().clone().requires_grad_()
    params = {n: p.detach().clone().requires_grad_() for n, p in module.named_parameters()}
    return x, params


@pytest.mark.parametrize("cls,kwargs", VARIANTS, ids=_id)
def test_gradgradcheck_in_fp64(cls, kwargs):
    """Second order exact, forward-over-reverse included."""
    module = make(cls, kwargs, shape=(2, 3))
    x, params = leaves(module, torch.randn(2, 2, 3, dtype=torch.float64))
    names = list(params)

    def f(x, *ps):
        return apply(module, x, dict(zip(names, ps)))

    inputs = (x, *params.values())
    assert gradcheck(f, inputs, check_forward_ad=True)
    assert gradgradcheck(f, inputs, check_fwd_over_rev=True)


# A layer norm whose input and parameters share a dtype is torch's layer_norm, whose third
# derivatives are wrong (its double backward treats the saved statistics as constants:
# pytorch/pytorch#175754); every other path is apex_lite's Function, exact to any order.
THIRD_ORDER = [(cls, kwargs) for cls, kwargs in VARIANTS
               if issubclass(cls, FusedRMSNorm) or kwargs.get("memory_efficient")]


@pytest.mark.parametrize("cls,kwargs", THIRD_ORDER, ids=_id)
def test_third_order_in_fp64(cls, kwargs):
    """The gradient of the norm, differentiated twice more (gradgradcheck of the gradient)."""
    module = make(cls, kwargs)
    x, params = leaves(module, torch.randn(3, 5, dtype=torch.float64))
    v = torch.randn(3, 5, dtype=torch.float64)
    names = list(params)

    def first_grads(x, *ps):
        out = apply(module, x, dict(zip(names, ps)))
        return torch.autograd.grad((out * v).sum(), (x, *ps), create_graph=True)

    assert gradgradcheck(first_grads, (x, *params.values()))


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("memory_efficient", [False, True], ids=["saves_input", "memory_eff"])
@pytest.mark.parametrize("params", ["weight_bias", "weight", "none"])
def test_the_function_itself_in_fp64(rms, memory_efficient, params):
    """apex_lite's Function on every path (the modules take torch's op for some): the path a
    half input with fp32 parameters takes, here in fp64."""
    if rms and params == "weight_bias":
        pytest.skip("RMS norms have no bias")
    x = torch.randn(2, 2, 3, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(2, 3, dtype=torch.float64) + 0.5).requires_grad_()
    b = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    inputs = {"weight_bias": (x, w, b), "weight": (x, w), "none": (x,)}[params]
    v = torch.randn(2, 2, 3, dtype=torch.float64)

    def f(x, w=None, b=None):
        return _autograd.norm(x, w, b, (2, 3), 1e-5, memory_efficient, rms=rms, mixed=False)

    def first_grads(*inputs):
        return torch.autograd.grad((f(*inputs) * v).sum(), inputs, create_graph=True)

    assert gradcheck(f, inputs, check_forward_ad=True)
    assert gradgradcheck(f, inputs, check_fwd_over_rev=True)
    assert gradgradcheck(first_grads, inputs)


def _penalty_and_hvp(module, x, params, reference):
    """(gradient penalty's gradients, Hessian-vector product) w.r.t. the input and parameters:
    what a WGAN-GP / R1 penalty and a second-order optimizer compute."""
    x, params = leaves(module, x)
    out = apply(module, x, params, reference)
    v = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).reshape(out.shape)
    wrt = (x, *params.values())
    grads = torch.autograd.grad((out.double() * v).sum(), wrt, create_graph=True)
    penalty = sum(g.double().square().sum() for g in grads)
    # (the bias' gradient is constant: nothing of the penalty depends on the bias)
    penalty_grads = torch.autograd.grad(penalty, wrt, retain_graph=True, allow_unused=True,
                                        materialize_grads=True)
    u = [torch.cos(torch.arange(g.numel(), dtype=torch.float64)).reshape(g.shape).to(g.dtype)
         for g in grads]
    # Without create_graph: the second backward through the norm is not itself recorded.
    # (a gradient that depends on nothing, as the bias' may, adds nothing)
    live = [(g, v) for g, v in zip(grads, u) if g.requires_grad]
    hvp = torch.autograd.grad([g for g, _ in live], wrt, [v for _, v in live], allow_unused=True,
                              materialize_grads=True)
    return penalty_grads, hvp


@pytest.mark.parametrize("cls,kwargs", VARIANTS, ids=_id)
def test_gradient_penalty_and_hvp_match_torchs_norms(cls, kwargs):
    module = make(cls, kwargs, shape=(6,))
    x = torch.randn(4, 6, dtype=torch.float64)
    got = _penalty_and_hvp(module, x, dict(module.named_parameters()), reference=False)
    want = _penalty_and_hvp(module, x, dict(module.named_parameters()), reference=True)
    for g_list, w_list in zip(got, want):
        for g, w in zip(g_list, w_list):
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("cls,kwargs", [v for v in VARIANTS if "elementwise_affine" not in v[1]],
                         ids=_id)
def test_second_order_with_fp32_parameters_and_a_half_input(cls, kwargs, dtype):
    """Mixed dtypes (apex_lite's Function): the second derivatives of torch's norm computed in
    fp32 from the same half input, to the half dtype's rounding (memory_efficient rebuilds the
    normalised input from the rounded output)."""
    module = make(cls, kwargs, shape=(16,), dtype=torch.float32)
    x = torch.randn(8, 16).to(dtype)
    got = _penalty_and_hvp(module, x, dict(module.named_parameters()), reference=False)
    want = _penalty_and_hvp(module, x, dict(module.named_parameters()), reference=True)
    for g_list, w_list in zip(got, want):
        # One scale per list: a gradient that is 0 in exact arithmetic (the penalty's w.r.t. the
        # bias) comes out at the rounding of the others' size.
        scale = max(w.double().abs().max().item() for w in w_list)
        for g, w in zip(g_list, w_list):
            assert g.dtype == w.dtype
            torch.testing.assert_close(g.double(), w.double(), rtol=0, atol=3e-2 * scale)


def _model(dtype=torch.float64):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(6, 6)]
    for cls, kwargs in VARIANTS:
        layers += [make(cls, kwargs, shape=(6,)), torch.nn.Linear(6, 6)]
    return torch.nn.Sequential(*layers).to(dtype)


def test_torch_jit_script_and_trace_of_a_model_holding_every_norm():
    """apex's norms script (their forward takes torch's ops under TorchScript); here too, with the
    eager results and gradients, memory_efficient ignored there as apex ignores it."""
    model = _model()
    scripted = torch.jit.script(model)
    x = torch.randn(5, 6, dtype=torch.float64)
    traced = torch.jit.trace(model, (x,))
    outputs = []
    for m in (model, scripted, traced):
        m.zero_grad()
        xi = x.clone().requires_grad_()
        out = m(xi)
        out.pow(2).sum().backward()
        outputs.append([out, xi.grad] + [p.grad for p in m.parameters()])
    for other in outputs[1:]:
        for a, b in zip(outputs[0], other):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm,
                                 MixedFusedRMSNorm], ids=_id)
def test_scripted_norms_give_apexs_dtypes(cls):
    """Scripted, fp32 parameters with a bf16 input: Fused* give bf16, MixedFused* fp32."""
    module = make(cls, {}, shape=(8,), dtype=torch.float32)
    x = torch.randn(3, 8).to(torch.bfloat16)
    eager, scripted = module(x), torch.jit.script(module)(x)
    assert scripted.dtype == eager.dtype
    torch.testing.assert_close(scripted, eager)


@pytest.mark.parametrize("cls,kwargs", VARIANTS, ids=_id)
def test_torch_func_transforms_match_torchs_norms(cls, kwargs):
    """vmap (over the batch, and over stacked parameters as model ensembling does), grad,
    jacrev, jvp, and forward-mode AD: each as over torch's own norm."""
    module = make(cls, kwargs, shape=(5,))
    params = {n: p.detach() for n, p in module.named_parameters()}
    x = torch.randn(4, 3, 5, dtype=torch.float64)
    t = torch.randn_like(x)

    def ours(x, params=params):
        return apply(module, x, params)

    def ref(x, params=params):
        return apply(module, x, params, reference=True)

    close = torch.testing.assert_close
    close(torch.func.vmap(ours)(x), torch.func.vmap(ref)(x))
    close(torch.func.vmap(ours, in_dims=1, out_dims=1)(x), ref(x))
    if params:
        stacked = {n: torch.stack([p, 2 * p, -p]) for n, p in params.items()}
        close(torch.func.vmap(lambda p: ours(x, p))(stacked),
              torch.stack([ref(x, {n: s[i] for n, s in stacked.items()}) for i in range(3)]))
        close(torch.func.grad(lambda p: ours(x, p).pow(2).sum())(params),
              torch.func.grad(lambda p: ref(x, p).pow(2).sum())(params))
    close(torch.func.grad(lambda x: ours(x).pow(2).sum())(x),
          torch.func.grad(lambda x: ref(x).pow(2).sum())(x))
    close(torch.func.jacrev(ours)(x[0]), torch.func.jacrev(ref)(x[0]))
    close(torch.func.jacfwd(ours)(x[0]), torch.func.jacrev(ref)(x[0]))
    close(torch.func.hessian(lambda x: ours(x).pow(3).sum())(x[0, 0]),
          torch.func.hessian(lambda x: ref(x).pow(3).sum())(x[0, 0]))
    close(torch.func.jvp(ours, (x,), (t,)), torch.func.jvp(ref, (x,), (t,)))
    with fwAD.dual_level():
        tangent = fwAD.unpack_dual(ours(fwAD.make_dual(x, t))).tangent
        want = fwAD.unpack_dual(ref(fwAD.make_dual(x, t))).tangent
    close(tangent, want)
    if params:
        tangents = {n: torch.randn_like(p) for n, p in params.items()}
        close(torch.func.jvp(lambda p: ours(x, p), (params,), (tangents,)),
              torch.func.jvp(lambda p: ref(x, p), (params,), (tangents,)))


@pytest.mark.parametrize("cls", [FusedLayerNorm, MixedFusedRMSNorm], ids=_id)
def test_forward_ad_with_a_half_input(cls):
    """Forward-mode AD on the mixed-dtype Function: the tangent in the output's dtype, equal to
    torch's norm computed in fp32 to bf16 rounding."""
    module = make(cls, {}, shape=(8,), dtype=torch.float32)
    params = {n: p.detach() for n, p in module.named_parameters()}
    x = torch.randn(3, 8).to(torch.bfloat16)
    t = torch.randn(3, 8).to(torch.bfloat16)
    got = torch.func.jvp(lambda x: apply(module, x, params), (x,), (t,))
    want = torch.func.jvp(lambda x: apply(module, x, params, reference=True), (x,), (t,))
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=1.6e-2, atol=2e-2)


def test_memory_efficient_still_frees_the_input_with_its_double_backward():
    """The rstd the Function returns for the double backward is per row: the input is still not
    kept (what memory_efficient is for)."""
    module = make(FusedLayerNorm, {"memory_efficient": True}, shape=(16,))
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        module(x)
    assert all(t.data_ptr() != x.data_ptr() for t in saved)
    assert sum(t.numel() for t in saved) <= x.numel() + 2 * 16 + 2 * 4


def test_functional_forms_and_apex_functions_differentiate_twice():
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(4, dtype=torch.float64) + 0.5).requires_grad_()
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    calls = [
        lambda x, w, b: fln.fused_layer_norm_affine(x, w, b, (4,), 1e-5, True),
        lambda x, w, b: fln.mixed_dtype_fused_rms_norm_affine(x, w, (4,), 1e-5),
        lambda x, w, b: fln.FusedLayerNormAffineFunction.apply(x, w, b, (4,), 1e-5, True),
        lambda x, w, b: fln.FusedRMSNormAffineFunction.apply(x, w, (4,), 1e-5) + 0 * b.sum(),
        lambda x, w, b: fln.FusedRMSNormFunction.apply(x, (4,), 1e-5, True) * w + b,
    ]
    for call in calls:
        assert gradgradcheck(call, (x, w, b))


def test_a_tensor_that_outlived_a_transform_goes_through_torchs_apply():
    """Outside torch.func the norm calls the Function's C++ apply itself (_autograd's note); a
    tensor left over from a transform still takes torch's Python apply, which unwraps it."""
    leaked = []
    torch.func.grad(lambda x: leaked.append(x) or x.sum())(torch.randn(2, 3))
    assert not _autograd._plain(leaked[0]) and _autograd._plain(torch.randn(2))
    module = FusedRMSNorm(3, memory_efficient=True)
    module(leaked[0]).sum().backward()
    assert module.weight.grad is not None
