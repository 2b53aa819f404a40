"""Host-side watches over lists of tensors: the Python backend's, and the reference of the native
ones (csrc/grad_watch.cpp, csrc/master_watches.cpp). They read only host state (which tensor a
``.grad`` is, version counters, flags): no host sync. amp uses them each step, where a Python
statement per parameter would cost more than the step's bookkeeping; the native backend runs the
same loops in C++ (``ops_for(device).watch_grads`` and the others).

- ``GradWatch``: whether the ``.grad`` of ``sources`` changed since ``record()`` (O2's half
  gradients edited after ``scale_loss``: amp/grad_edits.py).
- ``LazyGradSlots``: the fused step's lazy master gradients, given to the masters and watched
  for writes by user code (amp/master_grads.py); ``referenced_elsewhere``: which of amp's
  tensors user code still holds (a kept gradient keeps its values: amp reuses only the others).
- ``TensorWatch``: whether tensors were written or had ``requires_grad`` flipped since ``record()``
  (O2's two copies of each parameter: amp/two_copies.py).
"""
from __future__ import annotations

import sys
import weakref

from typing import List, Sequence, Tuple

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


class LazyGradSlots:
    """``give()``: each of ``masters`` whose source (``sources[i]``) has a gradient and that holds
    no gradient, or its own lazy one (``lazies[i]``), gets ``lazies[i]`` as its ``.grad``; the
    indices of those that hold another gradient are returned (the new one is added to it). What
    every master's ``.grad`` is then is recorded. ``changed()``: the index of the first master
    whose ``.grad`` is not the tensor recorded (another tensor, or None where one was, or one
    where None was); -1 when none. ``take_back()``: the masters that still hold their lazy
    gradient hold none (``put_back()`` gives them back). ``replace(i, lazy)``: slot ``i``'s lazy
    gradient from now on."""

    def __init__(self, sources: Tensors, masters: Tensors, lazies: List[torch.Tensor]):
        if not len(sources) == len(masters) == len(lazies):
            raise ValueError("LazyGradSlots: sources, masters and lazies must be aligned lists")
        # ``lazies`` is the caller's list itself, not a copy, so that the slots add no reference
        # to what they hold (as the C++ class's at::Tensors add none to the Python objects).
        self.sources, self.masters, self.lazies = list(sources), list(masters), lazies
        self.recorded = None

    def give(self) -> List[int]:
        holding = []
        self.recorded = None
        for i, (source, master, lazy) in enumerate(zip(self.sources, self.masters,
                                                        self.lazies)):
            if source.grad is not None:
                grad = master.grad
                if grad is None or grad is lazy:
                    master.grad = lazy
                else:
                    holding.append(i)
        # Weak references: a held reference would count as user code keeping the gradient.
        self.recorded = [None if g is None else weakref.ref(g)
                         for g in (master.grad for master in self.masters)]
        return holding

    def changed(self) -> int:
        if self.recorded is None:
            return -1
        for i, (master, old) in enumerate(zip(self.masters, self.recorded)):
            if master.grad is not (None if old is None else old()):
                return i
        return -1

    def take_back(self) -> None:
        self.taken = []
        for i, (master, lazy) in enumerate(zip(self.masters, self.lazies)):
            if master.grad is lazy:
                master.grad = None
                self.taken.append(i)

    def put_back(self) -> None:
        for i in getattr(self, "taken", ()):
            self.masters[i].grad = self.lazies[i]
        self.taken = []

    def replace(self, i: int, lazy: torch.Tensor) -> None:
        self.lazies[i] = lazy

    def clear(self) -> None:
        self.recorded = None


def referenced_elsewhere(objects: list, own: int) -> List[int]:
    """The indices of ``objects`` that something holds besides the ``own`` references of the
    caller's (the list ``objects`` counts as one of them): user code keeps them."""
    # getrefcount counts its argument; the object is read from the list, so that no loop
    # variable (or enumerate's tuple) holds one more.
    limit = own + 1
    return [i for i in range(len(objects)) if sys.getrefcount(objects[i]) > limit]


class TensorWatch:
    """Whether ``tensors`` were written since ``record()``: in place (a version counter moved) or
    given other memory (``p.data = t`` keeps the version counter, not the data pointer); and
    whether their ``requires_grad`` was flipped. ``changed()``: ``(written, flipped)``, the
    indices of each (both empty when nothing is recorded)."""

    def __init__(self, tensors: Tensors):
        self.tensors = list(tensors)
        self.recorded = None

    def record(self) -> None:
        self.recorded = [(_version(t), t.data_ptr(), t.requires_grad) for t in self.tensors]

    def changed(self) -> Tuple[List[int], List[int]]:
        if self.recorded is None:
            return [], []
        written, flipped = [], []
        for i, (t, (version, data, requires_grad)) in enumerate(zip(self.tensors,
                                                                     self.recorded)):
            if _version(t) != version or t.data_ptr() != data:
                written.append(i)
            if t.requires_grad != requires_grad:
                flipped.append(i)
        return written, flipped


def watch_grads(sources: Tensors) -> GradWatch:
    """A ``GradWatch`` over ``sources``."""
    return GradWatch(sources)


def lazy_grad_slots(sources: Tensors, masters: Tensors, lazies: Tensors) -> LazyGradSlots:
    """A ``LazyGradSlots`` over the aligned lists."""
    return LazyGradSlots(sources, masters, lazies)


def watch_tensors(tensors: Tensors) -> TensorWatch:
    """A ``TensorWatch`` over ``tensors``."""
    return TensorWatch(tensors)
