"""O2: writes to the half model that amp did not make reach the masters; so does unfreezing.

At O2 the fp32 masters are a second copy of the model's weights, and amp rounds them into the
half model after every step. Something else may write the half weights in between: a module in
its forward (``nn.Embedding(max_norm=...)`` renormalises the rows it looks up), a
re-initialisation or a ``copy_`` of pretrained weights under ``no_grad``, a ``.data = ...``
assignment, an adapter merged into its base layer (peft's ``merge_adapter``), a broadcast from
another rank. Were the masters to win, the next step would silently revert the write. So amp
takes every such write into the master: where the half value now differs from the master's
rounding, the master becomes the upcast of the new half value; elsewhere it keeps its fp32 bits.
This is what fp32 training does with the same write, at the half dtype's precision.

And a master follows its parameter's ``requires_grad``, both ways (a layer unfrozen or frozen
mid-training), so that whoever reads the optimizer's ``param_groups`` (mmengine's and mmcv's
clipping keep ``p.requires_grad and p.grad is not None``) sees what fp32 training shows.

How amp sees a write: the half parameters' version counters (bumped by every in-place op on a
tensor: autograd's own record of writes) and data pointers (``p.data = t`` gives a parameter
other memory without bumping its counter), compared with those recorded after amp's own last
write: host integers, no device sync, one C++ loop on the native backend (``watch_tensors``).
The check runs at every ``step()`` (before the update), at the end of every ``scale_loss``
(before code that reads ``param_groups`` between the backward and the step) and in
``amp.master_params``. A write found costs one elementwise comparison of that parameter with its
master. In-place ops through ``p.data`` (``p.data.copy_(w)``, ``p.data += d``, which is how
peft merges an adapter) bypass the counter as they bypass autograd: the check before a
``state_dict()`` of the model or of amp compares every parameter with its master (one pass over
the model), so a checkpoint holds such a write, but a step does not see it. Write under
``torch.no_grad()`` (``p.copy_(w)``) for training to go on from it.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from ..multi_tensor._backend import ops_for


class ModelWrites:
    """The watch over one run's O2 half parameters (``run.model_writes``)."""

    def __init__(self, run):
        self.run = run
        self._pairs_seen = -1
        # Per device: (watch, [(half parameter, master)]).
        self._watches: Dict[torch.device, tuple] = {}

    def _current(self) -> Dict[torch.device, tuple]:
        count = sum(len(pairs) for pairs in self.run.master_pairs)
        if count != self._pairs_seen:   # masters made since (add_param_group)
            per_device: Dict[torch.device, List[tuple]] = {}
            seen = set()
            for pairs in self.run.master_pairs:
                for _, param, master in pairs:
                    if id(param) not in seen:
                        seen.add(id(param))
                        per_device.setdefault(param.device, []).append((param, master))
            self._watches = {}
            for device, pairs in per_device.items():
                watch = ops_for(device).watch_tensors([param for param, _ in pairs])
                watch.record()
                self._watches[device] = (watch, pairs)
            self._pairs_seen = count
        return self._watches

    def record(self) -> None:
        """The half model as it is now is amp's own (after amp wrote it)."""
        for watch, _ in self._current().values():
            watch.record()

    def sync(self, compare_all: bool = False) -> None:
        """Take every write made since the last record into the masters, and every change of
        ``requires_grad``; then record. ``compare_all``: compare every parameter with its
        master, so that writes no counter shows (in place through ``p.data``) are taken too
        (before a checkpoint: one pass over the model)."""
        for watch, pairs in self._current().values():
            changed = pairs if compare_all else [pairs[i] for i in watch.changed()]
            if not changed:
                continue
            for param, master in changed:
                if master.requires_grad != param.requires_grad:
                    master.requires_grad_(param.requires_grad)
            take_writes(changed)
            watch.record()


def take_writes(pairs) -> None:
    """For each ``(half parameter, master)``: where the half value differs from the master's
    rounding, the master takes its upcast (elsewhere it keeps its fp32 bits). One comparison per
    parameter, on the device; no host read."""
    with torch.inference_mode(False), torch.no_grad():
        for param, master in pairs:
            rounded = master.to(param.dtype)
            # NaN where NaN was is no write (NaN != NaN).
            written = torch.ne(param, rounded) & ~(torch.isnan(param) & torch.isnan(rounded))
            master.copy_(torch.where(written, param.to(master.dtype), master))
