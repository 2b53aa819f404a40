"""amp.state_dict / load_state_dict: apex's format, refusals, and the bitwise resume across a
real process boundary."""
import copy
import os
import subprocess
import sys

import pytest
import torch

from amp_helpers import Net, snapshot, assert_bitwise_equal, train_step
from apex_lite import amp

SPECS = ["O0", "O1", "O2", "O3", "O2:fp16"]
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "amp_resume_worker.py")


def _setup(level="O2", **kwargs):
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    kwargs.setdefault("verbosity", 0)
    return amp.initialize(model, opt, opt_level=level, **kwargs)


# ---- the bitwise resume ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("resume")
    for mode in ("train", "resume"):
        done = subprocess.run([sys.executable, WORKER, mode, str(outdir)] + SPECS,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{mode} worker failed:\n{done.stdout}\n{done.stderr}"
    return outdir


@pytest.mark.parametrize("spec", SPECS)
def test_resume_in_a_fresh_process_is_bitwise_exact(resume_runs, spec):
    name = spec.replace(":", "_")
    full = torch.load(resume_runs / f"{name}_full.pt")
    resumed = torch.load(resume_runs / f"{name}_resumed.pt")
    assert full["loss_scaler0"] == resumed["loss_scaler0"]
    assert full["counters"] == resumed["counters"]
    assert full["counters"]["skipped_steps"] >= 2   # both injected overflows (fp16 also calibrates)
    for key in ("params", "buffers"):
        assert len(full[key]) == len(resumed[key])
        for a, b in zip(full[key], resumed[key]):
            torch.testing.assert_close(b, a, rtol=0, atol=0)


# ---- format ---------------------------------------------------------------------------------

def test_state_dict_format():
    model, opt = _setup("O2", num_losses=2)
    train_step(model, opt, 0, amp)
    state = amp.state_dict()
    assert list(state) == ["loss_scaler0", "loss_scaler1", "apex_lite"]
    assert state["loss_scaler0"] == {"loss_scale": 65536.0, "unskipped": 1}
    assert state["loss_scaler1"] == {"loss_scale": 65536.0, "unskipped": 0}
    extra = state["apex_lite"]
    assert extra["version"] == 1 and extra["opt_level"] == "O2"
    assert extra["loss_scalers"][0] == {"hysteresis_left": 1, "steps": 1, "skipped_steps": 0,
                                        "last_step_skipped": False}
    masters = list(amp.master_params(opt))
    assert len(extra["master_weights"]) == 1
    saved = extra["master_weights"][0]
    cast = [m for m in masters if m is not model.bn.weight and m is not model.bn.bias]
    assert len(saved) == len(cast)
    for s, m in zip(saved, cast):
        assert s.dtype == torch.float32 and s.data_ptr() != m.data_ptr()
        torch.testing.assert_close(s, m, rtol=0, atol=0)


def test_an_apex_written_state_loads():
    model, opt = _setup("O1", num_losses=2)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 17},
                         "loss_scaler1": {"loss_scale": 2048.0, "unskipped": 0}})
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 1024.0, "unskipped": 17}
    assert amp.state_dict()["loss_scaler1"] == {"loss_scale": 2048.0, "unskipped": 0}
    train_step(model, opt, 0, amp)
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 1024.0, "unskipped": 18}


@pytest.mark.parametrize("order", ["model_then_amp", "amp_then_model"])
def test_o2_masters_resume_exactly_in_either_load_order(order):
    model, opt = _setup("O2")
    for step in range(3):
        train_step(model, opt, step, amp)
    checkpoint = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                "amp": amp.state_dict()})
    expected = snapshot(model, opt)
    fresh, fresh_opt = _setup("O2")
    loads = [lambda: fresh.load_state_dict(checkpoint["model"]),
             lambda: amp.load_state_dict(checkpoint["amp"])]
    for load in (loads if order == "model_then_amp" else loads[::-1]):
        load()
    fresh_opt.load_state_dict(checkpoint["optimizer"])
    assert_bitwise_equal(expected, snapshot(fresh, fresh_opt))


def test_loading_fp32_weights_into_an_o2_model_sets_the_masters_exactly():
    source = Net()
    model, opt = _setup("O2")
    model.load_state_dict(source.state_dict())
    for (name, p), master in zip(source.named_parameters(), amp.master_params(opt)):
        torch.testing.assert_close(master, p, rtol=0, atol=0)


def test_loading_half_weights_into_an_o2_model_moves_the_masters_to_them():
    """A half state dict with other weights: the masters become those half values, exactly (the
    next step updates what was loaded). The model's own weights in half (its masters' rounding)
    leave the fp32 masters as they are, so a half checkpoint of this run loses nothing."""
    model, opt = _setup("O2")
    masters = [m.detach().clone() for m in amp.master_params(opt)]
    own = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    model.load_state_dict(own)
    for before, master in zip(masters, amp.master_params(opt)):
        torch.testing.assert_close(master, before, rtol=0, atol=0)
    torch.manual_seed(123)
    other = {k: (v + torch.randn_like(v) if "weight" in k or "bias" in k else v).to(
        torch.bfloat16) for k, v in Net().state_dict().items()}
    model.load_state_dict(other)
    for (name, p), master, before in zip(model.named_parameters(), amp.master_params(opt),
                                         masters):
        assert not torch.equal(other[name].float(), before)
        torch.testing.assert_close(master, other[name].float(), rtol=0, atol=0)
        torch.testing.assert_close(p, other[name].to(p.dtype), rtol=0, atol=0)


# ---- refusals: nothing changes --------------------------------------------------------------

def _good_state():
    model, opt = _setup("O2", num_losses=2)
    train_step(model, opt, 0, amp)
    return copy.deepcopy(amp.state_dict())


def _mutate(path, value):
    def apply(state):
        target = state
        for key in path[:-1]:
            target = target[key]
        if value is KeyError:
            del target[path[-1]]
        else:
            target[path[-1]] = value
        return state
    return apply


@pytest.mark.parametrize("mutate, message", [
    (_mutate(["loss_scaler1"], KeyError), r"holds 1 loss scaler\(s\).*num_losses=2"),
    (_mutate(["loss_scaler2"], {"loss_scale": 1.0, "unskipped": 0}),
     r"holds 3 loss scaler\(s\).*initialize with num_losses=3"),
    (_mutate(["model"], {}), r"this is not an amp state: unexpected keys \['model'\]"),
    (_mutate(["loss_scaler0", "loss_scale"], -1.0), "must be a positive finite number"),
    (_mutate(["loss_scaler0", "loss_scale"], float("nan")), "must be a positive finite number"),
    (_mutate(["loss_scaler0", "loss_scale"], 2.0 ** 30), "outside this run's"),
    (_mutate(["loss_scaler0", "unskipped"], "3"), "must be a non-negative int"),
    (_mutate(["loss_scaler0", "extra"], 1), "apex's format"),
    (_mutate(["apex_lite", "version"], 7), "has version 7; this apex_lite reads version 1"),
    (_mutate(["apex_lite", "opt_level"], "O1"), "saved at opt_level 'O1' but this run uses 'O2'"),
    (_mutate(["apex_lite", "master_weights", 0, 0], torch.zeros(3)), "saved master weight for "
                                                                     "'fc1.weight'"),
    (_mutate(["apex_lite", "master_weights", 0], []), "holds 0 master weights for model 0"),
    (_mutate(["apex_lite", "loss_scalers", 1, "steps"], -1), "counter 'steps'"),
])
def test_a_state_that_does_not_fit_is_refused_and_nothing_changes(mutate, message):
    state = mutate(_good_state())
    model, opt = _setup("O2", num_losses=2)
    train_step(model, opt, 5, amp)
    before_amp = copy.deepcopy(amp.state_dict())
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=message):
        amp.load_state_dict(state)
    assert_bitwise_equal(before, snapshot(model, opt))
    after_amp = amp.state_dict()
    assert {k: v for k, v in after_amp.items() if k != "apex_lite"} == \
           {k: v for k, v in before_amp.items() if k != "apex_lite"}
    assert after_amp["apex_lite"]["loss_scalers"] == before_amp["apex_lite"]["loss_scalers"]


def _differing_state():
    """A valid O2 state whose scalers and counters all differ from a fresh run's."""
    model, opt = _setup("O2", num_losses=2)
    train_step(model, opt, 0, amp)
    state = copy.deepcopy(amp.state_dict())
    state["loss_scaler0"] = {"loss_scale": 32768.0, "unskipped": 5}
    state["loss_scaler1"] = {"loss_scale": 1024.0, "unskipped": 7}
    state["apex_lite"]["loss_scalers"] = [
        {"hysteresis_left": 1, "steps": 40, "skipped_steps": 3, "last_step_skipped": True}] * 2
    state["apex_lite"]["master_weights"][0] = [m + 1.0 for m in
                                               state["apex_lite"]["master_weights"][0]]
    return state


UNREADABLE_MASTERS = [
    pytest.param(lambda m: torch.zeros(3), id="wrong shape"),
    pytest.param(lambda m: "garbage", id="not a tensor"),
    pytest.param(lambda m: m.double(), id="float64"),
    # A tensor with no data (a checkpoint saved from meta tensors, or torch.load(map_location=
    # "meta")): it passes the shape and dtype checks and fails in the copy, after the scalers
    # were loaded.
    pytest.param(lambda m: torch.empty_like(m, device="meta"), id="meta"),
]


@pytest.mark.parametrize("damage", UNREADABLE_MASTERS)
def test_a_master_that_cannot_be_read_changes_no_scaler(damage):
    """Issue 15 row 11: everything is checked before anything is applied. The saved state's
    scalers and counters differ from the run's, so loading them first would show."""
    state = _differing_state()
    masters = state["apex_lite"]["master_weights"][0]
    masters[-1] = damage(masters[-1])
    model, opt = _setup("O2", num_losses=2)
    train_step(model, opt, 5, amp)
    before_amp = copy.deepcopy(amp.state_dict())
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match=r"the saved master weight for 'fc2.bias' of model 0"):
        amp.load_state_dict(state)
    assert_bitwise_equal(before, snapshot(model, opt))
    after_amp = amp.state_dict()
    for key in ("loss_scaler0", "loss_scaler1"):
        assert after_amp[key] == before_amp[key]
    assert after_amp["apex_lite"]["loss_scalers"] == before_amp["apex_lite"]["loss_scalers"]


def test_the_differing_state_itself_loads():
    """The control for the test above: without the damage, the same state loads whole."""
    state = _differing_state()
    _setup("O2", num_losses=2)
    amp.load_state_dict(state)
    assert amp.state_dict()["loss_scaler1"] == {"loss_scale": 1024.0, "unskipped": 7}


@pytest.mark.parametrize("num_losses, keep", [(1, []), (2, ["loss_scaler1"])])
def test_a_state_without_its_scaler_entries_says_so(num_losses, keep):
    """Issue 15 row 15."""
    _setup("O2", num_losses=num_losses)
    state = copy.deepcopy(amp.state_dict())
    for key in [k for k in state if k.startswith("loss_scaler") and k not in keep]:
        del state[key]
    with pytest.raises(ValueError, match=r"lacks.*'loss_scaler0'") as raised:
        amp.load_state_dict(state)
    assert f"num_losses={len(keep)}" not in str(raised.value)


def test_static_scale_mismatch_is_refused():
    _setup("O2", loss_scale=128.0)
    with pytest.raises(ValueError, match="static loss scale 128.0"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 0}})


def test_load_before_initialize_and_non_dict():
    with pytest.raises(RuntimeError, match="amp.load_state_dict was called before "
                                           "amp.initialize"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 1.0, "unskipped": 0}})
    _setup("O1")
    with pytest.raises(TypeError, match="takes the dict amp.state_dict\\(\\) returned"):
        amp.load_state_dict([1, 2])
