"""O2 under data parallel: every rank's masters are rank 0's own fp32 values.

apex's documented order is ``amp.initialize`` first, then DistributedDataParallel, whose
constructor broadcasts rank 0's parameters so that every rank starts from the same weights; most
scripts rely on it and seed their ranks differently. At O2 that broadcast reaches the half
model only; the fp32 masters amp made at ``initialize`` are each rank's own, and the first step
would undo it. So amp broadcasts the masters too, once per DDP instance, from that DDP's rank 0
over its process group: ``apex_lite.parallel.DistributedDataParallel`` at its construction (a
collective every rank runs), and for torch's ``DistributedDataParallel``, whose construction amp
does not see, at the first ``scale_loss`` after a forward of the model ran inside it. Not in the
forward itself: a rank may run a forward alone (a validation pass on rank 0 before training), and
a collective there would wait for ranks that never come; every training rank runs
``scale_loss`` (as with any collective, every rank makes the same sequence of ``scale_loss``
calls). Writes made before the broadcast reach their master first, so a write on rank 0 survives
it (two_copies.py). Then every rank's masters and half model are rank 0's, bit for bit: not the
upcast of rank 0's half weights, which would lose their low bits. One collective per DDP
instance, nothing per step.
"""
from __future__ import annotations

import weakref
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .pairs import FP32_ATTR, ParamPair


def broadcast_masters(module: torch.nn.Module, process_group=None, src: int = 0) -> int:
    """Broadcast the O2 masters of ``module``'s parameters from rank ``src`` of
    ``process_group`` (default: the default group) and round them into the half parameters,
    so that every rank holds rank ``src``'s. A collective: call it on every rank of the group.
    Returns how many masters it broadcast (0 without torch.distributed, on one rank, or for a
    module without O2 masters)."""
    pairs: List[ParamPair] = []
    seen = set()
    for param in module.parameters():
        pair = getattr(param, FP32_ATTR, None)
        if isinstance(pair, ParamPair) and id(pair) not in seen:
            seen.add(id(pair))
            pairs.append(pair)
    if not pairs or not dist.is_available() or not dist.is_initialized() \
            or dist.get_world_size(process_group) == 1:
        return 0
    copies = pairs[0].copies()
    if copies is not None:   # writes made before the broadcast reach their master first
        copies.sync("the broadcast of the master weights", partial=True)
    root = src if process_group is None else dist.get_global_rank(process_group, src)
    per_device: Dict[torch.device, List[ParamPair]] = {}
    for pair in pairs:
        per_device.setdefault(pair.master.device, []).append(pair)
    loads = []
    with torch.no_grad():
        for on_device in per_device.values():
            tensors = [pair.master for pair in on_device]
            flat = _flatten_dense_tensors(tensors)
            dist.broadcast(flat, src=root, group=process_group)
            loads.extend(zip(on_device, _unflatten_dense_tensors(flat, tensors)))
    if copies is not None:
        copies.load(loads)
    return len(pairs)


class DDPBroadcasts:
    """The torch DistributedDataParallel instances a run's models ran inside, whose masters are
    still to be broadcast (``run.ddp``): noted in the forward, broadcast at ``scale_loss``."""

    def __init__(self):
        self._seen = weakref.WeakSet()
        self._pending: List[weakref.ref] = []

    def note(self, ddp: torch.nn.Module) -> bool:
        """A forward of a run's model started inside ``ddp``; whether it is the first."""
        if ddp in self._seen:
            return False
        self._seen.add(ddp)
        self._pending.append(weakref.ref(ddp))
        return True

    def broadcast_pending(self) -> None:
        """Broadcast the masters of every DDP noted since (at ``scale_loss``: a collective)."""
        pending, self._pending = self._pending, []
        for ref in pending:
            ddp = ref()
            if ddp is not None:
                broadcast_masters(ddp.module, getattr(ddp, "process_group", None), 0)


class FollowDDPBroadcast:
    """A forward pre-hook that models prepared by an earlier apex_lite held; the note of a DDP
    is now part of ``model_hooks._CopiesBeforeForward``. Kept so that such models unpickle."""

    def __init__(self, run=None):
        self.run = None

    def __call__(self, module, args) -> None:
        pass

    def __getstate__(self):
        return {"run": None}

    def __setstate__(self, state):
        self.run = None


def active_ddp() -> Optional[torch.nn.Module]:
    """The torch DistributedDataParallel whose forward is running, if any."""
    ddp_class = torch.nn.parallel.DistributedDataParallel
    return getattr(ddp_class, "_active_ddp_module", None)
