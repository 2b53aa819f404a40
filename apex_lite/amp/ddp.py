"""amp under data parallel (torch's DistributedDataParallel, apex_lite.parallel's): what amp
does so that ranks neither hang nor drift apart. Which amp calls are collectives, and when:

- The master broadcast (O2, O5): once per DDP instance. apex's documented order is
  ``amp.initialize`` first, then DistributedDataParallel, whose constructor broadcasts rank 0's
  parameters so that every rank starts from the same weights; most scripts rely on it and seed
  their ranks differently. At O2 that broadcast reaches the half model only, and the fp32
  masters amp made at ``initialize`` are each rank's own. So amp broadcasts the masters too, from
  that DDP's rank 0 over its process group: ``apex_lite.parallel.DistributedDataParallel`` at
  its construction (a collective every rank runs), and for torch's ``DistributedDataParallel``,
  whose construction amp does not see, at the first ``scale_loss`` after a forward of the model
  ran inside it. Not in the forward itself: a rank may run a forward alone (a validation pass on
  rank 0 before training), and a collective there would wait for ranks that never come. Writes
  made before the broadcast reach their master first, so a write on rank 0 survives it
  (two_copies.py). Then every rank's masters and half model are rank 0's, bit for bit: not the
  upcast of rank 0's half weights, which would lose their low bits.
- The skip decision: no collective where DDP all-reduced the gradients. When every forward
  behind a ``scale_loss``'s backward ran inside a wrapper that reduces that backward's
  gradients, every rank holds the same gradients after it (a non-finite one on any rank is
  non-finite on all), so each rank reaches the same decision from its own, and a rank that
  joined early (``torch.distributed.algorithms.Join``) is not waited for. Otherwise the overflow
  flags are all-reduced (MAX) over the run's process group before the decision, one small
  collective per ``scale_loss`` (overflow.py), which every rank must then make.
- Gradient accumulation: a backward whose forward ran under ``ddp.no_sync()`` (or apex's
  ``disable_allreduce()``) is left multiplied by the loss scale, as ``delay_unscale=True``
  leaves it, so that the synced backward adds to it in place and DDP all-reduces every
  micro-batch's gradient, which amp then unscales and checks once: ranks stay equal, as without
  amp. (Unscaling each micro-batch apart would all-reduce only the last one.)

Nothing here is a collective per step; the forward hook reads flags only.
"""
from __future__ import annotations

import contextlib
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


class DataParallel:
    """What amp knows of the data-parallel wrappers a run's models run inside (``run.ddp``),
    noted at each forward, no collective there: the torch DDPs whose masters are still to be
    broadcast (at the next ``scale_loss``), and whether the backward of the forwards since the
    last ``scale_loss`` all-reduces the gradients (``backward_reduces``)."""

    def __init__(self):
        self._seen = weakref.WeakSet()
        self._pending: List[weakref.ref] = []
        # Per forward (with grad) since the last scale_loss: True inside a wrapper that reduces
        # this backward's gradients, False inside one that does not (no_sync,
        # disable_allreduce), None outside any.
        self._forwards: List[Optional[bool]] = []

    def forward_started(self, sharded: bool) -> bool:
        """A forward of one of the run's models starts; whether it is the first inside a torch
        DistributedDataParallel (whose masters are then to be broadcast: not for FSDP2's
        ``sharded`` models, whose masters are their own shards)."""
        first = False
        torch_ddp = active_ddp()
        if torch_ddp is not None:
            if not sharded and torch_ddp not in self._seen:
                self._seen.add(torch_ddp)
                self._pending.append(weakref.ref(torch_ddp))
                first = True
            reduces = bool(torch_ddp.require_backward_grad_sync)
        else:
            apex_ddp = _ACTIVE_APEX_DDP[0]
            reduces = None if apex_ddp is None else apex_ddp.reduces_next_backward()
        if torch.is_grad_enabled():
            self._forwards.append(reduces)
        return first

    def backward_reduces(self) -> Optional[bool]:
        """Of the forwards since the last call (a ``scale_loss``'s backward): True when every one
        ran inside a data-parallel wrapper that all-reduces the gradients of its backward (then
        every rank holds the same gradients after it); False when every one ran inside one that
        does not (``no_sync()``, ``disable_allreduce()``: gradient accumulation); None
        otherwise."""
        forwards, self._forwards = self._forwards, []
        if forwards and all(f is True for f in forwards):
            return True
        if forwards and all(f is False for f in forwards):
            return False
        return None

    def broadcast_pending(self) -> None:
        """Broadcast the masters of every DDP noted since (at ``scale_loss``: a collective)."""
        pending, self._pending = self._pending, []
        for ref in pending:
            ddp = ref()
            if ddp is not None:
                broadcast_masters(ddp.module, getattr(ddp, "process_group", None), 0)


# The apex_lite.parallel.DistributedDataParallel whose forward is running (it sets it), as
# torch's DDP marks its own (DistributedDataParallel._active_ddp_module).
_ACTIVE_APEX_DDP: List[Optional[torch.nn.Module]] = [None]


@contextlib.contextmanager
def apex_ddp_forward(module: torch.nn.Module):
    """Around an apex_lite.parallel.DistributedDataParallel's forward: the models amp prepared
    see it (``reduces_next_backward()``) in their forward pre-hook."""
    previous, _ACTIVE_APEX_DDP[0] = _ACTIVE_APEX_DDP[0], module
    try:
        yield
    finally:
        _ACTIVE_APEX_DDP[0] = previous


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
