"""What the tests of users' habits at O2 and O5 share (issue 49): one small MLP and its batches,
runs of it in fp32 (the reference) or under amp on either step path, and the comparison within
bf16's precision.

Every habit is run twice with the same seeds, once as fp32 training (``level=None``, a plain
``loss.backward()``) and once under amp, so a test compares what the user's code gets with what
the same code gets without amp.
"""
from __future__ import annotations

import pytest
import torch

from apex_lite import amp

# fused_step=None is the default (the fused step, on both backends, for SGD and AdamW);
# fused_step=False the unfused step.
PATHS = {"fused": None, "unfused": False}
# (opt level, step path): O2 (bf16 on the CPU) and O5 (bf16 by definition), on both paths.
RUNS = [pytest.param(level, path, id=f"{level}-{path}")
        for level in ("O2", "O5") for path in PATHS]


def xfail_where(failing, reason, runs=RUNS):
    """``runs`` with ``xfail(strict=True, reason=...)`` on those whose id is in ``failing``
    (what fails today): a case that starts passing is noticed."""
    mark = pytest.mark.xfail(strict=True, reason=reason)
    return [pytest.param(*run.values, id=run.id, marks=mark if run.id in failing else ())
            for run in runs]


def fused_ids(runs=RUNS):
    return {run.id for run in runs if run.id.endswith("-fused")}


def all_ids(runs=RUNS):
    return {run.id for run in runs}


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def batch(i: int, target_scale: float = 1.0):
    g = torch.Generator().manual_seed(300 + i)
    return torch.randn(16, 8, generator=g), target_scale * torch.randn(16, 4, generator=g)


def loss_of(model, i: int = 0, target_scale: float = 1.0) -> torch.Tensor:
    x, y = batch(i, target_scale)
    return torch.nn.functional.mse_loss(model(x).float(), y)


def initialize(model, optimizer, level, path):
    """``amp.initialize`` at ``level`` on step path ``path`` (fp32: nothing, ``level`` None),
    in a fresh amp run."""
    if level is None:
        return model, optimizer
    amp.default_handle().__init__()
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, verbosity=0,
                                      fused_step=PATHS[path])
    return model, optimizer


def assert_path(path):
    """The run really takes ``path``: amp.report() names each optimizer's step."""
    report = str(amp.report())
    assert (": fused step" in report) == (path == "fused"), report


def backward(loss, optimizer, level):
    """``loss.backward()`` in fp32, ``with amp.scale_loss(...)`` under amp."""
    if level is None:
        loss.backward()
    else:
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()


def params(optimizer):
    """What the optimizer steps (at O2 and O5, the fp32 masters)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def weights(model):
    """The model's weights in fp32, as a checkpoint holds them."""
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


# bf16 keeps 8 bits: a few steps of this MLP under amp stay within 2e-3 of fp32's weights; the
# faults these tests catch move them by 1e-2 or more.
BF16_ATOL = 5e-3


def assert_close_bf16(actual, expected, atol=BF16_ATOL, rtol=1e-2):
    if isinstance(expected, dict):
        assert actual.keys() == expected.keys()
        for key in expected:
            torch.testing.assert_close(actual[key].float(), expected[key].float(), atol=atol,
                                       rtol=rtol, msg=lambda m: f"{key}: {m}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            torch.testing.assert_close(a.float(), e.float(), atol=atol, rtol=rtol)
    else:
        torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def warm_up(levels=("O1", "O2")):
    """One step of a tiny model at each level on each step path, and under torch.amp: what torch
    and amp import on first use (torch._dynamo with the first optimizer, ~1.5 s), imported now.
    For workers that fork a process per case after it."""
    for level in levels:
        for path in (PATHS if level in ("O2", "O5") else ["unfused"]):
            model = torch.nn.Linear(2, 2)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            model, optimizer = initialize(model, optimizer, level, path)
            backward(model(torch.ones(1, 2)).float().sum(), optimizer, level)
            optimizer.step()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.nn.Linear(2, 2)(torch.ones(1, 2))
    torch.amp.GradScaler("cpu")
    amp.default_handle().__init__()
