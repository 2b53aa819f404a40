"""Writes to O2's masters reach the model (issue 49, item 6 in one process, and "what must
work" 1).

The last round made writes to the half model reach the masters (tests/test_amp_model_writes.py).
This is the other way round: a write amp did not make to a master (in place, ``.data = t``,
``copy_``, another optimizer stepping it) reaches the half model before the model's next forward
and before any ``state_dict()``, the model's and amp's, as fp32 training would have it; and where
both copies of one parameter were written since amp last made them equal, amp refuses, naming the
parameter, instead of picking one. At O2 and O5, on the fused (default) and the unfused step.
"""
from __future__ import annotations

import pytest
import torch

from amp_habits import (assert_close_bf16, assert_path, backward, initialize,
                        loss_of, mlp, params, weights, RUNS)
from apex_lite import amp


def _another_optimizer(master):
    """An optimizer of the user's own stepping the master directly (an EMA-free 'fast weights'
    step, a meta-learning inner loop)."""
    master.grad = torch.full_like(master, 0.25)
    torch.optim.SGD([master], lr=1.0).step()
    master.grad = None


WRITES = {
    "in place": lambda m: m.mul_(0.5),
    "fill_": lambda m: m.fill_(0.5),
    ".data = t": lambda m: setattr(m, "data", torch.full_like(m, 0.5)),
    "copy_": lambda m: m.copy_(torch.linspace(-1.0, 1.0, m.numel()).view_as(m)),
    "another optimizer steps it": _another_optimizer,
}


def _written(level, path, how, then, steps=2):
    """Write the first layer's master (in fp32: its weight) under no_grad, then ``then``:
    "forward" (train ``steps`` steps, what the model computes with) or "state_dict" (a
    checkpoint right away)."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = initialize(model, optimizer, level, path)
    if level is not None:
        assert_path(path)
    master = params(optimizer)[0]
    with torch.no_grad():
        WRITES[how](master)
    written = master.detach().clone()
    if then == "state_dict":
        saved = {"model": weights(model)}
        if level is not None:
            saved["amp"] = amp.state_dict()["apex_lite"]["master_weights"][0][0].clone()
        return written, saved
    half_first = model[0].weight.detach().clone()
    losses = []
    for i in range(steps):
        optimizer.zero_grad()
        loss = loss_of(model, i)
        if i == 0:
            half_first = model[0].weight.detach().clone()     # what the forward computed with
        backward(loss, optimizer, level)
        optimizer.step()
        losses.append(float(loss.detach()))
    return written, {"half": half_first, "losses": torch.tensor(losses),
                     "weights": weights(model)}


@pytest.mark.parametrize("how", list(WRITES))
@pytest.mark.parametrize("level, path", RUNS)
def test_a_write_to_a_master_reaches_the_next_forward(level, path, how):
    _, fp32 = _written(None, None, how, "forward")
    written, got = _written(level, path, how, "forward")
    assert torch.equal(got["half"], written.to(got["half"].dtype))
    torch.testing.assert_close(got["losses"], fp32["losses"], atol=2e-2, rtol=1e-2)
    assert_close_bf16(got["weights"], fp32["weights"])


@pytest.mark.parametrize("how", list(WRITES))
@pytest.mark.parametrize("level, path", RUNS)
def test_a_write_to_a_master_is_what_state_dict_saves(level, path, how):
    """``master.fill_(0.5)``, then ``model.state_dict()`` gives 0.5 (the master itself), and so
    does ``amp.state_dict()``."""
    written, got = _written(level, path, how, "state_dict")
    assert torch.equal(got["model"]["0.weight"], written)
    assert torch.equal(got["amp"], written)


# ---- both copies written: refused, naming the parameter -----------------------------------------

def _both_written(level, path, then):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = initialize(model, optimizer, level, path)
    master = params(optimizer)[0]
    if then == "step()":
        backward(loss_of(model, 0), optimizer, level)
    with torch.no_grad():
        master.fill_(0.5)
        model[0].weight.fill_(0.25)
    return model, optimizer, master


THEN = {"the next forward": lambda model, optimizer: loss_of(model, 1),
        "model.state_dict()": lambda model, optimizer: model.state_dict(),
        "amp.state_dict()": lambda model, optimizer: amp.state_dict(),
        "step()": lambda model, optimizer: optimizer.step()}


@pytest.mark.parametrize("then", list(THEN))
@pytest.mark.parametrize("level, path", RUNS)
def test_both_copies_written_is_refused_naming_the_parameter(level, path, then):
    model, optimizer, master = _both_written(level, path, then)
    with pytest.raises((RuntimeError, ValueError), match=r"0\.weight"):
        THEN[then](model, optimizer)
    # Refused before anything changed: both writes are still there.
    assert torch.equal(master, torch.full_like(master, 0.5))
    assert torch.equal(model[0].weight, torch.full_like(model[0].weight, 0.25))
