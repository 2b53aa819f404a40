"""apex's skip rule across the optimizers of one scale_loss (issue 26): when the backward of
``amp.scale_loss(loss, [opt_a, opt_b])`` overflows, every optimizer given to it skips, and no
optimizer that was not given to it; each loss scaler backs off only for its own backward.

The table is apex's ``test_3models2losses2optimizers`` (tests/L0/run_amp/
test_multiple_models_optimizers_losses.py at apex e13873de), rewritten here: three models of two
weights, ``loss0 = m0(x) + m1(x)`` given optimizer 0 (m0 and m1), ``loss1 = m2(x) + m1(x)`` given
both optimizers; an inf injected after one backward into one model's weight at one step. apex's
reference (plain fp32 SGD) steps only optimizer 1 when loss 0's backward overflowed, and neither
when loss 1's did. apex's "fp16" and "fp32" inject locations are here a weight cast to half and one
kept fp32 (``keep_fp32_modules``) at O2; at O1 both weights are fp32, as the model's are there.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from apex_lite import amp

X = torch.ones(2)
LRS = {"m0": 0.25, "m1": 1.0, "m2": 0.5}
ITERS = 3
# bf16 forwards (the half weights under O2, autocast under O1) differ from fp32 by bf16's
# rounding; a skipped or an extra step moves a weight by about 0.25 or more.
TOL = dict(rtol=3e-2, atol=3e-2)


class _Weight(torch.nn.Module):
    def __init__(self, values):
        super().__init__()
        self.weight = torch.nn.Parameter(values)


class Fp32Weight(_Weight):
    pass


class HalfWeight(_Weight):
    pass


class MyModel(torch.nn.Module):
    """apex's MyModel: ``(x * weight0 * weight1).sum()``; weight0 stays fp32 under O2."""

    def __init__(self, unique):
        super().__init__()
        self.w0 = Fp32Weight(unique + torch.arange(2, dtype=torch.float32))
        self.w1 = HalfWeight(1.0 + unique + torch.arange(2, dtype=torch.float32))

    def forward(self, x):
        return (x.float() * self.w0.weight.float() * self.w1.weight.float()).sum()


def _build():
    models = [MyModel(1), MyModel(2), MyModel(3)]
    o0 = torch.optim.SGD([{"params": models[0].parameters(), "lr": LRS["m0"]},
                          {"params": models[1].parameters(), "lr": LRS["m1"]}], momentum=0.5)
    o1 = torch.optim.SGD([{"params": models[2].parameters(), "lr": LRS["m2"]}], momentum=0.25)
    return models, [o0, o1]


def _losses(models):
    m0, m1, m2 = models
    return m0(X) + m1(X), m2(X) + m1(X)


def _inject(model, loc):
    weight = model.w0.weight if loc == "fp32" else model.w1.weight
    weight.grad[0] = float("inf")


def _reference(inject):
    """Plain fp32 torch with apex's rule: at the inject step, loss 0's overflow skips optimizer
    0 (the only one given to it), loss 1's skips both. Returns the final weights, the gradients
    of each stepped iteration, and which optimizers stepped at each iteration."""
    models, opts = _build()
    grads, stepped = [], []
    for i in range(ITERS):
        for o in opts:
            o.zero_grad()
        loss0, loss1 = _losses(models)
        loss0.backward()
        loss1.backward()
        steps = [True, True]
        if inject is not None and i == inject[0]:
            steps = [False, True] if inject[1] == 0 else [False, False]
        else:
            grads.append([p.grad.clone() for o in opts for g in o.param_groups
                          for p in g["params"]])
        for o, step in zip(opts, steps):
            if step:
                o.step()
        stepped.append(steps)
    weights = [p.detach().clone() for o in opts for g in o.param_groups for p in g["params"]]
    return weights, grads, stepped


def _clear(how, models, opts):
    if how == "p.grad = None":
        for m in models:
            for p in m.parameters():
                p.grad = None
    elif how == "model.zero_grad()":
        for m in models:
            m.zero_grad()
    else:
        for o in opts:
            o.zero_grad()


def _masters(opt):
    return opt._apex_lite_amp.masters()


# (iteration, backward, model, location) as apex's loops: loss 0 reaches models 0 and 1, loss 1
# models 2 and 1.
INJECTS = [None] + [(i, b, m, loc) for i, b, loc in itertools.product((0, 1), (0, 1),
                                                                          ("half", "fp32"))
                    for m in ((0, 1) if b == 0 else (2, 1))]
PATHS = [("O1", None), ("O2", True), ("O2", False)]


@pytest.mark.parametrize("inject", INJECTS, ids=str)
@pytest.mark.parametrize("scalers", [1, 2])
@pytest.mark.parametrize("how_to_zero", ["p.grad = None", "model.zero_grad()",
                                         "optimizer.zero_grad()"])
@pytest.mark.parametrize("level, fused_step", PATHS, ids=["O1", "O2-fused", "O2-unfused"])
@pytest.mark.parametrize("read_grads", [True, False], ids=["master_params", "no-read"])
def test_3models2losses2optimizers(level, fused_step, how_to_zero, scalers, inject, read_grads):
    ref_weights, ref_grads, ref_stepped = _reference(inject)
    models, opts = _build()
    models, opts = amp.initialize(models, opts, opt_level=level, num_losses=scalers,
                                  verbosity=0, fused_step=fused_step,
                                  keep_fp32_modules=[Fp32Weight] if level == "O2" else ())
    assert all(o._apex_lite_amp.path.fused for o in opts) == bool(fused_step)
    if level == "O2":
        assert models[0].w0.weight.dtype == torch.float32
        assert models[0].w1.weight.dtype != torch.float32
    loss_ids = [0, 1] if scalers == 2 else [0, 0]
    start_scales = [4.0, 16.0][:scalers]
    for scaler, value in zip(amp.loss_scalers(), start_scales):
        scaler.loss_scale = value
    unskipped = 0
    stepped = []
    for i in range(ITERS):
        _clear(how_to_zero, models, opts)
        before = [[p.detach().clone() for p in _masters(o)] for o in opts]
        loss0, loss1 = _losses(models)
        with amp.scale_loss(loss0, opts[0], loss_id=loss_ids[0]) as scaled:
            scaled.backward()
            if inject is not None and i == inject[0] and inject[1] == 0:
                _inject(models[inject[2]], inject[3])
        with amp.scale_loss(loss1, opts, loss_id=loss_ids[1]) as scaled:
            scaled.backward()
            if inject is not None and i == inject[0] and inject[1] == 1:
                _inject(models[inject[2]], inject[3])
        if read_grads and (inject is None or i != inject[0]):
            # apex's check: the master gradients are the fp32 reference's.
            masters = list(amp.master_params(opts[0])) + list(amp.master_params(opts[1]))
            for p, ref in zip(masters, ref_grads[unskipped]):
                torch.testing.assert_close(p.grad.float(), ref, **TOL)
            unskipped += 1
        for o in opts:
            o.step()
        stepped.append([any(not torch.equal(b, p) for b, p in zip(bs, _masters(o)))
                        for bs, o in zip(before, opts)])
    assert stepped == ref_stepped
    masters = _masters(opts[0]) + _masters(opts[1])
    model_params = [p for m in models for p in m.parameters()]
    for model_param, master, ref in zip(model_params, masters, ref_weights):
        torch.testing.assert_close(master.detach().float(), ref, **TOL)
        assert torch.equal(model_param.detach(), master.detach().to(model_param.dtype))
    # Each scaler backed off once, for its own backward only.
    scales = [s.loss_scale for s in amp.loss_scalers()]
    skipped = [s.skipped_steps for s in amp.loss_scalers()]
    expected_scales, expected_skipped = list(start_scales), [0] * scalers
    if inject is not None:
        which = loss_ids[inject[1]]
        expected_scales[which] /= 2
        expected_skipped[which] = 1
    assert (scales, skipped) == (expected_scales, expected_skipped)


@pytest.mark.parametrize("level, fused_step", PATHS, ids=["O1", "O2-fused", "O2-unfused"])
def test_the_issue_repro_skips_both(level, fused_step):
    """The issue's snippet: an inf in model 2's gradient during loss 1's backward, which was given
    both optimizers: neither steps (m0.w1 stays 2.0)."""
    models, opts = _build()
    models, opts = amp.initialize(models, opts, opt_level=level, num_losses=2, verbosity=0,
                                  fused_step=fused_step)
    before = [p.detach().clone() for o in opts for p in _masters(o)]
    loss0, loss1 = _losses(models)
    with amp.scale_loss(loss0, opts[0], loss_id=0) as s:
        s.backward()
    with amp.scale_loss(loss1, opts, loss_id=1) as s:
        s.backward()
        models[2].w1.weight.grad[0] = float("inf")
    for o in opts:
        o.step()
    after = [p.detach().clone() for o in opts for p in _masters(o)]
    assert all(torch.equal(b, a) for b, a in zip(before, after))
    assert [s.skipped_steps for s in amp.loss_scalers()] == [0, 1]
