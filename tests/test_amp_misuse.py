"""Misuse of the step path that would train silently wrong is refused, naming the fix, before
anything changes (issue: "Misuse must never train silently wrong"). Each row: what the user did,
at every opt level where it applies, on both backends (the suite runs once per backend)."""
from __future__ import annotations

import logging
import re
import threading

import pytest
import torch

from apex_lite import amp

# Every rule holds on the fused and the unfused step path, which only O2 has: O2 runs once per
# path, the other levels once. Refusals at initialize (before a path is chosen) run per level.
LEVELS = ["O0", "O1", "O2-fused", "O2-unfused", "O3"]
SCALED_LEVELS = ["O1", "O2-fused", "O2-unfused"]      # the levels with a dynamic loss scale
INIT_LEVELS = ["O0", "O1", "O2", "O3"]


def _opt_level(level):
    return level.split("-")[0]


def _path(level):
    return {"O2-fused": True, "O2-unfused": False}.get(level)


def _setup(level, n_opts=1, **kwargs):
    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 2) for _ in range(n_opts)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    models, opts = amp.initialize(models, opts, opt_level=_opt_level(level), verbosity=0,
                                  fused_step=_path(level), **kwargs)
    return models, opts


def _loss(models, x=None):
    x = torch.ones(3, 4) if x is None else x
    return sum(m(x).float().pow(2).sum() for m in models)


def _snapshot(opts):
    """Everything a refused call must leave as it was: masters, model params, scaler state."""
    run = amp.default_handle()._run
    params = [p.detach().clone() for m in run.models for p in m.parameters()]
    masters = [p.detach().clone() for o in opts for p in o._apex_lite_amp.masters()]
    scalers = [(s.loss_scale, s.steps, s.skipped_steps, s.unskipped)
               for s in amp.loss_scalers()]
    return params, masters, scalers


def _assert_unchanged(before, opts):
    after = _snapshot(opts)
    for b, a in zip(before[0] + before[1], after[0] + after[1]):
        assert torch.equal(b, a)
    assert before[2] == after[2]


# ---- 1: step() inside the block ------------------------------------------------------------------

@pytest.mark.parametrize("level", LEVELS)
def test_step_inside_the_block_is_refused(level):
    models, opts = _setup(level)
    before = _snapshot(opts)
    with pytest.raises(RuntimeError, match=r"inside its `with amp.scale_loss\(...\)` block"):
        with amp.scale_loss(_loss(models), opts[0]) as scaled:
            scaled.backward()
            opts[0].step()
    _assert_unchanged(before, opts)


# ---- 2: backward after the block exited ----------------------------------------------------------

@pytest.mark.parametrize("level", LEVELS)
def test_backward_after_the_block_is_refused(level):
    models, opts = _setup(level)
    before = _snapshot(opts)
    with amp.scale_loss(_loss(models), opts[0]) as scaled:
        pass
    with pytest.raises(RuntimeError, match="after its `with amp.scale_loss"):
        scaled.backward()
    assert all(p.grad is None for m in models for p in m.parameters())
    _assert_unchanged(before, opts)


# ---- 3: no optimizers ----------------------------------------------------------------------------

@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("optimizers", [[], ()])
def test_scale_loss_without_optimizers_is_refused(level, optimizers):
    models, opts = _setup(level)
    with pytest.raises(ValueError, match="got no optimizers"):
        with amp.scale_loss(_loss(models), optimizers):
            pass


# ---- 4: a second optimizer fed by a scale_loss it was not given ----------------------------------

@pytest.mark.parametrize("level", LEVELS)
def test_optimizer_fed_by_another_scale_loss_is_refused(level):
    models, opts = _setup(level, n_opts=2)
    for o in opts:
        o.zero_grad()
    with amp.scale_loss(_loss(models), opts[0]) as scaled:   # reaches both models
        scaled.backward()
    opts[0].step()
    before = _snapshot(opts)
    with pytest.raises(RuntimeError, match=r"optimizer 1 \(SGD\).*no amp.scale_loss for this "
                                           r"optimizer unscaled"):
        opts[1].step()
    _assert_unchanged(before, opts)


@pytest.mark.parametrize("level", LEVELS)
def test_zeroed_gradients_of_an_unused_optimizer_step_as_in_torch(level):
    """zero_grad(set_to_none=False) leaves zeros, which are not a misuse: a no-op step, as torch's
    SGD (no momentum, no weight decay) takes on zero gradients. The unused optimizer held
    gradients from an earlier backward (which it did not step on), so zeros, not stale values,
    must be what it applies: its parameters, masters included, stay bit for bit; the used one's
    move, and no step is skipped."""
    models, opts = _setup(level, n_opts=2)
    with amp.scale_loss(_loss(models), opts) as scaled:
        scaled.backward()
    opts[0].step()
    before = _snapshot(opts)
    for o in opts:
        o.zero_grad(set_to_none=False)
    with amp.scale_loss(_loss(models[:1]), opts[0]) as scaled:
        scaled.backward()
    opts[0].step()
    opts[1].step()
    after = _snapshot(opts)
    unused_masters = [p.detach() for p in opts[1]._apex_lite_amp.masters()]
    assert all(torch.equal(p, q) for p, q in zip(before[0][2:], after[0][2:]))  # models[1]
    assert all(torch.equal(p, q) for p, q in zip(before[1][2:], unused_masters))
    assert not any(torch.equal(p, q) for p, q in zip(before[0][:2], after[0][:2]))
    assert not amp.loss_scalers()[0].last_step_skipped


# ---- 5: a backward outside scale_loss ------------------------------------------------------------

@pytest.mark.parametrize("level", LEVELS)
def test_backward_outside_scale_loss_is_refused(level):
    models, opts = _setup(level)
    opts[0].zero_grad()
    _loss(models).backward()
    before = _snapshot(opts)
    with pytest.raises(RuntimeError, match="outside\\s+amp.scale_loss"):
        opts[0].step()
    _assert_unchanged(before, opts)


@pytest.mark.parametrize("level", LEVELS)
def test_backward_outside_scale_loss_after_a_step_is_refused(level):
    models, opts = _setup(level)
    with amp.scale_loss(_loss(models), opts[0]) as scaled:
        scaled.backward()
    opts[0].step()
    for p in models[0].parameters():
        p.grad = None
    _loss(models).backward()
    with pytest.raises(RuntimeError, match="outside amp.scale_loss"):
        opts[0].step()


# ---- 6: loss scales outside fp32 -------------------------------------------------------------

OUT_OF_FP32 = [("loss_scale", 1e-40, r"its inverse 1e\+40, the factor that unscales"),
               ("loss_scale", 1e39, "it is above fp32's largest number"),
               ("max_loss_scale", 1e-40, r"its inverse 1e\+40"),
               ("max_loss_scale", 1e39, "it is above fp32's largest number"),
               ("min_loss_scale", 1e-40, r"its inverse 1e\+40")]


@pytest.mark.parametrize("level", INIT_LEVELS)
@pytest.mark.parametrize("name, value, why", OUT_OF_FP32)
def test_a_loss_scale_outside_fp32_is_refused_at_initialize(level, name, value, why):
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=f"{name}={re.escape(repr(value))} cannot be used as a "
                                         f"loss scale: {why}"):
        amp.initialize(model, opt, opt_level=level, verbosity=0, **{name: value})
    assert model.weight.dtype == torch.float32 and not hasattr(opt, "_apex_lite_amp")
    assert amp.default_handle()._run is None


@pytest.mark.parametrize("level", LEVELS)
def test_the_smallest_and_largest_fp32_scales_are_accepted(level):
    """The bounds are fp32's: 2**-126 (the floor without min_loss_scale) and 2**127 work."""
    for kwargs in (dict(loss_scale=2.0 ** -126), dict(loss_scale=2.0 ** 127),
                   dict(min_loss_scale=2.0 ** -126, max_loss_scale=2.0 ** 127)):
        amp.default_handle().__init__()
        _setup(level, **kwargs)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("value", [1e-40, 1e39])
def test_a_loaded_loss_scale_outside_fp32_is_refused_and_nothing_changes(level, value):
    models, opts = _setup(level)
    with amp.scale_loss(_loss(models), opts[0]) as scaled:
        scaled.backward()
    opts[0].step()
    state = amp.state_dict()
    state["loss_scaler0"]["loss_scale"] = value
    before = _snapshot(opts)
    with pytest.raises(ValueError, match=r"loss_scaler0\['loss_scale'\] is .*, which cannot be "
                                         r"a loss scale"):
        amp.load_state_dict(state)
    _assert_unchanged(before, opts)


@pytest.mark.parametrize("level", SCALED_LEVELS)
def test_a_tiny_loss_scale_never_writes_nan_into_the_weights(level):
    """Issue row 6's outcome: a step at the smallest accepted scale leaves finite weights."""
    models, opts = _setup(level, min_loss_scale=2.0 ** -126, max_loss_scale=2.0 ** -126)
    assert amp.loss_scalers()[0].loss_scale == 2.0 ** -126
    with amp.scale_loss(_loss(models), opts[0]) as scaled:
        scaled.backward()
    opts[0].step()
    assert all(torch.isfinite(p).all() for p in amp.master_params(opts[0]))


# ---- 10: min_loss_scale above the start ------------------------------------------------------------

@pytest.mark.parametrize("level", SCALED_LEVELS)
def test_the_dynamic_scale_starts_within_its_bounds(level):
    models, opts = _setup(level, min_loss_scale=1e5)
    scaler = amp.loss_scalers()[0]
    assert scaler.loss_scale == 1e5
    with amp.scale_loss(_loss(models), opts[0]) as scaled:
        scaled.backward()
        models[0].weight.grad.fill_(float("inf"))
    opts[0].step()
    assert scaler.loss_scale == 1e5 and scaler.skipped_steps == 1   # at its floor, not raised
    state = amp.state_dict()
    amp.default_handle().__init__()
    _setup(level, min_loss_scale=1e5)
    amp.load_state_dict(state)                                       # the run's own state loads
    assert amp.loss_scalers()[0].loss_scale == 1e5
    amp.default_handle().__init__()
    _setup(level, max_loss_scale=2.0 ** 10)
    assert amp.loss_scalers()[0].loss_scale == 2.0 ** 10


# ---- 7: one parameter in two optimizers ----------------------------------------------------------

@pytest.mark.parametrize("level", INIT_LEVELS)
def test_a_parameter_in_two_optimizers_is_refused_at_initialize(level):
    model = torch.nn.Linear(4, 2)
    o0 = torch.optim.SGD(model.parameters(), lr=0.1)
    o1 = torch.optim.SGD([model.weight], lr=0.1)
    with pytest.raises(ValueError, match=r"'weight' is in optimizer 0 and in optimizer 1"):
        amp.initialize(model, [o0, o1], opt_level=level, verbosity=0)
    assert model.weight.dtype == torch.float32 and not hasattr(o0, "_apex_lite_amp")


@pytest.mark.parametrize("level", LEVELS)
def test_add_param_group_of_another_optimizers_parameter_is_refused(level):
    models, opts = _setup(level, n_opts=2)
    with pytest.raises(ValueError, match=r"already updated by optimizer 0"):
        opts[1].add_param_group({"params": [models[0].weight]})
    assert len(opts[1].param_groups) == 1


# ---- 12: the model's dtype changed after initialize ----------------------------------------------

# Every cast that changes the model: not float() where it is fp32 (O0, O1), nor bfloat16() where
# it is bf16 already (O2's Linear, O3; the CPU's half dtype).
@pytest.mark.parametrize("level, cast", [
    (level, cast) for level in LEVELS for cast in ("half", "bfloat16", "double", "float")
    if (cast, _opt_level(level)) not in {("float", "O0"), ("float", "O1"), ("bfloat16", "O2"),
                                         ("bfloat16", "O3")}])
def test_dtype_change_after_initialize_is_refused(level, cast):
    models, opts = _setup(level)
    dtypes = {p.dtype for p in models[0].parameters()}
    getattr(models[0], cast)()
    assert {p.dtype for p in models[0].parameters()} != dtypes
    with pytest.raises(RuntimeError, match="dtype of the model changed after amp.initialize"):
        with amp.scale_loss(_loss(models, torch.ones(3, 4).to(models[0].weight.dtype)),
                            opts[0]) as scaled:
            scaled.backward()


# ---- 13: scaled_loss.backward without () ---------------------------------------------------------

@pytest.mark.parametrize("level", LEVELS)
def test_block_without_backward_then_step_is_refused(level):
    models, opts = _setup(level)
    before = _snapshot(opts)
    with amp.scale_loss(_loss(models), opts[0]) as scaled:
        scaled.backward                                  # noqa: B018  (the slip itself)
    with pytest.raises(RuntimeError, match="ran no backward through scaled_loss"):
        opts[0].step()
    _assert_unchanged(before, opts)
    # A block that ran no backward and no step is fine: the next iteration goes on.
    opts[0].zero_grad()
    with amp.scale_loss(_loss(models), opts[0]) as scaled:
        scaled.backward()
    opts[0].step()


# ---- 14: skips with the scale at its floor warn --------------------------------------------------

@pytest.mark.parametrize("level", SCALED_LEVELS)
def test_skips_at_the_floor_warn_and_the_rate_warning_comes(level, caplog):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=_opt_level(level), min_loss_scale=2.0 ** 14,
                                overflow_patience=None, fused_step=_path(level))
    with caplog.at_level(logging.INFO, logger="apex_lite.amp"):
        for _ in range(150):
            opt.zero_grad()
            with amp.scale_loss(model(torch.ones(2, 4)).float().sum(), opt) as scaled:
                scaled.backward()
                model.weight.grad.fill_(float("nan"))
            opt.step()
    assert amp.loss_scalers()[0].skipped_steps == 150
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("at its floor" in w for w in warnings) == 1
    assert any("of the last 100 steps were skipped" in w for w in warnings)


# ---- 16: two threads on the module-level amp -----------------------------------------------------

def test_a_second_initialize_elsewhere_points_to_one_handle_per_thread():
    models, opts = _setup("O1")
    errors = []

    def other_thread():
        _setup("O1")

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    try:
        with amp.scale_loss(_loss(models), opts[0]) as scaled:
            scaled.backward()
    except RuntimeError as exc:
        errors.append(str(exc))
    assert errors and "amp.AmpHandle()" in errors[0]
    assert "thread" in errors[0]


def test_one_handle_per_thread_trains_independently():
    """Two threads, each with its own handle, model and data, each train as plain torch does in
    one thread: O1 is torch.autocast around the forward, and a power-of-two loss scale that never
    overflows here is unscaled exactly, so the weights match bit for bit. Different models and
    inputs per thread, so that a step that does nothing or one thread's state in the other's
    step shows."""
    def make(seed):
        torch.manual_seed(seed)
        return torch.nn.Linear(4, 2)

    def inputs(seed):
        return torch.randn(3, 4, generator=torch.Generator().manual_seed(100 + seed))

    def reference(seed):
        model = make(seed)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(5):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(inputs(seed))
            out.float().pow(2).sum().backward()
            opt.step()
        return model.weight.detach().clone(), make(seed).weight.detach()

    models = [make(seed) for seed in range(2)]   # here: the threads would share torch's RNG
    results = {}

    def train(seed):
        handle = amp.AmpHandle()
        model = models[seed]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = handle.initialize(model, opt, opt_level="O1", half_dtype=torch.bfloat16,
                                       verbosity=0)
        for _ in range(5):
            opt.zero_grad()
            with handle.scale_loss(model(inputs(seed)).float().pow(2).sum(), opt) as scaled:
                scaled.backward()
            opt.step()
        results[seed] = model.weight.detach().clone(), handle.loss_scalers()[0].skipped_steps

    threads = [threading.Thread(target=train, args=(seed,)) for seed in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for seed in range(2):
        expected, initial = reference(seed)
        assert not torch.equal(expected, initial)
        assert results[seed][1] == 0
        torch.testing.assert_close(results[seed][0], expected, rtol=0, atol=0)


# ---- 4 and 5, once the optimizer already holds gradients amp unscaled ----------------------------
# The refusal above covers an optimizer whose gradients were cleared. When it already holds this
# iteration's unscaled gradients, a further backward that reaches its parameters outside any
# scale_loss it was given goes unseen: O1 applies it multiplied by the loss scale, O2 drops it
# (the model's half .grad changes, the fp32 master .grad that step() applies does not).

def _two_models(level):
    torch.manual_seed(0)
    a, b = torch.nn.Linear(2, 1, bias=False), torch.nn.Linear(2, 1, bias=False)
    o0 = torch.optim.SGD(a.parameters(), lr=0.1)
    o1 = torch.optim.SGD(b.parameters(), lr=0.1)
    return amp.initialize([a, b], [o0, o1], opt_level=_opt_level(level), verbosity=0,
                          fused_step=_path(level))


def _through_another_scale_loss(a, b, o0, x):
    with amp.scale_loss((a(x) + b(x)).float().sum(), o0) as scaled:   # reaches b as well
        scaled.backward()


def _outside_scale_loss(a, b, o0, x):
    b(x).float().sum().backward()


@pytest.mark.parametrize("extra_backward", [_through_another_scale_loss, _outside_scale_loss],
                         ids=["another scale_loss", "outside scale_loss"])
@pytest.mark.parametrize("level", SCALED_LEVELS)
def test_a_further_backward_into_unscaled_gradients_is_refused(level, extra_backward):
    (a, b), (o0, o1) = _two_models(level)
    x = torch.ones(1, 2)
    with amp.scale_loss(b(x).float().sum(), o1) as scaled:
        scaled.backward()
    extra_backward(a, b, o0, x)
    before = _snapshot([o0, o1])
    with pytest.raises(RuntimeError, match=r"optimizer 1 \(SGD\).*scale_loss"):
        o1.step()
    _assert_unchanged(before, [o0, o1])
