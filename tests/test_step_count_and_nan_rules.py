"""Two rules every backend keeps alike (issue 44): a step count shared by two parameters is
refused by every op that advances counts, naming the counts' device in the fix; NovoGrad's inf
norm (norm_type 0) passes NaN gradient elements over, as apex's fmaxf does, so that a NaN makes
NaN only where it is.

Backends: the native kernels and the Python reference (the ``backend`` fixture), and torch's
kernels' route (``_torch_fused``, what a pure install's FusedAdagrad and amp's O2 step run).
"""
from __future__ import annotations

import re

import pytest
import torch

from apex_lite.multi_tensor import _backend, _torch_fused
from test_multi_tensor import CHUNK, assert_bits, backend, device  # noqa: F401 (fixtures)
from test_novograd_adagrad_kernels import (HYPER, KIND_OPTIONS, KINDS, NOVOGRAD_OPTIONS, STATE,
                                           check, make_call, run_step)
from test_optimizer_kernels import INV_SCALE, f32


def _watched(kind, call):
    return call["params"] + call[STATE[kind][0]] + call["model_params"] + call["steps"]


def _shared_count_message(kind, steps):
    return (rf"^apex_lite::fused_{kind}_: steps\[2\] shares its memory with steps\[0\]: each "
            rf"parameter needs a step count of its own .* torch\.zeros\(\(\), "
            rf"dtype=torch\.float32, device='{re.escape(str(steps[0].device))}'\) per "
            rf"parameter, or a clone\(\) of the shared one\.$")


@pytest.mark.parametrize("kind", KINDS)
def test_a_shared_step_count_is_refused(backend, device, kind):
    """NovoGrad and Adagrad as Adam and LAMB: the native kernels refused a shared count, the
    Python backend advanced it once, torch's route twice."""
    call = make_call(kind, [3, 6, 5], "O2-bf16", device)
    call["steps"][2] = call["steps"][0]
    before = [t.clone() for t in _watched(kind, call)]
    with pytest.raises(ValueError, match=_shared_count_message(kind, call["steps"])):
        run_step(kind, _backend.ops_for(torch.device(device)), call,
                 dict(HYPER[kind], **KIND_OPTIONS[kind]), torch.ones(1, device=device),
                 torch.zeros(1, device=device))
    for actual, saved in zip(_watched(kind, call), before):
        assert_bits(actual, saved.cpu())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU on this machine"))])
def test_torch_kernels_route_refuses_a_shared_adagrad_count(device):
    call = make_call("adagrad", [3, 6, 5], "fp32", device)
    call["steps"][2] = call["steps"][0].view(call["steps"][0].shape)   # a view of one element
    before = [t.clone() for t in _watched("adagrad", call)]
    o = dict(HYPER["adagrad"], **KIND_OPTIONS["adagrad"])
    with pytest.raises(ValueError, match=_shared_count_message("adagrad", call["steps"])):
        _torch_fused.fused_adagrad_(call["params"], call["grads"], call["sums"],
                                    call["model_params"], call["steps"],
                                    torch.ones(1, device=device), torch.zeros(1, device=device),
                                    o["lr"], o["eps"], o["weight_decay"], o["adagrad_w_mode"])
    for actual, saved in zip(_watched("adagrad", call), before):
        assert_bits(actual, saved.cpu())


INF_NORM_OPTIONS = [o for o in NOVOGRAD_OPTIONS if o["norm_type"] == 0]


@pytest.mark.parametrize("options", INF_NORM_OPTIONS,
                         ids=[f"options{i}" for i in range(len(INF_NORM_OPTIONS))])
@pytest.mark.parametrize("position", ["first", "middle", "last"])
def test_novograd_inf_norm_passes_nan_over(backend, device, position, options):
    """A NaN gradient element, found_inf clear (no GradScaler or amp to skip the step): the
    parameter turns NaN at that element only, the others take the step of the largest other
    magnitude, on every backend (the reference's norm passes NaN over too); a gradient that is
    all NaN has norm 0."""
    call = make_call("novograd", [555, 7, CHUNK + 1], "mixed", device)
    grad = call["grads"][2]
    at = {"first": 0, "middle": grad.numel() // 2, "last": grad.numel() - 1}[position]
    grad.view(-1)[at] = float("nan")
    call["grads"][1].fill_(float("nan"))
    o = dict(HYPER["novograd"], **options)
    checker = check("novograd", call, o, backend, f32(INV_SCALE))
    next(checker)
    run_step("novograd", _backend.ops_for(torch.device(device)), call, o,
             torch.tensor([f32(INV_SCALE)], device=device), torch.zeros(1, device=device))
    next(checker, None)
    nans = torch.isnan(call["params"][2].float()).reshape(-1).cpu()
    assert nans.nonzero().reshape(-1).tolist() == [at]
    assert not torch.isnan(call["params"][0].float()).any()
    assert float(call["exp_avg_sqs"][2]) == float(call["exp_avg_sqs"][2])   # not NaN
