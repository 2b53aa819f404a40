"""Every diagnostic says the same true thing on the fused and the unfused step (issue 26.2): the
skip log lines, ``OverflowStuckError`` (which names the parameter whose gradient is NaN, also when
the fused step's device decision reaches the host after the gradients were cleared),
``amp.locate_nonfinite`` and ``amp.report()``."""
from __future__ import annotations

import logging

import pytest
import torch

from apex_lite import amp

STEP_PATHS = pytest.mark.parametrize("fused_step", [True, False], ids=["fused", "unfused"])


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def _setup(fused_step, opt_cls=torch.optim.SGD, **kwargs):
    model = _model()
    opt = opt_cls(model.parameters(), lr=0.1)
    kwargs.setdefault("verbosity", 0)
    return amp.initialize(model, opt, opt_level="O2", fused_step=fused_step, **kwargs)


def _step(model, opt, x):
    opt.zero_grad()
    with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()


def _stuck_message(fused_step, opt_cls, steps):
    """The issue's run: model[2].weight's gradient NaN every step, min_loss_scale=1.0; after
    ``steps`` steps the gradients are cleared and the scalers read (where the fused step's
    decisions reach the host at the latest)."""
    model, opt = _setup(fused_step, opt_cls, min_loss_scale=1.0)
    model[2].weight.register_hook(lambda g: g * float("nan"))
    x = torch.randn(8, 4)
    with pytest.raises(amp.OverflowStuckError) as info:
        for _ in range(steps):
            _step(model, opt, x)
        opt.zero_grad()
        amp.loss_scalers()
    return str(info.value)


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.Adam])
@pytest.mark.parametrize("steps", [150, 250])
def test_stuck_error_names_the_parameter_on_both_paths(opt_cls, steps):
    messages = {fused: _stuck_message(fused, opt_cls, steps) for fused in (True, False)}
    assert messages[True] == messages[False]
    message = messages[True]
    assert "Parameters whose gradients were inf or NaN: '2.weight'." in message
    assert "The loss was finite in the last step" in message
    assert "only the loss did" not in message


@STEP_PATHS
def test_stuck_error_with_a_nonfinite_loss(fused_step):
    model, opt = _setup(fused_step, min_loss_scale=1.0, overflow_patience=3, sync_interval=1)
    x = torch.randn(8, 4)
    with pytest.raises(amp.OverflowStuckError) as info:
        for _ in range(40):
            opt.zero_grad()
            loss = model(x).float().pow(2).mean() * float("inf")
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
    message = str(info.value)
    assert "The loss itself was inf or NaN" in message
    # inf * the gradients: NaN where they were 0, inf elsewhere; every parameter is named.
    assert "'0.weight'" in message and "'2.bias'" in message


def _skip_log(fused_step, caplog):
    model, opt = _setup(fused_step, verbosity=1)
    bad = {"on": False}
    model[2].bias.register_hook(lambda g: g * float("inf") if bad["on"] else g)
    x = torch.randn(8, 4)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="apex_lite.amp"):
        for step in range(40):
            bad["on"] = step < 3 or step in (10, 11, 30) or 20 <= step < 28
            _step(model, opt, x)
        amp.loss_scalers()      # the fused step's decisions reach the host here
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "apex_lite.amp"]


def test_skip_log_lines_are_the_same_on_both_paths(caplog):
    fused, unfused = _skip_log(True, caplog), _skip_log(False, caplog)
    assert fused == unfused
    assert ("INFO", "loss scaler 0: first 3 steps skipped while the loss scale calibrated to "
                    "8192.0") in fused
    assert ("INFO", "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to "
                    "4096.0") in fused
    assert any(level == "WARNING" and "of the last" in text for level, text in fused)


@STEP_PATHS
def test_the_stuck_error_turns_the_locator_on(fused_step, caplog):
    model, opt = _setup(fused_step, min_loss_scale=1.0, overflow_patience=2, sync_interval=1)
    model[2].weight.register_hook(lambda g: g * float("nan"))
    x = torch.randn(8, 4)
    with pytest.raises(amp.OverflowStuckError):
        for _ in range(40):
            _step(model, opt, x)
    with torch.no_grad():
        model[0].bias[0] = float("nan")
    with caplog.at_level(logging.WARNING, logger="apex_lite.amp"):
        model(x)
    assert "the first module of the model whose forward output holds inf or NaN is '0'" \
        in caplog.text


def _report_lines(fused_step):
    model, opt = _setup(fused_step)
    _step(model, opt, torch.randn(8, 4))
    return str(amp.report()).splitlines()


def test_report_says_the_same_on_both_paths_but_the_path_and_its_gradients():
    fused, unfused = _report_lines(True), _report_lines(False)
    # What differs, truly: the step path, and the fp32 master gradients that only the unfused
    # step holds (so the bytes per parameter).
    # (without native kernels the fused step says which kernels it runs on: torch's)
    assert any(line.startswith("  optimizer 0 (SGD): fused step") for line in fused)
    assert "  optimizer 0 (SGD): unfused step (fused_step=False)" in unfused
    assert "  gradients: 4 torch.float32 tensors, 196 B" in unfused
    assert not any("gradients: 4 torch.float32" in line for line in fused)
    assert "  bytes held per model parameter: 8.00" in fused
    assert "  bytes held per model parameter: 12.00" in unfused
    differs = ("  optimizer 0 (SGD):", "  gradients: 4 torch.float32", "  bytes held")
    assert [line for line in fused if not line.startswith(differs)] == \
        [line for line in unfused if not line.startswith(differs)]
