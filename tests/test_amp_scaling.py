"""Loss scaling: the dynamic rule, skipped steps, several losses and optimizers, accumulation,
logging, and the one host sync per step."""
import logging

import pytest
import torch

from amp_helpers import (CountSyncs, Net, batch, inject_inf, snapshot, assert_bitwise_equal,
                         train_step)
from apex_lite import amp
from apex_lite.amp.scaler import LossScaler

SKIP_LINE = "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0"


def _setup(level="O2", opt_cls=torch.optim.Adam, **kwargs):
    model = Net()
    opt = opt_cls(model.parameters(), lr=1e-2)
    kwargs.setdefault("verbosity", 0)
    # The log and its counters are checked decision by decision: on the fused step (O2's
    # default) the host catches up with the device after every decision with sync_interval=1
    # (test_amp_fused_step.py tests the catch-up at the default interval).
    kwargs.setdefault("sync_interval", 1)
    return amp.initialize(model, opt, opt_level=level, **kwargs)


# ---- the rule, on the scaler itself -------------------------------------------------------------

@pytest.mark.parametrize("kwargs, events, scales", [
    # apex's defaults: halve on each overflow, double after scale_window clean steps.
    (dict(), "o", [32768.0]),
    (dict(), "ooo", [32768.0, 16384.0, 8192.0]),
    (dict(scale_window=3), "...", [65536.0, 65536.0, 131072.0]),
    (dict(scale_window=3), "..o...", [65536.0, 65536.0, 32768.0, 32768.0, 32768.0, 65536.0]),
    # ceiling: the initial scale is capped too, and growth stops there.
    (dict(max_loss_scale=1024.0, scale_window=1), "..", [1024.0, 1024.0]),
    (dict(max_loss_scale=2.0 ** 17, scale_window=1), "...", [2.0 ** 17] * 3),
    # floor
    (dict(min_loss_scale=16384.0), "oooo", [32768.0, 16384.0, 16384.0, 16384.0]),
    # without min_loss_scale, the smallest fp32 scale whose inverse is finite
    (dict(), "o" * 145, [2.0 ** (15 - i) for i in range(141)] + [2.0 ** -126] * 4),
    # hysteresis: two overflows per halving; growth resets it.
    (dict(hysteresis=2), "oooo", [65536.0, 32768.0, 32768.0, 16384.0]),
    (dict(hysteresis=2, scale_window=1), "o.o", [65536.0, 131072.0, 131072.0]),
])
@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device"])
def test_dynamic_rule(kwargs, events, scales, on_device):
    """The same rule whether the scale lives on the host or on the device (the fused step)."""
    kwargs = {"min_loss_scale": None, "max_loss_scale": 2.0 ** 24, **kwargs}
    scaler = LossScaler(0, "dynamic", **kwargs)
    if on_device:
        scaler.use_device(torch.device("cpu"))
    seen = []
    for event in events:
        if on_device:
            scaler.update_on_device(torch.tensor([float(event == "o")]), torch.zeros(1))
        else:
            scaler.update(event == "o")
        seen.append(scaler.loss_scale)
    assert seen == scales
    assert scaler.steps == len(events) and scaler.skipped_steps == events.count("o")
    assert scaler.last_step_skipped == (events[-1] == "o")


@pytest.mark.parametrize("seed", range(5))
def test_device_rule_matches_the_host_rule_on_random_decisions(seed):
    """2000 random decisions: a device scaler, replayed on the host every sync_interval
    decisions (and when read), ends where a host scaler does, counter for counter, and hands
    the same decisions to its on_decision hook in the same order."""
    import random
    rng = random.Random(seed)
    kwargs = dict(min_loss_scale=rng.choice([None, 2.0 ** 4]), max_loss_scale=2.0 ** 20,
                  scale_window=rng.choice([1, 5, 50]), hysteresis=rng.choice([1, 3]))
    host = LossScaler(0, "dynamic", **kwargs)
    device = LossScaler(0, "dynamic", sync_interval=7, **kwargs)
    device.use_device(torch.device("cpu"))
    seen_host, seen_device = [], []
    host.on_decision = lambda *decision: seen_host.append(decision)
    device.on_decision = lambda *decision: seen_device.append(decision)
    for _ in range(2000):
        overflow = rng.random() < 0.3
        old = host.loss_scale
        host.update(overflow)
        host.on_decision(old, overflow, False)
        device.update_on_device(torch.tensor([float(overflow)]), torch.zeros(1))
    assert len(seen_device) == 2000 - 2000 % 7   # replayed when the history filled up
    assert (device.loss_scale, device.steps, device.skipped_steps, device.last_step_skipped,
            device.unskipped, device.hysteresis_left) == \
        (host.loss_scale, host.steps, host.skipped_steps, host.last_step_skipped,
         host.unskipped, host.hysteresis_left)
    assert seen_device == seen_host


def test_static_scale_never_moves_but_still_skips():
    scaler = LossScaler(0, 128.0, min_loss_scale=None, max_loss_scale=2.0 ** 24, scale_window=1)
    for overflow in (True, False, False, True):
        scaler.update(overflow)
        assert scaler.loss_scale == 128.0
    assert scaler.skipped_steps == 2


# ---- skipped steps change nothing ---------------------------------------------------------------

@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_step_with_nonfinite_grads_is_skipped_bit_for_bit(level, bad, caplog):
    model, opt = _setup(level, verbosity=1)
    for step in range(3):
        train_step(model, opt, step, amp)
    before = snapshot(model, opt)
    scale = amp.default_handle()._run.scalers[0].loss_scale
    handle = model.fc1.weight.register_hook(lambda g: g.masked_fill(g.new_ones(g.shape).bool()
                                                                    .tril(), bad))
    # After calibration (3 clean steps) a skip is logged with apex's text: INFO at verbosity 1
    # (a WARNING under a static scale).
    with caplog.at_level(logging.INFO, logger="apex_lite.amp"):
        train_step(model, opt, 3, amp)
    handle.remove()
    assert_bitwise_equal(before, snapshot(model, opt))
    scaler = amp.default_handle()._run.scalers[0]
    assert scaler.last_step_skipped and scaler.skipped_steps == 1
    assert scaler.loss_scale == (scale / 2 if scaler.dynamic else scale)
    assert "Gradient overflow.  Skipping step, loss scaler 0" in caplog.text
    train_step(model, opt, 4, amp)           # and training goes on
    assert not scaler.last_step_skipped
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_skip_log_has_apex_text(caplog):
    model, opt = _setup("O1", verbosity=2)   # apex's verbosity=1: every skip a WARNING
    hook = inject_inf(model.fc2.bias)
    with caplog.at_level(logging.WARNING, logger="apex_lite.amp"):
        train_step(model, opt, 0, amp)
    hook.remove()
    assert [r.getMessage() for r in caplog.records if r.name == "apex_lite.amp"] == [SKIP_LINE]


def test_nonfinite_loss_is_named_as_such(caplog):
    model, opt = _setup("O2", verbosity=1)
    loss = model(batch(0)[0]).sum() * float("nan")
    with caplog.at_level(logging.WARNING, logger="apex_lite.amp"):
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
    opt.step()
    assert ("Loss is inf or NaN (the forward produced a non-finite loss, not a scaling "
            "problem).  Skipping step, loss scaler 0 reducing loss scale to 32768.0"
            ) in caplog.text


def test_nonfinite_loss_in_a_delayed_micro_batch_is_named(caplog):
    model, opt = _setup("O2", verbosity=1)
    x = batch(0)[0]
    with amp.scale_loss(model(x).sum() * float("inf"), opt, delay_unscale=True) as scaled:
        scaled.backward()
    with caplog.at_level(logging.WARNING, logger="apex_lite.amp"):
        with amp.scale_loss(model(x).sum(), opt) as scaled:
            scaled.backward()
    assert "Loss is inf or NaN" in caplog.text
    before = snapshot(model, opt)
    opt.step()
    assert_bitwise_equal(before, snapshot(model, opt), fresh_state_ok=True)


def test_static_scale_skip_is_logged_and_verbosity_zero_is_silent(caplog):
    model, opt = _setup("O2", loss_scale=128.0, verbosity=1)
    hook = inject_inf(model.fc2.bias)
    with caplog.at_level(logging.WARNING, logger="apex_lite.amp"):
        train_step(model, opt, 0, amp)
    assert "Gradient overflow.  Skipping step, loss scaler 0 keeping its static loss scale " \
           "128.0" in caplog.text
    caplog.clear()
    model, opt = _setup("O2", verbosity=0)
    inject_inf(model.fc2.bias)
    with caplog.at_level(logging.DEBUG, logger="apex_lite.amp"):
        train_step(model, opt, 0, amp)
    assert caplog.text == ""
    hook.remove()


def test_hysteresis_keyword_delays_the_halving(caplog):
    model, opt = _setup("O2", hysteresis=2, verbosity=2)
    scaler = amp.default_handle()._run.scalers[0]
    hook = inject_inf(model.fc2.bias)
    with caplog.at_level(logging.WARNING, logger="apex_lite.amp"):
        train_step(model, opt, 0, amp)
        assert scaler.loss_scale == 65536.0 and scaler.last_step_skipped
        train_step(model, opt, 1, amp)
    hook.remove()
    assert scaler.loss_scale == 32768.0 and scaler.skipped_steps == 2
    assert "keeping loss scale 65536.0 (hysteresis: 1 more overflow(s) before it is reduced)" \
        in caplog.text
    assert SKIP_LINE in caplog.text


def test_growth_after_the_window_in_training():
    model, opt = _setup("O2", scale_window=4)
    for step in range(4):
        train_step(model, opt, step, amp)
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 131072.0, "unskipped": 0}


# ---- several models, optimizers and losses ------------------------------------------------------

@pytest.mark.parametrize("level", ["O1", "O2"])
def test_only_the_optimizers_given_to_the_overflowing_loss_skip(level):
    gen, disc = Net(), Net()
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-2)
    opt_d = torch.optim.SGD(disc.parameters(), lr=1e-2, momentum=0.9)
    [gen, disc], [opt_g, opt_d] = amp.initialize([gen, disc], [opt_g, opt_d], opt_level=level,
                                                 num_losses=3, verbosity=0)
    scalers = amp.default_handle()._run.scalers
    x, y = batch(0)
    for step in range(2):
        for opt in (opt_g, opt_d):
            opt.zero_grad()
        # Two discriminator losses accumulated before its step (as apex's DCGAN), the first
        # overflowing on the second iteration.
        hook = inject_inf(disc.fc2.bias) if step == 1 else None
        with amp.scale_loss(disc(x).float().mean(), opt_d, loss_id=0) as scaled:
            scaled.backward()
        if hook:
            hook.remove()
        with amp.scale_loss((disc(y.expand(-1, 8)).float() ** 2).mean(), opt_d,
                            loss_id=1) as scaled:
            scaled.backward()
        before_d = snapshot(disc, opt_d)
        opt_d.step()
        before_g = snapshot(gen, opt_g)
        with amp.scale_loss(torch.nn.functional.mse_loss(gen(x).float(), y), opt_g,
                            loss_id=2) as scaled:
            scaled.backward()
        opt_g.step()
    assert_bitwise_equal(before_d, snapshot(disc, opt_d))        # the last step was skipped
    with pytest.raises(AssertionError):
        assert_bitwise_equal(before_g, snapshot(gen, opt_g))      # the generator stepped
    assert [s.loss_scale for s in scalers] == [32768.0, 65536.0, 65536.0]
    assert [s.skipped_steps for s in scalers] == [1, 0, 0]


# ---- accumulation -------------------------------------------------------------------------------

def _micro_batch_loss(model, micro_batch):
    x, y = micro_batch
    return torch.nn.functional.mse_loss(model(x).float(), y)


def _plain_torch_accumulated_gradients(level, micro, in_half_grads):
    """What amp's accumulation must give, by plain torch on the unscaled losses: the model in
    the level's dtypes built by hand (O1: the forward under torch.autocast; O2: bf16 Linear
    layers, fp32 batchnorm between casts, fp32 output), one backward per micro-batch. Summed
    in fp32 in micro-batch order, or (``in_half_grads``: O2's delay_unscale, which accumulates in
    the half model's gradients) accumulated by autograd in the bf16 .grad and then widened.
    A power-of-two loss scale commutes with every rounding here (no overflow or underflow), so
    amp's gradients must equal these bit for bit."""
    torch.manual_seed(7)
    model, half = Net(), torch.bfloat16
    if level == "O2":
        model.fc1.to(half)
        model.fc2.to(half)

        def forward(x):
            hidden = model.bn(model.fc1(x.to(half)).float()).to(half)
            return model.fc2(torch.relu(hidden)).float()
    elif level == "O1":
        def forward(x):
            with torch.autocast("cpu", dtype=half):
                return model(x).float()
    else:
        forward = model
    total = None
    for x, y in micro:
        if not in_half_grads:
            model.zero_grad()
        torch.nn.functional.mse_loss(forward(x), y).backward()
        if not in_half_grads:
            grads = [p.grad.float() for p in model.parameters()]
            total = grads if total is None else [t + g for t, g in zip(total, grads)]
    return total if total is not None else [p.grad.float() for p in model.parameters()]


# Unscaling by a power of two is exact, so each case matches plain torch bit for bit: fp32
# sums of the micro-batches' gradients, or (O2 with delay_unscale) their bf16 sum in the half
# model's gradients.
# O0's static scale is 1 by default: 128 makes its case unscale too.
@pytest.mark.parametrize("level, kwargs", [
    ("O0", dict(loss_scale=128.0)), ("O1", {}), ("O2", dict(fused_step=True)),
    ("O2", dict(fused_step=False))], ids=["O0", "O1", "O2-fused", "O2-unfused"])
@pytest.mark.parametrize("delay_unscale", [False, True])
def test_gradient_accumulation(level, kwargs, delay_unscale):
    micro = [batch(i) for i in range(3)]
    expected = _plain_torch_accumulated_gradients(level, micro,
                                                  in_half_grads=level == "O2" and delay_unscale)
    torch.manual_seed(7)
    model, opt = _setup(level, opt_cls=torch.optim.SGD, **kwargs)
    opt.zero_grad()
    for i in range(len(micro)):
        last = i == len(micro) - 1
        with amp.scale_loss(_micro_batch_loss(model, micro[i]), opt,
                            delay_unscale=delay_unscale and not last) as scaled:
            scaled.backward()
    assert amp.loss_scalers()[0].loss_scale > 1     # the gradients were scaled
    masters = list(amp.master_params(opt))
    assert len(masters) == len(expected)
    for grad, master in zip(expected, masters):
        assert master.dtype == torch.float32
        torch.testing.assert_close(master.grad, grad, rtol=0, atol=0)
    opt.step()


def test_scale_loss_takes_apex_model_argument_and_trains_as_without_it():
    """apex's scale_loss(..., model=) is accepted and changes nothing: three O2 steps with it
    equal three without, bit for bit."""
    runs = []
    for pass_model in (False, True):
        amp.default_handle().__init__()
        torch.manual_seed(3)
        model, opt = _setup("O2", opt_cls=torch.optim.SGD)
        for step in range(3):
            opt.zero_grad()
            with amp.scale_loss(_micro_batch_loss(model, batch(step)), opt,
                                model=model if pass_model else None) as scaled:
                scaled.backward()
            opt.step()
        runs.append(snapshot(model, opt))
    assert amp.loss_scalers()[0].steps == 3 and not amp.loss_scalers()[0].skipped_steps
    assert_bitwise_equal(*runs)


def test_accumulation_without_zero_grad_after_step_adds_like_torch():
    model, opt = _setup("O0", opt_cls=torch.optim.SGD)
    x, y = batch(0)
    for _ in range(2):     # no zero_grad in between: torch semantics, gradients add up
        with amp.scale_loss(torch.nn.functional.mse_loss(model(x), y), opt) as scaled:
            scaled.backward()
    reference = Net()
    reference.load_state_dict(model.state_dict())
    for _ in range(2):
        torch.nn.functional.mse_loss(reference(x), y).backward()
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=0, atol=0)


def test_step_refused_while_gradients_are_still_scaled():
    model, opt = _setup("O2")
    with amp.scale_loss(model(batch(0)[0]).sum(), opt, delay_unscale=True) as scaled:
        scaled.backward()
    before = snapshot(model, opt)
    with pytest.raises(RuntimeError, match="still multiplied by the loss scale"):
        opt.step()
    assert_bitwise_equal(before, snapshot(model, opt))


def test_delayed_unscale_across_loss_scalers_with_different_scales_is_refused():
    model, opt = _setup("O2", num_losses=2)
    amp.default_handle()._run.scalers[1].loss_scale = 8.0
    with amp.scale_loss(model(batch(0)[0]).sum(), opt, loss_id=0, delay_unscale=True) as s:
        s.backward()
    with pytest.raises(RuntimeError, match="Accumulate under one loss_id"):
        with amp.scale_loss(model(batch(0)[0]).sum(), opt, loss_id=1):
            pass


# ---- unscaled at the end of the context ---------------------------------------------------------

@pytest.mark.parametrize("level", ["O1", "O2"])
def test_grads_are_true_grads_after_the_context_so_clipping_works(level):
    x, y = batch(0)
    torch.manual_seed(3)
    reference = Net()
    torch.nn.functional.mse_loss(reference(x), y).backward()
    torch.manual_seed(3)
    model, opt = _setup(level, opt_cls=torch.optim.SGD)
    with amp.scale_loss(torch.nn.functional.mse_loss(model(x).float(), y), opt) as scaled:
        scaled.backward()
    masters = list(amp.master_params(opt))
    for master, ref in zip(masters, reference.parameters()):
        torch.testing.assert_close(master.grad, ref.grad, rtol=3e-2, atol=3e-2)
    norm = torch.nn.utils.clip_grad_norm_(masters, max_norm=1e9)
    ref_norm = torch.nn.utils.clip_grad_norm_(list(reference.parameters()), max_norm=1e9)
    torch.testing.assert_close(norm, ref_norm, rtol=3e-2, atol=0)


def test_delay_overflow_check_defers_the_decision_to_step():
    model, opt = _setup("O2")
    scaler = amp.default_handle()._run.scalers[0]
    hook = inject_inf(model.fc2.bias)
    with amp.scale_loss(model(batch(0)[0]).sum(), opt, delay_overflow_check=True) as scaled:
        scaled.backward()
    hook.remove()
    assert scaler.steps == 0 and scaler.loss_scale == 65536.0
    before = snapshot(model, opt)
    opt.step()
    assert scaler.steps == 1 and scaler.loss_scale == 32768.0
    assert_bitwise_equal(before, snapshot(model, opt), fresh_state_ok=True)


# ---- cost: fused calls and host syncs -----------------------------------------------------------

@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_one_host_sync_and_one_fused_call_per_step(level, monkeypatch):
    """The unfused step: one unscale call (O2: and one copy back), one host read."""
    from apex_lite.amp import grad_lists, master_grads, opt_params, step_path, two_copies
    model, opt = _setup(level, opt_cls=torch.optim.SGD, fused_step=False)
    calls = []
    real_scale = grad_lists.fused_scale
    for module in (master_grads, opt_params, step_path, two_copies):   # where it is called
        monkeypatch.setattr(module, "fused_scale",
                            lambda *a: calls.append(len(a[0])) or real_scale(*a))
    x, y = batch(0)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x).float(), y)
    with CountSyncs() as syncs:
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    assert syncs.count == 1
    n = len(list(model.parameters()))
    assert calls == ([n, 4] if level == "O2" else [n])   # unscale; O2: copy of the 4 cast params


def test_found_inf_is_all_reduced_when_distributed(tmp_path, monkeypatch):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        reduced = []
        real = dist.all_reduce
        monkeypatch.setattr(dist, "all_reduce",
                            lambda t, op, group=None: reduced.append(op) or real(t, op, group))
        model, opt = _setup("O2")
        hook = inject_inf(model.fc2.bias)
        train_step(model, opt, 0, amp)
        hook.remove()
        assert reduced == [dist.ReduceOp.MAX]
        assert amp.default_handle()._run.scalers[0].loss_scale == 32768.0
    finally:
        dist.destroy_process_group()


# ---- bad input ----------------------------------------------------------------------------------

def test_scale_loss_before_initialize():
    model = Net()
    with pytest.raises(RuntimeError, match="amp.scale_loss was called before amp.initialize"):
        with amp.scale_loss(model(batch(0)[0]).sum(), torch.optim.SGD(model.parameters(), 0.1)):
            pass


@pytest.mark.parametrize("make_loss, error, message", [
    (lambda out: out.sum().long(), TypeError, "needs a floating-point loss tensor, got "
                                              "torch.int64"),
    (lambda out: 3.0, TypeError, "needs a floating-point loss tensor, got float"),
    (lambda out: out, ValueError, r"needs a scalar loss, got shape \(32, 1\)"),
])
def test_bad_losses_are_refused_and_change_nothing(make_loss, error, message):
    model, opt = _setup("O2")
    train_step(model, opt, 0, amp)
    before = snapshot(model, opt)
    scaler_state = amp.state_dict()["loss_scaler0"]
    with pytest.raises(error, match=message):
        with amp.scale_loss(make_loss(model(batch(1)[0])), opt):
            pass
    assert_bitwise_equal(before, snapshot(model, opt))
    assert amp.state_dict()["loss_scaler0"] == scaler_state


def test_bad_loss_id_and_foreign_optimizer():
    model, opt = _setup("O1", num_losses=2)
    loss = model(batch(0)[0]).sum()
    with pytest.raises(ValueError, match="loss_id=2 is out of range.*num_losses=2"):
        with amp.scale_loss(loss, opt, loss_id=2):
            pass
    stranger = torch.optim.SGD(Net().parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="was not passed to amp.initialize"):
        with amp.scale_loss(loss, stranger):
            pass


def test_a_closure_without_scale_loss_is_refused_with_the_way_out():
    model, opt = _setup("O1")
    with pytest.raises(RuntimeError, match=r"step\(closure\): the closure did not run its "
                                           r"backward inside `with amp.scale_loss"):
        opt.step(lambda: 0.0)
