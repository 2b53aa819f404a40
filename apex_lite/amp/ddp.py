"""O2 under DistributedDataParallel: every rank's masters are rank 0's own fp32 values.

apex's documented order is ``amp.initialize`` first, then DistributedDataParallel, whose
constructor broadcasts rank 0's parameters so that every rank starts from the same weights; most
scripts rely on it and seed their ranks differently. At O2 that broadcast reaches the half
model only; the fp32 masters amp made at ``initialize`` are each rank's own, and the first step
would undo it. So amp broadcasts the masters too, once: at the model's first forward inside a
torch ``DistributedDataParallel`` (torch marks the instance whose forward runs,
``DistributedDataParallel._active_ddp_module``), from that DDP's rank 0 over its process group,
the masters of the parameters it wraps; and ``apex_lite.parallel.DistributedDataParallel`` calls
``broadcast_masters`` at its construction. Then every rank's masters and half model are rank 0's,
bit for bit: not the upcast of rank 0's half weights, which would lose their low bits. One
collective per DDP instance, nothing per step.
"""
from __future__ import annotations

import weakref
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .model_hooks import FP32_ATTR


def broadcast_masters(module: torch.nn.Module, process_group=None, src: int = 0) -> int:
    """Broadcast the O2 masters of ``module``'s parameters from rank ``src`` of
    ``process_group`` (default: the default group) and round them into the half parameters,
    so that every rank holds rank ``src``'s. A collective: call it on every rank of the group.
    Returns how many masters it broadcast (0 without torch.distributed, on one rank, or for a
    module without O2 masters)."""
    params: List[torch.Tensor] = []
    masters: List[torch.Tensor] = []
    seen = set()
    for param in module.parameters():
        values = getattr(param, FP32_ATTR, None)
        if values is not None and values.live and id(param) not in seen:
            seen.add(id(param))
            params.append(param)
            masters.append(values.tensor)
    if not masters or not dist.is_available() or not dist.is_initialized() \
            or dist.get_world_size(process_group) == 1:
        return 0
    root = src if process_group is None else dist.get_global_rank(process_group, src)
    per_device: Dict[torch.device, List[int]] = {}
    for i, master in enumerate(masters):
        per_device.setdefault(master.device, []).append(i)
    with torch.no_grad():
        for indices in per_device.values():
            tensors = [masters[i] for i in indices]
            flat = _flatten_dense_tensors(tensors)
            dist.broadcast(flat, src=root, group=process_group)
            for master, value in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
                master.copy_(value)
        for param, master in zip(params, masters):
            param.copy_(master)
    return len(masters)


class FollowDDPBroadcast:
    """A forward pre-hook on an O2 model: the first time it runs inside a torch
    DistributedDataParallel's forward, that DDP's rank 0 masters are broadcast (``broadcast_
    masters``), once per DDP instance. The run is not pickled with the model."""

    def __init__(self, run):
        self.run = run
        self._seen = weakref.WeakSet()

    def __call__(self, module, args) -> None:
        ddp = _active_ddp()
        if ddp is None or self.run is None or ddp in self._seen:
            return
        self._seen.add(ddp)
        if self.run.sharding is None:
            broadcast_masters(ddp.module, getattr(ddp, "process_group", None), 0)
            self.run.model_writes.record()

    def __getstate__(self):
        return {"run": None, "_seen": None}

    def __setstate__(self, state):
        self.run = None
        self._seen = weakref.WeakSet()


def _active_ddp() -> Optional[torch.nn.Module]:
    """The torch DistributedDataParallel whose forward is running, if any."""
    ddp_class = torch.nn.parallel.DistributedDataParallel
    return getattr(ddp_class, "_active_ddp_module", None)
