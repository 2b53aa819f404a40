"""Host-side watches over lists of tensors: the Python backend's, and the reference of the native
ones (csrc/grad_watch.cpp, csrc/master_watches.cpp). They read only host state (which tensor a
``.grad`` is, version counters, flags): no host sync. amp uses them each step, where a Python
statement per parameter would cost more than the step's bookkeeping; the native backend runs the
same loops in C++ (``ops_for(device).watch_grads`` and the others).

- ``GradWatch``: whether the ``.grad`` of ``sources`` changed since ``record()`` (O2's half
  gradients edited after ``scale_loss``: amp/grad_edits.py).
- ``PendingGrads``: the fused step's pending master gradients, given to the masters and watched
  for writes by user code (amp/master_grads.py).
- ``TensorWatch``: whether tensors were written in place or had ``requires_grad`` flipped since
  ``record()`` (O2's half model parameters: amp/model_writes.py).
"""
from __future__ import annotations

from typing import List, Sequence

import torch

Tensors = Sequence[torch.Tensor]


def _version(t: torch.Tensor) -> int:
    return -1 if t.is_inference() else t._version


class GradWatch:
    """Whether the ``.grad`` of ``sources`` changed since ``record()``: a tensor other than the
    one recorded, or the recorded one at another version (every in-place op bumps a tensor's
    version). ``changed()``: the index of the first changed source, -1 when none (or nothing is
    recorded); a gradient set to None since counts as cleared, which ``cleared()`` lists."""

    def __init__(self, sources: Tensors):
        self.sources = list(sources)
        self.grads = None
        self.versions = None

    def record(self) -> None:
        self.grads = [p.grad for p in self.sources]
        self.versions = [-1 if g is None else _version(g) for g in self.grads]

    def changed(self) -> int:
        if self.grads is None:
            return -1
        for i, (p, old, version) in enumerate(zip(self.sources, self.grads, self.versions)):
            g = p.grad
            if g is not None and (g is not old or g.is_inference() or g._version != version):
                return i
        return -1

    def cleared(self) -> List[int]:
        """The indices of the sources that had a ``.grad`` when recorded and have none now
        (empty when none, or nothing is recorded)."""
        if self.grads is None:
            return []
        return [i for i, (p, old) in enumerate(zip(self.sources, self.grads))
                if old is not None and p.grad is None]

    def clear(self) -> None:
        self.grads = self.versions = None


class PendingGrads:
    """``pend()``: each of ``masters`` whose source (``sources[i]``) has a gradient gets
    ``pending[i]`` as its ``.grad``; what every master's ``.grad`` is then is recorded.
    ``changed()``: the index of the first master whose ``.grad`` is not the tensor recorded
    (another tensor, or None where one was, or one where None was); -1 when none. ``unpend()``:
    the masters that still hold their pending gradient hold none."""

    def __init__(self, sources: Tensors, masters: Tensors, pending: Tensors):
        if not len(sources) == len(masters) == len(pending):
            raise ValueError("PendingGrads: sources, masters and pending must be aligned lists")
        self.sources, self.masters, self.pending = list(sources), list(masters), list(pending)
        self.recorded = None

    def pend(self) -> None:
        for source, master, pending in zip(self.sources, self.masters, self.pending):
            if source.grad is not None:
                master.grad = pending
        self.recorded = [master.grad for master in self.masters]

    def changed(self) -> int:
        if self.recorded is None:
            return -1
        for i, (master, old) in enumerate(zip(self.masters, self.recorded)):
            if master.grad is not old:
                return i
        return -1

    def unpend(self) -> None:
        """Take the pending gradients off the masters that still hold them."""
        for master, pending in zip(self.masters, self.pending):
            if master.grad is pending:
                master.grad = None

    def clear(self) -> None:
        self.recorded = None


class TensorWatch:
    """Whether ``tensors`` were written in place (a version counter moved), given other memory
    (``p.data = t`` keeps the version counter, not the data pointer) or had ``requires_grad``
    flipped since ``record()``. ``changed()``: the indices of those tensors (empty when none, or
    nothing is recorded)."""

    def __init__(self, tensors: Tensors):
        self.tensors = list(tensors)
        self.recorded = None

    def record(self) -> None:
        self.recorded = [(_version(t), t.data_ptr(), t.requires_grad) for t in self.tensors]

    def changed(self) -> List[int]:
        if self.recorded is None:
            return []
        return [i for i, (t, (version, data, requires_grad)) in enumerate(zip(self.tensors,
                                                                               self.recorded))
                if _version(t) != version or t.data_ptr() != data
                or t.requires_grad != requires_grad]


def watch_grads(sources: Tensors) -> GradWatch:
    """A ``GradWatch`` over ``sources``."""
    return GradWatch(sources)


def pending_grads(sources: Tensors, masters: Tensors, pending: Tensors) -> PendingGrads:
    """A ``PendingGrads`` over the aligned lists."""
    return PendingGrads(sources, masters, pending)


def watch_tensors(tensors: Tensors) -> TensorWatch:
    """A ``TensorWatch`` over ``tensors``."""
    return TensorWatch(tensors)
