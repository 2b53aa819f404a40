"""apex_lite.optimizers: FusedSGD, FusedAdam, FusedLAMB and the per-device updates amp reuses.

References: torch.optim.SGD / Adam / AdamW on fp32 parameters (compared within FP32_TOL after
STEPS steps: the fused ops compute the same update with another order of fp32 roundings), and
float64 references written here for what torch has not (SGD's wd_after_momentum, Adam without
bias correction, apex's LAMB), compared within F64_TOL. Half parameters are compared with a
torch run on fp32 parameters rounded to the half dtype after every step (the same arithmetic
with one rounding per step), within HALF_ULPS units in the last place. Where the maths is the
same operations on the same values (GradScaler with a power-of-two scale against unscaled
gradients, a state_dict round trip, amp's form of the update against the plain one), results
are compared bit for bit.

The tests run on the backend the run selects (APEX_LITE_DISABLE_EXT=1: Python; otherwise the
native kernels when built); ``test_backends_agree`` compares the two where both are present.
Ported from apex's tests/L0/run_optimizers (test_adam.py, test_fused_optimizer.py, test_lamb.py,
test_zero_grad_configuration.py) to the CPU: see the ``apex_`` tests.
"""
from __future__ import annotations

import copy
import inspect
import io
import math
import os
import pickle
import re

import pytest
import torch
import torch.utils._python_dispatch
from torch.optim.optimizer import required

import apex_lite.optimizers._optimizer as optimizer_module
import apex_lite.optimizers.update as update_module
from apex_lite.multi_tensor import _backend, _torch_fused
from apex_lite.optimizers import (AdamHyper, AdamUpdate, FusedAdagrad, FusedAdam, FusedLAMB,
                                  FusedNovoGrad, FusedSGD, FusedUpdate, SGDHyper, SGDUpdate,
                                  unit_scalars)
from apex_lite.optimizers import fusable

STEPS = 50
CHUNK = 65536                      # the kernels' chunk of elements: a shape crosses it
SHAPES = [(33, 17), (555,), (1,), (CHUNK + 1,)]
# fp32 against torch, and against float64, after STEPS steps on parameters of magnitude up to
# ~4.5. Measured worst absolute differences (Python backend): AdamW 4.3e-6 (about 9 fp32 ulps
# there), SGD with momentum 2.9e-6; against float64 Adam 1.8e-6, LAMB 2.8e-6.
FP32_TOL = dict(rtol=1e-5, atol=1e-5)
F64_TOL = dict(rtol=1e-5, atol=1e-5)
HALF_ULPS = 2
HALF_DTYPES = [torch.float16, torch.bfloat16]


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


# ---- helpers ---------------------------------------------------------------------------------

def make_params(shapes=SHAPES, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(dtype).requires_grad_() for shape in shapes]


def copies(params, dtype=None):
    return [p.detach().clone().to(dtype or p.dtype).requires_grad_() for p in params]


def grads_for(step: int, shapes, scale=1.0):
    """The fp32 gradients of step ``step`` (deterministic)."""
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(shape, generator=gen) * scale for shape in shapes]


def set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.to(p.dtype).clone()


def assert_params_close(actual, expected, **tol):
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a.detach().double(), e.detach().double(), **tol)


def assert_bitwise(actual, expected):
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype
        assert torch.equal(a.detach(), e.detach()), (a, e)


def snapshot(optimizer, params):
    """Copies of the parameters and of every state tensor, to check that nothing changed."""
    state = {i: {k: v.clone() if isinstance(v, torch.Tensor) else v
                 for k, v in optimizer.state.get(p, {}).items()} for i, p in enumerate(params)}
    return [p.detach().clone() for p in params], state


def assert_unchanged(optimizer, params, before):
    params_before, state_before = before
    assert_bitwise(params, params_before)
    for i, p in enumerate(params):
        now = optimizer.state.get(p, {})
        if not state_before[i]:
            # a first step may create its state before it is skipped: all zeros (step 0 too)
            # is the same as none
            assert all(not value.any() for value in now.values()), now
            continue
        assert now.keys() == state_before[i].keys()
        for k, v in state_before[i].items():
            assert torch.equal(now[k], v), k


def half_tolerance(dtype):
    """HALF_ULPS units in the last place of ``dtype``, relative."""
    return dict(rtol=HALF_ULPS * torch.finfo(dtype).eps, atol=HALF_ULPS * torch.finfo(dtype).tiny)


# ---- float64 references (what torch has not) ---------------------------------------------------

class RefSGD:
    """SGD in float64 as apex's FusedSGD computes it, with ``wd_after_momentum``."""

    def __init__(self, params, lr, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, wd_after_momentum=False):
        self.params = [p.detach().double().clone() for p in params]
        self.h = dict(lr=lr, momentum=momentum, dampening=dampening, wd=weight_decay,
                      nesterov=nesterov, after=wd_after_momentum)
        self.bufs = [None] * len(params)

    def step(self, grads):
        h = self.h
        for i, (p, g) in enumerate(zip(self.params, grads)):
            g = g.double()
            if h["wd"] and not h["after"]:
                g = g + h["wd"] * p
            if h["momentum"]:
                if self.bufs[i] is None:
                    self.bufs[i] = g.clone()
                else:
                    self.bufs[i] = h["momentum"] * self.bufs[i] + (1 - h["dampening"]) * g
                g = g + h["momentum"] * self.bufs[i] if h["nesterov"] else self.bufs[i]
            if h["wd"] and h["after"]:
                g = g + h["wd"] * p
            p -= h["lr"] * g


class RefLAMB:
    """apex's FusedLAMB in float64 (and Adam, which it is without clipping and trust ratio):
    one global gradient norm over every group, clipped by ``max_grad_norm``; per tensor the
    trust ratio ||p|| / ||update|| for groups with weight decay or with ``use_nvlamb``."""

    def __init__(self, groups, lamb=True):
        self.groups = [dict(g, params=[p.detach().double().clone() for p in g["params"]])
                       for g in groups]
        self.lamb = lamb
        self.state = {}

    def step(self, grads_per_group):
        present = [g.double() for grads in grads_per_group for g in grads if g is not None]
        norm = math.sqrt(sum(float((g * g).sum()) for g in present))
        for gi, (group, grads) in enumerate(zip(self.groups, grads_per_group)):
            b1, b2 = group["betas"]
            wd = group["weight_decay"]
            max_norm = group.get("max_grad_norm", 0.0)
            clip = norm / max_norm if self.lamb and max_norm > 0 and norm > max_norm else 1.0
            beta3 = (1 - b1) if group.get("grad_averaging", True) else 1.0
            for pi, (p, g) in enumerate(zip(group["params"], grads)):
                if g is None:
                    continue
                g = g.double() / clip
                m, v, t = self.state.get((gi, pi), (torch.zeros_like(p), torch.zeros_like(p), 0))
                t += 1
                if wd and not group["adam_w_mode"]:
                    g = g + wd * p
                m = b1 * m + beta3 * g
                v = b2 * v + (1 - b2) * g * g
                bc1, bc2 = ((1 - b1 ** t), (1 - b2 ** t)) if group["bias_correction"] else (1, 1)
                update = (m / bc1) / ((v / bc2).sqrt() + group["eps"])
                if wd and group["adam_w_mode"]:
                    update = update + wd * p
                ratio = 1.0
                if self.lamb and (wd or group.get("use_nvlamb", False)):
                    pn, un = float(p.norm()), float(update.norm())
                    if pn and un:
                        ratio = pn / un
                p -= group["lr"] * ratio * update
                self.state[(gi, pi)] = (m, v, t)

    def params(self, gi=0):
        return self.groups[gi]["params"]


# ---- constructor signatures and refused options -------------------------------------------------

P = inspect.Parameter
APEX_SIGNATURES = {
    FusedAdam: [("lr", 1e-3), ("bias_correction", True), ("betas", (0.9, 0.999)), ("eps", 1e-8),
                ("adam_w_mode", True), ("weight_decay", 0.), ("amsgrad", False),
                ("set_grad_none", True), ("capturable", False, P.KEYWORD_ONLY),
                ("master_weights", False, P.KEYWORD_ONLY)],
    FusedSGD: [("lr", required), ("momentum", 0.), ("dampening", 0.), ("weight_decay", 0.),
               ("nesterov", False), ("wd_after_momentum", False),
               ("materialize_master_grads", True), ("set_grad_none", False)],
    FusedLAMB: [("lr", 1e-3), ("bias_correction", True), ("betas", (0.9, 0.999)), ("eps", 1e-6),
                ("weight_decay", 0.01), ("amsgrad", False), ("adam_w_mode", True),
                ("grad_averaging", True), ("set_grad_none", True), ("max_grad_norm", 1.0),
                ("use_nvlamb", False)],
}


@pytest.mark.parametrize("cls", list(APEX_SIGNATURES), ids=lambda c: c.__name__)
def test_constructor_signature_is_apex(cls):
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    assert params[0].name == "params" and params[0].default is P.empty
    got = [(p.name, p.default, p.kind) for p in params[1:]]
    want = [(name, default, rest[0] if rest else P.POSITIONAL_OR_KEYWORD)
            for name, default, *rest in APEX_SIGNATURES[cls]]
    assert got == want


@pytest.mark.parametrize("make,error,match", [
    (lambda p: FusedAdam(p, amsgrad=True), RuntimeError, r"AMSGrad.*torch\.optim\.Adam"),
    (lambda p: FusedAdam(p, capturable=True), RuntimeError, r"capturable.*fused=True"),
    (lambda p: FusedAdam(p, master_weights=True), RuntimeError, r"master_weights.*O2"),
    (lambda p: FusedLAMB(p, amsgrad=True), RuntimeError, r"AMSGrad"),
    (lambda p: FusedAdam(p, lr=-1e-3), ValueError, r"Invalid learning rate: -0\.001"),
    (lambda p: FusedAdam(p, eps=-1.0), ValueError, r"Invalid epsilon value"),
    (lambda p: FusedAdam(p, betas=(1.0, 0.9)), ValueError, r"beta parameter at index 0"),
    (lambda p: FusedAdam(p, betas=(0.9, -0.1)), ValueError, r"beta parameter at index 1"),
    (lambda p: FusedAdam(p, weight_decay=-1.0), ValueError, r"Invalid weight_decay value"),
    (lambda p: FusedAdam(p, lr=torch.tensor(1e-3)), TypeError, r"lr must be a Python number"),
    (lambda p: FusedLAMB(p, lr=-1.0), ValueError, r"Invalid learning rate"),
    (lambda p: FusedLAMB(p, betas=(0.9, 1.0)), ValueError, r"beta parameter at index 1"),
    (lambda p: FusedLAMB(p, max_grad_norm=-1.0), ValueError, r"max_grad_norm"),
    (lambda p: FusedSGD(p, lr=-0.1), ValueError, r"Invalid learning rate"),
    (lambda p: FusedSGD(p, lr=0.1, momentum=-0.5), ValueError, r"Invalid momentum value"),
    (lambda p: FusedSGD(p, lr=0.1, weight_decay=-0.5), ValueError, r"Invalid weight_decay"),
    (lambda p: FusedSGD(p, lr=0.1, nesterov=True), ValueError, r"Nesterov momentum requires"),
    (lambda p: FusedSGD(p, lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), ValueError,
     r"Nesterov momentum requires"),
    (lambda p: FusedSGD(p), ValueError, r"required optimization parameter lr"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_refused_options_and_invalid_hyper_parameters(make, error, match):
    with pytest.raises(error, match=match):
        make(make_params([(3,)]))


def test_sgd_takes_lr_per_group_without_a_default():
    """apex code builds FusedSGD(groups_with_their_own_lr, momentum=...) without lr."""
    a, b = make_params([(4,)]), make_params([(5,)], seed=1)
    opt = FusedSGD([{"params": a, "lr": 0.25}, {"params": b, "lr": 0.5}], momentum=0.125)
    assert [g["lr"] for g in opt.param_groups] == [0.25, 0.5]


@pytest.mark.parametrize("cls", [FusedSGD, FusedAdam, FusedLAMB], ids=lambda c: c.__name__)
@pytest.mark.parametrize("param,error,match", [
    (lambda: torch.zeros(3, dtype=torch.complex64, requires_grad=True), TypeError,
     r"complex.*view_as_real"),
    (lambda: torch.zeros(3, dtype=torch.float64, requires_grad=True), TypeError,
     r"torch\.float64.*float32, float16 and bfloat16"),
], ids=["complex", "float64"])
def test_refused_parameters(cls, param, error, match):
    with pytest.raises(error, match=match):
        cls([param()], lr=0.1)


def test_a_parameter_listed_twice_in_a_group_is_refused():
    p = make_params([(3,)])[0]
    with pytest.raises(ValueError, match="appears twice"):
        FusedAdam([p, p])


@pytest.mark.parametrize("cls", [FusedAdam, FusedLAMB, FusedNovoGrad, FusedAdagrad],
                         ids=lambda c: c.__name__)
def test_a_step_count_shared_by_two_parameters_is_refused(cls):
    """One step tensor in two parameters' state (issue 33) would advance once per parameter and
    give them bias corrections that depend on the order they are stepped in: refused, naming the
    fix, before anything changes."""
    params = make_params()
    optimizer = cls(params, lr=1e-3)
    set_grads(params, grads_for(0, SHAPES))
    optimizer.step()
    optimizer.state[params[2]]["step"] = optimizer.state[params[0]]["step"]
    before = snapshot(optimizer, params)
    set_grads(params, grads_for(1, SHAPES))
    with pytest.raises(ValueError, match=r"steps\[2\] shares its memory with steps\[0\]: each "
                                         r"parameter needs a step count of its own.*clone\(\)"):
        optimizer.step()
    assert_unchanged(optimizer, params, before)


@pytest.mark.parametrize("cls,kwargs,alternative", [
    (FusedAdam, {}, "SparseAdam"), (FusedSGD, {"lr": 0.1}, "SGD"), (FusedLAMB, {}, "SparseAdam"),
])
def test_sparse_gradient_names_the_fix(cls, kwargs, alternative):
    embedding = torch.nn.Embedding(10, 3, sparse=True)
    opt = cls(embedding.parameters(), **kwargs)
    embedding(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match=rf"sparse_coo gradient.*dense.*{alternative}"):
        opt.step()


# ---- results against torch (fp32) --------------------------------------------------------------

ADAM_CASES = {
    "adam": (dict(adam_w_mode=False), torch.optim.Adam, {}),
    "adam_l2": (dict(adam_w_mode=False, weight_decay=0.1), torch.optim.Adam,
                dict(weight_decay=0.1)),
    "adamw": (dict(weight_decay=0.1), torch.optim.AdamW, dict(weight_decay=0.1)),
    "adamw_no_decay": ({}, torch.optim.AdamW, dict(weight_decay=0.0)),
    # apex's test_adam_option
    "adamw_options": (dict(lr=0.01, betas=(0.6, 0.9), eps=3e-6, weight_decay=0.0),
                      torch.optim.AdamW, dict(lr=0.01, betas=(0.6, 0.9), eps=3e-6,
                                              weight_decay=0.0)),
}
SGD_CASES = {
    "plain": dict(lr=0.05),
    "weight_decay": dict(lr=0.05, weight_decay=0.01),
    "momentum": dict(lr=0.05, momentum=0.9),
    "dampening": dict(lr=0.05, momentum=0.9, dampening=0.3),
    "nesterov": dict(lr=0.05, momentum=0.9, nesterov=True),
    "momentum_weight_decay": dict(lr=0.05, momentum=0.9, weight_decay=0.01),
    "nesterov_weight_decay": dict(lr=0.05, momentum=0.5, nesterov=True, weight_decay=0.1),
    "dampening_weight_decay": dict(lr=0.05, momentum=0.5, dampening=0.5, weight_decay=0.1),
}


def run_pair(ours, theirs, ours_params, their_params, steps=STEPS, shapes=None):
    shapes = shapes or [p.shape for p in ours_params]
    for step in range(steps):
        grads = grads_for(step, shapes)
        set_grads(ours_params, grads)
        set_grads(their_params, grads)
        ours.step()
        theirs.step()


@pytest.mark.parametrize("case", list(ADAM_CASES))
def test_adam_matches_torch(case):
    ours_kwargs, torch_cls, torch_kwargs = ADAM_CASES[case]
    params = make_params()
    ours_params, their_params = copies(params), copies(params)
    ours = FusedAdam(ours_params, **dict(dict(lr=1e-2), **ours_kwargs))
    theirs = torch_cls(their_params, **dict(dict(lr=1e-2), **torch_kwargs))
    run_pair(ours, theirs, ours_params, their_params)
    assert_params_close(ours_params, their_params, **FP32_TOL)
    for p, q in zip(ours_params, their_params):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours.state[p][key], theirs.state[q][key], **FP32_TOL)
        assert float(ours.state[p]["step"]) == float(theirs.state[q]["step"]) == STEPS


@pytest.mark.parametrize("case", list(SGD_CASES))
def test_sgd_matches_torch(case):
    kwargs = SGD_CASES[case]
    params = make_params()
    ours_params, their_params = copies(params), copies(params)
    ours, theirs = FusedSGD(ours_params, **kwargs), torch.optim.SGD(their_params, **kwargs)
    run_pair(ours, theirs, ours_params, their_params)
    assert_params_close(ours_params, their_params, **FP32_TOL)
    for p, q in zip(ours_params, their_params):
        if kwargs.get("momentum"):
            torch.testing.assert_close(ours.state[p]["momentum_buffer"],
                                       theirs.state[q]["momentum_buffer"], **FP32_TOL)
        else:
            assert "momentum_buffer" not in ours.state.get(p, {})


@pytest.mark.parametrize("kwargs", [
    dict(lr=0.05, momentum=0.9, weight_decay=0.01, wd_after_momentum=True),
    dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.1, wd_after_momentum=True),
    dict(lr=0.05, momentum=0.5, nesterov=True, weight_decay=0.1, wd_after_momentum=True),
    dict(lr=0.05, weight_decay=0.1, wd_after_momentum=True),
    dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.1),
], ids=["momentum", "dampening", "nesterov", "no_momentum", "wd_before_dampening"])
def test_sgd_matches_float64_reference(kwargs):
    params = make_params()
    ours_params = copies(params)
    ours, ref = FusedSGD(ours_params, **kwargs), RefSGD(params, **kwargs)
    for step in range(STEPS):
        grads = grads_for(step, [p.shape for p in params])
        set_grads(ours_params, grads)
        ours.step()
        ref.step(grads)
    assert_params_close(ours_params, ref.params, **F64_TOL)


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_adam_matches_float64_reference(bias_correction, adam_w_mode):
    params = make_params()
    ours_params = copies(params)
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05,
                 bias_correction=bias_correction, adam_w_mode=adam_w_mode)
    ours = FusedAdam(ours_params, **hyper)
    ref = RefLAMB([dict(hyper, params=params)], lamb=False)
    for step in range(STEPS):
        grads = grads_for(step, [p.shape for p in params])
        set_grads(ours_params, grads)
        ours.step()
        ref.step([grads])
    assert_params_close(ours_params, ref.params(), **F64_TOL)


# ---- LAMB against apex's, in float64 -------------------------------------------------------------

LAMB_CASES = {
    # max_grad_norm 1 clips (the gradients' global norm is ~260); 1e4 does not; 0 turns it off
    "default": {},
    "no_clip": dict(max_grad_norm=1e4),
    "clip_off": dict(max_grad_norm=0.0),
    "l2_mode": dict(adam_w_mode=False),
    "no_grad_averaging": dict(grad_averaging=False),
    "nvlamb": dict(use_nvlamb=True),
    "no_bias_correction": dict(bias_correction=False),
    # apex's test_lamb_option
    "options": dict(lr=0.01, betas=(0.6, 0.9), eps=3e-6, use_nvlamb=True),
}


@pytest.mark.parametrize("case", list(LAMB_CASES))
def test_lamb_matches_float64_reference(case):
    """Two groups, one with weight decay 0 (no trust ratio unless use_nvlamb) and one with its
    own lr, share one global gradient norm."""
    kwargs = dict(dict(lr=1e-2), **LAMB_CASES[case])
    first, second = make_params(SHAPES[:2]), make_params(SHAPES[2:], seed=1)
    ours_groups = [{"params": copies(first), "weight_decay": 0.0},
                   {"params": copies(second), "lr": kwargs["lr"] / 2}]
    ours = FusedLAMB(ours_groups, **kwargs)
    ref = RefLAMB([dict(ours.param_groups[0], params=first),
                   dict(ours.param_groups[1], params=second)])
    for step in range(STEPS):
        grads = grads_for(step, [p.shape for p in first + second])
        set_grads(ours_groups[0]["params"] + ours_groups[1]["params"], grads)
        ours.step()
        ref.step([grads[:2], grads[2:]])
    for gi in range(2):
        assert_params_close(ours.param_groups[gi]["params"], ref.params(gi), **F64_TOL)


def test_lamb_global_norm_spans_groups_dtypes_and_skips_missing_grads():
    """The clip uses the norm of every gradient the step applies (fp32, bf16 and fp16 ones in
    two groups), and only of those: a parameter without a gradient adds nothing."""
    shapes = [(40,), (30,), (20,), (10,)]
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float32]
    params = [p.to(d).detach().requires_grad_() for p, d in zip(make_params(shapes), dtypes)]
    ours = FusedLAMB([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2)
    grads = grads_for(0, shapes)
    grads[3] = None
    set_grads(params, grads)
    ref = RefLAMB([dict(ours.param_groups[0], params=params[:2]),
                   dict(ours.param_groups[1], params=params[2:])])
    half_grads = [None if g is None else g.to(p.dtype).double() for g, p in zip(grads, params)]
    ref.step([half_grads[:2], half_grads[2:]])
    ours.step()
    for p, r in zip(params, ref.params(0) + ref.params(1)):
        torch.testing.assert_close(p.double(), r.to(p.dtype).double(), **half_tolerance(p.dtype))
    assert params[3] not in ours.state


# ---- half parameters, mixed dtypes -----------------------------------------------------------------

def run_against_rounded_torch(make_ours, torch_cls, torch_kwargs, dtypes):
    """Our optimizer on parameters of ``dtypes`` against torch on fp32 parameters rounded to the
    same dtypes after every step."""
    shapes = [(33, 17), (555,), (64,)][:len(dtypes)]
    params = [p.to(d).detach().requires_grad_() for p, d in zip(make_params(shapes), dtypes)]
    theirs_params = copies(params, torch.float32)
    ours = make_ours(params)
    theirs = torch_cls(theirs_params, **torch_kwargs)
    for step in range(STEPS):
        grads = [g.to(d) for g, d in zip(grads_for(step, shapes), dtypes)]
        set_grads(params, grads)
        set_grads(theirs_params, grads)
        ours.step()
        theirs.step()
        with torch.no_grad():
            for q, d in zip(theirs_params, dtypes):
                q.copy_(q.to(d))
    for p, q in zip(params, theirs_params):
        assert p.dtype in dtypes
        torch.testing.assert_close(p.double(), q.to(p.dtype).double(),
                                   **half_tolerance(p.dtype) if p.dtype != torch.float32
                                   else FP32_TOL)
    return ours, params


HALF_CASES = {
    "adamw": (lambda ps: FusedAdam(ps, lr=1e-3, weight_decay=0.1), torch.optim.AdamW,
              dict(lr=1e-3, weight_decay=0.1)),
    "sgd_momentum": (lambda ps: FusedSGD(ps, lr=0.01, momentum=0.9), torch.optim.SGD,
                     dict(lr=0.01, momentum=0.9)),
}


@pytest.mark.parametrize("case", list(HALF_CASES))
@pytest.mark.parametrize("dtypes", [[torch.float16] * 3, [torch.bfloat16] * 3,
                                    [torch.float32, torch.float16, torch.bfloat16]],
                         ids=["fp16", "bf16", "mixed_in_one_group"])
def test_half_params_keep_fp32_state(case, dtypes):
    make_ours, torch_cls, torch_kwargs = HALF_CASES[case]
    ours, params = run_against_rounded_torch(make_ours, torch_cls, torch_kwargs, dtypes)
    for p in params:
        for key, value in ours.state[p].items():
            assert value.dtype == torch.float32, (key, p.dtype)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_lamb_half_params_keep_fp32_state(dtype):
    params = make_params(SHAPES[:3], dtype)
    ours = FusedLAMB(params, lr=1e-2)
    ref = RefLAMB([dict(ours.param_groups[0], params=params)])
    for step in range(5):
        grads = [g.to(dtype) for g in grads_for(step, [p.shape for p in params])]
        set_grads(params, grads)
        ours.step()
        ref.step([grads])
        for p, r in zip(params, ref.params()):
            r.copy_(r.to(dtype))      # the reference rounds as the parameter does
    for p, r in zip(params, ref.params()):
        torch.testing.assert_close(p.double(), r.double(), **half_tolerance(dtype))
        assert all(v.dtype == torch.float32 for v in ours.state[p].values())


def test_fp16_moments_do_not_underflow():
    """Gradients of 1e-4 square to 1e-8, below fp16's smallest subnormal (6e-8): an fp16
    exp_avg_sq would be 0 and the step m / (0 + eps) about 1e4 times lr. In fp32 Adam moves
    each element by about lr."""
    p = torch.ones(1000, dtype=torch.float16, requires_grad=True)
    opt = FusedAdam([p], lr=1e-3)
    p.grad = torch.full_like(p, 1e-4)
    opt.step()
    moved = (1.0 - p.detach().float()).abs()
    assert moved.max() < 2e-3 and moved.min() > 0
    assert float(opt.state[p]["exp_avg_sq"][0]) > 0


# ---- param groups, missing gradients, zero-size tensors --------------------------------------------

@pytest.mark.parametrize("cls,kwargs", [(FusedAdam, {}), (FusedSGD, {"lr": 0.1}),
                                        (FusedLAMB, {})], ids=["adam", "sgd", "lamb"])
def test_empty_param_group_is_accepted_and_skipped(cls, kwargs):
    params = make_params([(5,)])
    opt = cls(params, **kwargs)
    opt.add_param_group({"params": []})
    opt.add_param_group({"params": [], "lr": 0.5})
    params[0].grad = torch.ones(5)
    before = params[0].detach().clone()
    opt.step()
    assert len(opt.param_groups) == 3
    assert not torch.equal(params[0].detach(), before)


def test_add_param_group_later_with_its_own_hyper_parameters():
    first, second = make_params([(7,)]), make_params([(9,)], seed=1)
    ours_first, ours_second = copies(first), copies(second)
    their_first, their_second = copies(first), copies(second)
    ours = FusedAdam(ours_first, lr=1e-2, adam_w_mode=False)
    theirs = torch.optim.Adam(their_first, lr=1e-2)
    run_pair(ours, theirs, ours_first, their_first, steps=3)
    ours.add_param_group({"params": ours_second, "lr": 3e-2, "betas": (0.5, 0.9)})
    theirs.add_param_group({"params": their_second, "lr": 3e-2, "betas": (0.5, 0.9)})
    run_pair(ours, theirs, ours_first + ours_second, their_first + their_second, steps=5)
    assert_params_close(ours_first + ours_second, their_first + their_second, **FP32_TOL)
    assert float(ours.state[ours_first[0]]["step"]) == 8
    assert float(ours.state[ours_second[0]]["step"]) == 5


@pytest.mark.parametrize("cls,torch_cls,kwargs", [
    (FusedAdam, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (FusedSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    (FusedSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.2)),
], ids=["adamw", "sgd_momentum", "sgd_dampening"])
def test_missing_gradients_are_skipped_and_may_appear_later(cls, torch_cls, kwargs):
    """A parameter without a gradient is neither moved nor given state; when its gradient
    appears its own state starts there (per-parameter step counts, first momentum), as torch."""
    params = make_params()
    ours_params, their_params = copies(params), copies(params)
    ours, theirs = cls(ours_params, **kwargs), torch_cls(their_params, **kwargs)
    for step in range(12):
        grads = grads_for(step, [p.shape for p in params])
        if step < 6:
            grads[1] = None
        if step % 4 == 3:
            grads[2] = None
        set_grads(ours_params, grads)
        set_grads(their_params, grads)
        if step == 0:
            before = ours_params[1].detach().clone()
        ours.step()
        theirs.step()
        if step < 6:
            assert ours_params[1] not in ours.state
            assert torch.equal(ours_params[1].detach(), before)
    assert_params_close(ours_params, their_params, **FP32_TOL)


@pytest.mark.parametrize("cls,kwargs", [
    (FusedAdam, {}), (FusedSGD, dict(lr=0.1, momentum=0.9)), (FusedLAMB, {})],
    ids=["adam", "sgd", "lamb"])
def test_zero_size_params(cls, kwargs):
    params = make_params([(0,), (3, 0), (4,)])
    opt = cls(params, **kwargs)
    for step in range(3):
        set_grads(params, grads_for(step, [p.shape for p in params]))
        opt.step()
    for p in params:
        for value in opt.state[p].values():
            if value.dim():
                assert value.shape == p.shape and value.dtype == torch.float32


def test_several_groups_with_their_own_hyper_parameters():
    params = make_params()
    ours_params, their_params = copies(params), copies(params)

    def groups(ps):
        return [{"params": ps[:1], "lr": 1e-2, "weight_decay": 0.2},
                {"params": ps[1:3], "lr": 5e-3, "betas": (0.8, 0.95), "eps": 1e-6},
                {"params": ps[3:], "weight_decay": 0.0}]
    ours = FusedAdam(groups(ours_params), lr=2e-2, weight_decay=0.01)
    theirs = torch.optim.AdamW(groups(their_params), lr=2e-2, weight_decay=0.01)
    run_pair(ours, theirs, ours_params, their_params)
    assert_params_close(ours_params, their_params, **FP32_TOL)


def test_hyper_parameters_are_read_at_every_step():
    """Changing a group's values between steps (as LR schedulers and user code do) takes effect
    at the next step, also after the lists are cached."""
    params = make_params()
    ours_params, their_params = copies(params), copies(params)
    ours = FusedSGD(ours_params, lr=0.1, momentum=0.9)
    theirs = torch.optim.SGD(their_params, lr=0.1, momentum=0.9)
    for step in range(8):
        for opt in (ours, theirs):
            opt.param_groups[0]["lr"] = 0.1 / (step + 1)
            opt.param_groups[0]["momentum"] = 0.9 if step < 4 else 0.5
            opt.param_groups[0]["weight_decay"] = 0.01 * step
        run_pair(ours, theirs, ours_params, their_params, steps=1)
    assert_params_close(ours_params, their_params, **FP32_TOL)


@pytest.mark.parametrize("make_ours,make_theirs", [
    (lambda ps: FusedAdam(ps, lr=1e-2), lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0)),
    (lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9), lambda ps: torch.optim.SGD(ps, lr=0.1,
                                                                               momentum=0.9)),
], ids=["adamw", "sgd"])
def test_lr_scheduler(make_ours, make_theirs):
    params = make_params()
    ours_params, their_params = copies(params), copies(params)
    ours, theirs = make_ours(ours_params), make_theirs(their_params)
    schedulers = [torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS)
                  for opt in (ours, theirs)]
    for step in range(STEPS):
        run_pair(ours, theirs, ours_params, their_params, steps=1)
        for scheduler in schedulers:
            scheduler.step()
        assert ours.param_groups[0]["lr"] == theirs.param_groups[0]["lr"]
    assert_params_close(ours_params, their_params, **FP32_TOL)


# ---- one op call per group and device, cached lists ---------------------------------------------------

class _CountingOps:
    """Records each op call by name; the steps of lists held in C++ (``hold_lists``) as
    "held <op>" when they stepped (not when they sent the caller to the list path)."""

    def __init__(self, ops, calls=None, prefix=""):
        self.ops = ops
        self.calls = [] if calls is None else calls
        self.prefix = prefix

    def __getattr__(self, name):
        op = getattr(self.ops, name)

        def counted(*args):
            result = op(*args)
            if result is not False:
                self.calls.append(self.prefix + name)
            if name == "hold_lists" and result is not None:
                return _CountingOps(result, self.calls, "held ")
            return result
        return counted


def count_op_calls(monkeypatch):
    """{device: _CountingOps} that ``apex_lite.optimizers.update`` will call through."""
    counting = {}

    def ops_for(device):
        if device not in counting:
            counting[device] = _CountingOps(_backend.ops_for(device))
        return counting[device]
    monkeypatch.setattr(update_module, "ops_for", ops_for)
    # Without native kernels FusedSGD/FusedAdam/FusedAdagrad hand their updates torch's kernels'
    # module (multi_tensor/_torch_fused.py) when they are built: counted as the CPU's ops.
    cpu = torch.device("cpu")
    monkeypatch.setattr(optimizer_module, "_torch_fused",
                        _CountingOps(_torch_fused, ops_for(cpu).calls))
    return counting


@pytest.mark.parametrize("cls,kwargs,op", [
    (FusedAdam, {}, "fused_adam_"), (FusedSGD, dict(lr=0.1, momentum=0.9), "fused_sgd_"),
    (FusedLAMB, {}, "fused_lamb_")], ids=["adam", "sgd", "lamb"])
def test_one_op_call_per_group_and_step(monkeypatch, cls, kwargs, op):
    counting = count_op_calls(monkeypatch)
    dtypes = [torch.float32, torch.float16, torch.bfloat16]
    params = [p.to(d).detach().requires_grad_() for p, d in zip(make_params(), dtypes * 2)]
    opt = cls([{"params": params[:3]}, {"params": params[3:]}], **kwargs)
    for step in range(4):
        set_grads(params, grads_for(step, [p.shape for p in params]))
        opt.step()
    calls = counting[torch.device("cpu")].calls
    assert [name.split()[-1] for name in calls if name != "hold_lists"] == [op] * 8


def test_lists_are_built_once_and_rebuilt_when_the_parameter_set_changes(monkeypatch):
    builds = []
    original = FusedUpdate._build

    def counting_build(self, *args):
        builds.append(self.label)
        return original(self, *args)
    monkeypatch.setattr(FusedUpdate, "_build", counting_build)
    params = make_params()
    opt = FusedAdam(params)

    def steps(n, missing=()):
        for step in range(n):
            grads = grads_for(step, [p.shape for p in params])
            for i in missing:
                grads[i] = None
            set_grads(params, grads)
            opt.step()

    steps(5)
    assert len(builds) == 1
    steps(3, missing=[0])             # a gradient disappears: once, then cached
    assert len(builds) == 2
    steps(2)                          # and comes back
    assert len(builds) == 3
    added = make_params([(3,)], seed=5)
    opt.add_param_group({"params": added, "lr": 0.1})
    params.extend(added)
    steps(2)
    # every update is new; the new group's first state then makes the old group's stale once
    assert len(builds) == 6
    opt.load_state_dict(opt.state_dict())
    steps(2)
    assert len(builds) == 8
    opt.state.clear()                 # a reset state is seen (its size changed); again the
    steps(2)                          # later group's first state makes the earlier one rebuild
    assert len(builds) == 11 and params[0] in opt.state


# ---- lists held in C++ between steps (native backend, Adam and SGD) ----------------------------------

def require_native():
    """Skip on the Python backend, which holds no lists (fail where native was required)."""
    if _env_flag("APEX_LITE_DISABLE_EXT") or not _native_available():
        if _env_flag("APEX_LITE_REQUIRE_EXT"):
            pytest.fail("APEX_LITE_REQUIRE_EXT=1 but the native kernels are not available")
        pytest.skip("the native extension is not built (or APEX_LITE_DISABLE_EXT=1)")


# update class, hyper-parameters, steps before the first held one beyond the plan's second use
HELD_CASES = {
    "adam": (AdamUpdate, AdamHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                                   adam_w_mode=True, bias_correction=True), 0),
    "sgd": (SGDUpdate, SGDHyper(lr=1e-2, momentum=0.0, dampening=0.0, weight_decay=0.0,
                                nesterov=False, wd_after_momentum=False), 0),
    "sgd-nesterov": (SGDUpdate, SGDHyper(lr=1e-2, momentum=0.9, dampening=0.0, weight_decay=0.1,
                                         nesterov=True, wd_after_momentum=False), 0),
    # The first (dampened) buffer update keeps a flag that the next step reads on the list path.
    "sgd-dampening": (SGDUpdate, SGDHyper(lr=1e-2, momentum=0.9, dampening=0.3,
                                          weight_decay=0.0, nesterov=False,
                                          wd_after_momentum=True), 1),
}


def _o2_update_run(monkeypatch, held: bool, case, events):
    """Ten O2 steps of an update (fp32 masters, bf16 and fp16 model parameters whose .grad is
    read) with ``events[step]`` applied to that step's gradients; returns the masters, the
    model parameters, the state and the op calls made."""
    update_class, hyper, _ = HELD_CASES[case]
    if not held:
        monkeypatch.setattr(update_class, "held_step", "")
    counting = count_op_calls(monkeypatch)
    masters = make_params()
    models = [m.detach().to(d) for m, d in zip(masters, [torch.bfloat16, torch.float16] * 2)]
    update = update_class(masters, grad_sources=models, model_params=models)
    state = {}
    inv_scale = torch.full((1,), 2.0 ** -8)
    for step in range(10):
        grads = [(g * 2.0 ** 8).to(m.dtype) for g, m in
                 zip(grads_for(step, [m.shape for m in models]), models)]
        found_inf = torch.zeros(1)
        event = events.get(step)
        if event == "missing":
            grads[1] = None
        elif event == "non-contiguous":
            grads[0] = torch.empty(grads[0].shape + (2,), dtype=grads[0].dtype)[..., 0]
            grads[0].copy_((grads_for(step, [models[0].shape])[0] * 2.0 ** 8))
        elif event == "skip":
            found_inf = torch.ones(1)
        for m, g in zip(models, grads):
            m.grad = g
        update(state, inv_scale, found_inf, hyper)
    calls = counting[torch.device("cpu")].calls
    return masters, models, [state.get(m, {}) for m in masters], calls


@pytest.mark.parametrize("events", [
    {}, {4: "missing"}, {4: "non-contiguous"}, {4: "skip", 5: "skip"}, {1: "skip", 6: "missing"},
], ids=["plain", "missing", "non-contiguous", "skips", "skip-then-missing"])
@pytest.mark.parametrize("case", list(HELD_CASES))
def test_held_lists_step_bit_for_bit_as_the_list_path(monkeypatch, case, events):
    """From a plan's second use on, the step goes through the lists held in C++; a step whose
    gradients that path does not take (one missing, one non-contiguous) goes the list path;
    found_inf skips either. Both give the list path's bits."""
    require_native()
    op = "held " + HELD_CASES[case][0].held_step
    held = _o2_update_run(monkeypatch, True, case, events)
    monkeypatch.undo()
    listed = _o2_update_run(monkeypatch, False, case, events)
    for a, b in zip(held[:2], listed[:2]):
        assert_bitwise(a, b)
    for held_state, listed_state in zip(held[2], listed[2]):
        assert held_state.keys() == listed_state.keys()
        for key, value in held_state.items():
            assert torch.equal(value, listed_state[key]), key
    assert not any(name.startswith("held") for name in listed[3])
    taken = held[3].count(op)
    # Step 0 builds the plan, step 1 hands it to C++; a step with a missing gradient builds a
    # masked plan, the next a full one again (held from its second use).
    fallbacks = sum(1 for e in events.values() if e in ("missing", "non-contiguous"))
    rebuilt_after = sum(1 for e in events.values() if e == "missing")
    assert taken == 9 - fallbacks - rebuilt_after - HELD_CASES[case][2], held[3]


def test_held_lists_refuse_as_the_list_path(monkeypatch):
    """A gradient that the held path leaves to the list path and the list path refuses (a sparse
    one) raises the list path's error and changes nothing. (torch itself refuses a gradient of
    another shape or dtype.)"""
    require_native()
    counting = count_op_calls(monkeypatch)
    params = make_params()
    opt = FusedAdam(params, lr=1e-2)
    for step in range(3):
        set_grads(params, grads_for(step, [p.shape for p in params]))
        opt.step()
    assert "held fused_adam_" in counting[torch.device("cpu")].calls
    before = snapshot(opt, params)
    params[0].grad = torch.randn(params[0].shape).to_sparse()
    with pytest.raises(RuntimeError, match="dense gradients only"):
        opt.step()
    assert_unchanged(opt, params, before)


class _DispatchLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the name of every op dispatched under it, and runs it."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("observer", ["dispatch-mode", "profiler"])
@pytest.mark.parametrize("cls,kwargs,op", [
    (FusedAdam, dict(lr=1e-2, weight_decay=0.1), "fused_adam_"),
    (FusedSGD, dict(lr=0.1, momentum=0.9), "fused_sgd_")], ids=["adam", "sgd"])
def test_held_step_is_seen_by_dispatch_modes_and_the_profiler(monkeypatch, cls, kwargs, op,
                                                              observer):
    """The held step skips the dispatcher's choice of kernel only where that choice is the
    device's kernel anyway: under a TorchDispatchMode the mode sees the op, under torch.profiler
    the op is recorded, and the step gives the bits of the same step outside them."""
    require_native()
    counting = count_op_calls(monkeypatch)
    params = make_params(SHAPES[:3])
    observed, plain = copies(params), copies(params)
    observed_opt, plain_opt = cls(observed, **kwargs), cls(plain, **kwargs)
    shapes = [p.shape for p in params]
    for step in range(4):
        for ps, opt in ((observed, observed_opt), (plain, plain_opt)):
            set_grads(ps, grads_for(step, shapes))
            if step < 3 or opt is plain_opt:
                opt.step()
                continue
            held_before = counting[torch.device("cpu")].calls.count("held " + op)
            if observer == "dispatch-mode":
                with _DispatchLog() as log:
                    opt.step()
                assert [n for n in log.names if n.startswith("apex_lite")] == ["apex_lite::" + op]
            else:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) \
                        as profile:
                    opt.step()
                assert "apex_lite::" + op in [event.name for event in profile.events()]
            assert counting[torch.device("cpu")].calls.count("held " + op) == held_before + 1
    assert_bitwise(observed, plain)
    for p, q in zip(observed, plain):
        for key, value in observed_opt.state[p].items():
            assert torch.equal(value, plain_opt.state[q][key]), key


def test_held_lists_follow_a_loaded_state_and_invalidate(monkeypatch):
    """A loaded state dict (a new plan) and ``invalidate()`` after a state tensor is replaced
    give new held lists over the new tensors."""
    require_native()
    params = make_params(SHAPES[:2])
    straight, other = copies(params), copies(params)
    opt, other_opt = FusedAdam(straight, lr=1e-2), FusedAdam(other, lr=1e-2)
    shapes = [p.shape for p in params]
    for step in range(3):
        for ps, o in ((straight, opt), (other, other_opt)):
            set_grads(ps, grads_for(step, shapes))
            o.step()
    other_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    with torch.no_grad():
        for a, b in zip(other, straight):
            a.copy_(b)
    for step in range(3, 6):
        for ps, o in ((straight, opt), (other, other_opt)):
            set_grads(ps, grads_for(step, shapes))
            o.step()
    assert_bitwise(other, straight)
    # A replaced state tensor, announced by invalidate(): the next steps update the new one.
    replacement = opt.state[straight[0]]["exp_avg"].clone()
    opt.state[straight[0]]["exp_avg"] = replacement
    for _, update in opt._fused_updates():
        update.invalidate()
    for step in range(6, 8):
        set_grads(straight, grads_for(step, shapes))
        opt.step()
    assert opt.state[straight[0]]["exp_avg"] is replacement
    assert not torch.equal(replacement, other_opt.state[other[0]]["exp_avg"])


# ---- state replaced by user code (watched_state.py) -------------------------------------------------------

def _replace_state(optimizer, param, how: str) -> None:
    """Replaces ``param``'s state as user code does: one tensor assigned (Adam's moments, SGD's
    buffer), the whole entry assigned, or the entry deleted (then made again, zeros, as torch
    makes a first state)."""
    entry = optimizer.state[param]
    if how == "tensor":
        for name in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
            if name in entry:
                entry[name] = torch.zeros_like(entry[name])
    elif how == "entry":
        optimizer.state[param] = {k: (v.clone() if k == "step" else torch.full_like(v, 0.5))
                                  for k, v in entry.items()}
    else:
        del optimizer.state[param]


REPLACED_CASES = {
    "adamw": (lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1),
              lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)),
    "sgd_momentum": (lambda ps: FusedSGD(ps, lr=0.05, momentum=0.9),
                     lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)),
}


@pytest.mark.parametrize("how", ["tensor", "entry", "delete"])
@pytest.mark.parametrize("case", list(REPLACED_CASES))
def test_state_replaced_between_steps_is_stepped_as_torch_does(case, how):
    """torch's optimizers read ``state[p]`` at every step; ours reuse lists built once (held in
    C++ from the second step on the native backend), and must still step what user code put in
    the state: the replacement, not the tensors it replaced (without watched_state.py the
    "tensor" and "entry" cases fail; a deleted entry changes the state's size, seen anyway)."""
    make_ours, make_torch = REPLACED_CASES[case]
    params = make_params(SHAPES[:3])
    ours, theirs = copies(params), copies(params)
    opt, ref = make_ours(ours), make_torch(theirs)
    shapes = [p.shape for p in params]
    for step in range(8):
        for ps, o in ((ours, opt), (theirs, ref)):
            set_grads(ps, grads_for(step, shapes))
            o.step()
            if step == 3:
                _replace_state(o, ps[1], how)
    assert_params_close(ours, theirs, **FP32_TOL)
    for name, value in ref.state[theirs[1]].items():
        torch.testing.assert_close(opt.state[ours[1]][name].float(), value.float(), **FP32_TOL)


@pytest.mark.parametrize("how", ["setitem", "pop_insert", "sort"])
def test_a_parameter_replaced_in_its_group_is_stepped_as_torch_does(how):
    """A parameter swapped into a param group's list in place (same list, same length) is
    stepped from then on, with a first state of its own, as torch's optimizers do; the one it
    replaced is no longer stepped."""
    params = make_params(SHAPES[:3])
    newcomer = make_params([SHAPES[1]], seed=7)[0]
    ours, theirs = copies(params), copies(params)
    ours_new, theirs_new = copies([newcomer]), copies([newcomer])
    opt = FusedAdam(ours, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1)
    shapes = [p.shape for p in params]
    for step in range(6):
        for ps, o, new in ((ours, opt, ours_new), (theirs, ref, theirs_new)):
            if step == 3:
                group = o.param_groups[0]["params"]
                if how == "setitem":
                    group[1] = new[0]
                elif how == "pop_insert":
                    group.pop(1)
                    group.insert(1, new[0])
                else:   # the same parameters in another order, then one swapped
                    group.sort(key=lambda p: p.numel())
                    group[next(i for i, p in enumerate(group) if p is ps[1])] = new[0]
                ps[1] = new[0]
            set_grads(ps, grads_for(step, shapes))
            o.step()
    assert_params_close(ours, theirs, **FP32_TOL)
    assert_params_close(ours_new, theirs_new, **FP32_TOL)


def test_state_replaced_is_seen_by_every_group_and_the_entries_stay_dicts():
    """One state shared by two groups: a tensor replaced in the first group's state, then in the
    second's, is stepped; the entries are dicts (the watched ones included) and ``state_dict()``
    returns plain dicts that ``torch.load(weights_only=True)`` reads."""
    params = make_params(SHAPES[:3])
    ours, theirs = copies(params), copies(params)
    opt = FusedAdam([{"params": ours[:2]}, {"params": ours[2:], "lr": 3e-3}], lr=1e-2)
    ref = torch.optim.Adam([{"params": theirs[:2]}, {"params": theirs[2:], "lr": 3e-3}], lr=1e-2)
    shapes = [p.shape for p in params]
    for step in range(7):
        for ps, o in ((ours, opt), (theirs, ref)):
            set_grads(ps, grads_for(step, shapes))
            o.step()
            if step in (2, 4):
                index = 0 if step == 2 else 2
                o.state[ps[index]]["exp_avg_sq"] = o.state[ps[index]]["exp_avg_sq"] * 4.0
    assert_params_close(ours, theirs, **FP32_TOL)
    assert all(isinstance(entry, dict) for entry in opt.state.values())
    saved = opt.state_dict()
    assert all(type(entry) is dict for entry in saved["state"].values())
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert all(type(entry) is dict for entry in loaded["state"].values())
    for pickled in (copy.deepcopy(opt.state), pickle.loads(pickle.dumps(opt)).state):
        assert all(type(entry) is dict for entry in pickled.values())


# ---- state_dict -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cls,kwargs", [
    (FusedAdam, dict(lr=1e-2, weight_decay=0.1)), (FusedSGD, dict(lr=0.1, momentum=0.9)),
    (FusedLAMB, dict(lr=1e-2))], ids=["adam", "sgd", "lamb"])
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


@pytest.mark.parametrize("ours_cls,ours_kwargs,torch_cls,torch_kwargs", [
    (FusedAdam, dict(lr=1e-2, adam_w_mode=False), torch.optim.Adam, dict(lr=1e-2)),
    (FusedAdam, dict(lr=1e-2, weight_decay=0.1), torch.optim.AdamW,
     dict(lr=1e-2, weight_decay=0.1)),
    (FusedSGD, dict(lr=0.1, momentum=0.9, nesterov=True), torch.optim.SGD,
     dict(lr=0.1, momentum=0.9, nesterov=True)),
], ids=["adam", "adamw", "sgd"])
@pytest.mark.parametrize("direction", ["ours_to_torch", "torch_to_ours"])
def test_state_dict_loads_into_torch_and_back(ours_cls, ours_kwargs, torch_cls, torch_kwargs,
                                              direction):
    params = make_params()
    shapes = [p.shape for p in params]
    reference = copies(params)
    ref_opt = torch_cls(reference, **torch_kwargs)
    first, second = copies(params), None
    if direction == "ours_to_torch":
        make_first, make_second = (lambda ps: ours_cls(ps, **ours_kwargs),
                                   lambda ps: torch_cls(ps, **torch_kwargs))
    else:
        make_first, make_second = (lambda ps: torch_cls(ps, **torch_kwargs),
                                   lambda ps: ours_cls(ps, **ours_kwargs))
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
    assert_params_close(second, reference, **FP32_TOL)
    for p in second:
        assert all(v.dtype == torch.float32 for v in other.state[p].values()
                   if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_state_dict_of_half_params_stays_fp32(dtype):
    """torch's load_state_dict casts state to each parameter's dtype; ours keeps it fp32, bit for
    bit, so a resumed run continues exactly."""
    params = make_params(SHAPES[:3], dtype)
    straight, resumed = copies(params), None
    opt = FusedAdam(straight, lr=1e-3)
    shapes = [p.shape for p in params]
    for step in range(6):
        set_grads(straight, grads_for(step, shapes, scale=1e-3))
        opt.step()
        if step == 2:
            resumed = copies(straight)
            other = FusedAdam(resumed, lr=1e-3)
            other.load_state_dict(copy.deepcopy(opt.state_dict()))
            for p, q in zip(straight, resumed):
                for key in ("exp_avg", "exp_avg_sq"):
                    assert other.state[q][key].dtype == torch.float32
                    assert torch.equal(other.state[q][key], opt.state[p][key])
    for step in range(3, 6):
        set_grads(resumed, grads_for(step, shapes, scale=1e-3))
        other.step()
    assert_bitwise(resumed, straight)


def test_loading_a_state_with_amsgrad_is_refused():
    params = make_params([(4,)])
    theirs = torch.optim.Adam(copies(params), amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad=True"):
        FusedAdam(params).load_state_dict(theirs.state_dict())


def test_apex_group_step_counts_move_into_the_parameters():
    """apex's FusedAdam kept ``group["step"]`` and no per-parameter step; loading such a state
    continues the bias correction from there."""
    params = make_params([(6,), (3,)])
    opt = FusedAdam(params, lr=1e-2)
    set_grads(params, grads_for(0, [p.shape for p in params]))
    opt.step()
    saved = opt.state_dict()
    for entry in saved["state"].values():
        del entry["step"]
    saved["param_groups"][0]["step"] = 7
    other = FusedAdam(copies(params), lr=1e-2)
    other.load_state_dict(saved)
    assert "step" not in other.param_groups[0]
    assert [float(other.state[p]["step"]) for p in other.param_groups[0]["params"]] == [7.0, 7.0]


def test_deepcopy_and_pickle_keep_apex_attributes():
    opt = FusedSGD(make_params([(3,)]), lr=0.1, momentum=0.9, set_grad_none=True,
                   materialize_master_grads=False)
    param = opt.param_groups[0]["params"][0]
    for step in range(3):   # from the second step its lists are held in C++ (native backend)
        param.grad = torch.full((3,), float(step))
        opt.step()
    clones = [copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))]
    param.grad = torch.ones(3)
    opt.step()
    for clone in clones:
        assert clone.set_grad_none is True and clone.materialize_master_grads is False
        clone_param = clone.param_groups[0]["params"][0]
        clone_param.grad = torch.ones(3)
        clone.step()
        assert torch.equal(clone_param, param)


# ---- zero_grad (apex's test_zero_grad_configuration) ----------------------------------------------------

@pytest.mark.parametrize("cls", [FusedSGD, FusedAdam, FusedLAMB], ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_apex_zero_grad_keeps_and_zeroes_buffers_without_set_grad_none(cls, dtype):
    first = torch.nn.Parameter(torch.ones(2, 3, dtype=dtype))
    second = torch.nn.Parameter(torch.ones(3, dtype=dtype))
    unused = torch.nn.Parameter(torch.ones(1, dtype=dtype))
    first.grad = torch.full_like(first, 3, requires_grad=True)
    second.grad = torch.arange(6, dtype=dtype)[::2]          # a view
    grads = (first.grad, second.grad)
    opt = cls([{"params": [first]}, {"params": [second, unused]}], lr=0.1, set_grad_none=False)
    for _ in range(2):
        opt.zero_grad()
        assert (first.grad, second.grad) == grads
        assert not first.grad.requires_grad and unused.grad is None
        assert not first.grad.any() and not second.grad.any()
        assert torch.equal(first.detach(), torch.ones_like(first))


@pytest.mark.parametrize("cls,default_none", [(FusedSGD, False), (FusedAdam, True),
                                              (FusedLAMB, True)], ids=lambda x: str(x))
def test_zero_grad_follows_set_grad_none_unless_told(cls, default_none):
    p = torch.nn.Parameter(torch.ones(3))
    opt = cls([p], lr=0.1)
    assert opt.set_grad_none is default_none
    p.grad = torch.ones(3)
    opt.zero_grad()
    assert (p.grad is None) is default_none
    p.grad = torch.ones(3)
    opt.zero_grad(set_to_none=not default_none)
    assert (p.grad is None) is (not default_none)


# ---- GradScaler -------------------------------------------------------------------------------------------

SCALER_CASES = {
    "adamw": lambda ps: FusedAdam(ps, lr=1e-3, weight_decay=0.1),
    "sgd": lambda ps: FusedSGD(ps, lr=0.01, momentum=0.9, dampening=0.1),
    # Clipping off: active clipping (the gradients' norm here is ~3.3, the default max_grad_norm
    # 1) divides the scale out of the gradients, so a LAMB ignoring the scale would pass.
    "lamb": lambda ps: FusedLAMB(ps, lr=1e-3, max_grad_norm=0),
    "lamb-clipped": lambda ps: FusedLAMB(ps, lr=1e-3, max_grad_norm=1.0),
}


def backward_with_grads(params, grads, scaler=None):
    """A backward whose gradient for ``params[i]`` is ``grads[i]`` (times the scale)."""
    loss = sum((p.float() * g).sum() for p, g in zip(params, grads))
    (scaler.scale(loss) if scaler is not None else loss).backward()


@pytest.mark.parametrize("case", list(SCALER_CASES))
@pytest.mark.parametrize("dtype", [torch.float32] + HALF_DTYPES)
def test_grad_scaler_hands_scale_and_found_inf_to_the_op(case, dtype):
    """With a power-of-two scale, GradScaler's scaled gradients times the inverse scale are the
    plain ones exactly: the run with a scaler equals the run without, bit for bit, for fp32 and
    for half parameters (which GradScaler itself refuses to unscale). A step with an inf in a
    gradient changes nothing and halves the scale."""
    make = SCALER_CASES[case]
    params = make_params(SHAPES[:3], dtype)
    scaled, plain = copies(params), copies(params)
    scaled_opt, plain_opt = make(scaled), make(plain)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    shapes = [p.shape for p in params]
    for step in range(8):
        grads = [g.to(dtype).float() for g in grads_for(step, shapes, scale=0.1)]
        scaled_opt.zero_grad()
        backward_with_grads(scaled, grads, scaler)
        if step in (0, 5):
            with torch.no_grad():
                scaled[1].grad.view(-1)[3] = float("inf")
            before = snapshot(scaled_opt, scaled)
            scale_before = scaler.get_scale()
        scaler.step(scaled_opt)
        scaler.update()
        if step in (0, 5):
            assert_unchanged(scaled_opt, scaled, before)
            assert scaler.get_scale() == scale_before / 2
            continue
        plain_opt.zero_grad()
        backward_with_grads(plain, grads)
        plain_opt.step()
        assert_bitwise(scaled, plain)
    assert not hasattr(scaled_opt, "grad_scale") and not hasattr(scaled_opt, "found_inf")


def test_grad_scaler_on_fp32_params_matches_torch():
    params = make_params(SHAPES[:3])
    ours_params, their_params = copies(params), copies(params)
    ours = FusedAdam(ours_params, lr=1e-3, weight_decay=0.1)
    theirs = torch.optim.AdamW(their_params, lr=1e-3, weight_decay=0.1)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 16) for _ in range(2)]
    shapes = [p.shape for p in params]
    for step in range(20):
        grads = grads_for(step, shapes)
        for opt, ps, scaler in ((ours, ours_params, scalers[0]),
                                (theirs, their_params, scalers[1])):
            opt.zero_grad()
            backward_with_grads(ps, grads, scaler)
            if step == 7:
                with torch.no_grad():
                    ps[0].grad.view(-1)[0] = float("nan")
            scaler.unscale_(opt) if step == 3 else None      # unscaled early (clipping)
            scaler.step(opt)
            scaler.update()
    assert scalers[0].get_scale() == scalers[1].get_scale()
    assert_params_close(ours_params, their_params, **FP32_TOL)


@pytest.mark.parametrize("make", [
    lambda ps: FusedAdam(ps, lr=1e-2),
    lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9),
    lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9, dampening=0.5),
    lambda ps: FusedLAMB(ps, lr=1e-2),
], ids=["adam", "sgd", "sgd_dampening", "lamb"])
@pytest.mark.parametrize("skipped_steps", [[0], [0, 1], [2]], ids=str)
def test_skipped_steps_equal_no_steps(make, skipped_steps):
    """Steps skipped on a device found_inf, the first ones included (whose state the op creates
    zero before it knows), leave a run equal bit for bit to one that never took them. SGD with
    dampening: a first step skipped twice in a row is a first step again after each."""
    params = make_params(SHAPES[:2])
    skipping, plain = copies(params), copies(params)
    skipping_opt, plain_opt = make(skipping), make(plain)
    shapes = [p.shape for p in params]
    for step in range(6):
        grads = grads_for(step, shapes)
        set_grads(skipping, grads)
        if step in skipped_steps:
            skipping_opt.found_inf = torch.ones(())
            before = snapshot(skipping_opt, skipping)
            skipping_opt.step()
            del skipping_opt.found_inf
            assert_unchanged(skipping_opt, skipping, before)
            continue
        skipping_opt.found_inf = torch.zeros(())      # a device flag, never read at its step
        skipping_opt.step()
        del skipping_opt.found_inf
        set_grads(plain, grads)
        plain_opt.step()
        assert_bitwise(skipping, plain)


# ---- the per-device update, as amp's O2 step uses it -------------------------------------------------------

@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("torch_cls,kwargs", [
    (torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.1)),
    (torch.optim.Adam, dict(lr=1e-3, weight_decay=0.1)),
    (torch.optim.SGD, dict(lr=0.01, momentum=0.9, nesterov=True)),
], ids=["AdamW", "Adam", "SGD"])
def test_update_with_masters_half_grads_and_model_params(half, torch_cls, kwargs):
    """amp's O2 form: fp32 masters in a torch optimizer, half model parameters whose gradients
    carry the loss scale, a device inv_scale and found_inf. Equal bit for bit to our optimizer
    stepping the masters with the unscaled gradients; the model parameters are the masters
    rounded; found_inf set changes nothing; torch's own step continues from the state."""
    masters = make_params(SHAPES[:3])
    model = copies(masters, half)
    opt = torch_cls(masters, **kwargs)
    assert fusable.unfused_reason(opt) == ""
    # The kernels the plain optimizer steps with (torch's without native ones), so that the two
    # runs can be compared bit for bit.
    update = fusable.update_class(opt)(masters, grad_sources=model, model_params=model,
                                       ops=_standalone_kernels())
    plain = copies(masters)
    plain_opt = (FusedSGD if torch_cls is torch.optim.SGD else FusedAdam)(
        plain, **dict(kwargs, **({} if torch_cls is torch.optim.SGD else
                                 {"adam_w_mode": torch_cls is torch.optim.AdamW})))
    scale = 2.0 ** 10
    inv_scale, found_inf = torch.full((1,), 1 / scale), torch.zeros(1)
    shapes = [p.shape for p in masters]
    for step in range(6):
        grads = [g.to(half) for g in grads_for(step, shapes, scale=0.1)]
        set_grads(model, [g * scale for g in grads])
        if step == 3:
            found_inf.fill_(1.0)
            before = snapshot(opt, masters), [m.detach().clone() for m in model]
        update(opt.state, inv_scale, found_inf, fusable.hyper_parameters(opt, opt.param_groups[0]))
        if step == 3:
            assert_unchanged(opt, masters, before[0])
            assert_bitwise(model, before[1])
            found_inf.zero_()
            continue
        set_grads(plain, grads)
        plain_opt.step()
        assert_bitwise(masters, plain)
        assert_bitwise(model, [p.detach().to(half) for p in plain])
    # torch's own step continues from the state the fused update kept
    reference = copies(masters)
    ref_opt = torch_cls(reference, **kwargs)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    grads = grads_for(6, shapes)
    set_grads(masters, grads)
    set_grads(reference, grads)
    opt.step()
    ref_opt.step()
    assert_bitwise(masters, reference)


def _standalone_kernels():
    """The ops FusedSGD/FusedAdam/FusedAdagrad step fp32 CPU parameters with: the backend's
    (None) where the native kernels serve the CPU, torch's fused kernels' module otherwise."""
    return None if _backend.backend("cpu")[0] == "native" else _torch_fused


def test_update_takes_explicit_gradients():
    """amp passes materialised fp32 master gradients instead of reading the model's."""
    masters = make_params(SHAPES[:2])
    plain = copies(masters)
    state, plain_opt = {}, FusedAdam(plain, lr=1e-2)
    update = AdamUpdate(masters, grad_sources=copies(masters, torch.bfloat16),
                        ops=_standalone_kernels())
    grads = grads_for(0, [p.shape for p in masters])
    update(state, *unit_scalars(torch.device("cpu")),
           fusable.hyper_parameters(plain_opt, plain_opt.param_groups[0]), grads=grads)
    set_grads(plain, grads)
    plain_opt.step()
    assert_bitwise(masters, plain)


@pytest.mark.parametrize("params,sources,models,error,match", [
    (lambda: make_params([(3,)]), lambda: make_params([(4,)]), None, ValueError,
     r"grad_sources\[0\] has shape \(4,\)"),
    (lambda: make_params([(3,)]), None, lambda: make_params([(3,), (3,)]), ValueError,
     r"model_params has 2 tensors but params has 1"),
    (lambda: make_params([(3,)], torch.float64), None, None, TypeError, r"torch\.float64"),
], ids=["shape", "length", "dtype"])
def test_update_checks_its_lists(params, sources, models, error, match):
    with pytest.raises(error, match=match):
        SGDUpdate(params(), grad_sources=sources and sources(), model_params=models and models())


def test_fusable_reasons_and_hyper_parameters():
    p = make_params([(3,)])
    cases = [
        (torch.optim.SGD(p, lr=0.1, maximize=True), r"maximize=True"),
        (torch.optim.Adam(p, amsgrad=True), r"amsgrad=True"),
        (torch.optim.AdamW(p, lr=torch.tensor(1e-3)), r"lr as a tensor"),
        (torch.optim.RMSprop(p), r"RMSprop is not an optimizer the fused ops compute"),
        (type("MyAdam", (torch.optim.Adam,), {})(p), r"subclasses torch\.optim\.adam\.Adam"),
    ]
    for opt, match in cases:
        assert fusable.update_class(opt) is None
        assert re.search(match, fusable.unfused_reason(opt)), fusable.unfused_reason(opt)
    for opt in (torch.optim.SGD(p, lr=0.1, foreach=True), torch.optim.AdamW(p, fused=True)):
        assert fusable.unfused_reason(opt) == ""
    adam = fusable.hyper_parameters(torch.optim.Adam(p, betas=(0.8, 0.9), weight_decay=0.1),
                                    {"lr": 1e-3, "betas": (0.8, 0.9), "eps": 1e-8,
                                     "weight_decay": 0.1})
    assert (adam.beta1, adam.beta2, adam.adam_w_mode, adam.bias_correction) == (0.8, 0.9, False,
                                                                                True)
    adamw = torch.optim.AdamW(p)
    assert fusable.hyper_parameters(adamw, adamw.param_groups[0]).adam_w_mode is True
    sgd = torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)
    assert tuple(fusable.hyper_parameters(sgd, sgd.param_groups[0])) == (0.1, 0.9, 0.1, 0.01,
                                                                        False, False)


# ---- apex's own tests, ported to the CPU ------------------------------------------------------------------

def apex_max_diffs(ref_params, tst_params):
    """apex's get_max_diff: the largest absolute and relative differences."""
    pairs = [(r.detach(), t.detach()) for r, t in zip(ref_params, tst_params)]
    abs_diff = max(float((r - t).abs().max()) for r, t in pairs)
    rel_diff = max(float(((r - t) / r).abs().max()) for r, t in pairs)
    return abs_diff, rel_diff


APEX_SIZES = [[256, 64], [256], [256, 128], [2020, 64], [1]]   # apex's, a 16th of the rows


def fp32_steps_tolerance(steps, params):
    """What fp32 arithmetic allows against a reference in higher precision (or another fp32
    order of operations) after ``steps`` steps: each step rounds a few times (the update, its
    scaling, the subtraction), so 16 fp32 epsilons per step at the parameters' size (at least
    1). apex's bound (max abs diff 1e-3, max relative diff 1) was a hundred times looser than
    a step of lr 5e-4, and let wrong options pass."""
    size = max(1.0, max(float(p.detach().abs().max()) for p in params))
    return 16 * steps * torch.finfo(torch.float32).eps * size


# (reference, ours, apex's options, the "option" case's): every option is passed to both.
APEX_AGAINST_TORCH = {
    "adam": (torch.optim.Adam, lambda ps, **kw: FusedAdam(ps, adam_w_mode=False, **kw),
             dict(lr=5e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0),
             dict(lr=0.01, betas=(0.6, 0.9), eps=3e-6, weight_decay=0)),
    "sgd": (torch.optim.SGD, FusedSGD, dict(lr=0.25, momentum=0.125),
            dict(lr=0.1, momentum=0.6, dampening=0.1, weight_decay=0.05)),
}


@pytest.mark.parametrize("case", ["single", "multi_params", "option"])
@pytest.mark.parametrize("name", list(APEX_AGAINST_TORCH))
def test_apex_fused_optimizer_against_torch(case, name):
    """apex's TestFusedAdam / TestFusedSGD: uniform parameters and gradients, 7 iterations, the
    options of each case passed to torch's optimizer and to ours; within fp32 rounding."""
    ref_cls, make_tst, default, option = APEX_AGAINST_TORCH[name]
    sizes = {"single": [[278011]], "multi_params": APEX_SIZES, "option": APEX_SIZES}[case]
    options = option if case == "option" else default
    torch.manual_seed(9876)
    tensors = [torch.rand(size) for size in sizes]
    ref_params = [torch.nn.Parameter(t.clone()) for t in tensors]
    tst_params = [torch.nn.Parameter(t.clone()) for t in tensors]
    ref_optim, tst_optim = ref_cls(ref_params, **options), make_tst(tst_params, **options)
    for step in range(1, 8):
        for r, t in zip(ref_params, tst_params):
            r.grad = torch.rand_like(r)
            t.grad = r.grad
        ref_optim.step()
        tst_optim.step()
        abs_diff, _ = apex_max_diffs(ref_params, tst_params)
        assert abs_diff <= fp32_steps_tolerance(step, ref_params)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_apex_fused_sgd_half_against_torch_half(dtype):
    """apex's TestFusedSGD.test_half: half parameters against torch.optim.SGD on the same half
    parameters. apex's bound (1e-3) assumed torch's CUDA SGD, which computes in fp32; on the CPU
    torch rounds its half buffer and every product and sum, drifting by up to ~3 units in the
    last place over the 7 steps. So both are measured against float64 SGD rounded to the half
    dtype after each step: ours stays within 1 unit in the last place of the largest parameter
    and never further than torch."""
    torch.manual_seed(9876)
    tensor = torch.rand(278011).to(dtype)
    ref_params, tst_params = [torch.nn.Parameter(tensor.clone())], [torch.nn.Parameter(
        tensor.clone())]
    ref_optim = torch.optim.SGD(ref_params, lr=0.25, momentum=0.125)
    tst_optim = FusedSGD(tst_params, lr=0.25, momentum=0.125)
    exact = RefSGD(tst_params, lr=0.25, momentum=0.125)
    for _ in range(7):
        ref_params[0].grad = torch.rand_like(ref_params[0])
        tst_params[0].grad = ref_params[0].grad
        ref_optim.step()
        tst_optim.step()
        exact.step([ref_params[0].grad])
        exact.params[0].copy_(exact.params[0].to(dtype))
        ours, _ = apex_max_diffs(exact.params, [tst_params[0].double()])
        theirs, _ = apex_max_diffs(exact.params, [ref_params[0].double()])
        largest = float(exact.params[0].abs().max())
        assert ours <= torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(largest))
        assert ours <= theirs
    assert tst_optim.state[tst_params[0]]["momentum_buffer"].dtype == torch.float32


@pytest.mark.parametrize("case", ["single", "multi_params", "option"])
@pytest.mark.parametrize("weight_decay", [0, 0.01])
def test_apex_lamb_against_apex_reference(case, weight_decay):
    """apex's TestFusedLAMB: FusedLAMB(use_nvlamb=True) against apex's reference LAMB (global
    norm clipped at 1, trust ratio on every tensor), 7 iterations, within fp32 rounding. The
    "option" case runs on apex's multi-tensor sizes, not on one element: there the trust ratio
    reduces the step to lr * |p| * sign(update), whatever betas and eps are."""
    sizes = {"single": [[278011]], "multi_params": APEX_SIZES, "option": APEX_SIZES}[case]
    options = (dict(lr=0.01, betas=(0.6, 0.9), eps=3e-6) if case == "option"
               else dict(lr=5e-4, betas=(0.9, 0.999), eps=1e-8))
    torch.manual_seed(9876)
    tst_params = [torch.nn.Parameter(torch.rand(size)) for size in sizes]
    tst_optim = FusedLAMB(tst_params, use_nvlamb=True, weight_decay=weight_decay, **options)
    ref = RefLAMB([dict(tst_optim.param_groups[0], params=tst_params)])
    for step in range(1, 8):
        grads = [torch.rand_like(p) for p in tst_params]
        set_grads(tst_params, grads)
        tst_optim.step()
        ref.step([grads])
        abs_diff, _ = apex_max_diffs([r.float() for r in ref.params()], tst_params)
        assert abs_diff <= fp32_steps_tolerance(step, tst_params)


# ---- the two backends ---------------------------------------------------------------------------------------

def _native_available():
    try:
        from apex_lite.multi_tensor import _native
    except ImportError:
        return False
    ops, _ = _native.ops_for("cpu")
    return ops is not None


@pytest.mark.parametrize("cls,kwargs", [
    (FusedAdam, dict(lr=1e-2, weight_decay=0.1)), (FusedSGD, dict(lr=0.1, momentum=0.9)),
    (FusedLAMB, dict(lr=1e-2))], ids=["adam", "sgd", "lamb"])
def test_backends_agree(monkeypatch, cls, kwargs):
    """The native CPU kernels and the Python reference: bit for bit for SGD and Adam (same
    roundings in the same order), LAMB within fp32 rounding of its norms."""
    require_native()
    from apex_lite.multi_tensor import _python
    params = make_params()
    results = []
    for backend in ("python", "native"):
        ps = copies(params)
        opt = cls(ps, **kwargs)
        if backend == "python":
            monkeypatch.setattr(update_module, "ops_for", lambda device: _python)
        else:
            monkeypatch.setattr(update_module, "ops_for", _backend.ops_for)
        for step in range(10):
            set_grads(ps, grads_for(step, [p.shape for p in params]))
            opt.step()
        results.append(ps)
    if cls is FusedLAMB:
        assert_params_close(results[1], results[0], rtol=1e-5, atol=1e-6)
    else:
        assert_bitwise(results[1], results[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_one_group_on_cpu_and_cuda_is_stepped_per_device():
    """A group with parameters on the CPU and on CUDA: one fused call per device, LAMB's global
    norm over both."""
    cpu, gpu = make_params([(33,)]), [p.detach().cuda().requires_grad_()
                                      for p in make_params([(17,)], seed=1)]
    ours = FusedLAMB(cpu + gpu, lr=1e-2)
    ref = RefLAMB([dict(ours.param_groups[0], params=cpu + gpu)])
    for step in range(5):
        grads = grads_for(step, [(33,), (17,)])
        cpu[0].grad, gpu[0].grad = grads[0].clone(), grads[1].cuda()
        ours.step()
        ref.step([grads])
    assert_params_close([cpu[0], gpu[0].cpu()], [r.cpu() for r in ref.params()], **F64_TOL)
