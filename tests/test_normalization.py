"""apex_lite.normalization (apex.normalization): the norms against a float64 reference and torch's
own ops, forward and backward, fp32/bf16/fp16, odd and empty shapes, non-contiguous inputs,
memory_efficient; output dtypes as apex's CUDA kernels give them; apex's signatures; autocast and
amp's O1/O2; and apex's own tests/L0/run_fused_layer_norm ported to the CPU."""
import inspect
import itertools

import pytest
import torch
import torch.nn.functional as F

from apex_lite import amp
from apex_lite.normalization import (FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm,
                                     MixedFusedRMSNorm)
from apex_lite.normalization import fused_layer_norm as fln

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rtol, atol) against a float64 reference, by the dtype of what is compared.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 2e-2),
       torch.float16: (2e-3, 2e-3), torch.float64: (1e-7, 1e-7)}
# (input shape, normalized_shape): odd sizes, two normalised dimensions, no rows at all.
SHAPES = [((3, 17), (17,)), ((2, 3, 5, 7), (5, 7)), ((0, 9), (9,)), ((1, 1), (1,))]


def reference(x, normalized_shape, weight, bias, eps, rms):
    """The norm in float64, composed of elementary ops."""
    dims = tuple(range(-len(normalized_shape), 0))
    x = x.double()
    if rms:
        out = x * torch.rsqrt(x.square().mean(dims, keepdim=True) + eps)
    else:
        mean = x.mean(dims, keepdim=True)
        out = (x - mean) * torch.rsqrt((x - mean).square().mean(dims, keepdim=True) + eps)
    if weight is not None:
        out = out * weight.double()
    if bias is not None:
        out = out + bias.double()
    return out


def make_input(shape, dtype, contiguous):
    if contiguous:
        return torch.randn(shape).to(dtype).requires_grad_()
    # Every other element of a wider tensor: strided in the normalised dimensions too.
    wide = torch.randn(*shape[:-1], shape[-1] * 2).to(dtype)
    x = wide[..., ::2].detach().requires_grad_()
    assert not x.is_contiguous() or x.numel() <= 1
    return x


def random_params(module, dtype):
    module.to(dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p, dtype=torch.float32) * 0.5 + 1.0)
    return module


def run(module, x):
    out = module(x)
    grad = torch.randn(out.shape).to(out.dtype)
    out.backward(grad)
    return out, grad


def _loosest(*dtypes):
    return tuple(max(TOL[d][i] for d in dtypes) for i in range(2))


def check_against_reference(module, x, out, grad, rms, out_dtype):
    w = getattr(module, "weight", None)
    b = getattr(module, "bias", None)
    x64 = x.detach().double().requires_grad_()
    leaves = [t.detach().double().requires_grad_() if t is not None else None for t in (w, b)]
    ref = reference(x64, module.normalized_shape, leaves[0], leaves[1], module.eps, rms)
    ref.backward(grad.double())
    assert out.dtype == out_dtype and out.shape == x.shape
    rtol, atol = TOL[out_dtype]
    torch.testing.assert_close(out.double(), ref, rtol=rtol, atol=atol)
    # memory_efficient rebuilds the normalised input from the output, rounded to its dtype.
    rounded = (out_dtype,) if module.memory_efficient else ()
    rtol, atol = _loosest(x.dtype, *rounded)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=rtol, atol=4 * atol)
    for param, leaf in zip((w, b), leaves):
        if param is not None:
            rtol, atol = _loosest(param.dtype, *rounded)
            rows = max(1, x.numel() // param.numel())
            torch.testing.assert_close(param.grad.double(), leaf.grad, rtol=rtol,
                                       atol=4 * atol * rows ** 0.5)


CLASSES = {"layer": (FusedLayerNorm, False), "rms": (FusedRMSNorm, True)}


@pytest.mark.parametrize("memory_efficient", [False, True], ids=["saves_input", "memory_eff"])
@pytest.mark.parametrize("contiguous", [True, False], ids=["contig", "strided"])
@pytest.mark.parametrize("shape,normalized_shape", SHAPES, ids=lambda v: "x".join(map(str, v)))
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", list(CLASSES))
def test_norms_against_float64(kind, dtype, affine, shape, normalized_shape, contiguous,
                               memory_efficient):
    cls, rms = CLASSES[kind]
    module = random_params(cls(normalized_shape, elementwise_affine=affine,
                               memory_efficient=memory_efficient), dtype)
    x = make_input(shape, dtype, contiguous)
    out, grad = run(module, x)
    check_against_reference(module, x, out, grad, rms, out_dtype=dtype)


@pytest.mark.parametrize("memory_efficient", [False, True], ids=["saves_input", "memory_eff"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("cls,rms,mixed", [(FusedLayerNorm, False, False),
                                           (FusedRMSNorm, True, False),
                                           (MixedFusedLayerNorm, False, True),
                                           (MixedFusedRMSNorm, True, True)],
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_fp32_parameters_with_a_half_input(cls, rms, mixed, dtype, memory_efficient):
    """apex's dtypes: Fused* give the input's dtype, MixedFused* the parameters' (fp32), both
    computed from the fp32 parameters; parameter gradients in fp32, the input's in its dtype."""
    module = random_params(cls((5, 7), memory_efficient=memory_efficient), torch.float32)
    x = make_input((3, 5, 14), dtype, True)[..., :7].detach().requires_grad_()   # strided
    out, grad = run(module, x)
    check_against_reference(module, x, out, grad, rms,
                            out_dtype=torch.float32 if mixed else dtype)
    assert x.grad.dtype == dtype and module.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("torch_rms_on_cpu", [False, True], ids=["rms_function", "rms_torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_against_torchs_own_modules(dtype, affine, torch_rms_on_cpu, monkeypatch):
    """Without memory_efficient, with parameters of the input's dtype, FusedLayerNorm is torch's
    layer_norm bit for bit, forward and backward; FusedRMSNorm is torch's rms_norm bit for bit
    where it uses it (not on the CPU, whose rms_norm backward is slower than apex_lite's Function:
    there it agrees to rounding)."""
    if torch_rms_on_cpu:
        monkeypatch.setattr(fln, "_RMS_NORM_NOT_BY_TORCH", ())
    x = torch.randn(6, 33).to(dtype)
    for ours, theirs, exact in ((FusedLayerNorm(33, elementwise_affine=affine),
                                 torch.nn.LayerNorm(33, elementwise_affine=affine), True),
                                (FusedRMSNorm(33, elementwise_affine=affine),
                                 torch.nn.RMSNorm(33, eps=1e-5, elementwise_affine=affine),
                                 torch_rms_on_cpu)):
        random_params(ours, dtype)
        theirs.load_state_dict(ours.state_dict())
        theirs.to(dtype)
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_a, out_b = ours(a), theirs(b)
        grad = torch.randn_like(out_a)
        out_a.backward(grad)
        out_b.backward(grad)
        pairs = [(out_a, out_b), (a.grad, b.grad)] + [
            (p.grad, q.grad) for p, q in zip(ours.parameters(), theirs.parameters())]
        for got, want in pairs:
            if exact:
                assert torch.equal(got, want)
            else:
                rtol, atol = TOL[dtype]
                torch.testing.assert_close(got, want, rtol=rtol, atol=4 * atol)


@pytest.mark.parametrize("memory_efficient", [False, True])
def test_memory_efficient_keeps_the_output_not_the_input(memory_efficient):
    """What ``memory_efficient`` means here: the tensors saved for the backward include the
    output and not the input (torch's layer_norm keeps the input)."""
    for cls in (FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm):
        module = cls(16, memory_efficient=memory_efficient)
        x = torch.randn(4, 16, requires_grad=True)
        saved = []

        def pack(t):
            saved.append(t.data_ptr())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = module(x)
        assert (x.data_ptr() in saved) is not memory_efficient, cls
        assert (out.data_ptr() in saved) is memory_efficient, cls


def test_memory_efficient_with_weights_near_zero():
    """The output-based backward divides by the weight, clamped to +-eps in magnitude (apex's
    rule): finite gradients, exact where weights are far from 0."""
    module = FusedLayerNorm(8, memory_efficient=True)
    with torch.no_grad():
        module.weight.copy_(torch.tensor([1.0, -2.0, 0.0, 1e-9, -1e-9, 0.5, 3.0, -1.0]))
    x = torch.randn(5, 8, requires_grad=True)
    module(x).sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(module.weight.grad).all()
    assert torch.equal(module.bias.grad, torch.full((8,), 5.0))


def test_functional_forms_and_apex_functions():
    """The functional forms (eps 1e-6 by default, as apex's) and apex's autograd Functions called
    directly, as Megatron-style code does."""
    x = torch.randn(4, 3, 10, dtype=torch.float64, requires_grad=True)
    w = torch.randn(10, dtype=torch.float64, requires_grad=True)
    b = torch.randn(10, dtype=torch.float64, requires_grad=True)
    cases = [
        (fln.fused_layer_norm_affine(x, w, b, (10,)), reference(x, (10,), w, b, 1e-6, False)),
        (fln.fused_layer_norm(x, (3, 10)), reference(x, (3, 10), None, None, 1e-6, False)),
        (fln.fused_rms_norm_affine(x, w, (10,)), reference(x, (10,), w, None, 1e-6, True)),
        (fln.fused_rms_norm(x, (10,), 1e-3), reference(x, (10,), None, None, 1e-3, True)),
        (fln.mixed_dtype_fused_layer_norm_affine(x, w, b, [10], 1e-6, True),
         reference(x, (10,), w, b, 1e-6, False)),
        (fln.mixed_dtype_fused_rms_norm_affine(x, w, (10,), 1e-6, True),
         reference(x, (10,), w, None, 1e-6, True)),
        (fln.FusedLayerNormAffineFunction.apply(x, w, b, (10,), 1e-6),
         reference(x, (10,), w, b, 1e-6, False)),
        (fln.FusedRMSNormAffineFunction.apply(x, w, (10,), 1e-6, True),
         reference(x, (10,), w, None, 1e-6, True)),
        (fln.FusedLayerNormFunction.apply(x, (10,), 1e-6), reference(x, (10,), None, None,
                                                                    1e-6, False)),
        (fln.FusedRMSNormFunction.apply(x, (10,), 1e-6), reference(x, (10,), None, None, 1e-6,
                                                                  True)),
        (fln.manual_rms_norm(x, (10,), w, 1e-6), reference(x, (10,), w, None, 1e-6, True)),
    ]
    for i, (ours, ref) in enumerate(cases):
        grad = torch.randn_like(ref)
        got = torch.autograd.grad(ours, (x, w, b), grad, allow_unused=True)
        want = torch.autograd.grad(ref, (x, w, b), grad, allow_unused=True)
        torch.testing.assert_close(ours, ref, msg=f"case {i}")
        for g, h in zip(got, want):
            assert (g is None) == (h is None), i
            if g is not None:
                torch.testing.assert_close(g, h, msg=f"case {i}")


def test_rms_norm_without_torchs_fused_rms_norm(monkeypatch):
    """torch before 2.8 has no _fused_rms_norm: the Function's forward is composed of ops, with
    the same results to rounding."""
    from apex_lite.normalization import _autograd
    x = torch.randn(5, 12).to(torch.bfloat16)
    modules = [random_params(FusedRMSNorm(12), torch.float32),
               random_params(MixedFusedRMSNorm(12, memory_efficient=True), torch.float32)]
    expected = [m(x) for m in modules]
    monkeypatch.setattr(_autograd, "_FUSED_RMS_NORM", None)
    for module, want in zip(modules, expected):
        got = module(x)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=2 ** -7)


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("memory_efficient", [False, True])
def test_under_autocast_the_norms_run_in_autocasts_dtype(autocast_dtype, memory_efficient):
    """apex's _cast_if_autocast_enabled, on the input's device: input and parameters cast to
    autocast's dtype, output in it, gradients reaching the fp32 parameters (apex's
    test_autocast_fused_layer_norm/rms_norm, on the CPU)."""
    for fused, native in ((FusedLayerNorm([8, 4], memory_efficient=memory_efficient),
                           torch.nn.LayerNorm([8, 4])),
                          (MixedFusedRMSNorm([8, 4], memory_efficient=memory_efficient),
                           torch.nn.RMSNorm([8, 4], eps=1e-5))):
        random_params(fused, torch.float32)
        native.load_state_dict(fused.state_dict())
        native.to(autocast_dtype)
        x = torch.randn(6, 8, 4)
        x_fused, x_native = x.clone().requires_grad_(), x.to(autocast_dtype).requires_grad_()
        with torch.autocast("cpu", dtype=autocast_dtype):
            actual = fused(x_fused)
        expected = native(x_native)
        assert actual.dtype == autocast_dtype
        torch.testing.assert_close(actual, expected, rtol=1.6e-2, atol=3e-3)
        grad = torch.rand_like(expected)
        actual.backward(grad)
        expected.backward(grad)
        assert x_fused.grad.dtype == torch.float32 and fused.weight.grad.dtype == torch.float32
        torch.testing.assert_close(x_fused.grad, x_native.grad.float(), rtol=1.6e-2, atol=3e-2)


def _model():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), FusedLayerNorm(16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 16), MixedFusedRMSNorm(16),
                               torch.nn.Linear(16, 16), FusedRMSNorm(16, memory_efficient=True),
                               MixedFusedLayerNorm(16), torch.nn.Linear(16, 1))


@pytest.mark.parametrize("opt_level,keep", [("O1", ()), ("O2", ()), ("O2", (FusedLayerNorm,))])
def test_under_amp(opt_level, keep):
    """O1: parameters stay fp32, the norms run in autocast's dtype; O2: the norms are cast to half
    with the model (as apex did; ``keep_fp32_modules`` keeps them fp32), the masters are fp32.
    Training converges either way."""
    torch.manual_seed(0)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    kwargs = {"keep_fp32_modules": keep} if keep else {}
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0,
                                      **kwargs)
    seen = {}
    for index in (1, 4, 6, 7):
        model[index].register_forward_hook(
            lambda m, i, o, index=index: seen.__setitem__(index, (i[0].dtype, o.dtype)))
    x = torch.randn(64, 8)
    y = x.sum(1, keepdim=True)
    losses = []
    for _ in range(40):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x).float(), y)
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    half = torch.bfloat16
    if opt_level == "O1":
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert seen == {1: (half, half), 4: (half, half), 6: (half, half), 7: (half, half)}
    else:
        # A kept type keeps its subclasses (MixedFusedLayerNorm); a kept module takes and hands
        # on half (it runs in fp32 inside).
        kept = FusedLayerNorm in keep
        for index in (1, 7):
            assert model[index].weight.dtype == (torch.float32 if kept else half)
        assert model[4].weight.dtype == half
        assert seen == {1: (half, half), 4: (half, half), 6: (half, half), 7: (half, half)}
        assert all(p.dtype == torch.float32 for p in amp.master_params(optimizer))


def test_mixed_norms_refuse_no_parameters():
    for cls in (MixedFusedLayerNorm, MixedFusedRMSNorm):
        with pytest.raises(RuntimeError, match="does not support `elementwise_affine = False`"):
            cls(8, elementwise_affine=False)
        with pytest.raises(TypeError, match="unexpected keyword arguments \\['bias'\\]"):
            cls(8, bias=False)
        assert cls(8, elementwise_affine=True).weight.shape == (8,)


def test_shape_errors_name_the_shapes():
    for module in (FusedLayerNorm(8, memory_efficient=True), FusedRMSNorm(8),
                   FusedRMSNorm(8, memory_efficient=True)):
        with pytest.raises(RuntimeError, match="normalized_shape|shape"):
            module(torch.randn(3, 7))
    with pytest.raises(RuntimeError, match=r"normalized_shape \[8\] must be the trailing"):
        fln.fused_rms_norm_affine(torch.randn(3, 7), torch.ones(8), (8,), 1e-6, True)


def test_module_attributes_as_apex():
    m = FusedLayerNorm(torch.Size([4, 5]), eps=1e-3)
    assert m.normalized_shape == torch.Size([4, 5]) and m.eps == 1e-3
    assert torch.equal(m.weight, torch.ones(4, 5)) and torch.equal(m.bias, torch.zeros(4, 5))
    assert repr(m) == "FusedLayerNorm(torch.Size([4, 5]), eps=0.001, elementwise_affine=True)"
    r = FusedRMSNorm(6, elementwise_affine=False)
    assert r.weight is None and list(r.parameters()) == [] and not r.memory_efficient
    assert sorted(FusedLayerNorm(3).state_dict()) == ["bias", "weight"]
    assert sorted(MixedFusedRMSNorm(3).state_dict()) == ["weight"]


# apex's signatures (apex/normalization/fused_layer_norm.py at e13873de).
APEX_SIGNATURES = {
    FusedLayerNorm.__init__: "(self, normalized_shape, eps=1e-05, elementwise_affine=True, "
                             "memory_efficient=False)",
    FusedRMSNorm.__init__: "(self, normalized_shape, eps=1e-05, elementwise_affine=True, "
                           "memory_efficient=False)",
    MixedFusedLayerNorm.__init__: "(self, normalized_shape, eps=1e-05, *, memory_efficient=False, "
                                  "**kwargs)",
    MixedFusedRMSNorm.__init__: "(self, normalized_shape, eps=1e-05, *, memory_efficient=False, "
                                "**kwargs)",
    fln.fused_layer_norm_affine: "(input, weight, bias, normalized_shape, eps=1e-06, "
                                 "memory_efficient=False)",
    fln.fused_layer_norm: "(input, normalized_shape, eps=1e-06, memory_efficient=False)",
    fln.mixed_dtype_fused_layer_norm_affine: "(input, weight, bias, normalized_shape, eps=1e-06, "
                                             "memory_efficient=False)",
    fln.fused_rms_norm_affine: "(input, weight, normalized_shape, eps=1e-06, "
                               "memory_efficient=False)",
    fln.fused_rms_norm: "(input, normalized_shape, eps=1e-06, memory_efficient=False)",
    fln.mixed_dtype_fused_rms_norm_affine: "(input, weight, normalized_shape, eps=1e-06, "
                                           "memory_efficient=False)",
    fln.manual_rms_norm: "(input, normalized_shape, weight, eps)",
    # apex's Functions are called as ``X.apply(...)``: its forward's arguments without ``ctx``.
    fln.FusedLayerNormAffineFunction.apply: "(input, weight, bias, normalized_shape, eps, "
                                            "memory_efficient=False)",
    fln.FusedLayerNormAffineMixedDtypesFunction.apply:
        "(input, weight, bias, normalized_shape, eps, memory_efficient=False)",
    fln.FusedLayerNormFunction.apply: "(input, normalized_shape, eps, memory_efficient=False)",
    fln.FusedRMSNormAffineFunction.apply: "(input, weight, normalized_shape, eps, "
                                          "memory_efficient=False)",
    fln.FusedRMSNormAffineMixedDtypesFunction.apply:
        "(input, weight, normalized_shape, eps, memory_efficient=False)",
    fln.FusedRMSNormFunction.apply: "(input, normalized_shape, eps, memory_efficient=False)",
}


@pytest.mark.parametrize("fn", list(APEX_SIGNATURES), ids=lambda f: f.__qualname__)
def test_apex_signatures(fn):
    assert str(inspect.signature(fn)) == APEX_SIGNATURES[fn]


@pytest.mark.parametrize("name", ["FusedLayerNormAffineFunction",
                                  "FusedLayerNormAffineMixedDtypesFunction",
                                  "FusedLayerNormFunction", "FusedRMSNormAffineFunction",
                                  "FusedRMSNormAffineMixedDtypesFunction", "FusedRMSNormFunction"])
def test_megatron_finds_memory_efficient_in_the_functions_forward(name):
    """Megatron-LM (core/fusions/fused_layer_norm.py) probes
    ``inspect.getfullargspec(FusedLayerNormAffineFunction.forward).args`` for
    ``memory_efficient`` before passing it to ``apply``."""
    function = getattr(fln, name)
    assert "memory_efficient" in inspect.getfullargspec(function.forward).args
    assert function.forward is function.apply


# ---- apex's tests/L0/run_fused_layer_norm/test_fused_layer_norm.py, on the CPU ---------------
# apex compared a CPU fp32 module with a CUDA module in ``dtype``; here both run on the CPU: the
# fp32 module is the reference. apex's batch sizes were 16 and 65536; 65536 is 17 here (odd).

def _apex_case(rms, batch_size, contiguous, elementwise_affine, mixed_fused, dtype,
               memory_efficient, fwd=None, bwd=None):
    normalized_shape = [32, 16]
    cls = {(False, False): FusedLayerNorm, (False, True): MixedFusedLayerNorm,
           (True, False): FusedRMSNorm, (True, True): MixedFusedRMSNorm}[(rms, mixed_fused)]
    kwargs = {"memory_efficient": memory_efficient}
    if not mixed_fused:
        kwargs["elementwise_affine"] = elementwise_affine
    module_ref = cls(normalized_shape=normalized_shape, **kwargs)
    module = cls(normalized_shape=normalized_shape, **kwargs).to(dtype=dtype)
    if contiguous:
        input_ = torch.randn([batch_size] + normalized_shape).requires_grad_(True)
        input_dt = input_.to(dtype).detach().requires_grad_(True)
    else:
        source = torch.randn([batch_size * 3, normalized_shape[0] * 5, normalized_shape[1] * 3])
        input_ = source[::3, ::5, ::3].detach().requires_grad_(True)
        input_dt = source.to(dtype)[::3, ::5, ::3].detach().requires_grad_(True)
        assert not input_.is_contiguous() and not input_dt.is_contiguous()
    out_ref = module_ref(input_)
    g = torch.rand_like(out_ref)
    out_ref.backward(g)
    out = module(input_dt)
    out.backward(g.to(dtype))
    fwd, bwd = fwd or {}, bwd or {}
    torch.testing.assert_close(out_ref.to(dtype), out, **fwd)
    torch.testing.assert_close(input_.grad.to(dtype), input_dt.grad, **bwd)
    if rms and elementwise_affine:
        torch.testing.assert_close(module_ref.weight.grad.to(dtype), module.weight.grad, **bwd)


BF16_FWD, BF16_BWD = dict(rtol=1.6e-2, atol=3e-4), dict(rtol=1.6e-2, atol=3e-3)
APEX_CASES = (
    # (rms, batch sizes, affine, mixed, dtype, fwd, bwd)
    [(False, (16, 17), False, False, torch.float, None, None),
     (False, (16, 17), True, False, torch.float, None, None),
     (False, (16, 17), True, True, torch.float, None, None),
     (False, (16,), True, False, torch.half, dict(rtol=1e-3, atol=1e-3),
      dict(rtol=1e-3, atol=1e-3)),
     (False, (16,), True, False, torch.bfloat16, BF16_FWD, BF16_BWD),
     (True, (16, 17), False, False, torch.float, None, None),
     (True, (16, 17), True, False, torch.float, None, dict(rtol=2e-3, atol=2e-4)),
     (True, (16, 17), True, True, torch.float, None, dict(rtol=2e-3, atol=2e-4)),
     (True, (16,), True, False, torch.half, None, dict(rtol=1.6e-2, atol=3e-3)),
     (True, (16,), True, False, torch.bfloat16, BF16_FWD, dict(rtol=1.6e-2, atol=3e-2))])


@pytest.mark.parametrize("rms,batch_size,contiguous,affine,mixed,dtype,fwd,bwd,memory_efficient", [
    (rms, batch, contiguous, affine, mixed, dtype, fwd, bwd, memory_efficient)
    for rms, batches, affine, mixed, dtype, fwd, bwd in APEX_CASES
    for batch, contiguous, memory_efficient in itertools.product(batches, (True, False),
                                                                 (True, False))])
def test_apex_fused_layer_norm_cases(rms, batch_size, contiguous, affine, mixed, dtype, fwd, bwd,
                                     memory_efficient):
    _apex_case(rms, batch_size, contiguous, affine, mixed, dtype, memory_efficient, fwd, bwd)


@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm], ids=lambda c: c.__name__)
def test_compiles_without_graph_breaks(cls):
    """apex's test_compile_fused_layer_norm/rms_norm on the CPU: the whole forward is one graph
    (fullgraph), with the results and gradients of the eager module (the "eager" backend keeps
    this test cheap: it checks the capture, not a compiler)."""
    eager = cls([32, 16])
    compiled = torch.compile(eager, fullgraph=True, backend="eager")
    x = torch.randn(16, 32, 16, requires_grad=True)
    y = x.detach().clone().requires_grad_()
    expected, actual = eager(x), compiled(y)
    torch.testing.assert_close(actual, expected)
    grad = torch.rand_like(expected)
    expected.backward(grad)
    actual.backward(grad)
    torch.testing.assert_close(y.grad, x.grad)
