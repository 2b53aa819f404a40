"""One dense layout shared by a parameter's tensors is stepped without copies (issue 44): the CUDA
path's wrapper (``STAGED_OPS``, run here over the CPU kernels) passes channels_last parameters,
gradients and state to the kernels as they are, and holds their lists; a parameter whose tensors
differ in layout is staged, all its tensors alike. The CUDA kernels' own check (csrc/cuda,
``checks::laid_out_as``) is compile-checked only: no GPU here."""
from __future__ import annotations

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from apex_lite.multi_tensor import _native
from apex_lite.multi_tensor._layout import dense, laid_out_as

CL = torch.channels_last


def test_dense_and_shared_layouts():
    x = torch.zeros(2, 3, 4, 5)
    assert dense(x) and dense(x.contiguous(memory_format=CL)) and dense(x.transpose(0, 3))
    assert not dense(x[:, :, ::2]) and not dense(torch.zeros(3, 1).expand(3, 4))
    assert laid_out_as(x.contiguous(memory_format=CL),
                       torch.ones(2, 3, 4, 5, dtype=torch.half).contiguous(memory_format=CL))
    assert not laid_out_as(x, x.contiguous(memory_format=CL))
    assert not laid_out_as(x.reshape(6, 20), x)
    # Dims of size 1 carry no layout: their strides may differ.
    one = torch.zeros(1, 8)
    assert laid_out_as(one, torch.zeros(8, 1).t())


class CountCopies(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.clone, torch.ops.aten.copy_,
                                   torch.ops.aten._to_copy, torch.ops.aten.empty_like):
            self.copies += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def staged_ops():
    ops, why = _native.ops_for("cpu")
    if ops is None or os.environ.get("APEX_LITE_DISABLE_EXT", "") == "1":
        if os.environ.get("APEX_LITE_REQUIRE_EXT", "") == "1" and ops is None:
            pytest.fail(f"APEX_LITE_REQUIRE_EXT=1 but the native kernels are unavailable: {why}")
        pytest.skip("the wrapper runs over the native kernels")
    from apex_lite.multi_tensor._native_ops import STAGED_OPS
    return STAGED_OPS


def _adam_call(grad_layout):
    g = torch.Generator().manual_seed(0)
    shapes = [(2, 3, 5, 7), (4, 8, 3, 3), (2, 1, 1, 6)]
    params = [torch.randn(s, generator=g).contiguous(memory_format=CL) for s in shapes]
    grads = [(torch.randn(s, generator=g) * 1024).bfloat16().contiguous(memory_format=grad_layout)
             for s in shapes]
    exp_avgs = [torch.zeros_like(p) for p in params]            # preserve_format: channels_last
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    models = [p.bfloat16() for p in params]
    steps = [torch.zeros(()) for _ in params]
    return [params, grads, exp_avgs, exp_avg_sqs, models, steps]


def _step(ops, call):
    ops.fused_adam_(*call, torch.full((1,), 2.0 ** -10), torch.zeros(1), 1e-3, 0.9, 0.999, 1e-8,
                    1e-2, True, True)


@pytest.mark.parametrize("grad_layout", [CL, torch.contiguous_format])
def test_channels_last_parameters_are_stepped_without_copies(staged_ops, grad_layout):
    call = _adam_call(grad_layout)
    reference = [[t.clone(memory_format=torch.contiguous_format) for t in tensors]
                 for tensors in call]
    counter = CountCopies()
    with counter:
        _step(staged_ops, call)
    shared = grad_layout == CL
    # Shared layouts: no copy at all; else each parameter's tensors staged (copies and back).
    assert (counter.copies == 0) == shared, counter.copies
    _step(staged_ops, reference)
    for tensors, expected in zip(call, reference):
        for t, e in zip(tensors, expected):
            torch.testing.assert_close(t, e, rtol=0, atol=0)
    assert all(p.is_contiguous(memory_format=CL) for p in call[0] if p.dim() == 4)


def test_channels_last_lists_are_held(staged_ops):
    params, grads, exp_avgs, exp_avg_sqs, models, steps = _adam_call(CL)
    sources = [torch.nn.Parameter(m) for m in models]
    assert staged_ops.hold_lists(params, sources, models, [exp_avgs, exp_avg_sqs, steps]) \
        is not None
    mixed = [e.contiguous() for e in exp_avgs]
    assert staged_ops.hold_lists(params, sources, models, [mixed, exp_avg_sqs, steps]) is None
