"""fp8 matmuls under amp (``amp.initialize(..., fp8=...)``), in this process on the CPU, where
``torch._scaled_mm`` is torch's emulated reference: which layers run in fp8, their numerics
against an independent reference, both recipes, the counts, the refusals, the checkpoint state,
the report, and what else a model goes through (the O2 steps, accumulation, the skip rule,
pickling, tied weights, torch.compile). Fresh processes and ranks: test_amp_fp8_runs.py."""
from __future__ import annotations

import copy
import dataclasses
import io
import logging
import math

import pytest
import torch
import torch._dynamo  # noqa: F401  (before any test wraps torch._scaled_mm: see below)
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from apex_lite import amp
from apex_lite.amp.fp8 import cast as fp8_cast
from apex_lite.amp.fp8 import scaled_mm as fp8_mm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


class Mlp(torch.nn.Module):
    """fc1 and fc2 run in fp8 at min_features=16; head (10 outputs) stays in half."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 64)
        self.fc2 = torch.nn.Linear(64, 32)
        self.head = torch.nn.Linear(32, 10)

    def forward(self, x):
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def small(**kwargs):
    return amp.FP8(min_features=16, **kwargs)


def setup(fp8=None, level="O2", model=None, lr=1e-3, **kwargs):
    model = Mlp() if model is None else model
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    kwargs.setdefault("verbosity", 0)
    return amp.initialize(model, opt, opt_level=level, fp8=small() if fp8 is None else fp8,
                          **kwargs)


def batch(step, n=24, d=32, classes=10):
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, d, generator=g), torch.randint(0, classes, (n,), generator=g)


def train_step(model, opt, step, handle=amp):
    x, y = batch(step)
    opt.zero_grad()
    loss = F.cross_entropy(model(x).float(), y)
    with handle.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    return loss.item()


def fp8_run():
    return amp.default_handle()._run.fp8


class _ScaledMmCalls(TorchDispatchMode):
    """Records the first operand's dtype of every aten._scaled_mm call (forward and backward;
    a dispatch mode rather than a patched torch._scaled_mm, which torch.compile's tables
    would remember)."""

    def __init__(self):
        super().__init__()
        self.calls = []
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._scaled_mm.default:
            self.calls.append(args[0].dtype)
            self.shapes.append((tuple(args[0].shape), tuple(args[1].shape)))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def mm_mode():
    if not fp8_mm.runs_natively(torch.device("cpu")):
        pytest.skip("this torch emulates _scaled_mm on the CPU (before 2.7): nothing to count")
    with _ScaledMmCalls() as mode:
        yield mode


@pytest.fixture
def mm_calls(mm_mode):
    """The scaled matmuls run inside the test, as a list of their first operand's dtype."""
    return mm_mode.calls


# ---- an independent reference ---------------------------------------------------------------

def ref_scale(t: torch.Tensor, fp8_dtype, margin=0) -> float:
    """The largest power of two keeping t's amax within the format (float64 arithmetic)."""
    amax = t.detach().abs().max().double().item()
    top = torch.finfo(fp8_dtype).max / 2 ** margin
    if amax == 0 or not math.isfinite(amax):
        return 1.0
    k = math.floor(math.log2(top / amax))
    while amax * 2.0 ** k > top:
        k -= 1
    while amax * 2.0 ** (k + 1) <= top:
        k += 1
    return 2.0 ** max(-126, min(126, k))


def ref_quantize(t, fp8_dtype, scale):
    top = torch.finfo(fp8_dtype).max
    return (t.double() * scale).clamp(-top, top).to(fp8_dtype)


def ref_linear(x, w, b, out_dtype):
    """fp8 forward as the reference computes it: both operands quantized by ref_scale, fp32
    products and sums of the fp8 values (as torch's emulated _scaled_mm), one rounding."""
    sx, sw = ref_scale(x, E4M3), ref_scale(w, E4M3)
    x8, w8 = ref_quantize(x, E4M3, sx), ref_quantize(w, E4M3, sw)
    out = torch.matmul(x8.float() * (1 / sx), (w8.float() * (1 / sw)).t())
    if b is not None:
        out = out + b.float()
    return out.to(out_dtype)


# ---- the config and the refusals ------------------------------------------------------------

def test_fp8_true_is_the_default_config():
    config = amp.FP8()
    assert (config.recipe, config.amax_history, config.margin, config.counts) == \
        ("current", 16, 0, True)
    assert config.min_features == 2048
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.recipe = "delayed"
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 16))
    amp.initialize(model, opt_level="O2", fp8=True, verbosity=0)
    assert fp8_run().config == amp.FP8()
    assert "forward" in vars(model[0]) and "forward" not in vars(model[1])   # 16 < 2048


@pytest.mark.parametrize("kwargs,match", [
    ({"recipe": "hybrid"}, "recipes are 'current'"), ({"amax_history": 0}, "amax_history"),
    ({"min_features": 8}, "min_features"), ({"margin": -1}, "margin"),
    ({"counts": "yes"}, "counts"), ({"compile_casts": 1}, "compile_casts"),
])
def test_a_config_out_of_range_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        amp.FP8(**kwargs)
    with pytest.raises(TypeError, match="exclude"):
        amp.FP8(exclude=(3,))
    with pytest.raises(TypeError, match="amp.FP8"):
        amp.initialize(Mlp(), opt_level="O2", fp8="fast")


@pytest.mark.parametrize("level,kwargs", [("O0", {}), ("O1", {}), ("O3", {}), ("O4", {}),
                                          ("O2", {"cast_model_type": torch.float32})])
def test_levels_without_a_half_model_refuse_fp8_and_change_nothing(level, kwargs):
    model = Mlp()
    with pytest.raises(amp.OptLevelError, match="'O2'.*'O5'") as info:
        amp.initialize(model, opt_level=level, fp8=True, verbosity=0, **kwargs)
    assert f"not at {level}" in str(info.value)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not any("forward" in vars(m) for m in model.modules())
    amp.initialize(model, opt_level="O2", fp8=small(), verbosity=0)   # still fresh


# ---- which layers -----------------------------------------------------------------------------

def test_eligible_layers_run_all_three_matmuls_in_fp8(mm_mode):
    mm_calls = mm_mode.calls
    model, opt = setup()
    assert "forward" not in vars(model.head)
    x, y = batch(0)
    out = model(x)
    assert mm_calls == [E4M3, E4M3]                              # fc1, fc2 forward
    F.cross_entropy(out.float(), y).backward()
    # fc2: grad_input and grad_weight (E5M2 gradients); fc1: grad_weight only (its input
    # needs no gradient, as in torch's Linear).
    assert mm_calls[2:] == [E5M2, E5M2, E5M2]
    mm_calls.clear()
    model(x.requires_grad_()).float().sum().backward()
    assert len(mm_calls) == 2 + 4
    # cuBLASLt's rule on every device: each operand's dimensions are multiples of 16 (the 24
    # rows of the batch, grad_weight's contraction, padded to 32).
    assert ((32, 32), (32, 64)) in mm_mode.shapes           # fc2's grad_weight, 24 -> 32
    for a, b in mm_mode.shapes:
        assert a[1] % 16 == 0 and b[0] % 16 == 0 and b[1] % 16 == 0, (a, b)


def test_a_wrapper_around_torch_scaled_mm_sees_every_fp8_matmul(monkeypatch):
    """amp calls torch._scaled_mm through the attribute, and nothing else calls it (whether
    the CPU has a kernel is read from the dispatcher). torch._dynamo, imported on first use,
    keeps the function it finds there as the op: it is imported at the top of this file."""
    if not fp8_mm.runs_natively(torch.device("cpu")):
        pytest.skip("this torch emulates _scaled_mm on the CPU (before 2.7)")
    calls = []
    original = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm",
                        lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    model, opt = setup()
    assert calls == []
    train_step(model, opt, 0)
    assert len(calls) == 2 + 3


class OwnForward(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


def test_min_features_exclude_subclasses_and_kept_modules_stay_in_half(mm_calls):
    model = torch.nn.Sequential()
    model.add_module("small", torch.nn.Linear(16, 32))          # 16 < min_features=32
    model.add_module("big", torch.nn.Linear(32, 32))
    model.add_module("odd", torch.nn.Linear(32, 40))            # 40: not a multiple of 16
    model.add_module("skip_me", torch.nn.Linear(40, 32))
    model.add_module("own", OwnForward(32, 32))
    model.add_module("kept", torch.nn.Linear(32, 32))
    model.add_module("sub", torch.nn.Sequential(torch.nn.Linear(32, 48)))
    amp.initialize(model, opt_level="O2", verbosity=0, keep_fp32_modules=("kept",),
                   fp8=amp.FP8(min_features=32, exclude=("skip_*",)))
    layers = [name for name, _ in fp8_run().layers[0]]
    assert layers == ["big", "sub.0"]
    reasons = dict(fp8_run().left)
    assert reasons == {"small": "in_features=16 below min_features=32",
                       "odd": "out_features=40 not a multiple of 16",
                       "skip_me": "excluded", "own": "OwnForward has its own forward",
                       "kept": "kept fp32"}
    model(torch.randn(4, 16))
    assert len(mm_calls) == 2
    text = str(amp.report())
    assert "fp8: 2 Linear layer(s) in fp8" in text and "in half: odd (out_features=40" in text
    model2 = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    amp.initialize(model2, opt_level="O2", verbosity=0, fp8=small(exclude=torch.nn.Linear))
    assert fp8_run().layer_count() == 0


def test_a_model_with_no_eligible_layer_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="apex_lite.amp"):
        amp.initialize(Mlp(), opt_level="O2", fp8=True)
    assert "no Linear layer is eligible for fp8" in caplog.text


# ---- numerics -----------------------------------------------------------------------------------

@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(24, 32), (3, 5, 32), (32,)])
def test_a_layer_equals_the_reference_forward_and_backward(half, shape):
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 48)   # the model itself: its fp8 forward sits inside amp's cast
    model = amp.initialize(model, opt_level="O2", half_dtype=half, fp8=small(), verbosity=0)
    x = torch.randn(*shape).to(half).requires_grad_()
    out = model(x)                                              # amp casts the output to fp32
    w, b = model.weight.detach(), model.bias.detach()
    expected = ref_linear(x.detach().reshape(-1, 32), w, b, half)
    torch.testing.assert_close(out, expected.float().reshape(*shape[:-1], 48), rtol=0, atol=0)
    # fp8 is not half: the result differs from F.linear, within E4M3's rounding.
    plain = F.linear(x.detach(), w, b).float()
    assert not torch.equal(out, plain)
    assert (out - plain).abs().max() < 0.1 * plain.abs().max()
    grad = torch.randn(*shape[:-1], 48)
    out.backward(grad)
    g = grad.to(half).reshape(-1, 48)
    sg = ref_scale(g, E5M2)
    g8 = ref_quantize(g, E5M2, sg).float() / sg
    x2 = x.detach().reshape(-1, 32)
    sx, sw = ref_scale(x2, E4M3), ref_scale(w, E4M3)
    x8 = ref_quantize(x2, E4M3, sx).float() / sx
    w8 = ref_quantize(w, E4M3, sw).float() / sw
    torch.testing.assert_close(x.grad, (g8 @ w8).to(half).reshape(shape), rtol=0, atol=0)
    torch.testing.assert_close(model.weight.grad, (g8.t() @ x8).to(half), rtol=0, atol=0)
    torch.testing.assert_close(model.bias.grad, g.sum(0).to(half), rtol=0, atol=0)


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("margin", [0, 2])
def test_scales_are_the_largest_power_of_two_within_range(fp8_dtype, margin):
    top = torch.finfo(fp8_dtype).max
    values = [1.0, 3.0, top, top * (1 + 2 ** -20), top * (1 - 2 ** -20), top / 2 ** 7, 1e-3,
              2.0 ** -140, 1e-38, 3e38, 0.0, float("inf"), float("nan")]
    amax = torch.tensor(values, dtype=torch.float32)
    scale = fp8_cast.pow2_scale(amax, fp8_dtype, margin)
    for value, s in zip(amax.tolist(), scale.tolist()):
        assert s == ref_scale(torch.tensor([value]), fp8_dtype, margin), value
        assert math.frexp(s)[0] == 0.5                              # a power of two
    inverse = fp8_cast.inverse_pow2(scale)
    assert torch.equal(inverse * scale, torch.ones_like(scale))


@pytest.mark.skipif(not fp8_mm.runs_natively(torch.device("cpu")),
                    reason="this torch has no CPU _scaled_mm to compare with (before 2.7)")
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_emulation_for_old_torch_equals_torch_scaled_mm(out_dtype, with_bias):
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(24, 32, generator=g) * 8).to(E4M3)
    b = (torch.randn(48, 32, generator=g) * 8).to(E5M2).t()
    sa, sb = torch.tensor(2.0 ** -3), torch.tensor(2.0 ** 5)
    bias = torch.randn(48, generator=g).to(out_dtype) if with_bias else None
    native = fp8_mm.scaled_mm(a, b, sa, sb, out_dtype=out_dtype, bias=bias)
    emulated = fp8_mm.scaled_mm(a, b, sa, sb, out_dtype=out_dtype, bias=bias, native=False)
    torch.testing.assert_close(emulated, native, rtol=0, atol=0)


def test_current_scaling_never_clips_and_counts_what_it_flushes():
    model, opt = setup()
    x, y = batch(0)
    x[:, :4] *= 1e-5      # 2**-17 of the rest: below E4M3's smallest subnormal once scaled
    x[0, 5] = 1e4         # huge: the current scale follows it
    loss = F.cross_entropy(model(x).float(), y)
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    counts = amp.report().fp8
    xh = x.bfloat16()
    flushed = int(((ref_quantize(xh, E4M3, ref_scale(xh, E4M3)) == 0) & (xh != 0)).sum())
    assert flushed > 50
    assert counts["fc1"]["input"] == {"saturated": 0, "underflow": flushed}
    assert all(c["saturated"] == 0 for per_role in counts.values() for c in per_role.values())
    assert set(counts) == {"fc1", "fc2"} and set(counts["fc1"]) == {"input", "weight", "grad"}
    assert amp.default_handle().report().fp8 == counts


def test_delayed_scaling_scales_by_the_history_and_counts_saturation():
    model, opt = setup(small(recipe="delayed", amax_history=3))
    group = fp8_run().groups[0]
    assert not group.has_history.any()          # before the first step: scaled as "current"
    amaxes = []
    for step in range(4):
        amaxes.append(batch(step)[0].bfloat16().abs().max().float())
        train_step(model, opt, step)
    assert int(group.steps) == 4 and not group.dirty
    # newest first, three steps kept; the scale from their largest
    torch.testing.assert_close(group.history[0, 0], torch.stack(amaxes[::-1][:3]))
    expected = ref_scale(torch.stack(amaxes[1:]), E4M3)
    assert group.scale[0, 0].item() == expected
    before = amp.report().fp8["fc1"]["input"]["saturated"]
    x = batch(9)[0] * 1000.0                    # far above the history
    model(x)
    xh = x.bfloat16()
    clipped = int((xh.double().abs() * expected > torch.finfo(E4M3).max).sum())
    assert clipped > 0
    assert amp.report().fp8["fc1"]["input"]["saturated"] - before == clipped
    assert "fc1 input: %d clipped at the fp8 maximum" % (before + clipped) in str(amp.report())
    # the current recipe follows the same input without clipping
    amp.initialize(Mlp(), opt_level="O2", fp8=small(), verbosity=0)(x)
    assert amp.report().fp8["fc1"]["input"]["saturated"] == 0


def test_without_an_optimizer_each_forward_is_a_step():
    model = amp.initialize(Mlp(), opt_level="O2", fp8=small(recipe="delayed"), verbosity=0)
    group = fp8_run().groups[0]
    for step in range(3):
        model(batch(step)[0])
    assert int(group.steps) == 2 and group.has_history[:, :2].all()   # the third is pending
    model(batch(0)[0] * 1000.0)
    assert amp.report().fp8["fc1"]["input"]["saturated"] > 0


def test_counts_can_be_turned_off():
    model, opt = setup(small(counts=False))
    x = batch(0)[0]
    x[:, :4] *= 1e-6
    model(x)
    assert amp.report().fp8["fc1"]["input"] == {"saturated": 0, "underflow": 0}
    assert "counts: off" in str(amp.report())


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_an_overflow_inside_an_fp8_backward_skips_the_step(recipe):
    model, opt = setup(small(recipe=recipe))
    train_step(model, opt, 0)
    masters = [p.detach().clone() for p in amp.master_params(opt)]
    x, y = batch(1)
    def overflow(module, args, out):
        out.register_hook(lambda g: torch.full_like(g, float("inf")))
    handle = model.fc2.register_forward_hook(overflow)
    loss = F.cross_entropy(model(x).float(), y)
    handle.remove()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    assert not torch.isfinite(model.fc2.weight.grad).all()     # NaN, not clipped to E5M2's max
    opt.step()
    assert amp.loss_scalers()[0].last_step_skipped
    for before, after in zip(masters, amp.master_params(opt)):
        assert torch.equal(before, after)
    if recipe == "delayed":
        group = fp8_run().groups[0]
        assert group.history[1, 2, 0] == 0 and torch.isfinite(group.history).all()
    train_step(model, opt, 2)
    assert not amp.loss_scalers()[0].last_step_skipped


def test_an_infinite_input_gives_nan_not_a_clipped_value():
    model = amp.initialize(Mlp(), opt_level="O2", fp8=small(recipe="delayed"), verbosity=0)
    x = batch(0)[0]
    x[3, 3] = float("inf")
    assert torch.isnan(model(x)).all()


# ---- training: the O2 steps, accumulation ------------------------------------------------------

def _train(fp8, fused_step, steps=48, device="cpu"):
    handle = amp.AmpHandle()
    torch.manual_seed(0)
    model = Mlp().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = handle.initialize(model, opt, opt_level="O2", fp8=fp8, verbosity=0,
                                   fused_step=fused_step)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, 10, generator=g)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 32, generator=g)
        loss = F.cross_entropy(model(x.to(device)).float(), (x @ w).argmax(1).to(device))
        with handle.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, handle


@pytest.mark.parametrize("recipe,fused_step", [("current", True), ("delayed", False)])
def test_training_stays_within_a_few_percent_of_O2(recipe, fused_step, mm_calls):
    baseline, _ = _train(None, fused_step)
    mm_calls.clear()
    losses, handle = _train(small(recipe=recipe), fused_step)
    assert len(mm_calls) == 48 * 5
    assert losses[-1] < 0.7 * losses[0]
    late, late_baseline = sum(losses[-8:]) / 8, sum(baseline[-8:]) / 8
    assert abs(late - late_baseline) < 0.05 * late_baseline
    assert (": fused step" in handle.report().step_paths[0]) == fused_step


def test_gradient_accumulation_folds_once_per_step_the_largest_amax():
    model, opt = setup(small(recipe="delayed"), fused_step=True)
    group = fp8_run().groups[0]
    micro = [batch(1), batch(2)]
    micro[1] = (micro[1][0] * 3, micro[1][1])
    opt.zero_grad()
    for i, (x, y) in enumerate(micro):
        loss = F.cross_entropy(model(x).float(), y)
        with amp.scale_loss(loss, opt, delay_unscale=i == 0) as scaled:
            scaled.backward()
    opt.step()
    assert int(group.steps) == 1
    largest = max(x.bfloat16().abs().max().float() for x, _ in micro)
    assert group.history[0, 0, 0] == largest
    # the accumulated update is the sum of the two micro-batches' fp8 gradients
    assert not amp.loss_scalers()[0].last_step_skipped


def test_two_optimizers_stepping_one_model_fold_once_per_step():
    model = Mlp()
    first = torch.optim.SGD(model.fc1.parameters(), lr=0.1)
    second = torch.optim.AdamW(list(model.fc2.parameters()) + list(model.head.parameters()))
    model, (first, second) = amp.initialize(model, [first, second], opt_level="O2",
                                            verbosity=0, fp8=small(recipe="delayed"))
    for step in range(3):
        x, y = batch(step)
        loss = F.cross_entropy(model(x).float(), y)
        with amp.scale_loss(loss, [first, second]) as scaled:
            scaled.backward()
        first.step()
        second.step()
        first.zero_grad()
        second.zero_grad()
    group = fp8_run().groups[0]
    assert int(group.steps) == 3 and group.history[0, 0, :3].gt(0).all()


# ---- the checkpoint state -----------------------------------------------------------------------

def _saved(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_the_fp8_state_is_plain_tensors_and_loads_with_weights_only():
    model, opt = setup(small(recipe="delayed", amax_history=4))
    for step in range(3):
        train_step(model, opt, step)
    model(batch(7)[0])                          # a forward after the step: amaxes not folded
    state = _saved(amp.state_dict())
    fp8 = state["apex_lite"]["fp8"]
    assert (fp8["version"], fp8["recipe"], fp8["amax_history"], fp8["margin"]) == \
        (1, "delayed", 4, 0)
    layer = fp8["models"][0]["layers"]["fc1"]
    assert fp8["models"][0]["steps"] == 3
    assert {k: (tuple(v.shape), v.dtype) for k, v in layer.items()} == {
        "counts": ((3, 2), torch.int64), "amax_history": ((3, 4), torch.float32),
        "scale": ((3,), torch.float32), "pending_amax": ((3,), torch.float32)}
    group = fp8_run().groups[0]
    handle = amp.AmpHandle()
    fresh = Mlp()
    handle.initialize(fresh, torch.optim.AdamW(fresh.parameters()), opt_level="O2",
                      verbosity=0, fp8=small(recipe="delayed", amax_history=4))
    handle.load_state_dict(state)
    loaded = handle._run.fp8.groups[0]
    assert group.pending.gt(0).any()
    for key in ("history", "scale", "has_history", "pending", "counts", "steps"):
        assert torch.equal(getattr(loaded, key), getattr(group, key)), key
    # the model's own checkpoint holds no fp8 state: amp's state_dict() carries it
    assert list(model.state_dict()) == list(Mlp().state_dict())


def _mismatch(saved_config, run_config, caplog):
    model, opt = setup(saved_config)
    train_step(model, opt, 0)
    train_step(model, opt, 1)
    state = _saved(amp.state_dict())
    handle = amp.AmpHandle()
    fresh = Mlp()
    handle.initialize(fresh, torch.optim.AdamW(fresh.parameters()), opt_level="O2",
                      verbosity=1, fp8=run_config)
    with caplog.at_level(logging.INFO, logger="apex_lite.amp"):
        handle.load_state_dict(state)
    return handle, state


def test_a_checkpoint_without_fp8_state_loads_into_an_fp8_run_and_back(caplog):
    handle, _ = _mismatch(False, small(recipe="delayed"), caplog)
    assert "holds no fp8 state (saved without fp8=)" in caplog.text
    assert "empty amax histories" in caplog.text
    assert not handle._run.fp8.groups[0].has_history.any()
    caplog.clear()
    handle, state = _mismatch(small(), None, caplog)
    assert "left out the saved fp8 state (current recipe, 2 layer(s)): this run does not use " \
           "fp8" in caplog.text
    assert state["loss_scaler0"] == handle.state_dict()["loss_scaler0"]


def test_another_recipe_or_history_length_loads_what_carries_over(caplog):
    handle, state = _mismatch(small(recipe="delayed", amax_history=4),
                              small(recipe="delayed", amax_history=2), caplog)
    assert "amax histories of 4 steps loaded into 2: the newest 2 kept" in caplog.text
    saved = state["apex_lite"]["fp8"]["models"][0]["layers"]["fc2"]["amax_history"]
    assert torch.equal(handle._run.fp8.groups[0].history[1], saved[:, :2])
    caplog.clear()
    handle, state = _mismatch(small(recipe="delayed"), small(), caplog)
    assert "saved with the delayed recipe, this run uses current: left out the amax " \
           "histories" in caplog.text
    assert torch.equal(handle._run.fp8.groups[0].counts[0],
                       state["apex_lite"]["fp8"]["models"][0]["layers"]["fc1"]["counts"])


@pytest.mark.parametrize("damage,match", [
    (lambda f: f.update(version=2), "version 2"),
    (lambda f: f.update(recipe="hybrid"), "recipe 'hybrid'"),
    (lambda f: f["models"][0]["layers"]["fc1"].update(amax_history=torch.zeros(3, 5)),
     "amax_history of layer 'fc1'"),
    (lambda f: f["models"][0]["layers"]["fc2"].pop("counts"), "layer 'fc2'"),
    (lambda f: f["models"].append(None), "covers 2 model"),
])
def test_a_damaged_fp8_state_is_refused_and_nothing_changes(damage, match):
    model, opt = setup(small(recipe="delayed"))
    train_step(model, opt, 0)
    state = copy.deepcopy(amp.state_dict())
    train_step(model, opt, 1)
    before = amp.state_dict()
    damage(state["apex_lite"]["fp8"])
    with pytest.raises(ValueError, match=match):
        amp.load_state_dict(state)
    after = amp.state_dict()
    assert after["loss_scaler0"] == before["loss_scaler0"]
    for a, b in zip(before["apex_lite"]["master_weights"][0],
                    after["apex_lite"]["master_weights"][0]):
        assert torch.equal(a, b)
    fc1 = before["apex_lite"]["fp8"]["models"][0]["layers"]["fc1"]
    assert torch.equal(fc1["amax_history"],
                       after["apex_lite"]["fp8"]["models"][0]["layers"]["fc1"]["amax_history"])


# ---- the model as other code uses it ------------------------------------------------------------

def test_the_model_checkpoint_holds_the_fp32_masters_under_the_same_keys():
    model, opt = setup()
    train_step(model, opt, 0)
    state = model.state_dict()
    assert list(state) == list(Mlp().state_dict())
    assert all(v.dtype == torch.float32 for v in state.values())
    masters = list(amp.master_params(opt))
    for value, master in zip(state.values(), masters):
        assert torch.equal(value, master)
    plain = Mlp()
    plain.load_state_dict(state)                               # loads into an fp32 model


def test_a_pickled_or_deep_copied_model_runs_fp8_with_its_own_state(mm_calls):
    model, opt = setup(small(recipe="delayed"))
    train_step(model, opt, 0)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    pickled = torch.load(buffer, weights_only=False)
    copied = copy.deepcopy(model)
    x = batch(5)[0]
    expected = model(x)
    for other in (pickled, copied):
        mm_calls.clear()
        assert torch.equal(other(x), expected)
        assert len(mm_calls) == 2
        mine = other.fc1.forward.state.group
        assert mine is not model.fc1.forward.state.group
        assert other.fc1.forward.linear is other.fc1
        assert torch.equal(mine.history, fp8_run().groups[0].history)
    before = fp8_run().groups[0].counts.clone()
    x[:, 0] *= 1e-7
    copied(x)
    assert torch.equal(fp8_run().groups[0].counts, before)


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 32)
        self.fc2 = torch.nn.Linear(32, 32)
        self.fc2.weight = self.fc1.weight
        self.head = torch.nn.Linear(32, 10)

    def forward(self, x):
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def test_tied_weights_train_as_one_parameter(mm_calls):
    model, opt = setup(model=Tied(), lr=1e-2)
    losses = [train_step(model, opt, step % 2) for step in range(6)]
    assert losses[-1] < losses[0]
    assert len(mm_calls) == 6 * 5
    state = model.state_dict()
    assert torch.equal(state["fc1.weight"], state["fc2.weight"])
    assert model.fc1.weight is model.fc2.weight
    assert [name for name, _ in fp8_run().layers[0]] == ["fc1", "fc2"]


def test_compiled_model_equals_eager():
    """Bitwise where inductor keeps eager's roundings (emulate_precision_casts); without, the
    compiled cast of amp's fp32->half input cast into the fp8 cast skips a rounding: equal to
    fp8 rounding."""
    inductor = pytest.importorskip("torch._inductor.config")
    model, opt = setup(small(recipe="delayed"))
    train_step(model, opt, 0)
    group = fp8_run().groups[0]
    x, y = batch(3)
    x[:, :2] *= 1e-6

    def run(m):
        out = m(x)
        F.cross_entropy(out.float(), y).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        return out, grads, group.counts.clone(), group.pending.clone()

    state = [t.clone() for t in (group.counts, group.pending)]
    model.zero_grad()
    eager = run(model)
    group.counts.copy_(state[0])
    group.pending.copy_(state[1])
    old = inductor.emulate_precision_casts
    inductor.emulate_precision_casts = True
    try:
        compiled = run(torch.compile(model))
    finally:
        inductor.emulate_precision_casts = old
    torch.testing.assert_close(compiled[0], eager[0], rtol=0, atol=0)
    for a, b in zip(compiled[1], eager[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert torch.equal(compiled[2], eager[2]) and torch.equal(compiled[3], eager[3])


def test_O5_runs_fp8_with_its_static_scale(mm_calls):
    model, opt = setup(small(), level="O5")
    losses = [train_step(model, opt, step % 2) for step in range(4)]
    assert losses[-1] < losses[0] and len(mm_calls) == 4 * 5
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 1.0


# ---- the compiled casts (the GPU's path; the CPU's inductor checks the same code) -------------

def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and not torch.version.hip \
        and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not _fp8_gpu(), reason="needs a CUDA GPU with fp8 matmuls (sm_89 or newer)"))])
def test_compiled_casts_equal_the_eager_casts(device):
    compiled = fp8_cast._Compiled()
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(40, 48, generator=g) * 3).bfloat16().to(device)
    x[:, :3] *= 1e-11                        # flushed in either format
    history = (torch.tensor(2.0 ** 4, device=device), torch.tensor(True, device=device))
    for fp8_dtype in (E4M3, E5M2):
        for delayed in (False, True):
            results = []
            for fn in (fp8_cast.cast, compiled):
                counts = torch.zeros(2, dtype=torch.int64, device=device)
                pending = torch.zeros((), device=device)
                args = history + (pending,) if delayed else ()
                t8, inverse = fn(x, fp8_dtype, 0, True, counts, *args)
                results.append((t8.view(torch.uint8), inverse, counts, pending))
            assert not compiled.failed
            for a, b in zip(*results):
                assert torch.equal(a, b), (fp8_dtype, delayed)
            assert results[0][2].sum() > 0       # something was flushed (and clipped)


def test_a_cast_compilation_that_fails_is_said_once_and_runs_eagerly(monkeypatch, caplog):
    def broken(fn, **kwargs):
        def call(*args):
            raise RuntimeError("no C++ compiler here")
        return call
    monkeypatch.setattr(torch, "compile", broken)
    compiled = fp8_cast._Compiled()
    x = torch.randn(16, 16).bfloat16()
    with caplog.at_level(logging.WARNING, logger="apex_lite.amp"):
        first = compiled(x, E4M3, 0, False, None)
        second = compiled(x, E4M3, 0, False, None)
    assert compiled.failed and caplog.text.count("compiling the casts to fp8 failed") == 1
    expected = fp8_cast.cast(x, E4M3, 0, False, None)
    for got in (first, second):
        assert torch.equal(got[0].view(torch.uint8), expected[0].view(torch.uint8))
