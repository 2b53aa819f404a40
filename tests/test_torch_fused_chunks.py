"""The chunks of torch's kernels' route (``_torch_fused``) are sized by device (issue 44): 1 MiB on
the CPU, for its cache; 32 MiB on a GPU, where each chunk costs kernel launches and no cache
holds it. Counted with a dispatch mode on meta tensors (sized as a GPU's: any device but the
CPU), a 1.3B-parameter step makes a few hundred launches, where 1 MiB chunks made 15,000."""
from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from apex_lite.multi_tensor import _torch_fused

PARAMS, TENSORS = 1_300_000_000, 400
VIEWS = {"view", "slice", "as_strided", "_reshape_alias", "alias", "reshape"}


class CountOps(TorchDispatchMode):
    """Counts the ops dispatched (each a kernel launch or more on a GPU). Meta tensors carry no
    data, so in-place ops are counted and not run, and an item() reads 1.0 (on CUDA the step
    counts' add takes the flag as a tensor: no item())."""

    def __init__(self):
        super().__init__()
        self.ops = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            return 1.0
        name = func.overloadpacket.__name__
        self.ops[name] = self.ops.get(name, 0) + 1
        if func._schema.is_mutable and not func._schema.returns:
            return None
        return func(*args, **(kwargs or {}))


def _adam_lists(device):
    size = PARAMS // TENSORS
    params = [torch.empty(size, device=device) for _ in range(TENSORS)]
    grads = [torch.empty(size, device=device, dtype=torch.float16) for _ in range(TENSORS)]
    states = [[torch.empty(size, device=device) for _ in range(TENSORS)] for _ in range(2)]
    models = [torch.empty(size, device=device, dtype=torch.float16) for _ in range(TENSORS)]
    steps = [torch.zeros((), device=device) for _ in range(TENSORS)]
    return params, grads, states, models, steps


def test_chunk_sizes_by_device():
    assert _torch_fused.chunk_elements(torch.device("cpu")) * 4 == 2 ** 20
    assert _torch_fused.chunk_elements(torch.device("cuda")) * 4 == 32 * 2 ** 20
    assert _torch_fused.chunk_elements("meta") == _torch_fused.GPU_CHUNK_ELEMENTS


def test_a_large_model_steps_in_a_few_hundred_launches_on_a_gpu():
    params, grads, states, models, steps = _adam_lists("meta")
    layout = _torch_fused._Layout(params, states, steps, models)
    chunks = math.ceil(PARAMS / _torch_fused.GPU_CHUNK_ELEMENTS)
    assert len(layout.chunks) == chunks == 155
    kernel = _torch_fused._adam_kernel(1e-3, 0.9, 0.999, 1e-8, 1e-2, True)
    inv_scale, found_inf = torch.ones(1, device="meta"), torch.zeros(1, device="meta")
    counter = CountOps()
    with counter:
        _torch_fused._step(kernel, grads, inv_scale, found_inf, steps, layout)
    # Per chunk: the conversion into the fp32 buffer, torch's fused AdamW, the rounding into
    # the half model; per step: the scales, the flag and the step counts. Views (a gradient's
    # slices of each chunk) launch nothing, but are host work too: bounded alike.
    assert counter.ops["_foreach_copy_"] == 2 * chunks
    assert counter.ops["_fused_adamw_"] == chunks
    launches = sum(n for op, n in counter.ops.items() if op not in VIEWS)
    assert launches <= 3 * chunks + 10, sorted(counter.ops.items())
    pieces = chunks + TENSORS   # a tensor split across chunks is a piece in each
    assert sum(counter.ops.values()) <= launches + 2 * pieces, sorted(counter.ops.items())
    # The CPU's 1 MiB chunks would have made 30 times as many.
    cpu_chunks = math.ceil(PARAMS / _torch_fused.CHUNK_ELEMENTS)
    assert 3 * cpu_chunks > 30 * launches


def test_the_cpu_keeps_its_cache_sized_chunks():
    params = [torch.zeros(3 * _torch_fused.CHUNK_ELEMENTS + 5)]
    layout = _torch_fused._Layout(params, [[torch.zeros_like(params[0])]], [], [])
    assert len(layout.chunks) == 4
    assert layout.nbytes == 4 * _torch_fused.CHUNK_ELEMENTS
