"""Issue 31: a run resumes at another opt level (O2 unstable? continue at O1 from the checkpoint).

- ``optimizer.load_state_dict`` never refuses torch's part because of the amp part it carries:
  what of the amp part does not fit is left out, with one WARNING saying what and why.
- ``amp.load_state_dict`` of a state saved at another level loads what carries over, at INFO:
  the loss scale and its counters between dynamic levels (O1 <-> O2); a static level (O0, O3,
  ROCm apex's O4 and O5) keeps its static scale; O2's and O5's masters are not needed (the
  model's state_dict holds the fp32 values). It still refuses, changing nothing, what is not an
  amp state and a different number of losses.
- Model, optimizer and amp state saved at each level load into a fresh run at each other level
  and training continues; the optimizer's moments and steps are restored exactly (as torch casts
  them to the parameters' dtype), the loss scale too between O1 and O2. The model's
  state_dict() holds no half tensor at any level.

Every ordered pair of O0..O5, the O2 and O5 sides on both step paths.
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch

from amp_helpers import Net, assert_bitwise_equal, inject_inf, snapshot, train_step
from apex_lite import amp
from apex_lite.amp.optimizer import AMP_STATE_KEY

LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5"]
DYNAMIC = {"O1", "O2"}   # the levels whose loss scale is dynamic by default
MASTERS = {"O2", "O5"}   # the levels with fp32 master weights, and two step paths


def _pairs():
    for saved in LEVELS:
        for resumed in LEVELS:
            if saved == resumed:
                continue
            if MASTERS & {saved, resumed}:
                for fused in (True, False):
                    path = "fused" if fused else "unfused"
                    yield pytest.param(saved, resumed, fused, id=f"{saved}-{resumed}-{path}")
            else:
                yield pytest.param(saved, resumed, None, id=f"{saved}-{resumed}")


def _setup(level, fused_step, seed=0, num_losses=1, verbosity=0):
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, num_losses=num_losses,
                                fused_step=fused_step if level in MASTERS else None,
                                verbosity=verbosity)
    assert opt._apex_lite_amp.path.fused == bool(fused_step and level in MASTERS)
    return model, opt


def _train(model, opt, steps, overflow_at=()):
    for step in steps:
        hook = inject_inf(model.fc1.weight) if step in overflow_at else None
        train_step(model, opt, step, amp)
        if hook:
            hook.remove()


def _scaler():
    state = amp.state_dict()
    return state["loss_scaler0"], state["apex_lite"]["loss_scalers"][0]


def _records(caplog, level):
    return [r for r in caplog.records if r.name.startswith("apex_lite") and r.levelno == level]


def _saved_run(level, fused_step):
    model, opt = _setup(level, fused_step)
    _train(model, opt, range(4), overflow_at={1})
    checkpoint = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                "amp": amp.state_dict()})
    assert all(v.dtype in (torch.float32, torch.int64) for v in checkpoint["model"].values())
    return checkpoint, _scaler()


def _as_torch_loads(saved: torch.Tensor, key: str, param: torch.Tensor) -> torch.Tensor:
    """What torch's load_state_dict makes of a saved state tensor: cast to its parameter's dtype,
    "step" kept as it is."""
    return saved if key == "step" else saved.to(param.dtype)


@pytest.mark.parametrize("saved, resumed, fused_step", list(_pairs()))
def test_a_checkpoint_resumes_at_another_level(saved, resumed, fused_step, caplog):
    checkpoint, saved_scaler = _saved_run(saved, fused_step)
    assert saved_scaler[1]["skipped_steps"] == 1
    amp.default_handle().__init__()
    model, opt = _setup(resumed, fused_step, seed=1, verbosity=1)
    fresh_scaler = _scaler()
    carries = saved in DYNAMIC and resumed in DYNAMIC
    expected_scaler = saved_scaler if carries else fresh_scaler

    model.load_state_dict(checkpoint["model"])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="apex_lite"):
        opt.load_state_dict(checkpoint["optimizer"])
    warnings = _records(caplog, logging.WARNING)
    assert len(warnings) == (0 if carries else 1), [r.getMessage() for r in warnings]
    if warnings:
        message = warnings[0].getMessage()
        assert "not restored" in message and f"'{saved}'" in message \
            and f"'{resumed}'" in message, message
    assert _scaler() == expected_scaler

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="apex_lite"):
        amp.load_state_dict(checkpoint["amp"])
    assert not _records(caplog, logging.WARNING)
    infos = [r.getMessage() for r in _records(caplog, logging.INFO)]
    assert len(infos) == 1 and f"'{saved}'" in infos[0] and f"'{resumed}'" in infos[0], infos
    assert _scaler() == expected_scaler
    if resumed in DYNAMIC and saved not in DYNAMIC:
        assert _scaler()[0]["loss_scale"] == 65536.0
    if resumed not in DYNAMIC:
        assert _scaler()[0]["loss_scale"] == 1.0

    # The weights: exact where the resumed level keeps fp32 (O2: its masters), else rounded.
    state = model.state_dict()
    for name, value in checkpoint["model"].items():
        expected = value.bfloat16().float() if resumed == "O3" and value.is_floating_point() \
            else value
        torch.testing.assert_close(state[name], expected, rtol=0, atol=0, msg=name)
    # The optimizer's moments and steps, exactly as torch loads them.
    params = [p for group in opt.param_groups for p in group["params"]]
    loaded = opt.state_dict()["state"]
    assert set(loaded) == set(checkpoint["optimizer"]["state"])
    for index, entry in checkpoint["optimizer"]["state"].items():
        assert set(loaded[index]) == set(entry)
        for key, value in entry.items():
            torch.testing.assert_close(loaded[index][key],
                                       _as_torch_loads(value, key, params[index]),
                                       rtol=0, atol=0, msg=f"{index} {key}")

    # And training continues.
    steps_before = [s["step"].item() for s in opt.state_dict()["state"].values()]
    _train(model, opt, range(4, 7))
    steps_after = [s["step"].item() for s in opt.state_dict()["state"].values()]
    assert steps_after == [s + 3 for s in steps_before]
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())
    assert _scaler()[1]["steps"] == expected_scaler[1]["steps"] + 3


# ---- what is still refused, and what the optimizer leaves out -----------------------------

def _o2_two_losses():
    model, opt = _setup("O2", False, num_losses=2)
    _train(model, opt, range(2), overflow_at={1})
    return copy.deepcopy({"optimizer": opt.state_dict(), "amp": amp.state_dict()})


@pytest.mark.parametrize("resumed", ["O1", "O2"])
def test_a_different_number_of_losses_is_still_refused_and_nothing_changes(resumed):
    checkpoint = _o2_two_losses()
    amp.default_handle().__init__()
    model, opt = _setup(resumed, False, seed=1)
    _train(model, opt, range(3))
    before, before_scaler = snapshot(model, opt), _scaler()
    with pytest.raises(ValueError, match=r"holds 2 loss scaler\(s\).*initialize with "
                                         r"num_losses=2"):
        amp.load_state_dict(checkpoint["amp"])
    assert_bitwise_equal(before, snapshot(model, opt))
    assert _scaler() == before_scaler


@pytest.mark.parametrize("state", [
    pytest.param(lambda ck: {"state": {}, "param_groups": []}, id="an optimizer state"),
    pytest.param(lambda ck: {"model": ck["amp"]}, id="a whole checkpoint"),
    pytest.param(lambda ck: dict(ck["amp"], apex_lite=dict(ck["amp"]["apex_lite"],
                                                           opt_level="O7")), id="no opt level"),
    pytest.param(lambda ck: dict(ck["amp"], loss_scaler0={"loss_scale": float("nan"),
                                                          "unskipped": 0}), id="damaged scale"),
])
def test_what_is_not_an_amp_state_is_still_refused_at_another_level(state, caplog):
    checkpoint, _ = _saved_run("O2", False)
    amp.default_handle().__init__()
    model, opt = _setup("O1", None, seed=1)
    _train(model, opt, range(2))
    before, before_scaler = snapshot(model, opt), _scaler()
    with pytest.raises(ValueError):
        amp.load_state_dict(state(checkpoint))
    assert_bitwise_equal(before, snapshot(model, opt))
    assert _scaler() == before_scaler


DAMAGE = {
    "not a dict": lambda s: s.update({AMP_STATE_KEY: 3}),
    "two losses": lambda s: s[AMP_STATE_KEY].update(
        loss_scaler1=dict(s[AMP_STATE_KEY]["loss_scaler0"])),
    "bad scale": lambda s: s[AMP_STATE_KEY]["loss_scaler0"].update(loss_scale=float("inf")),
    "extra key": lambda s: s[AMP_STATE_KEY]["apex_lite"].update(master_weights=[]),
}


@pytest.mark.parametrize("fused_step", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("damage", DAMAGE)
def test_the_optimizer_loads_torchs_part_and_leaves_out_an_amp_part_that_does_not_fit(
        damage, fused_step, caplog):
    model, opt = _setup("O2", fused_step)
    _train(model, opt, range(2))
    saved = copy.deepcopy(opt.state_dict())
    saved_moments = copy.deepcopy(saved["state"])
    amp.default_handle().__init__()
    model, opt = _setup("O2", fused_step, seed=1, verbosity=1)
    _train(model, opt, range(3), overflow_at={1})
    before_scaler = _scaler()
    DAMAGE[damage](saved)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="apex_lite"):
        opt.load_state_dict(saved)
    warnings = _records(caplog, logging.WARNING)
    assert len(warnings) == 1 and "not restored" in warnings[0].getMessage()
    assert _scaler() == before_scaler
    loaded = opt.state_dict()["state"]
    for index, entry in saved_moments.items():
        for key, value in entry.items():
            torch.testing.assert_close(loaded[index][key], value, rtol=0, atol=0)
    _train(model, opt, range(3, 5))


def test_a_plain_torch_optimizer_state_loads_without_a_word(caplog):
    model, opt = _setup("O2", False)
    _train(model, opt, range(2))
    plain = copy.deepcopy(opt.state_dict())
    plain.pop(AMP_STATE_KEY)
    amp.default_handle().__init__()
    model, opt = _setup("O1", None, seed=1, verbosity=1)
    before_scaler = _scaler()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="apex_lite"):
        opt.load_state_dict(plain)
    assert not _records(caplog, logging.WARNING) and not _records(caplog, logging.INFO)
    assert _scaler() == before_scaler
    assert opt.state_dict()["state"][0]["step"].item() == 2
