"""The masters' gradients keep torch's lifetimes at O2 and O5 (issue 49, items 3, 4 and 5).

torch gives each backward after ``zero_grad()`` (set_to_none) new gradient tensors, so a kept
reference keeps its values and a saved gradient holds its own bytes; after
``zero_grad(set_to_none=False)`` a parameter's ``.grad`` is one live tensor across steps, edits
through any reference to it are applied, and what is added to it before a backward is added to.
Each case runs the user's code in fp32 and under amp (same seeds), on the fused (default) and
the unfused step; the suite runs it on both backends.
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from amp_habits import (RUNS, assert_close_bf16, assert_path, backward,
                        initialize, loss_of, mlp, params)


def _setup(level, path, **sgd):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, **sgd)
    model, optimizer = initialize(model, optimizer, level, path)
    if level is not None:
        assert_path(path)
    return model, optimizer, params(optimizer)


# ---- set_to_none: each backward gives new tensors -----------------------------------------------

def _kept_reference(level, path):
    """``g = p.grad`` after a backward, then zero_grad() and the next backward."""
    model, optimizer, ps = _setup(level, path)
    backward(loss_of(model, 0), optimizer, level)
    kept = [p.grad for p in ps]
    values = [g.clone() for g in kept]
    optimizer.zero_grad()
    backward(loss_of(model, 1), optimizer, level)
    return kept, values, [p.grad for p in ps]


@pytest.mark.parametrize("level, path", RUNS)
def test_a_kept_gradient_keeps_its_values_across_zero_grad_and_the_next_backward(level, path):
    fp32_kept, _, _ = _kept_reference(None, None)
    kept, values, new = _kept_reference(level, path)
    for g, v in zip(kept, values):
        assert torch.equal(g, v)
    assert all(g is not n for g, n in zip(kept, new))
    assert_close_bf16(kept, fp32_kept)


def _surgery(level, path):
    """Multi-task gradient surgery (PCGrad, GradNorm): keep task 1's gradients, zero_grad,
    backward task 2, combine (PCGrad's projection of conflicting gradients), step."""
    model, optimizer, ps = _setup(level, path)
    optimizer.zero_grad()
    backward(loss_of(model, 0), optimizer, level)
    task1 = [p.grad for p in ps]
    optimizer.zero_grad()
    backward(loss_of(model, 1, target_scale=-3.0), optimizer, level)
    task2 = [p.grad for p in ps]
    flat1 = torch.cat([g.flatten() for g in task1])
    flat2 = torch.cat([g.flatten() for g in task2])
    cosine = torch.nn.functional.cosine_similarity(flat1, flat2, dim=0)
    if cosine < 0:
        flat1 = flat1 - (flat1 @ flat2) / (flat2 @ flat2) * flat2
    combined = flat1 + flat2
    offset = 0
    for p in ps:
        p.grad = combined[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    optimizer.step()
    return float(cosine), [p.detach().clone() for p in ps]


@pytest.mark.parametrize("level, path", RUNS)
def test_multi_task_gradient_surgery_combines_both_tasks_as_in_fp32(level, path):
    fp32_cosine, fp32_weights = _surgery(None, None)
    cosine, got = _surgery(level, path)
    assert fp32_cosine < 0.9
    assert abs(cosine - fp32_cosine) < 0.02
    assert_close_bf16(got, fp32_weights)


def _saved_bias_gradient(level, path):
    model, optimizer, ps = _setup(level, path)
    backward(loss_of(model, 0), optimizer, level)
    buffer = io.BytesIO()
    torch.save(ps[-1].grad, buffer)                 # the last layer's bias: 4 elements
    size = len(buffer.getvalue())
    buffer.seek(0)
    return size, torch.load(buffer)


@pytest.mark.parametrize("level, path", RUNS)
def test_a_saved_gradient_holds_its_own_bytes(level, path):
    fp32_size, fp32_grad = _saved_bias_gradient(None, None)
    size, grad = _saved_bias_gradient(level, path)
    assert grad.untyped_storage().nbytes() == fp32_grad.untyped_storage().nbytes() == 16
    assert size <= fp32_size + 64
    assert_close_bf16(grad, fp32_grad)


# ---- set_to_none=False: one live tensor across steps ---------------------------------------------

def _live_tensor(level, path, edit, steps=3):
    """zero_grad(set_to_none=False) every step; ``edit(step, cached, ps)`` between the backward
    and the step, where ``cached`` are the .grad tensors read once, after the first step's
    zero_grad."""
    model, optimizer, ps = _setup(level, path, momentum=0.9)
    optimizer.zero_grad(set_to_none=False)
    backward(loss_of(model, 0), optimizer, level)
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    cached = [p.grad for p in ps]
    same, history = [], []
    for i in range(1, steps):
        if i > 1:
            optimizer.zero_grad(set_to_none=False)
        before = [p.detach().clone() for p in ps]
        backward(loss_of(model, i), optimizer, level)
        edit(cached, ps)
        optimizer.step()
        same.append([p.grad is g for p, g in zip(ps, cached)])
        history.append([(p.detach() - b) for p, b in zip(ps, before)])
    return same, history, [p.detach().clone() for p in ps]


@pytest.mark.parametrize("level, path", RUNS)
def test_zero_grad_without_set_to_none_keeps_one_live_tensor(level, path):
    fp32_same, _, fp32_weights = _live_tensor(None, None, lambda cached, ps: None)
    same, _, got = _live_tensor(level, path, lambda cached, ps: None)
    assert all(all(s) for s in fp32_same)
    assert all(all(s) for s in same)
    assert_close_bf16(got, fp32_weights)


def _halve_then_zero_one(cached, ps):
    for g in cached:
        g.mul_(0.5)
    cached[0].zero_()


@pytest.mark.parametrize("level, path", RUNS)
def test_edits_through_cached_references_are_applied(level, path):
    fp32_same, fp32_moves, fp32_weights = _live_tensor(None, None, _halve_then_zero_one)
    same, moves, got = _live_tensor(level, path, _halve_then_zero_one)
    # The first weight's gradient was zeroed through the cache each step: only momentum moves
    # it, exactly as in fp32 (SGD without weight decay: the same fp32 arithmetic).
    for move, fp32_move in zip(moves, fp32_moves):
        assert_close_bf16(move, fp32_move, atol=5e-4)
    assert_close_bf16(got, fp32_weights)


def _added_before_backward(level, path):
    """A value added to a zeroed master gradient before the backward (a regulariser's
    gradient, a prior term), then the backward, then the gradient read."""
    model, optimizer, ps = _setup(level, path)
    optimizer.zero_grad(set_to_none=False)
    backward(loss_of(model, 0), optimizer, level)
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    with torch.no_grad():
        ps[-1].grad.add_(100.0)
    backward(loss_of(model, 1), optimizer, level)
    grad = ps[-1].grad.clone()
    optimizer.step()
    return grad, [p.detach().clone() for p in ps]


@pytest.mark.parametrize("level, path", RUNS)
def test_a_value_added_before_the_backward_is_accumulated_into(level, path):
    fp32_grad, fp32_weights = _added_before_backward(None, None)
    grad, got = _added_before_backward(level, path)
    assert (fp32_grad > 90).all()
    assert_close_bf16(grad, fp32_grad, atol=5e-2, rtol=1e-3)
    assert_close_bf16(got, fp32_weights)


# ---- gradients amp did not make ------------------------------------------------------------------

def _hand_set(level, path):
    model, optimizer, ps = _setup(level, path)
    before = [p.detach().clone() for p in ps]
    for p in ps:
        p.grad = torch.full_like(p, 5.0)           # no backward
    optimizer.step()
    return [p.detach() - b for p, b in zip(ps, before)], {
        k: v.float() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("level, path", RUNS)
def test_hand_set_master_gradients_are_applied(level, path):
    fp32_moves, fp32_weights = _hand_set(None, None)
    moves, got = _hand_set(level, path)
    for move, fp32_move in zip(moves, fp32_moves):
        torch.testing.assert_close(move, fp32_move, rtol=0, atol=1e-6)
    assert_close_bf16(got, fp32_weights)


def _kept_unread(level, path, read_at):
    """``g = p.grad`` kept after the backward and not read until ``read_at``."""
    model, optimizer, ps = _setup(level, path)
    backward(loss_of(model, 0), optimizer, level)
    kept = [p.grad for p in ps]
    optimizer.step()
    if read_at == "after step()":
        return [g.clone() for g in kept]
    optimizer.zero_grad()
    return [g.clone() for g in kept]


KEPT_UNREAD = [pytest.param(*run.values, read_at, id=f"{run.id}-{read_at}")
               for run in RUNS for read_at in ("after step()", "after zero_grad()")]


@pytest.mark.parametrize("level, path, read_at", KEPT_UNREAD)
def test_a_kept_unread_gradient_reads_as_torchs(level, path, read_at):
    assert_close_bf16(_kept_unread(level, path, read_at), _kept_unread(None, None, read_at))


# ---- DLPack: each case in a process of its own (an export that read a lazy gradient's memory
# would kill it) ---------------------------------------------------------------------------------

DLPACK = Path(__file__).parent / "workers" / "dlpack_worker.py"
HOWS = ["to_dlpack", "to_dlpack_made", "to_dlpack_bound", "from_dlpack"]
DLPACK_CASES = [f"{how}-{level}-{path}" for how in HOWS
                for level in ("fp32", "O2", "O5") for path in ("fused", "unfused")
                if level != "fp32" or path == "fused"]


@pytest.fixture(scope="module")
def dlpack_runs(tmp_path_factory):
    """Every DLPack case, each in a child process of its own (forked by one worker process,
    so that torch is imported once), with their exit codes and what they exported."""
    out = tmp_path_factory.mktemp("dlpack")
    result = subprocess.run([sys.executable, str(DLPACK), "--out", str(out), *DLPACK_CASES],
                            capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads((out / "results.json").read_text())


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("level, path", RUNS)
def test_dlpack_export_of_a_master_gradient(dlpack_runs, how, level, path):
    """DLPack exports a master's true gradient, never kills the process: torch.from_dlpack
    (__dlpack__), and torch.utils.dlpack.to_dlpack, which apex_lite wraps at import to make a
    fused step's lazy gradient first. One exception, by design: torch's own to_dlpack, as code
    that bound it before importing apex_lite holds it, reads the memory of a lazy gradient without
    any operation amp could see, so on one not made yet (the fused step holds no fp32 gradient
    until used) it raises torch's error; made first (amp.master_params, any read) it exports
    (master_grads.py)."""
    got = dlpack_runs[f"{how}-{level}-{path}"]
    fp32 = dlpack_runs[f"{how}-fp32-fused"]
    assert fp32["exit"] == 0, fp32
    assert got["exit"] == 0, f"the case's process ended with {got['exit']}: {got['output']}"
    if how == "to_dlpack_bound" and path == "fused":
        assert "Cannot access data pointer" in got["refused"]
        return
    assert got["exported"] == got["grad"]          # the same values as .grad, not a copy's
    assert_close_bf16(torch.tensor(got["exported"]), torch.tensor(fp32["exported"]))
