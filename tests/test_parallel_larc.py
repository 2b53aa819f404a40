"""apex_lite.parallel.LARC: apex's formula and forwarding, torch's LR schedulers, and amp
(apex's test_larc at O0-O3; at O2 LARC steps the fp32 masters with their true gradients)."""
import copy
import pickle

import pytest
import torch
from torch.nn import Parameter

from apex_lite import amp
from apex_lite.amp.saved_state import AMP_STATE_KEY
from apex_lite.parallel.LARC import LARC


def reference_larc_grads(params, grads, lr, weight_decay, trust, clip, eps):
    """apex's rule, written out per parameter in fp64: the gradient LARC hands the inner step."""
    out = []
    for p, g in zip(params, grads):
        p, g = p.double(), g.double()
        pn, gn = p.norm().item(), g.norm().item()
        if pn == 0 or gn == 0:
            out.append(g)
            continue
        local = trust * pn / (gn + pn * weight_decay + eps)
        factor = min(local / lr, 1.0) if clip else local
        out.append((g + weight_decay * p) * factor)
    return out


def make_params():
    torch.manual_seed(0)
    shapes = [(3, 4), (5,), (2, 3, 2), (4,), (3,)]
    params = [Parameter(torch.randn(*s)) for s in shapes]
    grads = [torch.randn(*s) * scale for s, scale in zip(shapes, (1.0, 1e-3, 50.0, 1.0, 1.0))]
    with torch.no_grad():
        params[3].zero_()          # a parameter of norm 0
    grads[4] = torch.zeros(3)      # a gradient of norm 0
    return params, grads


@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_gradients_handed_to_the_inner_step_follow_apex(clip, weight_decay):
    params, grads = make_params()
    lr, trust, eps = 0.1, 0.02, 1e-8
    seen = {}
    inner = torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    inner.register_step_pre_hook(lambda opt, args, kwargs: seen.update(
        grads=[p.grad.clone() for p in params],
        weight_decay=[g["weight_decay"] for g in opt.param_groups]))
    larc = LARC(inner, clip=clip)
    before = [p.detach().clone() for p in params]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    larc.step()
    expected = reference_larc_grads(before, grads, lr, weight_decay, trust, clip, eps)
    for got, want in zip(seen["grads"], expected):
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-9)
    assert seen["weight_decay"] == [0]                       # hidden from the inner step
    assert inner.param_groups[0]["weight_decay"] == weight_decay   # and given back
    for p, b, g in zip(params, before, seen["grads"]):      # SGD applied what LARC handed it
        torch.testing.assert_close(p.detach(), b - lr * g)
    # Clipping really clipped somewhere, and scaling really scaled (the rule is exercised).
    factors = [(w / (g + weight_decay * b.double())).flatten()[0].item()
               for w, g, b in zip(expected[:3], grads[:3], before[:3])]
    if clip:
        assert max(factors) == pytest.approx(1.0) and min(factors) < 1.0
    else:
        assert max(factors) > 1.0 and min(factors) < 1.0


def test_zero_norms_leave_the_gradient_and_skip_weight_decay():
    params, grads = make_params()
    inner = torch.optim.SGD(params, lr=0.1, weight_decay=0.5)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    LARC(inner).step()
    assert torch.equal(params[3].grad, grads[3])            # parameter of norm 0
    assert torch.equal(params[4].grad, grads[4])            # gradient of norm 0
    assert torch.equal(params[3].detach(), -0.1 * grads[3])  # no decay of 0 anyway; plain SGD


def test_weight_decay_is_restored_when_the_inner_step_raises():
    p = Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    inner = torch.optim.SGD([p], lr=0.1, weight_decay=0.3)

    def fail(opt, args, kwargs):
        raise RuntimeError("inner failed")
    inner.register_step_pre_hook(fail)
    with pytest.raises(RuntimeError, match="inner failed"):
        LARC(inner).step()
    assert inner.param_groups[0]["weight_decay"] == 0.3


def test_forwarding():
    model = torch.nn.Linear(3, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    larc = LARC(inner, trust_coefficient=0.1, clip=False, eps=1e-6)
    assert (larc.trust_coefficient, larc.clip, larc.eps) == (0.1, False, 1e-6)
    assert larc.optim is inner
    assert larc.param_groups is inner.param_groups and larc.state is inner.state
    assert larc.defaults is inner.defaults
    assert repr(larc) == repr(inner)
    model(torch.randn(4, 3)).sum().backward()
    larc.step()
    assert larc.state_dict() == inner.state_dict() and len(inner.state) == 2
    saved = copy.deepcopy(larc.state_dict())
    larc.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    extra = Parameter(torch.zeros(2))
    larc.add_param_group({"params": [extra], "lr": 0.5})
    assert inner.param_groups[1]["params"] == [extra] and inner.param_groups[1]["lr"] == 0.5
    fresh = LARC(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.state_dict()["state"][0]["momentum_buffer"],
                       saved["state"][0]["momentum_buffer"])
    with pytest.raises(TypeError, match="wraps an optimizer"):
        LARC(model.parameters())


def test_lr_schedulers_and_hooks_take_a_larc():
    """apex's LARC is not a torch Optimizer and LR schedulers refuse it; this one is."""
    model = torch.nn.Linear(3, 2)
    larc = LARC(torch.optim.SGD(model.parameters(), lr=1.0))
    assert isinstance(larc, torch.optim.Optimizer)
    schedule = torch.optim.lr_scheduler.StepLR(larc, step_size=1, gamma=0.5)
    calls = []
    larc.register_step_pre_hook(lambda *a: calls.append("pre"))
    larc.register_step_post_hook(lambda *a: calls.append("post"))
    for _ in range(2):
        model(torch.randn(4, 3)).sum().backward()
        larc.step()
        schedule.step()
    assert larc.optim.param_groups[0]["lr"] == 0.25
    assert calls == ["pre", "post"] * 2


def test_copies_and_pickles():
    model = torch.nn.Linear(3, 2)
    larc = LARC(torch.optim.SGD(model.parameters(), lr=0.1), trust_coefficient=0.05)
    twin = copy.deepcopy(larc)
    assert twin.trust_coefficient == 0.05 and twin.optim is not larc.optim
    again = pickle.loads(pickle.dumps(larc))
    assert again.param_groups[0]["lr"] == 0.1
    again.register_step_pre_hook(lambda *a: None)


# ---- under amp ----------------------------------------------------------------------------------
class MyModel(torch.nn.Module):
    """apex's test_larc model: its gradient is the input, exact in any dtype."""

    def __init__(self, unique):
        super().__init__()
        self.weight0 = Parameter(unique + torch.arange(2, dtype=torch.float32))
        self.weight1 = Parameter(unique * 3 - torch.arange(3, dtype=torch.float32))

    def forward(self, input):
        return (input[:2] * self.weight0).sum() + (input[2:] * self.weight1).sum() * 0.5


def larc_run(opt_level, clip, steps=4, fused_step=None):
    model = MyModel(1)
    optimizer = LARC(torch.optim.SGD([{"params": model.parameters(), "lr": 0.25}],
                                     momentum=0.125, weight_decay=1e-3), clip=clip)
    if opt_level is not None:
        model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0,
                                          fused_step=fused_step)
    x = torch.tensor([1.0, 1.0, 0.5, -2.0, 4.0])
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(x)
        if opt_level is None:
            loss.backward()
        else:
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
        optimizer.step()
    weights = list(amp.master_params(optimizer)) if opt_level else list(model.parameters())
    return [w.detach().clone() for w in weights], optimizer


@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
def test_larc_mixed_precision(opt_level, clip):
    """apex's test_larc (amp.initialize takes a LARC); at O0-O2 the fp32 weights (O2: the
    masters, stepped with their true fp32 gradients) equal an fp32 run's; O3 steps half."""
    expected, _ = larc_run(None, clip)
    got, optimizer = larc_run(opt_level, clip)
    for g, e in zip(got, expected):
        if opt_level == "O3":
            assert g.dtype == torch.bfloat16
            torch.testing.assert_close(g.float(), e, rtol=1e-2, atol=1e-2)
        else:
            assert g.dtype == torch.float32
            torch.testing.assert_close(g, e, rtol=0, atol=0)
    assert isinstance(optimizer, LARC) and hasattr(optimizer, "_amp_stash")


def test_larc_steps_through_its_optimizer_at_O2_and_carries_amps_state():
    """LARC shares its optimizer's param groups and calls its step: amp takes over the inner
    optimizer (issue 49), which takes the fused step where it can, with the gradients LARC
    rescaled."""
    _, optimizer = larc_run("O2", clip=True, steps=1)
    report = str(amp.report())
    assert "optimizer 0 (LARC): fused step" in report
    state = optimizer.state_dict()
    assert AMP_STATE_KEY in state and "state" in state
    optimizer.load_state_dict(state)


@pytest.mark.parametrize("fused_step", [True, False])
def test_larc_at_O2_on_either_step_path_trains_as_fp32(fused_step):
    expected, _ = larc_run(None, clip=True)
    got, optimizer = larc_run("O2", clip=True, fused_step=fused_step)
    assert optimizer._apex_lite_amp.path.fused == fused_step
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_steps_as_cpu(dtype):
    """The same rule on the device (no host read per parameter): as the CPU step, to rounding."""
    results = []
    for device in ("cpu", "cuda"):
        params, grads = make_params()
        params = [Parameter(p.detach().to(device, dtype)) for p in params]
        for p, g in zip(params, grads):
            p.grad = g.to(device, dtype)
        LARC(torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)).step()
        results.append([p.detach().cpu().float() for p in params])
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, **tol)
