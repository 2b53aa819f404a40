"""Diagnostics: the skip log policy (calibration folded, abnormal rates, a collapsed scale), the
error when steps keep overflowing at the lowest scale, the non-finite locator, amp.report."""
import logging

import pytest
import torch

from amp_helpers import Net, batch, inject_inf, snapshot, assert_bitwise_equal, train_step
from apex_lite import amp, multi_tensor
from apex_lite.amp.master_grads import is_lazy
from apex_lite.amp.diagnostics import SkipLog
from apex_lite.amp.overflow import skip_message
from apex_lite.amp.scaler import LossScaler


def _setup(level="O2", **kwargs):
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    kwargs.setdefault("verbosity", 1)
    # The log and its counters are checked decision by decision: on the fused step (O2's
    # default) the host catches up with the device after every decision with sync_interval=1
    # (test_amp_fused_step.py tests the catch-up at the default interval).
    kwargs.setdefault("sync_interval", 1)
    return amp.initialize(model, opt, opt_level=level, **kwargs)


def _amp_records(caplog):
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "apex_lite.amp"]


def _overflow_above(model, scaler, limit):
    """Gradients overflow while the loss scale is above ``limit`` (a calibrating model)."""
    return model.fc2.bias.register_hook(
        lambda g: g * float("inf") if scaler.loss_scale > limit else g)


# ---- the log policy, in training ----------------------------------------------------------------

def test_calibration_skips_fold_into_one_line(caplog):
    model, opt = _setup("O2")
    scaler = amp.loss_scalers()[0]
    hook = _overflow_above(model, scaler, 512.0)
    with caplog.at_level(logging.INFO, logger="apex_lite.amp"):
        for step in range(10):
            train_step(model, opt, step, amp)
    assert _amp_records(caplog) == [
        ("INFO", "loss scaler 0: first 7 steps skipped while the loss scale calibrated to 512.0")]
    assert scaler.skipped_steps == 7 and scaler.steps == 10
    caplog.clear()
    hook.remove()
    # After calibration a single skip is an INFO line with apex's text, not a warning.
    hook = inject_inf(model.fc2.bias)
    with caplog.at_level(logging.INFO, logger="apex_lite.amp"):
        train_step(model, opt, 10, amp)
    hook.remove()
    assert _amp_records(caplog) == [
        ("INFO", "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 256.0")]


def test_verbosity_2_logs_every_skip_as_apex_did(caplog):
    model, opt = _setup("O1", verbosity=2)
    scaler = amp.loss_scalers()[0]
    hook = _overflow_above(model, scaler, 8192.0)
    with caplog.at_level(logging.WARNING, logger="apex_lite.amp"):
        for step in range(4):
            train_step(model, opt, step, amp)
    hook.remove()
    assert _amp_records(caplog) == [
        ("WARNING", f"Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to "
                    f"{scale}") for scale in (32768.0, 16384.0, 8192.0)]


def _drive(events, verbosity=1, **kwargs):
    """Feed skip decisions ("o" overflow, "n" non-finite loss, "." clean) to a scaler and its log;
    returns the scaler, the log and the last stuck answer."""
    kwargs = {"min_loss_scale": None, "max_loss_scale": 2.0 ** 24, **kwargs}
    patience = kwargs.pop("overflow_patience", None)
    scaler = LossScaler(0, kwargs.pop("loss_scale", "dynamic"), **kwargs)
    log = SkipLog(scaler, verbosity=verbosity, overflow_patience=patience)
    stuck = []
    for event in events:
        old = scaler.loss_scale
        scaler.update(event != ".")
        stuck.append(log.record(old, event != ".", event == "n",
                                skip_message(scaler, old, event == "n") if event != "." else ""))
    return scaler, log, stuck


RATE = ("loss scaler 0: 6 of the last 7 steps were skipped (inf/NaN gradients or loss), loss "
        "scale now 1024.0")
FAR = "loss scaler 0: the loss scale fell to 16.0, 4096x below its start 65536.0"


@pytest.mark.parametrize("events, warnings", [
    ("", []),
    (".....", []),
    ("ooooo.....", []),                                  # calibration only: no warning
    (".ooooo", []),                                      # 5 skips in the window: the limit
    (".oooooo", [RATE]),                                 # 6: abnormal, warned once
    (".oooooo" + "." * 50 + "o", [RATE]),                # not again within the window
    ("n", ["Loss is inf or NaN"]),                       # a bad loss is always a warning
    ("oooooooooooo.", [FAR]),                            # 12 halvings during calibration
])
def test_warnings_only_for_abnormal_skips(events, warnings, caplog):
    with caplog.at_level(logging.WARNING, logger="apex_lite.amp"):
        _drive(events)
    got = [m for level, m in _amp_records(caplog) if level == "WARNING"]
    assert len(got) == len(warnings)
    for message, expected in zip(got, warnings):
        assert message.startswith(expected), message


def test_static_scale_skips_are_warnings_and_verbosity_0_is_silent(caplog):
    with caplog.at_level(logging.DEBUG, logger="apex_lite.amp"):
        _drive(".o", loss_scale=128.0)
    assert _amp_records(caplog) == [
        ("WARNING", "Gradient overflow.  Skipping step, loss scaler 0 keeping its static loss "
                    "scale 128.0")]
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="apex_lite.amp"):
        _drive("oooooooooooooo.oooooooon", verbosity=0)
    assert _amp_records(caplog) == []


@pytest.mark.parametrize("events, kwargs, stuck_at", [
    ("oooooo", dict(min_loss_scale=16384.0, overflow_patience=3), 4),   # floor reached at 2
    ("oo.ooooo", dict(min_loss_scale=16384.0, overflow_patience=3), 5),  # a clean step resets
    ("oooo", dict(loss_scale=128.0, overflow_patience=2), 1),           # static: always floor
    ("o" * 5, dict(overflow_patience=5), 4),                            # no min: any run of skips
    ("o" * 300, dict(min_loss_scale=1.0, overflow_patience=None), None),  # None disables
])
def test_stuck_detection(events, kwargs, stuck_at):
    _, _, stuck = _drive(events, verbosity=0, **kwargs)
    assert stuck.index(True) == stuck_at if stuck_at is not None else not any(stuck)


# ---- OverflowStuckError in training -------------------------------------------------------------

def test_stuck_overflow_raises_naming_the_parameters_and_turns_the_locator_on(caplog):
    model, opt = _setup("O2", min_loss_scale=16384.0, overflow_patience=3, verbosity=0)
    hook = inject_inf(model.fc2.bias)
    for step in range(4):
        train_step(model, opt, step, amp)
    before = snapshot(model, opt)
    scale_state = amp.state_dict()
    with pytest.raises(amp.OverflowStuckError) as info:
        train_step(model, opt, 4, amp)
    hook.remove()
    message = str(info.value)
    assert message.startswith("loss scaler 0: 3 steps in a row were skipped with the loss scale "
                              "at min_loss_scale 16384.0 (overflow_patience=3). The loss was "
                              "finite in the last step")
    assert "Parameters whose gradients were inf or NaN: 'fc2.bias'." in message
    assert "amp has turned on the non-finite locator" in message
    opt.step()                                   # the failed step is still skipped
    assert_bitwise_equal(before, snapshot(model, opt))
    assert amp.state_dict()["loss_scaler0"] == scale_state["loss_scaler0"] | {"unskipped": 0}
    # The locator now names the first module whose output is not finite.
    with torch.no_grad():
        model.fc1.bias[0] = float("nan")
    with caplog.at_level(logging.WARNING, logger="apex_lite.amp"):
        model(batch(0)[0])
    assert "the first module of the model whose forward output holds inf or NaN is 'fc1'" \
        in caplog.text


def test_stuck_with_a_nonfinite_loss_says_it_is_a_forward_problem():
    model, opt = _setup("O1", loss_scale=1.0, overflow_patience=2, verbosity=0)
    x = batch(0)[0]
    for step in range(2):
        opt.zero_grad()
        loss = model(x).sum() * float("nan")
        if step == 0:
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            continue
        with pytest.raises(amp.OverflowStuckError) as info:
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
    message = str(info.value)
    assert "loss scale at its static value 1.0" in message
    assert "The loss itself was inf or NaN (in 2 of these 2 steps, the last included): the " \
           "forward produces it, so this is not a loss-scaling problem." in message
    assert "'fc1.weight'" in message     # NaN * everything: every gradient is NaN


def test_per_tensor_flags_are_computed_only_on_the_error_path(monkeypatch):
    calls = []
    real = multi_tensor.nonfinite_flags
    monkeypatch.setattr(multi_tensor, "nonfinite_flags", lambda t: calls.append(1) or real(t))
    model, opt = _setup("O2", verbosity=0, overflow_patience=None)
    hook = inject_inf(model.fc2.bias)
    for step in range(5):
        train_step(model, opt, step, amp)
    hook.remove()
    assert calls == [] and amp.loss_scalers()[0].skipped_steps == 5


# ---- the locator --------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["function", "keyword"])
@pytest.mark.parametrize("fault, first, inputs", [
    ("bias", "fc1", "its inputs were finite, so this module produced the inf/NaN"),
    ("input", "fc1", "its inputs already held inf or NaN"),
    ("none", None, None),
])
def test_locator_names_the_first_nonfinite_module(how, fault, first, inputs, caplog):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0,
                                locate_nonfinite=(how == "keyword"))
    locator = amp.locate_nonfinite(model) if how == "function" else \
        amp.default_handle()._run.locators[0]
    x = batch(0)[0]
    if fault == "bias":
        with torch.no_grad():
            model.fc1.bias[3] = float("inf")
    elif fault == "input":
        x[0, 0] = float("nan")
    with caplog.at_level(logging.WARNING, logger="apex_lite.amp"):
        model(x)
        model(x)                       # the same finding is logged once
    assert locator.first_module == first
    messages = [m for _, m in _amp_records(caplog)]
    if first is None:
        assert messages == []
    else:
        assert messages == [f"amp.locate_nonfinite: the first module of the model whose forward "
                            f"output holds inf or NaN is {first!r} (Linear); {inputs}"
                            + ("" if fault == "bias" else
                               " (they came from outside the model, or from a functional op "
                               "between modules)")]
    locator.remove()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="apex_lite.amp"):
        model(x)
    assert _amp_records(caplog) == []


def test_locator_without_a_run_or_with_a_non_module():
    with pytest.raises(RuntimeError, match="needs an enabled amp.initialize first"):
        amp.locate_nonfinite()
    with pytest.raises(TypeError, match="takes an nn.Module"):
        amp.locate_nonfinite(torch.zeros(1))


# ---- amp.report ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fused_step", [True, False], ids=["fused", "unfused"])
def test_report_o2(fused_step):
    model, opt = _setup("O2", verbosity=0, fused_step=fused_step)
    model.conv = torch.nn.Conv2d(3, 16, 3)      # a conv with 3 input channels (not on the opt)
    train_step(model, opt, 0, amp)
    rep = amp.report()
    bf16 = [p for p in model.parameters() if p.dtype == torch.bfloat16]
    fp32 = [p for p in model.parameters() if p.dtype == torch.float32]
    masters = opt._apex_lite_amp.masters()   # (amp.master_params would materialise gradients)
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    assert rep.tensors["parameters"] == {torch.bfloat16: (len(bf16), nbytes(bf16)),
                                         torch.float32: (len(fp32), nbytes(fp32))}
    assert len(bf16) == 4 + 0 and len(fp32) == 2 + 2    # fc1, fc2 half; bn and conv fp32
    # The half gradients stay until they are cleared, as torch's .grad does; the unfused step
    # also holds fp32 master gradients, the fused step none (the fp32-kept params' own only:
    # the O2 masters' are lazy, made only if used).
    half_grads = [p.grad for p in bf16]
    assert len(half_grads) == 4 and all(g is not None for g in half_grads)
    grads = [p.grad for p in masters if p.grad is not None and not is_lazy(p.grad)]
    assert len(grads) == (6 if fused_step is False else 2)
    assert rep.tensors["gradients"] == {torch.float32: (len(grads), nbytes(grads)),
                                        torch.bfloat16: (4, nbytes(half_grads))}
    half_masters = [p for p in masters if amp.default_handle()._run.pairs.is_master(p)]
    assert rep.tensors["master weights"] == {torch.float32: (4, nbytes(half_masters))}
    assert rep.kept_fp32 == [["bn"]]
    assert rep.backends == {"cpu": multi_tensor.backend("cpu")}
    assert rep.not_multiple_of_8 == ["fc2 (Linear): out_features=1",
                                     "conv (Conv2d): in_channels=3"]
    text = str(rep)
    assert text.startswith("apex_lite.amp report: opt_level O2, half dtype torch.bfloat16")
    for line in ("  model modules kept fp32: bn",
                 f"  kernels on cpu: {multi_tensor.backend('cpu')[0]}",
                 "    fc2 (Linear): out_features=1", "  master weights: 4 torch.float32 tensors"):
        assert line in text, text


def test_report_o1_and_before_initialize():
    with pytest.raises(RuntimeError, match="amp.report needs an enabled amp.initialize"):
        amp.report()
    model = torch.nn.Linear(16, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    rep = amp.report(model, opt)
    assert rep.tensors["master weights"] == {} and rep.tensors["gradients"] == {}
    assert rep.not_multiple_of_8 == [] and rep.kept_fp32 == [[]]
    assert "  master weights: none" in str(rep)
    assert "every Linear/Conv dimension is a multiple of 8" in str(rep)
