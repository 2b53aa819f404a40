"""apex_lite.optimizers.FusedNovoGrad and FusedAdagrad, and their amp_C ops.

References: float64 runs written here from apex's kernels (csrc/multi_tensor_novograd.cu,
multi_tensor_adagrad.cu: the formulas as apex writes them, not the fused ops' order of roundings)
compared within F64_TOL after STEPS steps; torch.optim.Adagrad for FusedAdagrad's L2 mode.
Where the maths is the same operations on the same values (GradScaler with a power-of-two scale
against unscaled gradients, a state_dict round trip, amp's fused and unfused O2 steps, skipped
steps against no steps) results are compared bit for bit.
"""
from __future__ import annotations

import importlib.util
import inspect
import io
import math
import subprocess
import sys

import pytest
import torch

from apex_lite import amp
from apex_lite.apex_compat import multi_tensor as amp_C
from apex_lite.optimizers import FusedAdagrad, FusedNovoGrad, fusable
from test_fused_optimizers import (SHAPES, assert_bitwise, assert_params_close,
                                   assert_unchanged, backward_with_grads, copies, grads_for,
                                   make_params, set_grads, snapshot)

STEPS = 20
F64_TOL = dict(rtol=2e-5, atol=2e-5)


# ---- float64 references, as apex computes -------------------------------------------------------

class RefNovoGrad:
    """apex's FusedNovoGrad in float64 (its Python step and its CUDA kernel)."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, reg_inside_moment=False, grad_averaging=True, norm_type=2,
                 init_zero=False):
        self.params = [p.detach().double().clone() for p in params]
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = None
        self.o = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                      weight_decay=weight_decay, reg_inside_moment=reg_inside_moment,
                      grad_averaging=grad_averaging, norm_type=norm_type, init_zero=init_zero)
        self.step_count = 0

    def _norm(self, g):
        return float(g.abs().max()) if self.o["norm_type"] == 0 else float(g.norm())

    def step(self, grads):
        o = self.o
        beta1, beta2 = o["betas"]
        self.step_count += 1
        t = self.step_count
        grads = [g.double() for g in grads]
        norms = [self._norm(g) for g in grads]
        if self.v is None:
            self.v = [0.0] * len(grads) if o["init_zero"] else list(norms)
        for i, n in enumerate(norms):   # multi_tensor_norm_out_cuda's blend
            if o["norm_type"] == 0:
                self.v[i] = beta2 * self.v[i] + (1 - beta2) * n
            else:
                self.v[i] = math.sqrt(beta2 * self.v[i] ** 2 + (1 - beta2) * n ** 2)
        bc1 = 1 - beta1 ** t if o["bias_correction"] else 1.0
        bc2 = math.sqrt(1 - beta2 ** t) if o["bias_correction"] else 1.0
        beta3 = 1 - beta1 if o["grad_averaging"] else 1.0
        for i, g in enumerate(grads):
            p, denom = self.params[i], self.v[i] / bc2 + o["eps"]
            if o["reg_inside_moment"]:
                g = g / denom + o["weight_decay"] * p
                self.m[i] = beta1 * self.m[i] + beta3 * g
                self.params[i] = p - o["lr"] * (self.m[i] / bc1)
            else:
                self.m[i] = beta1 * self.m[i] + beta3 * g
                update = (self.m[i] / bc1) / denom + o["weight_decay"] * p
                self.params[i] = p - o["lr"] * update


class RefAdagrad:
    """apex's FusedAdagrad in float64."""

    def __init__(self, params, lr=1e-2, eps=1e-10, weight_decay=0.0, adagrad_w_mode=False):
        self.params = [p.detach().double().clone() for p in params]
        self.h = [torch.zeros_like(p) for p in self.params]
        self.o = dict(lr=lr, eps=eps, weight_decay=weight_decay, w=adagrad_w_mode)

    def step(self, grads):
        o = self.o
        for i, g in enumerate(grads):
            g, p = g.double(), self.params[i]
            if not o["w"]:
                g = g + o["weight_decay"] * p
            self.h[i] = self.h[i] + g * g
            update = g / (self.h[i].sqrt() + o["eps"])
            if o["w"]:
                update = update + o["weight_decay"] * p
            self.params[i] = p - o["lr"] * update


NOVOGRAD_CASES = {
    "default": dict(lr=1e-2),
    "inf-norm": dict(lr=1e-2, norm_type=0, weight_decay=1e-2),
    "init-zero": dict(lr=1e-2, init_zero=True, betas=(0.95, 0.98)),
    "reg-inside": dict(lr=1e-2, reg_inside_moment=True, weight_decay=1e-2),
    "no-averaging": dict(lr=1e-3, grad_averaging=False, weight_decay=1e-2),
    "no-bias-correction": dict(lr=1e-2, bias_correction=False, norm_type=0, init_zero=True,
                               reg_inside_moment=True),
}
ADAGRAD_CASES = {
    "default": dict(),
    "l2": dict(weight_decay=1e-2),
    "w-mode": dict(weight_decay=1e-2, adagrad_w_mode=True),
}


def _run(opt_params, opt, ref, steps=STEPS, shapes=None):
    shapes = shapes or [p.shape for p in opt_params]
    for step in range(steps):
        grads = grads_for(step, shapes)
        set_grads(opt_params, grads)
        opt.step()
        ref.step(grads)


@pytest.mark.parametrize("case", list(NOVOGRAD_CASES))
def test_novograd_matches_apex_float64_reference(case):
    params = make_params()
    ours = copies(params)
    ref = RefNovoGrad(params, **NOVOGRAD_CASES[case])
    opt = FusedNovoGrad(ours, **NOVOGRAD_CASES[case])
    _run(ours, opt, ref)
    assert_params_close(ours, ref.params, **F64_TOL)
    for p, v in zip(ours, ref.v):
        state = opt.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
        assert state["exp_avg_sq"].shape == () and float(state["step"]) == STEPS
        assert math.isclose(float(state["exp_avg_sq"]), v, rel_tol=1e-5)


@pytest.mark.parametrize("case", list(ADAGRAD_CASES))
def test_adagrad_matches_apex_float64_reference(case):
    params = make_params()
    ours = copies(params)
    ref = RefAdagrad(params, **ADAGRAD_CASES[case])
    opt = FusedAdagrad(ours, **ADAGRAD_CASES[case])
    _run(ours, opt, ref)
    assert_params_close(ours, ref.params, **F64_TOL)


@pytest.mark.parametrize("kwargs", [dict(lr=1e-2), dict(lr=1e-2, weight_decay=0.1),
                                    dict(lr=1e-2, initial_accumulator_value=0.5, eps=1e-6)])
def test_adagrad_matches_torch(kwargs):
    params = make_params()
    ours, theirs = copies(params), copies(params)
    opt = FusedAdagrad(ours, **kwargs)
    ref = torch.optim.Adagrad(theirs, **kwargs)
    shapes = [p.shape for p in params]
    for step in range(STEPS):
        grads = grads_for(step, shapes)
        set_grads(ours, grads)
        set_grads(theirs, grads)
        opt.step()
        ref.step()
    assert_params_close(ours, theirs, rtol=1e-5, atol=1e-5)
    for p, q in zip(ours, theirs):
        assert opt.state[p].keys() == ref.state[q].keys()
        assert torch.equal(opt.state[p]["step"], ref.state[q]["step"])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cls,kwargs", [(FusedNovoGrad, dict(lr=1e-2)),
                                        (FusedAdagrad, dict(lr=1e-2))], ids=["novograd",
                                                                             "adagrad"])
def test_half_params_keep_fp32_state_and_step_as_fp32_rounded_once(cls, kwargs, dtype):
    params = make_params(SHAPES[:3])
    half = copies(params, dtype)
    full = copies(half, torch.float32)
    half_opt, full_opt = cls(half, **kwargs), cls(full, **kwargs)
    shapes = [p.shape for p in params]
    for step in range(5):
        grads = [g.to(dtype).float() for g in grads_for(step, shapes)]
        set_grads(half, grads)
        set_grads(full, grads)
        half_opt.step()
        full_opt.step()
        with torch.no_grad():    # the fp32 run rounded as the half one is, once per step
            for p in full:
                p.copy_(p.to(dtype).float())
    for h, f in zip(half, full):   # the same values, stepped in fp32 and rounded once
        assert h.dtype == dtype
        assert torch.equal(h.float(), f.detach())
    for p in half:
        assert all(v.dtype == torch.float32 for v in half_opt.state[p].values())


# ---- construction -----------------------------------------------------------------------------

APEX_SIGNATURES = {
    FusedNovoGrad: "(self, params, lr=0.001, bias_correction=True, betas=(0.9, 0.999), eps=1e-08, "
                   "weight_decay=0.0, amsgrad=False, reg_inside_moment=False, grad_averaging=True, "
                   "norm_type=2, init_zero=False, set_grad_none=True)",
    FusedAdagrad: "(self, params, lr=0.01, eps=1e-10, weight_decay=0.0, set_grad_none=True, "
                  "adagrad_w_mode=False, *, initial_accumulator_value=0.0, lr_decay=0.0)",
}


@pytest.mark.parametrize("cls", list(APEX_SIGNATURES), ids=lambda c: c.__name__)
def test_constructor_signature_is_apex(cls):
    assert str(inspect.signature(cls.__init__)) == APEX_SIGNATURES[cls]


@pytest.mark.parametrize("make,error,match", [
    (lambda p: FusedNovoGrad(p, amsgrad=True), RuntimeError, "does not support the AMSGrad"),
    (lambda p: FusedNovoGrad(p, norm_type=1), ValueError, "norm_type=1"),
    (lambda p: FusedNovoGrad(p, lr=-1.0), ValueError, "Invalid learning rate"),
    (lambda p: FusedNovoGrad(p, betas=(1.0, 0.9)), ValueError, "Invalid beta parameter"),
    (lambda p: FusedAdagrad(p, lr_decay=0.1), ValueError, "lr_decay=0.1"),
    (lambda p: FusedAdagrad(p, eps=-1.0), ValueError, "Invalid epsilon"),
])
def test_refused_options(make, error, match):
    with pytest.raises(error, match=match):
        make([torch.nn.Parameter(torch.zeros(3))])


def test_a_bad_norm_type_in_a_group_is_refused_before_any_group_steps():
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = FusedNovoGrad([{"params": [a]}, {"params": [b]}], lr=0.1)
    opt.param_groups[1]["norm_type"] = 1
    a.grad, b.grad = torch.ones(3), torch.ones(3)
    with pytest.raises(ValueError, match="norm_type=1"):
        opt.step()
    assert torch.equal(a.detach(), torch.ones(3)) and not opt.state


# ---- state_dict -----------------------------------------------------------------------------

@pytest.mark.parametrize("cls,kwargs", [
    (FusedNovoGrad, dict(lr=1e-2, weight_decay=0.01)), (FusedNovoGrad, dict(norm_type=0)),
    (FusedAdagrad, dict(lr=0.1, weight_decay=0.1, adagrad_w_mode=True))],
    ids=["novograd", "novograd-inf", "adagrad"])
def test_state_dict_round_trip_resumes_bitwise(cls, kwargs):
    params = make_params()
    straight, resumed = copies(params), copies(params)
    opt = cls(straight, **kwargs)
    shapes = [p.shape for p in params]
    for step in range(10):
        set_grads(straight, grads_for(step, shapes))
        opt.step()
        if step == 4:
            buffer = io.BytesIO()
            torch.save({"params": [p.detach().clone() for p in straight],
                        "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    with torch.no_grad():
        for p, value in zip(resumed, saved["params"]):
            p.copy_(value)
    other = cls(resumed, **kwargs)
    other.load_state_dict(saved["optimizer"])
    for step in range(5, 10):
        set_grads(resumed, grads_for(step, shapes))
        other.step()
    assert_bitwise(resumed, straight)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("direction", ["ours_to_torch", "torch_to_ours"])
def test_adagrad_state_dict_loads_into_torch_and_back(direction, weight_decay):
    params = make_params()
    shapes = [p.shape for p in params]
    kwargs = dict(lr=1e-2, weight_decay=weight_decay)
    reference = copies(params)
    ref_opt = torch.optim.Adagrad(reference, **kwargs)
    makers = [lambda ps: FusedAdagrad(ps, **kwargs), lambda ps: torch.optim.Adagrad(ps, **kwargs)]
    make_first, make_second = makers if direction == "ours_to_torch" else makers[::-1]
    first = copies(params)
    opt = make_first(first)
    for step in range(10):
        grads = grads_for(step, shapes)
        set_grads(reference, grads)
        ref_opt.step()
        if step < 5:
            set_grads(first, grads)
            opt.step()
            if step == 4:
                second = copies(first)
                other = make_second(second)
                other.load_state_dict(opt.state_dict())
        else:
            set_grads(second, grads)
            other.step()
    assert_params_close(second, reference, rtol=1e-5, atol=1e-5)
    for p, q in zip(second, reference):
        assert other.state[p].keys() == ref_opt.state[q].keys()
        assert float(other.state[p]["step"]) == 10


def test_loading_an_adagrad_state_with_lr_decay_is_refused():
    theirs = torch.optim.Adagrad([torch.nn.Parameter(torch.ones(3))], lr_decay=0.01)
    ours = FusedAdagrad([torch.nn.Parameter(torch.ones(3))])
    with pytest.raises(ValueError, match="param group 0: lr_decay=0.01"):
        ours.load_state_dict(theirs.state_dict())


def test_apex_adagrad_state_without_step_counts_from_zero():
    p = torch.nn.Parameter(torch.ones(3))
    opt = FusedAdagrad([p], lr=0.1)
    opt.state[p]["sum"] = torch.full((3,), 2.0)
    p.grad = torch.ones(3)
    opt.step()
    assert float(opt.state[p]["step"]) == 1.0 and torch.equal(opt.state[p]["sum"],
                                                               torch.full((3,), 3.0))


# ---- GradScaler, skipped steps ------------------------------------------------------------------

CASES = {
    "novograd": lambda ps: FusedNovoGrad(ps, lr=1e-2, weight_decay=1e-2),
    "novograd-inf": lambda ps: FusedNovoGrad(ps, lr=1e-2, norm_type=0, reg_inside_moment=True),
    "adagrad": lambda ps: FusedAdagrad(ps, lr=1e-2, weight_decay=1e-2),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grad_scaler_hands_scale_and_found_inf_to_the_op(case, dtype):
    """Power-of-two scale: the scaled run equals the plain one bit for bit; a step with an inf
    (first, middle or last element) changes nothing and halves the scale."""
    make = CASES[case]
    params = make_params(SHAPES[:3], dtype)
    scaled, plain = copies(params), copies(params)
    scaled_opt, plain_opt = make(scaled), make(plain)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    shapes = [p.shape for p in params]
    inject = {0: 0, 3: "middle", 5: -1}
    for step in range(8):
        grads = [g.to(dtype).float() for g in grads_for(step, shapes, scale=0.1)]
        scaled_opt.zero_grad()
        backward_with_grads(scaled, grads, scaler)
        if step in inject:
            flat = scaled[1].grad.view(-1)
            index = flat.numel() // 2 if inject[step] == "middle" else inject[step]
            with torch.no_grad():
                flat[index] = float("inf")
            before = snapshot(scaled_opt, scaled)
            scale_before = scaler.get_scale()
        scaler.step(scaled_opt)
        scaler.update()
        if step in inject:
            assert_unchanged(scaled_opt, scaled, before)
            assert scaler.get_scale() == scale_before / 2
            continue
        plain_opt.zero_grad()
        backward_with_grads(plain, grads)
        plain_opt.step()
        assert_bitwise(scaled, plain)


@pytest.mark.parametrize("case", list(CASES))
def test_skipped_first_steps_equal_no_steps(case):
    """A skipped first step leaves NovoGrad's next step a first one (its norm initialised)."""
    params = make_params(SHAPES[:2])
    skipping, plain = copies(params), copies(params)
    skipping_opt, plain_opt = CASES[case](skipping), CASES[case](plain)
    shapes = [p.shape for p in params]
    for step in range(5):
        grads = grads_for(step, shapes)
        set_grads(skipping, grads)
        skipping_opt.found_inf = torch.ones(()) if step in (0, 1) else torch.zeros(())
        skipping_opt.step()
        del skipping_opt.found_inf
        if step in (0, 1):
            continue
        set_grads(plain, grads)
        plain_opt.step()
        assert_bitwise(skipping, plain)


# ---- amp --------------------------------------------------------------------------------------

def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _train(case, opt_level, fused_step=None, steps=6, inject_at=()):
    amp.default_handle().__init__()
    model = _net()
    opt = CASES[case](model.parameters())
    model, opt = amp.initialize(model, opt, opt_level=opt_level, fused_step=fused_step,
                                verbosity=0)
    losses = []
    for i in range(steps):
        g = torch.Generator().manual_seed(100 + i)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        losses.append(float(loss.detach()))
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
            if i in inject_at:
                next(model.parameters()).grad.view(-1)[0] = float("inf")
        opt.step()
    return model, opt, losses


@pytest.mark.parametrize("case", list(CASES))
def test_fusable_and_the_o2_fused_step_equals_the_unfused_one(case):
    opt = CASES[case]([torch.nn.Parameter(torch.ones(2))])
    assert fusable.unfused_reason(opt) == ""
    _, fused_opt, _ = _train(case, "O2", fused_step=True, inject_at={2})
    assert fused_opt._apex_lite_amp.path.fused
    assert "fused step" in str(amp.report())
    fused = [p.detach().clone() for p in fused_opt._apex_lite_amp.masters()]
    fused_state = fused_opt.state_dict()["state"]
    # Without native kernels Adagrad's fused step runs on torch's _fused_adagrad_ (the
    # optimizer's own step on the Python reference): the same update to fp32 rounding.
    torch_kernels = "torch's fused kernels" in fused_opt._apex_lite_amp.path.describe()
    _, plain_opt, _ = _train(case, "O2", fused_step=False, inject_at={2})
    assert not plain_opt._apex_lite_amp.path.fused
    plain_state = plain_opt.state_dict()["state"]
    if torch_kernels:
        assert case == "adagrad"
        for a, b in zip(fused, plain_opt._apex_lite_amp.masters()):
            torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)
    else:
        assert_bitwise(fused, list(plain_opt._apex_lite_amp.masters()))
    for key, entry in fused_state.items():
        for k, value in entry.items():
            if torch_kernels and k != "step":
                torch.testing.assert_close(value, plain_state[key][k], rtol=1e-5, atol=1e-7)
            else:
                assert torch.equal(value, plain_state[key][k]), k
    assert amp.loss_scalers()[0].skipped_steps == 1


@pytest.mark.parametrize("case", list(CASES))
def test_o1_trains_and_skips_an_overflowing_step(case):
    model, opt, losses = _train(case, "O1", steps=8, inject_at={3})
    assert not opt._apex_lite_amp.path.fused
    assert losses[-1] < losses[0]
    assert amp.loss_scalers()[0].skipped_steps == 1
    steps = {float(s["step"]) for s in opt.state_dict()["state"].values()}
    assert steps == {7.0}


# ---- amp_C ------------------------------------------------------------------------------------

def _apex_novograd_step(params, exp_avgs, norms, group, step):
    """What apex's FusedNovoGrad.step does with amp_C, for one fp32 group."""
    grads = [p.grad for p in params]
    if norms is None:
        if group["init_zero"]:
            norms = torch.zeros(len(grads))
        elif group["norm_type"] == 0:
            norms = torch.tensor([float(g.abs().max()) for g in grads])
        else:
            norms = torch.tensor([float(g.pow(2).sum().sqrt()) for g in grads])
    beta1, beta2 = group["betas"]
    amp_C.multi_tensor_applier(amp_C.multi_tensor_novograd, torch.zeros(1, dtype=torch.int),
                               [grads, [p.data for p in params], exp_avgs], norms, group["lr"],
                               beta1, beta2, group["eps"], step, 1, group["weight_decay"], 1,
                               0 if group["reg_inside_moment"] else 1, group["norm_type"])
    return norms


AMP_C_NOVOGRAD = {
    "l2": CASES["novograd"], "inf": CASES["novograd-inf"],
    "init-zero": lambda ps: FusedNovoGrad(ps, lr=1e-2, init_zero=True, betas=(0.9, 0.5)),
}


@pytest.mark.parametrize("case", list(AMP_C_NOVOGRAD))
def test_amp_c_novograd_steps_as_fused_novograd(case):
    params = make_params()
    ours, theirs = copies(params), copies(params)
    opt = AMP_C_NOVOGRAD[case](ours)
    group = opt.param_groups[0]
    exp_avgs = [torch.zeros_like(p) for p in theirs]
    norms = None
    shapes = [p.shape for p in params]
    for step in range(1, 6):
        grads = grads_for(step, shapes)
        set_grads(ours, grads)
        set_grads(theirs, grads)
        opt.step()
        with torch.no_grad():
            norms = _apex_novograd_step(theirs, exp_avgs, norms, group, step)
    assert_params_close(theirs, ours, rtol=1e-5, atol=1e-6)
    for i, p in enumerate(ours):
        assert math.isclose(float(norms[i]), float(opt.state[p]["exp_avg_sq"]), rel_tol=1e-5)


@pytest.mark.parametrize("mode", [0, 1])
def test_amp_c_adagrad_steps_as_fused_adagrad(mode):
    params = make_params()
    ours, theirs = copies(params), copies(params)
    opt = FusedAdagrad(ours, lr=1e-2, weight_decay=1e-2, adagrad_w_mode=bool(mode))
    sums = [torch.zeros_like(p, dtype=torch.float16) for p in theirs]   # half state is staged
    shapes = [p.shape for p in params]
    for step in range(5):
        grads = grads_for(step, shapes)
        set_grads(ours, grads)
        opt.step()
        with torch.no_grad():
            amp_C.multi_tensor_applier(amp_C.multi_tensor_adagrad, torch.zeros(1, dtype=torch.int),
                                       [grads, theirs, sums], 1e-2, 1e-10, mode, 1e-2)
    assert_params_close(theirs, ours, rtol=1e-2, atol=1e-3)
    assert all(s.dtype == torch.float16 for s in sums)


def test_amp_c_refuses_what_does_not_map():
    p = [torch.zeros(3)]
    flag = torch.zeros(1, dtype=torch.int)
    with pytest.raises(ValueError, match="moment_mode=2"):
        amp_C.multi_tensor_novograd(0, flag, [p, p, p], torch.zeros(1), 0.1, 0.9, 0.9, 1e-8, 1,
                                    1, 0.0, 1, 2, 2)
    with pytest.raises(TypeError, match="grad_norms must be a floating tensor"):
        amp_C.multi_tensor_novograd(0, flag, [p, p, p], torch.zeros(2), 0.1, 0.9, 0.9, 1e-8, 1,
                                    1, 0.0, 1, 1, 2)
    with pytest.raises(ValueError, match="mode=3"):
        amp_C.multi_tensor_adagrad(0, flag, [p, p, p], 0.1, 1e-8, 3, 0.0)
    assert {"multi_tensor_novograd", "multi_tensor_adagrad"} <= set(amp_C.AMP_C_OPS)


# ---- the one-line import of timm and others, through the alias -----------------------------------

@pytest.mark.skipif(importlib.util.find_spec("apex") is not None,
                    reason="a package named apex is installed here, and the alias refuses to "
                           "shadow it")
def test_the_one_line_import_through_the_alias():
    code = ("import apex_lite; apex_lite.install_apex_alias()\n"
            "from apex.optimizers import FusedNovoGrad, FusedAdam, FusedLAMB, FusedSGD\n"
            "from apex.optimizers import FusedAdagrad\n"
            "import apex_lite.optimizers as o\n"
            "assert (FusedNovoGrad, FusedAdagrad) == (o.FusedNovoGrad, o.FusedAdagrad)\n"
            "import amp_C\n"
            "assert amp_C.multi_tensor_novograd and amp_C.multi_tensor_adagrad\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 0, result.stderr
