"""apex.fp16_utils' FP16_Optimizer keeps fp32 masters beside a half model too, and follows the
same rule as amp's O2 (issue 49, item 7, and "what must work" 5): weights loaded into the model
after wrapping are kept, and a parameter frozen at wrapping and unfrozen later gets an fp32
master and its true, unscaled gradient. fp32 training with the same seeds is the reference.
(Real apex has both faults; apex_lite goes past it.)"""
from __future__ import annotations

import pytest
import torch

from amp_habits import assert_close_bf16, batch, mlp
from apex_lite.fp16_utils import FP16_Optimizer, convert_network

HALF = [torch.float16, torch.bfloat16]


def _setup(dtype, frozen=False, loss_scale=128.0):
    model = mlp()
    if frozen:
        model[0].requires_grad_(False)
    if dtype is not None:
        model = convert_network(model, dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if dtype is not None:
        optimizer = FP16_Optimizer(optimizer, static_loss_scale=loss_scale, verbose=False)
    return model, optimizer


def _train(model, optimizer, dtype, steps):
    for i in range(steps):
        x, y = batch(i)
        loss = torch.nn.functional.mse_loss(model(x.to(dtype or torch.float32)).float(), y)
        optimizer.zero_grad()
        if dtype is None:
            loss.backward()
        else:
            optimizer.backward(loss)
        optimizer.step()


def _weights(model):
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def _loaded_after_wrapping(dtype):
    model, optimizer = _setup(dtype)
    # Values every half dtype holds exactly: what was loaded is known bit for bit.
    loaded = {k: torch.full_like(v, 0.125) for k, v in model.state_dict().items()}
    model.load_state_dict(loaded)
    _train(model, optimizer, dtype, steps=2)
    return _weights(model)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_weights_loaded_into_the_model_after_wrapping_are_kept(dtype):
    assert_close_bf16(_loaded_after_wrapping(dtype), _loaded_after_wrapping(None))


def _written_between_backward_and_step(dtype):
    model, optimizer = _setup(dtype)
    _train(model, optimizer, dtype, steps=1)
    x, y = batch(1)
    loss = torch.nn.functional.mse_loss(model(x.to(dtype or torch.float32)).float(), y)
    optimizer.zero_grad()
    loss.backward() if dtype is None else optimizer.backward(loss)
    with torch.no_grad():   # a constraint, or a reload, after the gradients are in
        model[0].weight.fill_(0.125)
    optimizer.step()
    return _weights(model)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_a_model_write_between_backward_and_step_is_the_step_s_start(dtype):
    assert_close_bf16(_written_between_backward_and_step(dtype),
                      _written_between_backward_and_step(None))


def _unfrozen_later(dtype):
    model, optimizer = _setup(dtype, frozen=True, loss_scale=1024.0)
    model[0].requires_grad_(True)
    before = model[0].weight.detach().float().clone()
    _train(model, optimizer, dtype, steps=1)
    first_update = model[0].weight.detach().float() - before
    _train(model, optimizer, dtype, steps=2)
    return first_update, _weights(model)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_a_parameter_unfrozen_after_wrapping_steps_with_its_true_gradient(dtype):
    fp32_update, fp32_weights = _unfrozen_later(None)
    update, got = _unfrozen_later(dtype)
    assert fp32_update.abs().max() > 1e-3
    assert_close_bf16(update, fp32_update, atol=2e-3)
    assert_close_bf16(got, fp32_weights)
