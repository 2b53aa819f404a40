"""apex's semantics that a user cannot see until training goes wrong (apex's L0 multiple-models,
add_param_group and checkpointing tests are the model): O2 master gradients start afresh after
every step however the model's gradients were cleared, and accumulate as torch's .grad does when
they were not; apex's skip rule (an overflow in a scale_loss backward skips every optimizer given
to that scale_loss, and no other), each loss scaler backing off only for its own backward;
``cast_model_type=False``; fp32 model checkpoints.

The table compares amp with a plain fp32 run of the same models that skips, by apex's rule, the
steps whose backwards overflowed (what a correct amp must do).
"""
from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch

from apex_lite import amp
from apex_lite.amp.optimizer import CHECKED

STEP_PATHS = pytest.mark.parametrize("fused_step", [True, False], ids=["fused", "unfused"])


def _path(level, fused_step):
    """``fused_step`` for ``initialize`` at ``level``: the fused step exists at O2 and O5."""
    return fused_step if level in ("O2", "O5") else None

LEVELS = ["O0", "O1", "O2", "O3"]
ROCM_LEVELS = ["O4", "O5"]   # ROCm apex's: O1 and O2 in bf16 with a static scale of 1.0
CLEARING = ["opt.zero_grad()", "opt.zero_grad(set_to_none=False)", "model.zero_grad()",
            "model.zero_grad(set_to_none=False)", "p.grad = None", "none"]
STEPS = 3
INJECT_STEP = 1
# bf16 forwards (O1 autocast, O2/O3 half models) differ from fp32 by bf16's rounding; the errors
# guarded against (a gradient added twice, an update dropped or taken while it should be skipped)
# are far larger.
TOLERANCE = {"O0": dict(rtol=1e-5, atol=1e-6), "O1": dict(rtol=3e-2, atol=3e-2),
             "O2": dict(rtol=3e-2, atol=3e-2), "O3": dict(rtol=6e-2, atol=6e-2),
             "O4": dict(rtol=3e-2, atol=3e-2), "O5": dict(rtol=3e-2, atol=3e-2)}


def _models(shared: bool):
    torch.manual_seed(0)
    models = [torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)]
    if shared:
        models.append(torch.nn.Linear(3, 2))
    return models


def _optimizers(models, n_opts: int):
    make = lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)  # noqa: E731
    a, b, *s = models
    if n_opts == 1:
        return [make([p for m in models for p in m.parameters()])]
    return [make([*a.parameters(), *(p for m in s for p in m.parameters())]),
            make(list(b.parameters()))]


def _losses(models, x):
    a, b, *s = models
    loss0 = a(x).float().pow(2).sum()
    loss1 = b(x).float().pow(2).sum()
    for m in s:                      # the shared trunk feeds both losses
        loss0 = loss0 + m(x).float().pow(2).sum()
        loss1 = loss1 + m(x).float().sum()
    return loss0, loss1


def _clear(how: str, models, opts) -> None:
    if how == "opt.zero_grad()":
        for o in opts:
            o.zero_grad()
    elif how == "opt.zero_grad(set_to_none=False)":
        for o in opts:
            o.zero_grad(set_to_none=False)
    elif how == "model.zero_grad()":
        for m in models:
            m.zero_grad()
    elif how == "model.zero_grad(set_to_none=False)":
        for m in models:
            m.zero_grad(set_to_none=False)
    elif how == "p.grad = None":
        for m in models:
            for p in m.parameters():
                p.grad = None
    else:
        assert how == "none"


def _inject(models, step: int, backward: int, inject) -> None:
    if inject == backward and step == INJECT_STEP:
        models[backward].weight.grad[0, 0] = float("inf")


def _given(opts, n_opts: int, shared: bool):
    """The optimizers each loss's scale_loss is given."""
    if n_opts == 1:
        return [[opts[0]], [opts[0]]]
    return [[opts[0]], [opts[1], opts[0]] if shared else [opts[1]]]


def _nonfinite(params) -> set:
    return {id(p) for p in params if p.grad is not None and not torch.isfinite(p.grad).all()}


def _reference(clearing, n_opts, shared, inject, x):
    """Plain fp32 torch with apex's rule: a backward overflowed when a gradient it reached is not
    finite after it (and was finite before it in this step); then every optimizer given to its
    scale_loss skips."""
    models = _models(shared)
    opts = _optimizers(models, n_opts)
    given = _given(opts, n_opts, shared)
    a, b, *s = models
    reached = [[p for m in [a, *s] for p in m.parameters()],
               [p for m in [b, *s] for p in m.parameters()]]
    skipped = []
    for step in range(STEPS):
        _clear(clearing, models, opts)
        bad_this_step: set = set()
        skipping = set()
        for backward, loss in enumerate(_losses(models, x)):
            loss.backward()
            _inject(models, step, backward, inject)
            bad = _nonfinite(reached[backward])
            if bad - bad_this_step:
                skipping.update(id(o) for o in given[backward])
            bad_this_step |= bad
        skips = [id(o) in skipping for o in opts]
        skipped.append(skips)
        for o, skip in zip(opts, skips):
            if not skip:
                o.step()
    return models, opts, skipped


def _masters(opt):
    """What ``opt`` updates, read without materialising anything (amp.master_params would turn
    the fused step's lazy gradients into master gradients)."""
    return opt._apex_lite_amp.masters()


def _true_grads(opt):
    """The unscaled gradients ``opt`` is about to apply: the masters' (unfused) or, lazy on the
    fused step, the model's divided by their loss scale."""
    amp_opt = opt._apex_lite_amp
    grads = []
    for master in amp_opt.masters():
        if amp_opt.grad_state == CHECKED:
            grad = amp_opt.run.pairs.model_of(master).grad
            grads.append(None if grad is None else grad.float() * amp_opt.held_scale.inv)
        else:
            grads.append(None if master.grad is None else master.grad.float().clone())
    return grads


def _amp_run(level, clearing, n_opts, n_scalers, shared, inject, x, fused_step):
    models = _models(shared)
    opts = _optimizers(models, n_opts)
    models, opts = amp.initialize(models, opts, opt_level=level, num_losses=n_scalers,
                                  verbosity=0, fused_step=_path(level, fused_step))
    assert all(o._apex_lite_amp.path.fused for o in opts) == bool(fused_step)
    given = _given(opts, n_opts, shared)
    loss_ids = [0, 0] if n_scalers == 1 else [0, 1]
    steps_taken = []
    for step in range(STEPS):
        _clear(clearing, models, opts)
        before = [[p.detach().clone() for p in _masters(o)] for o in opts]
        for backward, loss in enumerate(_losses(models, x)):
            with amp.scale_loss(loss, given[backward], loss_id=loss_ids[backward]) as scaled:
                scaled.backward()
                _inject(models, step, backward, inject)
        master_grads = [_true_grads(o) for o in opts]
        for o in opts:
            o.step()
        steps_taken.append([any(not torch.equal(b, p) for b, p in zip(bs, _masters(o)))
                            for bs, o in zip(before, opts)])
    return models, opts, master_grads, steps_taken


# O2 and O5 run on both step paths (fused_step=True and False); the other levels have only the
# unfused one. O4 and O5 run the same code as O1 and O2 (test_amp_rocm_levels.py holds them bit
# for bit equal): here every clearing, two optimizers over a shared trunk, a skip in either loss.
CASES = [c + (path,) for c in itertools.product(LEVELS, CLEARING, [1, 2], [1, 2], [False, True],
                                                [None, 0, 1])
         for path in ([True, False] if c[0] == "O2" else [None])] + \
    [c + (path,) for c in itertools.product(ROCM_LEVELS, CLEARING, [2], [1, 2], [True], [0, 1])
     for path in ([True, False] if c[0] == "O5" else [None])]


@pytest.mark.parametrize("level, clearing, n_opts, n_scalers, shared, inject, fused_step", CASES)
def test_matches_fp32_that_skips_the_same_steps(level, clearing, n_opts, n_scalers, shared,
                                                inject, fused_step):
    x = torch.tensor([[1.0, -0.5, 0.25], [0.5, 1.0, -1.0]])
    ref_models, ref_opts, ref_skipped = _reference(clearing, n_opts, shared, inject, x)
    models, opts, master_grads, steps_taken = _amp_run(level, clearing, n_opts, n_scalers,
                                                       shared, inject, x, fused_step)
    tol = TOLERANCE[level]
    # The same steps skipped, per optimizer.
    assert [[not s for s in skips] for skips in ref_skipped] == steps_taken
    # The last step's gradients (what the optimizer saw) and the final weights.
    for ref_opt, grads in zip(ref_opts, master_grads):
        ref_grads = [p.grad for g in ref_opt.param_groups for p in g["params"]]
        for ref, got in zip(ref_grads, grads):
            torch.testing.assert_close(got, ref.float(), equal_nan=True, **tol)
    for ref_opt, opt in zip(ref_opts, opts):
        ref_params = [p for g in ref_opt.param_groups for p in g["params"]]
        for ref, got in zip(ref_params, _masters(opt)):
            torch.testing.assert_close(got.detach().float(), ref.detach(), **tol)
    # Each scaler backed off only for an inf in its own backward (one injected inf, one skip).
    if clearing != "none" and inject is not None:
        skipped = [scaler.skipped_steps for scaler in amp.loss_scalers()]
        expected = [0] * n_scalers
        expected[min(inject, n_scalers - 1)] = 1
        assert skipped == expected


# ---- the regression snippets -----------------------------------------------------------

@STEP_PATHS
def test_o2_master_gradients_start_afresh_after_param_grad_none(fused_step):
    m = torch.nn.Linear(4, 1, bias=False)
    o = torch.optim.SGD(m.parameters(), lr=0.0)
    m, o = amp.initialize(m, o, opt_level="O2", verbosity=0, fused_step=fused_step)
    for _ in range(3):
        for p in m.parameters():
            p.grad = None
        with amp.scale_loss(m(torch.ones(1, 4)).float().sum(), o) as s:
            s.backward()
        assert torch.equal(_true_grads(o)[0], torch.ones(1, 4))
        o.step()


@pytest.mark.parametrize("level", ["O1", "O2", "O4", "O5"])
@STEP_PATHS
def test_no_clearing_accumulates_like_torch(level, fused_step):
    """Never cleared, gradients add up over steps in torch; amp's unscaled ones do the same."""
    m = torch.nn.Linear(4, 1, bias=False)
    o = torch.optim.SGD(m.parameters(), lr=0.0)
    m, o = amp.initialize(m, o, opt_level=level, verbosity=0,
                          fused_step=_path(level, fused_step))
    for i in range(3):
        with amp.scale_loss(m(torch.ones(1, 4)).float().sum(), o) as s:
            s.backward()
        assert torch.equal(_true_grads(o)[0], torch.full((1, 4), i + 1.0))
        o.step()


@pytest.mark.parametrize("level", ["O1", "O2", "O4", "O5"])
@pytest.mark.parametrize("delay_unscale", [False, True])
@STEP_PATHS
def test_accumulation_before_one_step_still_adds(level, delay_unscale, fused_step):
    m = torch.nn.Linear(4, 1, bias=False)
    o = torch.optim.SGD(m.parameters(), lr=0.0)
    m, o = amp.initialize(m, o, opt_level=level, verbosity=0,
                          fused_step=_path(level, fused_step))
    for step in range(2):
        o.zero_grad()
        for micro in range(3):
            with amp.scale_loss(m(torch.ones(1, 4)).float().sum(), o,
                                delay_unscale=delay_unscale and micro < 2) as s:
                s.backward()
        assert torch.equal(_true_grads(o)[0], torch.full((1, 4), 3.0))
        o.step()


@pytest.mark.parametrize("level", ["O1", "O2"])
@STEP_PATHS
def test_one_loss_overflow_does_not_skip_another_loss_optimizer(level, fused_step):
    a, s, b = (torch.nn.Linear(2, 1, bias=False) for _ in range(3))
    o0 = torch.optim.SGD([*a.parameters(), *s.parameters()], lr=0.1)
    o1 = torch.optim.SGD(b.parameters(), lr=0.1)
    [a, s, b], [o0, o1] = amp.initialize([a, s, b], [o0, o1], opt_level=level, num_losses=2,
                                         verbosity=0, fused_step=_path(level, fused_step))
    x = torch.ones(1, 2)
    before = [p.detach().clone() for p in _masters(o0)] + \
        [b.weight.detach().float().clone()]
    with amp.scale_loss((a(x) + s(x)).float().sum(), o0, loss_id=0) as loss:
        loss.backward()
        s.weight.grad[0, 0] = float("inf")      # overflow in the first backward only
    with amp.scale_loss((b(x) + s(x)).float().sum(), [o0, o1], loss_id=1) as loss:
        loss.backward()                          # finite
    o0.step()
    o1.step()
    assert all(torch.equal(p, q) for p, q in zip(before[:2], _masters(o0)))
    stepped = _masters(o1)[0]
    torch.testing.assert_close(stepped.float(), before[2] - 0.1 * torch.ones(1, 2),
                               rtol=1e-2, atol=1e-2)
    scalers = amp.loss_scalers()
    assert (scalers[0].skipped_steps, scalers[1].skipped_steps) == (1, 0)
    assert scalers[0].loss_scale == 2.0 ** 15 and scalers[1].loss_scale == 2.0 ** 16


@pytest.mark.parametrize("level", ["O1", "O2"])
@STEP_PATHS
def test_two_scalers_into_the_same_gradients_sum_the_unscaled_values(level, fused_step):
    m = torch.nn.Linear(3, 1, bias=False)
    o = torch.optim.SGD(m.parameters(), lr=0.0)
    m, o = amp.initialize(m, o, opt_level=level, num_losses=2, verbosity=0,
                          fused_step=_path(level, fused_step))
    amp.loss_scalers()[1].loss_scale = 2.0 ** 5      # different scales on purpose
    x = torch.ones(1, 3)
    with amp.scale_loss(m(x).float().sum(), o, loss_id=0) as loss:
        loss.backward()
    with amp.scale_loss(3 * m(x).float().sum(), o, loss_id=1) as loss:
        loss.backward()
    assert torch.equal(_true_grads(o)[0], torch.full((1, 3), 4.0))


# ---- cast_model_type=False -----------------------------------------------------------------------

@pytest.mark.parametrize("level", LEVELS + ROCM_LEVELS)   # apex accepted False at O1 as well
@pytest.mark.parametrize("false", [False, "False"])      # apex's argparse string too
def test_cast_model_type_false_leaves_the_model_fp32(level, false):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, cast_model_type=false, verbosity=0)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert amp.default_handle()._run.properties.cast_model_type is None
    # The fp32 parameters are their own masters: no copies.
    assert all(m is p for m, p in zip(amp.master_params(opt), model.parameters()))
    out = model(torch.randn(8, 4))
    assert out.dtype == torch.float32
    with amp.scale_loss(out.sum(), opt) as scaled:
        scaled.backward()
    opt.step()


def test_o2_master_weights_on_an_uncast_model_is_accepted():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", cast_model_type=torch.float32,
                                master_weights=True, verbosity=0)
    assert model.weight.dtype == torch.float32
    assert next(amp.master_params(opt)) is model.weight


def test_o1_master_weights_still_refused():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="master_weights with O1"):
        amp.initialize(model, opt, opt_level="O1", master_weights=True)


# ---- model checkpoints hold fp32 -----------------------------------------------------------------

def _trained(level, **kwargs):  # the default (fused where it applies) step path
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, **kwargs)
    for _ in range(3):
        opt.zero_grad()
        with amp.scale_loss(model(torch.randn(8, 4)).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
    return model, opt


def test_o2_state_dict_holds_the_masters_themselves():
    model, opt = _trained("O2")
    state = model.state_dict()
    assert all(v.dtype in (torch.float32, torch.int64) for v in state.values())
    run = amp.default_handle()._run
    for name, master in ((pair.name, pair.master) for pair in run.pairs.per_model[0]):
        assert torch.equal(state[name], master)
    # Loads into a plain fp32 model, exactly.
    plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Linear(8, 2))
    plain.load_state_dict(state)
    for name, master in ((pair.name, pair.master) for pair in run.pairs.per_model[0]):
        assert torch.equal(plain.state_dict()[name], master)


def test_o2_state_dict_under_a_parent_module_uses_its_prefix():
    model, opt = _trained("O2")
    parent = torch.nn.ModuleDict({"net": model, "head": torch.nn.Linear(2, 2).bfloat16()})
    state = parent.state_dict()
    assert state["net.0.weight"].dtype == torch.float32
    assert state["head.weight"].dtype == torch.bfloat16      # not amp's: left as it is


def test_o3_state_dict_holds_fp32_upcasts():
    model, opt = _trained("O3")
    state = model.state_dict()
    for name, value in state.items():
        assert value.dtype in (torch.float32, torch.int64)
        half = dict(model.named_parameters()).get(name)
        if half is not None:
            assert torch.equal(value, half.detach().float())


def test_o2_model_checkpoint_alone_resumes_bit_for_bit():
    model, opt = _trained("O2")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    opt_state = copy.deepcopy(opt.state_dict())
    torch.manual_seed(1)
    batch = torch.randn(8, 4)

    def step(model, opt):
        opt.zero_grad()
        with amp.scale_loss(model(batch).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
        return [p.detach().clone() for p in amp.master_params(opt)]

    expected = step(model, opt)
    amp.default_handle().__init__()           # a fresh handle, as a new process
    torch.manual_seed(0)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Linear(8, 2))
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    fresh, fresh_opt = amp.initialize(fresh, fresh_opt, opt_level="O2", verbosity=0)
    fresh.load_state_dict(state)
    fresh_opt.load_state_dict(opt_state)
    got = step(fresh, fresh_opt)
    assert all(torch.equal(e, g) for e, g in zip(expected, got))
    assert math.isfinite(got[0].sum().item())
