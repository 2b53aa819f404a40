"""Bad input and faults: each gets an error naming the problem and the fix, and leaves the
parameters, master weights, optimizer state and scaler state as they were."""
import copy

import pytest
import torch

from amp_helpers import (Net, batch, inject_inf, requires_cuda, snapshot, assert_bitwise_equal,
                         train_step)
from apex_lite import amp


def _setup(level="O2", **kwargs):
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    kwargs.setdefault("verbosity", 0)
    return amp.initialize(model, opt, opt_level=level, **kwargs)


def _amp_state():
    return copy.deepcopy(amp.state_dict())


def _assert_amp_state_equal(a, b):
    assert {k: v for k, v in a.items() if k != "apex_lite"} == \
           {k: v for k, v in b.items() if k != "apex_lite"}
    assert a["apex_lite"]["loss_scalers"] == b["apex_lite"]["loss_scalers"]
    for x, y in zip(a["apex_lite"]["master_weights"], b["apex_lite"]["master_weights"]):
        for s, t in zip(x, y):
            torch.testing.assert_close(s, t, rtol=0, atol=0)


def _backward(model, opt, step, **scale_kwargs):
    x, y = batch(step)
    loss = torch.nn.functional.mse_loss(model(x).float(), y)
    with amp.scale_loss(loss, opt, **scale_kwargs) as scaled:
        scaled.backward()


# ---- delay_overflow_check never drops the decision ---------------------------------------------

@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("overflow", [True, False])
def test_zero_grad_before_step_resolves_a_deferred_decision(level, overflow):
    model, opt = _setup(level)
    scaler = amp.loss_scalers()[0]
    train_step(model, opt, 0, amp)
    hook = inject_inf(model.fc2.bias) if overflow else None
    _backward(model, opt, 1, delay_overflow_check=True)
    if hook is not None:
        hook.remove()
    assert scaler.steps == 1                     # deferred
    opt.zero_grad()                              # the decision is made here, not dropped
    assert scaler.steps == 2 and scaler.last_step_skipped == overflow
    assert scaler.loss_scale == (32768.0 if overflow else 65536.0)
    before = snapshot(model, opt)
    opt.step()                                   # no gradients: torch's no-op
    assert_bitwise_equal(before, snapshot(model, opt))
    # The next backward is judged on its own: a clean one is applied.
    _backward(model, opt, 2, delay_overflow_check=True)
    opt.step()
    assert not scaler.last_step_skipped and scaler.steps == 3
    assert not all(torch.equal(a, b) for a, b in zip(before["masters"],
                                                      snapshot(model, opt)["masters"]))


def test_deferred_and_immediate_checks_give_the_same_schedule():
    schedules = []
    for delay in (False, True):
        amp.default_handle()._run = None
        torch.manual_seed(0)
        model, opt = _setup("O2", scale_window=2)
        for step in range(8):
            hook = inject_inf(model.fc2.bias) if step in (1, 2, 6) else None
            opt.zero_grad()
            _backward(model, opt, step, delay_overflow_check=delay)
            if hook is not None:
                hook.remove()
            opt.step()
        scaler = amp.loss_scalers()[0]
        schedules.append((scaler.loss_scale, scaler.steps, scaler.skipped_steps, snapshot(model)))
    assert schedules[0][:3] == schedules[1][:3] == (16384.0, 8, 3)
    assert_bitwise_equal(schedules[0][3], schedules[1][3])


@pytest.mark.parametrize("set_to_none", [True, False])
def test_model_zero_grad_clears_o2_master_gradients_of_that_model_only(set_to_none):
    a, b = Net(), Net()
    opt = torch.optim.SGD(list(a.parameters()) + list(b.parameters()), lr=0.1)
    [a, b], opt = amp.initialize([a, b], opt, opt_level="O2", verbosity=0)
    x = batch(0)[0]
    with amp.scale_loss(a(x).sum() + b(x).sum(), opt) as scaled:
        scaled.backward()
    masters_a = [p for p in amp.master_params(opt) if any(
        p is getattr(amp.default_handle()._run.pairs.of_model(q), "master", None) for q in a.parameters())]
    masters_b = [p for p in amp.master_params(opt) if any(
        p is getattr(amp.default_handle()._run.pairs.of_model(q), "master", None) for q in b.parameters())]
    a.zero_grad(set_to_none=set_to_none)
    for m in masters_a:
        assert m.grad is None if set_to_none else not m.grad.any()
    assert all(m.grad is not None and m.grad.any() for m in masters_b)
    b.zero_grad(set_to_none=set_to_none)
    # Every gradient is gone: as after optimizer.zero_grad(); zeroed ones accumulate from zero.
    assert opt._apex_lite_amp.grad_state.value == ("clean" if set_to_none else "unscaled")
    assert all(m.grad is None if set_to_none else not m.grad.any()
               for m in amp.master_params(opt))


# ---- misuse of step / scale_loss ----------------------------------------------------------------

@pytest.mark.parametrize("skipped", [False, True])
def test_step_twice_without_a_backward_is_refused(skipped):
    model, opt = _setup("O2")
    opt.step()                                   # a step before any backward is allowed
    train_step(model, opt, 0, amp)
    hook = inject_inf(model.fc2.bias) if skipped else None
    train_step(model, opt, 1, amp)
    if hook is not None:
        hook.remove()
    before, before_amp = snapshot(model, opt), _amp_state()
    with pytest.raises(RuntimeError, match="optimizer.step\\(\\) was called twice without a "
                                           "backward in between"):
        opt.step()
    assert_bitwise_equal(before, snapshot(model, opt))
    _assert_amp_state_equal(before_amp, _amp_state())
    train_step(model, opt, 2, amp)               # the normal loop goes on


def test_nested_scale_loss_for_the_same_optimizer_is_refused():
    model, opt = _setup("O2")
    train_step(model, opt, 0, amp)
    before, before_amp = snapshot(model, opt), _amp_state()
    x = batch(1)[0]
    with pytest.raises(RuntimeError, match="amp.scale_loss was entered for optimizer 0 inside "
                                           "another amp.scale_loss for the same optimizer"):
        with amp.scale_loss(model(x).sum(), opt) as outer:
            with amp.scale_loss(model(x).mean(), opt) as inner:
                (outer + inner).backward()
    assert_bitwise_equal(before, snapshot(model, opt))
    _assert_amp_state_equal(before_amp, _amp_state())
    train_step(model, opt, 2, amp)
    assert amp.loss_scalers()[0].steps == 2


def test_nested_scale_loss_for_different_optimizers_is_allowed():
    a, b = Net(), Net()
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    [a, b], [opt_a, opt_b] = amp.initialize([a, b], [opt_a, opt_b], opt_level="O1", num_losses=2,
                                            verbosity=0)
    x = batch(0)[0]
    with amp.scale_loss(a(x).sum(), opt_a, loss_id=0) as sa:
        with amp.scale_loss(b(x).sum(), opt_b, loss_id=1) as sb:
            sb.backward()
        sa.backward()
    opt_a.step()
    opt_b.step()
    assert [s.steps for s in amp.loss_scalers()] == [1, 1]


# ---- models on the wrong devices ----------------------------------------------------------------

def test_parameters_on_two_devices_are_refused_before_anything_changes():
    model = Net()
    model.fc2.to("meta")
    opt = torch.optim.SGD([model.fc1.weight], lr=0.1)
    with pytest.raises(ValueError, match=r"model 0 has parameters on 2 devices \('fc1.weight' on "
                                         r"cpu, 'fc2.weight' on meta\).*model.to\(device\)"):
        amp.initialize(model, opt, opt_level="O2", verbosity=0)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not hasattr(model, "_apex_lite_amp") and not hasattr(opt, "_apex_lite_amp")


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_model_moved_after_initialize_is_named(level):
    model, opt = _setup(level)
    train_step(model, opt, 0, amp)
    before_masters = [p.detach().clone() for p in amp.master_params(opt)]
    before_state = copy.deepcopy(opt.state_dict())
    before_amp = _amp_state()
    model.to("meta")
    loss = torch.ones((), requires_grad=True)
    fix = r"Move the model before initializing \(model.to\(device\); then model, optimizer"
    with pytest.raises(RuntimeError, match=r"amp.scale_loss: the model was moved after "
                                           r"amp.initialize: its parameters are not the tensors "
                                           r"amp.initialize set up \(now on meta.*" + fix):
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
    with pytest.raises(RuntimeError, match=r"optimizer.step\(\): the model was moved"):
        opt.step()
    for a, b in zip(before_masters, amp.master_params(opt)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert opt.state_dict()["state"].keys() == before_state["state"].keys()
    for k, s in before_state["state"].items():
        for name, v in s.items():
            torch.testing.assert_close(v, opt.state_dict()["state"][k][name], rtol=0, atol=0)
    _assert_amp_state_equal(before_amp, _amp_state())


@requires_cuda
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_model_moved_to_cuda_after_initialize_is_named(level):
    model, opt = _setup(level)
    model.cuda()
    loss = model(batch(0)[0].cuda()).float().sum()
    with pytest.raises(RuntimeError, match="its parameters are now on cuda:0, but were on cpu "
                                           "when amp.initialize ran"):
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()


# ---- amp states and checkpoint files ------------------------------------------------------------

@pytest.mark.parametrize("make_state, message", [
    (lambda m, o: m.state_dict(), r"it looks like a model's state_dict; keys \['fc1.weight'"),
    (lambda m, o: o.state_dict(), "it looks like an optimizer's state_dict"),
    (lambda m, o: {"model": m.state_dict(), "amp": amp.state_dict()},
     r"it looks like the whole checkpoint: pass checkpoint\['amp'\]"),
    (lambda m, o: {}, "the amp state is an empty dict"),
    (lambda m, o: {"epoch": 3}, "it holds none of the keys amp.state_dict"),
    (lambda m, o: {"loss_scaler0": {"loss_scale": 1.0, "unskipped": 0}, "apex_lite": [1]},
     "'apex_lite' entry is a list"),
])
def test_what_is_not_an_amp_state_is_refused_and_nothing_changes(make_state, message):
    model, opt = _setup("O2")
    train_step(model, opt, 0, amp)
    state = make_state(model, opt)
    before, before_amp = snapshot(model, opt), _amp_state()
    with pytest.raises(ValueError, match=message):
        amp.load_state_dict(state)
    assert_bitwise_equal(before, snapshot(model, opt))
    _assert_amp_state_equal(before_amp, _amp_state())


def _checkpoint(model, opt):
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": amp.state_dict()}


def test_save_and_load_checkpoint_round_trip(tmp_path):
    model, opt = _setup("O2")
    train_step(model, opt, 0, amp)
    path = tmp_path / "ckpt.pt"
    amp.save_checkpoint(_checkpoint(model, opt), path)
    loaded = amp.load_checkpoint(path)
    assert loaded["amp"]["loss_scaler0"] == amp.state_dict()["loss_scaler0"]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]      # no temporary left


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_a_damaged_checkpoint_file_is_explained(tmp_path, damage):
    model, opt = _setup("O2")
    train_step(model, opt, 0, amp)
    path = tmp_path / "ckpt.pt"
    amp.save_checkpoint(_checkpoint(model, opt), path)
    data = path.read_bytes()
    path.write_bytes({"truncate": data[:len(data) // 2], "garbage": b"\x80\x02not a checkpoint",
                      "empty": b""}[damage])
    before, before_amp = snapshot(model, opt), _amp_state()
    with pytest.raises(amp.CheckpointError, match=r"checkpoint '.*ckpt.pt' \(\d+ bytes\) is "
                                                  r"truncated or corrupted.*resume from an "
                                                  r"earlier checkpoint.*Nothing was loaded"):
        amp.load_checkpoint(path)
    assert_bitwise_equal(before, snapshot(model, opt))
    _assert_amp_state_equal(before_amp, _amp_state())


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path):
    path = tmp_path / "ckpt.pt"
    amp.save_checkpoint({"step": 1}, path)
    with pytest.raises(Exception):
        amp.save_checkpoint({"step": 2, "unpicklable": lambda: None}, path)
    assert amp.load_checkpoint(path) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]
