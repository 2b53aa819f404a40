"""ROCm apex's O4 and O5 (issue 43) as amp.initialize runs them: O4 is O1 in bf16 and O5 is O2
in bf16, each with a static loss scale of 1.0, through the same code paths (a run at O4/O5 is
bit for bit the run at O1/O2 with half_dtype=bf16 and loss_scale=1.0, on both of O2's step
paths); a non-finite step is never applied at the static scale (apex_lite's rule, not ROCm's);
``patch_torch_functions_type`` in ``_amp_state`` and ``amp.report``; ``cast_model_type=fp32`` at
O1/O4 keeps autocast on; an fp16 O5 warns; refusals change nothing; ``bfloat16_function``.
The level-by-level property table and the rules' messages are in test_amp_opt_levels.py,
checkpoints across the six levels in test_amp_resume_levels.py, ROCm's L0 tests in
test_amp_rocm_l0.py.
"""
from __future__ import annotations

import logging
import types

import pytest
import torch

from amp_helpers import Net, assert_bitwise_equal, batch, inject_inf, snapshot, train_step
from apex_lite import amp

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _setup(level, optimizer=torch.optim.AdamW, seed=0, verbosity=0, **kwargs):
    torch.manual_seed(seed)
    model = Net()
    opt = optimizer(model.parameters(), lr=1e-2)
    return amp.initialize(model, opt, opt_level=level, verbosity=verbosity, **kwargs)


def _probe(model):
    """(fc1's output dtype, autocast on) per forward."""
    seen = []
    model.fc1.register_forward_hook(
        lambda module, args, out: seen.append((out.dtype, torch.is_autocast_enabled("cpu"))))
    return seen


# ---- what each level does to the model -----------------------------------------------------------

def test_o4_keeps_fp32_weights_and_runs_the_forward_under_bf16_autocast():
    model, opt = _setup("O4")
    seen = _probe(model)
    out = model(batch(0)[0])
    assert seen == [(BF16, True)] and out.dtype == FP32
    assert all(p.dtype == FP32 for p in model.parameters())
    assert all(m is p for m, p in zip(amp.master_params(opt), model.parameters()))
    assert not opt._apex_lite_amp.path.fused
    assert amp.loss_scalers()[0].loss_scale == 1.0 and not amp.loss_scalers()[0].dynamic


def test_o5_casts_the_model_to_bf16_with_fp32_batchnorm_and_masters():
    torch.manual_seed(0)
    model = Net()
    original = {name: p.detach().clone() for name, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O5", verbosity=0)
    seen_inputs = []
    model.fc1.register_forward_pre_hook(lambda module, args: seen_inputs.append(args[0].dtype))
    seen = _probe(model)
    out = model(batch(0)[0])
    assert seen_inputs == [BF16] and seen == [(BF16, False)] and out.dtype == FP32
    assert model.fc1.weight.dtype == BF16 and model.bn.weight.dtype == FP32
    assert model.bn.running_mean.dtype == FP32
    # The masters are the original fp32 values, the model their rounding.
    masters = dict(zip([n for n, _ in model.named_parameters()], opt._apex_lite_amp.masters()))
    for name, p in model.named_parameters():
        torch.testing.assert_close(masters[name], original[name], rtol=0, atol=0)
        torch.testing.assert_close(p, original[name].to(p.dtype), rtol=0, atol=0)
    # state_dict() holds the fp32 masters themselves.
    train_step(model, opt, 0, amp)
    state = model.state_dict()
    assert all(v.dtype in (FP32, torch.int64) for v in state.values())
    for name, p in model.named_parameters():
        assert torch.equal(state[name], masters[name])


# O4/O5 against O1/O2 in bf16 with a static scale of 1.0: the same code, so the same bits. An
# inf gradient at step 1 is skipped by both.
SAME_AS = [("O4", "O1", None, torch.optim.AdamW), ("O5", "O2", True, torch.optim.AdamW),
           ("O5", "O2", False, torch.optim.AdamW), ("O5", "O2", True, torch.optim.SGD),
           ("O4", "O1", None, torch.optim.SGD)]


@pytest.mark.parametrize("level, like, fused_step, optimizer", SAME_AS,
                         ids=[f"{a}-{b}-{c}-{d.__name__}" for a, b, c, d in SAME_AS])
def test_o4_and_o5_train_as_o1_and_o2_in_bf16_with_a_static_scale(level, like, fused_step,
                                                                    optimizer):
    def run(level, **kwargs):
        amp.default_handle().__init__()
        model, opt = _setup(level, optimizer, fused_step=fused_step, **kwargs)
        assert opt._apex_lite_amp.path.fused == bool(fused_step)
        losses = []
        for step in range(4):
            hook = inject_inf(model.fc1.weight) if step == 1 else None
            losses.append(train_step(model, opt, step, amp))
            if hook:
                hook.remove()
        state = amp.state_dict()
        return snapshot(model, opt), losses, state["loss_scaler0"], \
            state["apex_lite"]["loss_scalers"], model.state_dict()

    rocm = run(level)
    nvidia = run(like, half_dtype=BF16, loss_scale=1.0)
    assert_bitwise_equal(rocm[0], nvidia[0])
    assert all(torch.equal(a, b) for a, b in zip(rocm[1], nvidia[1]))
    assert rocm[2] == nvidia[2] == {"loss_scale": 1.0, "unskipped": 2}
    assert rocm[3] == nvidia[3] and rocm[3][0]["skipped_steps"] == 1
    assert all(torch.equal(rocm[4][k], nvidia[4][k]) for k in rocm[4])


@pytest.mark.parametrize("level, fused_step", [("O4", None), ("O5", True), ("O5", False)])
def test_a_nonfinite_step_is_never_applied_at_the_static_scale(level, fused_step):
    """ROCm apex applies a step at its static scale 1.0 whatever its gradients hold; apex_lite
    skips it, as at every level, and the scale stays 1.0."""
    model, opt = _setup(level, fused_step=fused_step)
    train_step(model, opt, 0, amp)
    before = snapshot(model, opt)
    for poison in ("inf", "nan"):
        hook = model.fc1.weight.register_hook(
            lambda g, poison=poison: torch.full_like(g, float(poison)))
        train_step(model, opt, 1, amp)
        hook.remove()
        assert_bitwise_equal(before, snapshot(model, opt))
        assert amp.loss_scalers()[0].last_step_skipped
        assert amp.loss_scalers()[0].loss_scale == 1.0
    train_step(model, opt, 2, amp)
    assert not amp.loss_scalers()[0].last_step_skipped
    assert amp.loss_scalers()[0].skipped_steps == 2
    assert not torch.equal(before["masters"][0], opt._apex_lite_amp.masters()[0])


@pytest.mark.parametrize("level, fused_step", [("O4", None), ("O5", True), ("O5", False)])
def test_a_dynamic_scale_is_accepted_and_backs_off(level, fused_step):
    model, opt = _setup(level, fused_step=fused_step, loss_scale="dynamic")
    assert amp._amp_state.opt_properties.loss_scale == "dynamic"
    assert amp.loss_scalers()[0].loss_scale == 65536.0
    hook = inject_inf(model.fc1.weight)
    train_step(model, opt, 0, amp)
    hook.remove()
    assert amp.loss_scalers()[0].loss_scale == 32768.0


@pytest.mark.parametrize("fused_step", [True, False], ids=["fused", "unfused"])
def test_o5_masters_give_their_true_gradients_on_both_step_paths(fused_step):
    """After scale_loss each master's .grad is its fp32 gradient (read through param_groups, as
    mmengine's clip does), the same on the fused step as on the unfused one."""
    def grads(fused_step):
        amp.default_handle().__init__()
        model, opt = _setup("O5", loss_scale=128.0, fused_step=fused_step)
        x, y = batch(0)
        with amp.scale_loss(torch.nn.functional.mse_loss(model(x), y), opt) as scaled:
            scaled.backward()
        return [p.grad.clone() for g in opt.param_groups for p in g["params"]]

    got, unfused = grads(fused_step), grads(False)
    assert all(g.dtype == FP32 for g in got)
    assert all(torch.equal(a, b) for a, b in zip(got, unfused))


# ---- patch_torch_functions_type in _amp_state and amp.report -------------------------------------

@pytest.mark.parametrize("level, kwargs, patch, patch_type", [
    ("O0", {}, False, None), ("O1", {}, True, BF16), ("O2", {}, False, None),
    ("O3", {}, False, None), ("O4", {}, True, BF16), ("O5", {}, None, None),
    ("O1", dict(patch_torch_functions_type=FP16), True, FP16),
    ("O4", dict(patch_torch_functions_type=BF16), True, BF16),
    ("O4", dict(patch_torch_functions=False), False, None),
])
def test_patch_torch_functions_type_is_in_amp_state_and_the_report(level, kwargs, patch,
                                                                    patch_type):
    model, opt = _setup(level, **kwargs)
    properties = amp._amp_state.opt_properties
    assert properties.patch_torch_functions is patch
    assert properties.patch_torch_functions_type is patch_type
    assert properties.options["patch_torch_functions_type"] is patch_type
    seen = _probe(model)
    model(batch(0)[0])
    assert seen[0] == ((patch_type, True) if patch_type else (seen[0][0], False))
    report = amp.report()
    assert report.patch_torch_functions_type is patch_type
    where = f"under torch.autocast in {patch_type}" if patch_type else "not under autocast"
    assert f"  forward: {where} (patch_torch_functions={patch}, patch_torch_functions_type=" \
           f"{patch_type})" in str(report)


@pytest.mark.parametrize("level", ["O1", "O4"])
@pytest.mark.parametrize("no_cast", [FP32, False])
def test_cast_model_type_fp32_or_false_keeps_autocast_on(level, no_cast):
    """Apex (NVIDIA's and ROCm's) kept patching torch at O1 with cast_model_type=torch.float32:
    the model's cast is a no-op, the forward still runs in half."""
    model, opt = _setup(level, cast_model_type=no_cast)
    seen = _probe(model)
    out = model(batch(0)[0])
    assert seen == [(BF16, True)] and out.dtype == FP32
    assert all(p.dtype == FP32 for p in model.parameters())
    assert amp._amp_state.opt_properties.patch_torch_functions is True
    assert "forward: under torch.autocast in torch.bfloat16" in str(amp.report())
    train_step(model, opt, 0, amp)


def test_o1_patch_type_fp16_runs_autocast_in_fp16():
    model, opt = _setup("O1", patch_torch_functions_type=FP16)
    seen = _probe(model)
    assert model(batch(0)[0]).dtype == FP32 and seen == [(FP16, True)]


def test_an_fp16_o5_keeps_the_static_scale_and_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="apex_lite.amp"):
        model, opt = _setup("O5", cast_model_type=FP16, verbosity=1)
    assert model.fc1.weight.dtype == FP16 and model.bn.weight.dtype == FP32
    assert amp.loss_scalers()[0].loss_scale == 1.0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "loss_scale='dynamic'" in warnings[0] \
        and "opt_level='O2'" in warnings[0], warnings
    train_step(model, opt, 0, amp)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="apex_lite.amp"):
        _setup("O5", cast_model_type=FP16, loss_scale="dynamic", verbosity=1)
        _setup("O5", verbosity=1)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("level, kwargs, words", [
    ("O4", dict(master_weights=False), "master_weights with O1 and O4"),
    ("O4", dict(cast_model_type=BF16), "cast_model_type must stay None"),
    ("O4", dict(keep_batchnorm_fp32=False), "keep_batchnorm_fp32 must be None"),
    ("O4", dict(patch_torch_functions_type=FP16), "must be torch.bfloat16 at opt_level 'O4'"),
    ("O5", dict(patch_torch_functions=True), "belongs to opt_level='O1' or 'O4'"),
    ("O5", dict(patch_torch_functions_type=BF16), "should only be set by selecting"),
    ("O2", dict(patch_torch_functions_type=FP16), "should only be set by selecting"),
    ("O1", dict(patch_torch_functions_type=BF16), "must be torch.float16 at opt_level 'O1'"),
    ("O5", dict(half_dtype=FP16), "O5 is O2 in torch.bfloat16"),
    ("O6", {}, "Options are 'O0', 'O1', 'O2', 'O3', 'O4', 'O5'"),
])
def test_refusals_come_before_anything_changes(level, kwargs, words):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = snapshot(model)
    forward = model.forward
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        amp.initialize(model, opt, opt_level=level, verbosity=0, **kwargs)
    assert_bitwise_equal(before, snapshot(model))
    assert model.forward == forward and not hasattr(opt, "_amp_stash")
    assert [p.dtype for p in model.parameters()] == [FP32] * 6


# ---- bfloat16_function and register_bfloat16_function (ROCm apex's) ------------------------------

@pytest.mark.parametrize("autocast_dtype", [BF16, FP16])
def test_bfloat16_function_casts_to_bf16_under_autocast(autocast_dtype):
    seen = []

    def add(a, b):
        seen.append((a.dtype, b.dtype, torch.is_autocast_enabled("cpu")))
        return a + b

    fn = amp.bfloat16_function(add)
    assert fn.__name__ == "add"
    a, b = torch.ones(3), torch.ones(3, dtype=FP16)
    with torch.autocast("cpu", dtype=autocast_dtype):
        assert fn(a, b).dtype == BF16
    assert seen == [(BF16, BF16, False)]      # autocast off inside, as apex's casts
    assert fn(a, b).dtype == FP32 and seen[-1] == (FP32, FP16, False)   # outside: unchanged


@pytest.mark.parametrize("level", ["O1", "O4"])
def test_register_bfloat16_function_in_an_autocast_forward(level):
    module = types.SimpleNamespace(mm=lambda a, b: a @ b)
    amp.register_bfloat16_function(module, "mm")
    kwargs = dict(patch_torch_functions_type=FP16) if level == "O1" else {}

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            seen.update(registered=module.mm(x, self.w).dtype, plain=(x @ self.w).dtype)
            return x @ self.w

    seen = {}
    model = amp.initialize(Model(), opt_level=level, verbosity=0, **kwargs)
    model(torch.randn(2, 4))
    assert seen == {"registered": BF16, "plain": FP16 if level == "O1" else BF16}
    with pytest.raises(ValueError, match="No function named 'nope'"):
        amp.register_bfloat16_function(module, "nope")


# ---- apex's legacy amp.init (ROCm's L0 cast tests use it) -----------------------------------------

@pytest.mark.parametrize("patch_type", [torch.bfloat16, torch.float16])
def test_legacy_init_casts_torch_functions_until_deactivated(patch_type):
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    handle = amp.init(enabled=True, patch_type=patch_type)
    try:
        assert handle.is_active()
        assert torch.nn.functional.linear(x, w).dtype == patch_type
        assert torch.nn.functional.softmax(x, dim=1).dtype == torch.float32
        assert (x.to(patch_type) + x).dtype == torch.float32       # promotion to the widest

        @amp.float_function
        def fp32_only(t):
            return t
        assert fp32_only(x.to(patch_type)).dtype == torch.float32
    finally:
        handle._deactivate()
    assert not handle.is_active()
    assert torch.nn.functional.linear(x, w).dtype == torch.float32


def test_legacy_init_disabled_or_with_another_type():
    handle = amp.init(enabled=False)
    assert not handle.is_active()
    assert torch.nn.functional.linear(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.float32
    handle._deactivate()
    with pytest.raises(ValueError, match="supported types are torch.float16 and torch.bfloat16"):
        amp.init(patch_type=torch.float64)
