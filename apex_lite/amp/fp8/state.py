"""The fp8 scaling state of one model's fp8 layers, on the model's device: the counts, and for
the delayed recipe the amax histories and the scales they give.

Note: one set of tensors per model (``Fp8Group``, a row per layer), each layer reading its row
(``LayerState``, views): the once-a-step fold is a handful of kernels for the whole model, the
state of a layer is found from the layer, and a copy of the model (deepcopy, ``torch.save``)
copies the tensors and the views together. A step's amaxes (the largest of its forwards and
backwards, gradient accumulation included) are gathered in ``pending``, and folded into the
histories at the optimizer's ``step()`` (``Fp8StepFold``, a step pre-hook: outside any graph
the user compiles), after an all-reduce (max) over the run's process group when
torch.distributed runs: every rank scales alike, and the state any rank saves after a step
resumes every rank.
"""
from __future__ import annotations

import weakref
from typing import List

import torch

from .cast import FORMATS, ROLES, pow2_scale
from .config import FP8


class Fp8Group:
    """The fp8 state of one model's fp8 layers (``names``, in ``named_modules`` order).

    Attributes:
        counts: int64 (layers, 3 roles, 2): elements clipped, nonzero elements flushed to zero.
        history: fp32 (layers, 3, amax_history), newest first (delayed recipe, else None).
        scale: fp32 (layers, 3): the powers of two the history gives (delayed).
        has_history: bool (layers, 3): whether the history holds a nonzero amax (delayed).
        pending: fp32 (layers, 3): the largest amax since the last fold (delayed).
        steps: int64 scalar: the folds so far (delayed).
    """

    def __init__(self, names: List[str], device: torch.device, config: FP8):
        self.names = list(names)
        self.config = config
        n = len(names)
        self.counts = torch.zeros(n, len(ROLES), 2, dtype=torch.int64, device=device)
        self.history = self.scale = self.has_history = self.pending = self.steps = None
        # Set by a forward through a layer; the fold at the next optimizer step clears it.
        self.dirty = False
        if config.recipe == "delayed":
            self.history = torch.zeros(n, len(ROLES), config.amax_history, device=device)
            self.scale = torch.ones(n, len(ROLES), device=device)
            self.has_history = torch.zeros(n, len(ROLES), dtype=torch.bool, device=device)
            self.pending = torch.zeros(n, len(ROLES), device=device)
            self.steps = torch.zeros((), dtype=torch.int64, device=device)

    @property
    def delayed(self) -> bool:
        return self.history is not None

    def layer(self, index: int) -> "LayerState":
        """The views layer ``index`` reads and writes."""
        return LayerState(self, index)

    def fold(self, process_group=None, reduce: bool = False) -> None:
        """Delayed recipe: the step's amaxes (all-reduced with max over ``process_group`` when
        ``reduce``) become the newest history entries, and the scales follow. An amax that is
        inf or NaN (an overflowing step, which amp skips) enters as 0: it never poisons the
        history."""
        with torch.no_grad():
            amax = self.pending.clone()
            if reduce:
                torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX,
                                             group=process_group)
            amax = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))
            self.history.copy_(torch.cat([amax.unsqueeze(-1), self.history[..., :-1]], dim=-1))
            self.pending.zero_()
            self.refresh_scales()
            self.steps.add_(1)
        self.dirty = False

    def refresh_scales(self) -> None:
        """``scale`` and ``has_history`` from ``history`` (after a fold or a load)."""
        largest = self.history.amax(dim=-1)
        for role, fp8_dtype in enumerate(FORMATS):
            self.scale[:, role] = pow2_scale(largest[:, role], fp8_dtype, self.config.margin)
        self.has_history.copy_(largest > 0)


class LayerState:
    """One fp8 layer's row of its model's ``Fp8Group`` (views of its tensors)."""

    def __init__(self, group: Fp8Group, index: int):
        self.index = index
        self.group = group
        self.name = group.names[index]
        self.config = group.config
        self.counts = group.counts[index]
        self.delayed = group.delayed
        self.scale = group.scale[index] if group.delayed else None
        self.has_history = group.has_history[index] if group.delayed else None
        self.pending = group.pending[index] if group.delayed else None


class Fp8StepFold:
    """An optimizer step pre-hook on each optimizer of a run with delayed-scaling fp8 layers:
    at the first ``step()`` after a forward through them (applied or skipped), the groups
    fold the step's amaxes (``Fp8Group.fold``), all-reduced over the run's process group when
    torch.distributed runs with more than one rank (every rank steps, so every rank folds).
    It holds the run weakly."""

    def __init__(self, groups: List[Fp8Group], run=None):
        self.groups = groups
        self.run = None if run is None else weakref.ref(run)

    def __call__(self, optimizer, args, kwargs) -> None:
        dirty = [group for group in self.groups if group.dirty]
        if not dirty:
            return
        run = None if self.run is None else self.run()
        process_group = None if run is None else run.process_group
        reduce = (torch.distributed.is_available() and torch.distributed.is_initialized()
                  and torch.distributed.get_world_size(process_group) > 1)
        for group in dirty:
            group.fold(process_group, reduce)


class Fp8ForwardFold:
    """A forward pre-hook on a model initialised without an optimizer (no step to fold at):
    each forward after one through its fp8 layers folds that forward's amaxes first, on this
    rank alone (``Fp8Group.fold``). A module-level class, so the model still pickles."""

    def __init__(self, group: Fp8Group):
        self.group = group

    def __call__(self, module, args) -> None:
        if self.group.dirty:
            self.group.fold()
