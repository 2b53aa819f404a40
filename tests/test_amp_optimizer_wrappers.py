"""Optimizers that wrap another and share its param_groups, and what users set on the optimizer
instance, under O2 and O5 (issue 49, items 1, 2, 5 and "what must work" 2 and 4).

SAM perturbs the optimizer's parameters (the masters) and steps its base optimizer itself;
Lookahead writes the masters every k steps; LARC rescales their gradients. Whether amp.initialize
gets the wrapper or the optimizer it wraps, training must be fp32 training's within bf16's
precision, and what a checkpoint holds must be what the optimizer holds. A step wrapper or step
hooks put on the optimizer instance before initialize run on every step path. Each case runs on
the fused (default) and the unfused step; the suite runs it on both backends.
"""
from __future__ import annotations

import functools

import pytest
import torch

from amp_habits import (RUNS, assert_close_bf16, assert_path, backward,
                        initialize, loss_of, mlp, params, weights)
from apex_lite import amp
from apex_lite.parallel.LARC import LARC
from user_optimizers import SAM, Lookahead


# ---- SAM ----------------------------------------------------------------------------------------

def _sam_run(level, path, given, steps=3):
    """SAM's two-step loop (davda54's README), as fp32 training (level None) or under amp.
    ``given``: "base" (amp.initialize gets the base optimizer, SAM is built around it after)
    or "sam" (amp.initialize gets SAM). The two losses of each step, and the weights."""
    model = mlp()
    if given == "base":
        base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, base = initialize(model, base, level, path)
        sam = SAM(params(base), base, rho=0.3)
        scaled_by = base
    else:
        sam = SAM(model.parameters(), torch.optim.SGD, rho=0.3, lr=0.1, momentum=0.9)
        model, sam = initialize(model, sam, level, path)
        scaled_by = sam
    losses = []
    for i in range(steps):
        first = loss_of(model, i)
        backward(first, scaled_by, level)
        sam.first_step(zero_grad=True)
        second = loss_of(model, i)            # at w + e(w)
        backward(second, scaled_by, level)
        sam.second_step(zero_grad=True)
        losses.append((float(first.detach()), float(second.detach())))
    return torch.tensor(losses), weights(model)


@pytest.mark.parametrize("given", ["base", "sam"], ids=["SAM(amp_optimizer)", "initialize(SAM)"])
@pytest.mark.parametrize("level, path", RUNS)
def test_sam_trains_as_in_fp32(level, path, given):
    fp32_losses, fp32_weights = _sam_run(None, None, given)
    losses, got = _sam_run(level, path, given)
    # The perturbed loss rises as fp32's does: the second forward saw w + e(w).
    assert (fp32_losses[:, 1] > fp32_losses[:, 0] + 0.05).all()
    torch.testing.assert_close(losses, fp32_losses, atol=2e-2, rtol=1e-2)
    assert_close_bf16(got, fp32_weights)


# ---- Lookahead ----------------------------------------------------------------------------------

def _lookahead_run(level, path, given, steps=4, k=2):
    """timm's Lookahead around AdamW, as fp32 training or under amp. ``given``: "wrap" (around
    the optimizer amp.initialize returned) or "initialize" (amp.initialize gets the Lookahead).
    What the model and amp checkpoint after the last (synced) step, the slow weights, and the
    weights after one more step taken after a save-and-load of the Lookahead's state."""
    model = mlp()
    base = torch.optim.AdamW(model.parameters(), lr=2e-2)
    if given == "wrap":
        model, base = initialize(model, base, level, path)
        lookahead = Lookahead(base, k=k)
        scaled_by = base
    else:
        lookahead = Lookahead(base, k=k)
        model, lookahead = initialize(model, lookahead, level, path)
        scaled_by = lookahead
    if level is not None and given == "wrap":
        assert_path(path)
    for i in range(steps):
        lookahead.zero_grad()
        backward(loss_of(model, i), scaled_by, level)
        lookahead.step()
    slow = [base.state[p]["lookahead_slow_buff"].clone() for p in params(base)]
    # Given to initialize, Lookahead's own step ends with its sync in the model; built around
    # the amp optimizer afterwards, its writes to the masters reach the model before the next
    # forward and any state_dict() (amp sees nothing of Lookahead's step after amp's own).
    half = [p.detach().clone() for p in model.parameters()] if given == "initialize" else None
    checkpoint = weights(model)
    if half is None:
        half = [p.detach().clone() for p in model.parameters()]
    amp_masters = (None if level is None else
                   [m.clone() for m in amp.state_dict()["apex_lite"]["master_weights"][0]])
    lookahead.load_state_dict(lookahead.state_dict())
    lookahead.zero_grad()
    backward(loss_of(model, steps), scaled_by, level)
    lookahead.step()
    return {"slow": slow, "half": half, "checkpoint": checkpoint, "amp": amp_masters,
            "after": weights(model)}


@pytest.mark.parametrize("given", ["wrap", "initialize"],
                         ids=["Lookahead(amp_optimizer)", "initialize(Lookahead)"])
@pytest.mark.parametrize("level, path", RUNS)
def test_lookahead_trains_as_in_fp32_and_checkpoints_the_synced_weights(level, path, given):
    fp32 = _lookahead_run(None, None, given)
    got = _lookahead_run(level, path, given)
    # After a synced step the weights are the slow weights, in the model and in checkpoints.
    for p, slow in zip(got["half"], got["slow"]):
        assert torch.equal(p, slow.to(p.dtype))
    for saved, slow in zip(got["amp"], got["slow"]):
        assert torch.equal(saved, slow)
    for saved, slow in zip(got["checkpoint"].values(), got["slow"]):
        assert torch.equal(saved, slow)
    assert_close_bf16(got["checkpoint"], fp32["checkpoint"])
    assert_close_bf16(got["after"], fp32["after"])


# ---- LARC (apex_lite.parallel.LARC), around initialize's optimizer or given to it ---------------

def _larc_run(level, path, given, steps=4):
    model = mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=1e-3)
    if given == "wrap":
        model, sgd = initialize(model, sgd, level, path)
        optimizer, scaled_by = LARC(sgd, trust_coefficient=0.02), sgd
    else:
        optimizer = LARC(sgd, trust_coefficient=0.02)
        model, optimizer = initialize(model, optimizer, level, path)
        scaled_by = optimizer
    for i in range(steps):
        optimizer.zero_grad()
        backward(loss_of(model, i), scaled_by, level)
        optimizer.step()
    return weights(model)


@pytest.mark.parametrize("given", ["wrap", "initialize"],
                         ids=["LARC(amp_optimizer)", "initialize(LARC)"])
@pytest.mark.parametrize("level, path", RUNS)
def test_larc_trains_as_in_fp32(level, path, given):
    """LARC rescales the masters' true fp32 gradients (given to initialize, it takes the
    unfused step on either setting)."""
    assert_close_bf16(_larc_run(level, path, given), _larc_run(None, None, given))


# ---- what is set on the optimizer instance before initialize ------------------------------------

def _instance_run(level, path, steps=2):
    """A step wrapper (as profilers and loggers install: ``opt.step = wrapper(opt.step)``) and
    torch's step pre/post hooks, all set on the instance before amp.initialize."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    inner = optimizer.step

    @functools.wraps(inner)
    def logged_step(*args, **kwargs):
        calls.append("wrapper")
        return inner(*args, **kwargs)
    optimizer.step = logged_step
    optimizer.register_step_pre_hook(lambda *args: calls.append("pre"))
    optimizer.register_step_post_hook(lambda *args: calls.append("post"))
    model, optimizer = initialize(model, optimizer, level, path)
    for i in range(steps):
        optimizer.zero_grad()
        backward(loss_of(model, i), optimizer, level)
        optimizer.step()
    return calls, weights(model)


@pytest.mark.parametrize("level, path", RUNS)
def test_a_step_wrapper_set_before_initialize_runs_every_step(level, path):
    fp32_calls, fp32_weights = _instance_run(None, None)
    calls, got = _instance_run(level, path)
    assert fp32_calls.count("wrapper") == 2
    assert calls.count("wrapper") == 2
    assert_close_bf16(got, fp32_weights)


@pytest.mark.parametrize("level, path", RUNS)
def test_step_hooks_registered_before_initialize_fire_once_per_step(level, path):
    fp32_calls, _ = _instance_run(None, None)
    calls, _ = _instance_run(level, path)
    hooks = [c for c in calls if c != "wrapper"]
    assert hooks == [c for c in fp32_calls if c != "wrapper"] == ["pre", "post"] * 2
