"""amp's fused step (O2, optimizers whose update the kernels compute): the same training as the
unfused step within a stated tolerance, no fp32 master gradients, no host sync per step (the
loss scale and the skip decisions on the device, the host catching up lazily), clipping,
schedulers, param groups, checkpoints, skipped steps, and what it reports.

The rules every step path shares (accumulation, which optimizer skips, what step() refuses) are
tested on both paths in test_amp_apex_semantics.py and test_amp_misuse.py."""
from __future__ import annotations

import copy
import logging

import pytest
import torch

from amp_helpers import CountSyncs, assert_bitwise_equal, snapshot
from apex_lite import amp
from apex_lite.amp.master_grads import is_lazy
from apex_lite.amp.optimizer import CHECKED, UNSCALED
from apex_lite.multi_tensor import backend
from apex_lite.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedSGD

OPTIMIZERS = {
    "SGD": lambda params: torch.optim.SGD(params, lr=0.05),
    "SGD-momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9,
                                                    weight_decay=1e-2),
    "SGD-nesterov": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9,
                                                    nesterov=True, dampening=0.0),
    "SGD-dampening": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.5,
                                                     dampening=0.3),
    "Adam": lambda params: torch.optim.Adam(params, lr=1e-2, weight_decay=1e-2),
    "AdamW": lambda params: torch.optim.AdamW(params, lr=1e-2, betas=(0.8, 0.99)),
    "FusedSGD": lambda params: FusedSGD(params, lr=0.05, momentum=0.9, weight_decay=1e-2,
                                        wd_after_momentum=True),
    "FusedAdam": lambda params: FusedAdam(params, lr=1e-2, weight_decay=1e-2),
    "FusedAdam-L2": lambda params: FusedAdam(params, lr=1e-2, weight_decay=1e-2,
                                             adam_w_mode=False, bias_correction=False),
    "FusedLAMB": lambda params: FusedLAMB(params, lr=1e-2, max_grad_norm=0.5),
}


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                               torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))


def _batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def _loss(model, i):
    x, y = _batch(i)
    return torch.nn.functional.mse_loss(model(x).float(), y)


def _train(make_opt, fused_step, steps=6, inject_at=(), clip=None, after_step=None, **kwargs):
    model = _net()
    opt = make_opt(model.parameters())
    kwargs.setdefault("verbosity", 0)
    model, opt = amp.initialize(model, opt, opt_level="O2", fused_step=fused_step, **kwargs)
    for i in range(steps):
        opt.zero_grad()
        with amp.scale_loss(_loss(model, i), opt) as scaled:
            scaled.backward()
            if i in inject_at:
                next(model.parameters()).grad.view(-1)[0] = float("nan")
        if clip == "amp":
            amp.clip_grad_norm_(opt, 0.5)
        elif clip == "apex":
            torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 0.5)
        opt.step()
        if after_step is not None:
            after_step(opt, i)
    return model, opt


def _masters(opt):
    return [p.detach().clone() for p in opt._apex_lite_amp.masters()]


def _fresh_handle():
    amp.default_handle().__init__()


# ---- the same training as the unfused step ------------------------------------------------------

@pytest.mark.parametrize("half_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fused_step_trains_as_the_unfused_step(name, half_dtype):
    """Tolerance: the kernels compute the same update in fp32 in another order (Adam:
    (m*r1)/(sqrt(v)*r2+eps) with r1 = 1/bc1, r2 = 1/sqrt(bc2) against torch's
    m/(sqrt(v)/sqrt(bc2)+eps)*lr/bc1, the weight decay of AdamW folded into the update); over
    6 steps, one of them skipped, the masters agree to 1e-5 relative. The half model is the
    rounding of the masters on both paths."""
    model, fused_opt = _train(OPTIMIZERS[name], True, inject_at={2}, half_dtype=half_dtype)
    assert fused_opt._apex_lite_amp.path.fused
    fused, fused_model = _masters(fused_opt), [p.detach().clone() for p in model.parameters()]
    _fresh_handle()
    plain_model, plain_opt = _train(OPTIMIZERS[name], False, inject_at={2},
                                    half_dtype=half_dtype)
    assert not plain_opt._apex_lite_amp.path.fused
    for a, b in zip(fused, _masters(plain_opt)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(fused_model, plain_model.parameters()):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.detach().float(), rtol=1e-2, atol=1e-3)
    # The optimizer's state is torch's, key for key.
    fused_state, plain_state = fused_opt.state_dict()["state"], plain_opt.state_dict()["state"]
    assert fused_state.keys() == plain_state.keys()
    for key in fused_state:
        assert fused_state[key].keys() == plain_state[key].keys()
        for k, v in fused_state[key].items():
            torch.testing.assert_close(v.float(), plain_state[key][k].float(), rtol=1e-4,
                                       atol=1e-6)


def _reset_first_state(opt, i):
    """After step 2, user code resets the first master's moments (or momentum buffer) by
    assigning new tensors, as torch's optimizers allow."""
    if i != 2:
        return
    entry = opt.state[_masters_of(opt)[0]]
    for name in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
        if name in entry:
            entry[name] = torch.zeros_like(entry[name])


def _masters_of(opt):
    return list(opt._apex_lite_amp.masters())


@pytest.mark.parametrize("name", ["AdamW", "FusedAdam", "SGD-momentum"])
def test_state_replaced_by_user_code_is_stepped_on_the_fused_step(name):
    """The fused step's lists are built once (and held in C++): a state tensor user code
    replaces between steps is still what the next steps update, as on the unfused step, where
    the optimizer reads its state at every step."""
    _, fused_opt = _train(OPTIMIZERS[name], True, steps=6, after_step=_reset_first_state)
    assert fused_opt._apex_lite_amp.path.fused
    fused = _masters(fused_opt)
    _fresh_handle()
    _, plain_opt = _train(OPTIMIZERS[name], False, steps=6, after_step=_reset_first_state)
    for a, b in zip(fused, _masters(plain_opt)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    _fresh_handle()
    _, unreset = _train(OPTIMIZERS[name], True, steps=6)
    assert not torch.allclose(fused[0], _masters(unreset)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["AdamW", "FusedAdam", "SGD-momentum", "SGD-dampening"])
def test_held_lists_step_as_the_list_path(name, monkeypatch):
    """The Adam and SGD updates hand their lists over once (from the second step) and step
    through them without passing a list: to C++ on the native backend, to torch's fused kernels'
    route with its chunk layout built once without native kernels (multi_tensor/_torch_fused.py).
    The training, a skipped step included, is the list path's bit for bit."""
    from apex_lite.multi_tensor import _torch_fused
    from apex_lite.optimizers import AdamUpdate, SGDUpdate
    model, opt = _train(OPTIMIZERS[name], True, steps=8, inject_at={3})
    buckets = opt._apex_lite_amp.path.buckets()
    held = [b.update._plan.held for b in buckets]
    if backend("cpu")[0] != "native":
        assert all(isinstance(h, _torch_fused._HeldLists) for h in held), held
    else:
        assert all(h is not None and h is not False for h in held), held
    held_run = snapshot(model, opt), copy.deepcopy(opt.state_dict())
    _fresh_handle()
    for update_class in (AdamUpdate, SGDUpdate):
        monkeypatch.setattr(update_class, "held_step", "")
    model, opt = _train(OPTIMIZERS[name], True, steps=8, inject_at={3})
    assert all(b.update._plan.held is False for b in opt._apex_lite_amp.path.buckets())
    assert_bitwise_equal(held_run[0], snapshot(model, opt))
    for key, entry in held_run[1]["state"].items():
        for k, value in entry.items():
            assert torch.equal(value, opt.state_dict()["state"][key][k]), k


@pytest.mark.parametrize("name", ["SGD-momentum", "SGD-dampening", "Adam"])
def test_a_skipped_fused_step_changes_nothing(name):
    model, opt = _train(OPTIMIZERS[name], True, steps=2)
    before = snapshot(model, opt)
    state = copy.deepcopy(opt.state_dict())
    with amp.scale_loss(_loss(model, 9), opt) as scaled:
        scaled.backward()
        next(model.parameters()).grad.view(-1)[0] = float("inf")
    opt.step()
    assert_bitwise_equal(before, snapshot(model, opt))
    after = opt.state_dict()["state"]
    for k, s in state["state"].items():
        for key, value in s.items():
            assert torch.equal(value, after[k][key]), key
    assert amp.loss_scalers()[0].skipped_steps == 1


@pytest.mark.parametrize("name", ["SGD-dampening", "Adam"])
def test_a_skipped_first_step_leaves_the_next_one_a_first_step(name):
    """The fused step creates the optimizer's state before a step whose skip only the device
    knows. A skipped first step leaves it as torch would find it before any step: Adam's zeros
    and step 0; SGD's momentum buffer then takes the next gradient as a first step does (not
    (1 - dampening) times it)."""
    _, fused_opt = _train(OPTIMIZERS[name], True, steps=3, inject_at={0})
    _fresh_handle()
    _, plain_opt = _train(OPTIMIZERS[name], False, steps=3, inject_at={0})
    for a, b in zip(_masters(fused_opt), _masters(plain_opt)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
@pytest.mark.parametrize("inject", [None, 0, 1])
def test_fused_sgd_with_two_models_two_losses_one_optimizer(level, inject):
    """apex's run_amp/test_fused_sgd.py, test_2models2losses1optimizer, on the CPU: FusedSGD
    under amp steps as torch.optim.SGD does with the same hyper-parameters, with an overflow in
    the first or the second loss's backward skipping the same steps (each loss its own scaler)."""
    def run(make):
        torch.manual_seed(0)
        a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        opt = make([{"params": a.parameters()}, {"params": b.parameters(), "lr": 0.5}])
        [a, b], opt = amp.initialize([a, b], opt, opt_level=level, num_losses=2, verbosity=0)
        x = torch.ones(2, 4)
        for step in range(6):
            opt.zero_grad()
            for loss_id, model in enumerate((a, b)):
                with amp.scale_loss(model(x).float().square().mean(), opt,
                                    loss_id=loss_id) as scaled:
                    scaled.backward()
                    if inject == loss_id and step in (1, 4):
                        model.weight.grad.view(-1)[0] = float("inf")
            opt.step()
        return _masters(opt), [(s.steps, s.skipped_steps) for s in amp.loss_scalers()]
    fused, fused_counts = run(lambda groups: FusedSGD(groups, lr=0.25, momentum=0.125))
    _fresh_handle()
    plain, plain_counts = run(lambda groups: torch.optim.SGD(groups, lr=0.25, momentum=0.125))
    assert fused_counts == plain_counts
    # O3 steps bf16 parameters: FusedSGD in fp32 with an fp32 momentum buffer, one rounding;
    # torch's SGD in bf16 throughout. The others agree to fp32 rounding.
    tol = dict(rtol=2e-2, atol=2e-2) if level == "O3" else dict(rtol=1e-5, atol=1e-6)
    for x, y in zip(fused, plain):
        torch.testing.assert_close(x.float(), y.float(), **tol)


# ---- memory and host syncs ------------------------------------------------------------------------

def test_o2_fused_holds_no_master_gradients_and_16_bytes_per_parameter_with_adam():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0, fused_step=True)
    with amp.scale_loss(model(torch.randn(4, 64)).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    # After the step each master shows the gradient it applied, as on the unfused step, made
    # only if something uses it: none is held.
    assert all(is_lazy(p.grad) for p in opt._apex_lite_amp.masters())
    report = amp.report()
    # half param 2 + half grad 2 + fp32 master 4 + Adam state 8 (+ a 4-byte step per tensor).
    assert 16.0 <= report.bytes_per_parameter < 16.01
    assert "optimizer 0 (Adam): fused step" in str(report)
    _fresh_handle()
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0, fused_step=False)
    with amp.scale_loss(model(torch.randn(4, 64)).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert 20.0 <= amp.report().bytes_per_parameter < 20.01
    assert "optimizer 0 (Adam): unfused step (fused_step=False)" in str(amp.report())


@pytest.mark.parametrize("opt_name", ["SGD-momentum", "Adam"])
def test_no_host_sync_per_step_and_one_check_one_kernel_call(opt_name, monkeypatch):
    """Five steps, one of them skipped: no host read, on either backend (the Python backend's
    reference keeps found_inf and the step counts on the device too). No unscale pass, no fp32
    master gradient; the counters are right when read afterwards."""
    from apex_lite.amp import master_grads, opt_params, two_copies
    model = _net()
    model, opt = amp.initialize(model, OPTIMIZERS[opt_name](model.parameters()),
                                opt_level="O2", verbosity=0, fused_step=True)
    assert amp.default_handle()._run.decides_on_device
    unscales = []
    # Where master gradients would be made (the fp32 parameters' own in-place unscale at the
    # block's end, step_path.py, is expected).
    for module in (master_grads, opt_params, two_copies):
        monkeypatch.setattr(module, "fused_scale", lambda *a: unscales.append(a))
    syncs = 0
    for i in range(5):
        opt.zero_grad()
        loss = _loss(model, i)               # (the forward is not amp's business)
        with CountSyncs() as counted:
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
                if i == 3:
                    next(model.parameters()).grad.view(-1)[0] = float("inf")
            opt.step()
        syncs += counted.count
    assert unscales == []
    assert syncs == 0
    run = amp.default_handle()._run
    # No fp32 master gradient was made: each master shows its step's, lazy.
    assert all(is_lazy(m.grad) for m in opt._apex_lite_amp.masters() if run.pairs.is_master(m))
    scaler = amp.loss_scalers()[0]
    assert (scaler.steps, scaler.skipped_steps, scaler.loss_scale) == (5, 1, 32768.0)
    assert not scaler.last_step_skipped


def test_the_unfused_step_of_another_optimizer_keeps_decisions_on_the_host():
    """A run with an optimizer the kernels do not compute decides on the host (its step needs the
    decision there); the other optimizer still takes the fused step, and both match a run
    where both are unfused."""
    def run(fused_step):
        torch.manual_seed(0)
        a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
        opts = [torch.optim.Adam(a.parameters(), lr=1e-2),
                torch.optim.RMSprop(b.parameters(), lr=1e-2)]
        [a, b], opts = amp.initialize([a, b], opts, opt_level="O2", verbosity=0,
                                      fused_step=fused_step)
        for i in range(4):
            for o in opts:
                o.zero_grad()
            with amp.scale_loss(b(a(_batch(i)[0][:, :4])).float().pow(2).mean(), opts) as s:
                s.backward()
                if i == 1:
                    a.weight.grad.view(-1)[0] = float("inf")
            for o in opts:
                o.step()
        return [m.detach().clone() for o in opts for m in o._apex_lite_amp.masters()], opts
    fused, opts = run(None)
    assert not amp.default_handle()._run.decides_on_device
    # The default takes the fused step for Adam: the native kernels, or torch's fused ones.
    assert [o._apex_lite_amp.path.fused for o in opts] == [True, False]
    assert "RMSprop is not an optimizer the fused ops compute" in \
        opts[1]._apex_lite_amp.path.why
    _fresh_handle()
    plain, _ = run(False)
    for x, y in zip(fused, plain):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


# ---- the host catches up lazily ------------------------------------------------------------------

def test_skip_log_lines_arrive_at_the_sync_in_order(caplog):
    """verbosity keeps its meaning: the lines a host decision would have logged come, in order,
    when the host catches up (every sync_interval decisions, or when the counters are read)."""
    model, opt = _train(OPTIMIZERS["Adam"], True, steps=0, verbosity=1, sync_interval=4)
    with caplog.at_level(logging.INFO, logger="apex_lite.amp"):
        for i in range(3):
            opt.zero_grad()
            with amp.scale_loss(_loss(model, i) * float("nan"), opt) as scaled:
                scaled.backward()
            opt.step()
        assert caplog.records == []          # three decisions, none replayed yet
        opt.zero_grad()
        with amp.scale_loss(_loss(model, 3), opt) as scaled:
            scaled.backward()                # the fourth fills the history: the host catches up
        opt.step()
        lines = [r.getMessage() for r in caplog.records if r.name == "apex_lite.amp"]
    assert lines[:3] == [
        "Loss is inf or NaN (the forward produced a non-finite loss, not a scaling problem).  "
        f"Skipping step, loss scaler 0 reducing loss scale to {2.0 ** (15 - i)}"
        for i in range(3)]
    assert amp.loss_scalers()[0].steps == 4


def test_overflow_stuck_error_comes_at_the_sync():
    model, opt = _train(OPTIMIZERS["SGD"], True, steps=0, min_loss_scale=2.0 ** 14,
                        overflow_patience=3, sync_interval=8)
    hook = model[0].bias.register_hook(lambda g: torch.full_like(g, float("inf")))
    for i in range(7):                       # 5 at the floor, but no sync yet
        opt.zero_grad()
        with amp.scale_loss(_loss(model, i), opt) as scaled:
            scaled.backward()
        opt.step()
    opt.zero_grad()
    with pytest.raises(amp.OverflowStuckError, match="Parameters whose gradients were inf or "
                                                     "NaN: '0.bias'"):
        with amp.scale_loss(_loss(model, 7), opt) as scaled:
            scaled.backward()
    hook.remove()
    assert amp.loss_scalers()[0].skipped_steps == 8   # every decision counted before it raised


def test_state_dict_catches_up_and_a_resume_continues_bit_for_bit():
    model, opt = _train(OPTIMIZERS["Adam"], True, steps=5, inject_at={1, 3})
    state = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(),
                           "amp": amp.state_dict()})
    assert state["amp"]["loss_scaler0"] == {"loss_scale": 16384.0, "unskipped": 1}
    for i in range(5, 8):
        opt.zero_grad()
        with amp.scale_loss(_loss(model, i), opt) as scaled:
            scaled.backward()
        opt.step()
    expected = _masters(opt)
    _fresh_handle()
    model2 = _net()
    opt2 = OPTIMIZERS["Adam"](model2.parameters())
    model2, opt2 = amp.initialize(model2, opt2, opt_level="O2", verbosity=0, fused_step=True)
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["opt"])
    amp.load_state_dict(state["amp"])
    assert amp.loss_scalers()[0].loss_scale == 16384.0
    for i in range(5, 8):
        opt2.zero_grad()
        with amp.scale_loss(_loss(model2, i), opt2) as scaled:
            scaled.backward()
        opt2.step()
    for a, b in zip(expected, _masters(opt2)):
        assert torch.equal(a, b)


# ---- clipping ----------------------------------------------------------------------------------

@pytest.mark.parametrize("clip", ["amp", "apex"])
def test_clipping_matches_the_unfused_step(clip):
    _, fused_opt = _train(OPTIMIZERS["SGD-momentum"], True, clip=clip, inject_at={3})
    fused = _masters(fused_opt)
    _fresh_handle()
    _, plain_opt = _train(OPTIMIZERS["SGD-momentum"], False, clip="apex", inject_at={3})
    for a, b in zip(fused, _masters(plain_opt)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_clip_grad_norm_returns_the_true_norm_without_materialising():
    model = torch.nn.Linear(4, 2, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0, fused_step=True)
    with amp.scale_loss(model(torch.ones(1, 4)).float().sum(), opt) as scaled:
        scaled.backward()
    with CountSyncs() as syncs:
        norm = amp.clip_grad_norm_(opt, 1.0)
    assert syncs.count == 0
    assert opt._apex_lite_amp.grad_state == CHECKED
    assert is_lazy(opt._apex_lite_amp.masters()[0].grad)   # nothing made
    torch.testing.assert_close(norm, torch.tensor(8.0 ** 0.5))   # ones(2, 4)
    before = opt._apex_lite_amp.masters()[0].detach().clone()
    opt.step()
    step = before - opt._apex_lite_amp.masters()[0]
    torch.testing.assert_close(step, torch.full((2, 4), 0.1 / 8.0 ** 0.5), rtol=1e-5,
                               atol=1e-7)


def test_master_params_materialises_true_gradients_between_backward_and_step():
    model = torch.nn.Linear(4, 2, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0, fused_step=True)
    with amp.scale_loss(model(torch.ones(1, 4)).float().sum() * 3, opt) as scaled:
        scaled.backward()
    (master,) = amp.master_params(opt)
    assert opt._apex_lite_amp.grad_state == UNSCALED
    assert torch.equal(master.grad, torch.full((2, 4), 3.0))
    master.grad.mul_(0.5)                    # what clipping does: the step applies it
    before = master.detach().clone()
    opt.step()
    torch.testing.assert_close(before - master, torch.full((2, 4), 0.15))
    (master,) = amp.master_params(opt)       # after the step nothing is made
    assert opt._apex_lite_amp.grad_state == UNSCALED


def test_a_nonfinite_norm_skips_the_step():
    model, opt = _train(OPTIMIZERS["SGD"], True, steps=1)
    before = snapshot(model, opt)
    opt.zero_grad()
    with amp.scale_loss(_loss(model, 1), opt) as scaled:
        scaled.backward()
        # Huge but finite bf16 gradients (inside the block: an edit after it is refused): the
        # norm overflows.
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None and p.grad.dtype == torch.bfloat16:
                    p.grad.fill_(3e38)
    norm = amp.clip_grad_norm_(opt, 1.0)
    assert not torch.isfinite(norm)
    opt.step()
    assert_bitwise_equal(before, snapshot(model, opt))


# ---- schedulers, param groups, checkpoints, choices ----------------------------------------------

def test_lr_scheduler_and_add_param_group_on_the_fused_step():
    model = torch.nn.Linear(4, 2)
    extra = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    [model, extra], opt = amp.initialize([model, extra], opt, opt_level="O2", verbosity=0,
                                         fused_step=True)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.add_param_group({"params": list(extra.parameters()), "lr": 1.0})
    for i in range(3):
        opt.zero_grad()
        before = _masters(opt)
        loss = model(torch.ones(1, 4)).float().sum() + extra(torch.ones(1, 4)).float().sum()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        scheduler.step()
        moved = [b - a for b, a in zip(before, _masters(opt))]
        torch.testing.assert_close(moved[1], torch.full((2,), 0.1 * 0.5 ** i))  # bias: grad 1
        torch.testing.assert_close(moved[3], torch.full((2,), 1.0 * 0.5 ** i))


def test_fused_state_loads_into_plain_torch():
    model, opt = _train(OPTIMIZERS["Adam"], True, steps=3)
    plain = _net()
    plain.load_state_dict(model.state_dict())
    plain_opt = OPTIMIZERS["Adam"](plain.parameters())
    plain_opt.load_state_dict(opt.state_dict())
    for p, master in zip(plain.parameters(), opt._apex_lite_amp.masters()):
        assert torch.equal(p, master)
    plain_opt.zero_grad()
    _loss(plain, 0).backward()
    plain_opt.step()                         # the restored state steps in plain fp32 torch
    assert all(int(s["step"]) == 4 for s in plain_opt.state.values())


def test_fused_step_true_names_an_optimizer_it_cannot_run():
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.RMSprop(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="fused_step=True, but optimizer 0 \\(RMSprop\\) cannot "
                                         "take the fused step: torch.optim.rmsprop.RMSprop"):
        amp.initialize(model, opt, opt_level="O2", fused_step=True)
    assert model.weight.dtype == torch.float32      # refused before anything changed
    with pytest.raises(ValueError, match="fused_step must be None"):
        amp.initialize(model, opt, opt_level="O2", fused_step="yes")
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    assert not opt._apex_lite_amp.path.fused
    assert "unfused step (torch.optim.rmsprop.RMSprop is not an optimizer the fused ops" in str(amp.report())


def test_the_default_takes_the_fused_step_where_kernels_serve_the_device():
    """fused_step=None: the fused step with the native kernels; without them, with torch's own
    fused kernels for SGD, Adam and AdamW (what they compute), and the unfused step for the
    rest (the Python backend's fused ops are the kernels' exact but slower reference), saying
    why."""
    name, reason = backend("cpu")
    cases = [(torch.optim.Adam, {}, ""), (torch.optim.AdamW, {}, ""),
             (torch.optim.SGD, dict(momentum=0.9, nesterov=True), ""),
             (FusedAdam, {}, ""), (FusedSGD, dict(momentum=0.9, weight_decay=0.1), ""),
             (FusedAdagrad, dict(weight_decay=0.1), ""),
             (FusedAdagrad, dict(weight_decay=0.1, adagrad_w_mode=True),
              "param group 0 has adagrad_w_mode=True"),
             (FusedLAMB, {}, "torch has no fused kernel for apex_lite.optimizers.fused_lamb"
                             ".FusedLAMB's update"),
             (FusedAdam, dict(bias_correction=False), "param group 0 has bias_correction=False"),
             (FusedSGD, dict(weight_decay=0.1, wd_after_momentum=True),
              "param group 0 has wd_after_momentum=True")]
    for make, options, why in cases:
        _fresh_handle()
        model = torch.nn.Linear(4, 2)
        opt = make(model.parameters(), lr=0.1, **options)
        model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
        path = opt._apex_lite_amp.path
        fused = name == "native" or not why
        assert path.fused == fused, (make, options)
        report = str(amp.report())
        if name == "native":
            assert f"optimizer 0 ({make.__name__}): fused step\n" in report + "\n"
        elif fused:
            assert (f"optimizer 0 ({make.__name__}): fused step (torch's fused kernels, half "
                    f"gradients converted to fp32 1 MiB at a time on cpu)") in report
        else:
            assert path.why.startswith(f"the native kernels do not serve cpu ({reason}), {why}")
            assert path.why.endswith("and the Python reference of the fused step is slower "
                                     "than the optimizer's own; fused_step=True takes it anyway "
                                     "(no fp32 master gradients)")


@pytest.mark.parametrize("options", [dict(amsgrad=True), dict(maximize=True)])
def test_options_the_kernels_do_not_compute_take_the_unfused_step(options):
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1, **options)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    assert not opt._apex_lite_amp.path.fused
    assert next(iter(options)) in opt._apex_lite_amp.path.why


@pytest.mark.parametrize("level, kwargs", [("O0", {}), ("O1", {}), ("O3", {}), ("O4", {}),
                                           ("O3", dict(master_weights=True)),
                                           ("O0", dict(master_weights=True)),
                                           ("O5", dict(master_weights=False))])
def test_other_levels_take_the_unfused_step_and_say_why(level, kwargs):
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, **kwargs)
    assert not opt._apex_lite_amp.path.fused
    assert f"the fused step runs at O2 and O5 (fp32 master weights), not at {level}" in \
        opt._apex_lite_amp.path.why
    other = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match="fused_step=True"):
        amp.initialize(other, torch.optim.SGD(other.parameters(), lr=0.1), opt_level=level,
                       fused_step=True, **kwargs)


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_o2_and_o5_take_the_fused_step(level):
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, fused_step=True)
    assert opt._apex_lite_amp.path.fused
