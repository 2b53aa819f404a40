"""O2's master gradients, with torch's lifetimes.

At O2 the optimizer steps the fp32 masters, and each master's ``.grad`` is the true fp32
gradient: the half model gradient of the backward, unscaled. Code that drives an optimizer reads
and writes those gradients between ``scale_loss`` and ``step()``, as it did with apex and does
in fp32 training: mmengine clips them and logs their norm, LARC scales them, SAM perturbs the
weights along them, multi-task gradient surgery keeps one task's and combines it with the next
one's, a loop sets ``p.grad = t`` by hand or exports it through DLPack. What it may do is what
torch allows, and what it sees is what torch shows:

- after ``zero_grad()`` (``set_to_none``) each backward gives new gradient tensors: a reference
  kept from before keeps its values, and a saved gradient holds its own bytes;
- after ``zero_grad(set_to_none=False)`` a master's ``.grad`` is one live tensor across steps:
  edits through any reference are applied, and values written before the backward are added to;
- a backward without a ``zero_grad`` adds to the gradient in place;
- a gradient set by hand is the gradient the step applies; one read after ``step()`` is the one
  the step applied.

The fused step holds no fp32 master gradient unless something uses one, so that O2 costs fp32
training's bytes per parameter (no Adam state or gradient twice): its kernel reads the half
gradients, still multiplied by the loss scale, and unscales them as it updates the masters. So
what the fused step gives each master's ``.grad`` at the end of ``scale_loss`` is a ``LazyGrad``:
a tensor that stands for the master's true gradient and holds no memory. ``p.grad is not
None``, its shape, dtype and device read as the gradient's, without any work; the first
operation on any of an optimizer's lazy gradients (a norm, ``mul_``, ``print``, ``torch.save``,
``torch.from_dlpack``) makes all of them, in one fused pass, into real fp32 tensors, each with
storage of its own, and the operation runs on that (``MasterGrads.make``). The masters' ``.grad``
are then those tensors, which the step applies with whatever was done to them. DLPack's legacy
export reads memory without an operation, so importing apex_lite wraps
``torch.utils.dlpack.to_dlpack`` (and ``torch.to_dlpack``, the same function) to make a lazy
gradient first (``export_made``); C code that still reads a lazy gradient's memory directly (a
``to_dlpack`` bound before apex_lite was imported, ``torch._C._to_dlpack``) gets torch's error,
never memory that does not hold it: make it first (``amp.master_params``).

Note: reuse. A step allocates nothing here when nothing outside amp holds what amp gave out:
each master keeps one ``LazyGrad`` object and one fp32 tensor for made values, reused from step
to step while amp holds the only reference (a reference count, read in one C loop on the native
backend). When user code keeps one, amp lets it go (a lazy gradient kept across ``zero_grad()``
is made first, from the half gradient still there) and takes a new one for the next step, so a
kept gradient keeps its values.
"""
from __future__ import annotations

import copy
import enum
import functools
import sys
import weakref
from typing import Callable, List, Optional, Sequence

import torch

from ..multi_tensor._backend import ops_for
from .grad_lists import Scale, fused_accumulate, fused_scale

__all__ = ["GradState", "LazyGrad", "MasterGrads", "is_lazy", "resolve"]


class GradState(enum.Enum):
    """Where an amp optimizer's gradients stand (``AmpOptimizer.grad_state``); the step paths
    return the state a backward leaves (step_path.py).

    - CLEAN: no backward since ``zero_grad`` (gradients None, zero, or set by hand);
    - SCALED: gradients hold backwards still multiplied by the loss scale (``delay_unscale``);
    - UNSCALED: gradients hold true values (under O2 in the masters' fp32 gradients); another
      backward is added to them;
    - CHECKED (the fused step): the half model gradients hold one backward still multiplied by
      the loss scale, checked for inf/NaN at its ``scale_loss``'s end; the masters hold lazy
      gradients that stand for their true values, and the step's kernel unscales the half ones.
    """

    CLEAN = "clean"
    SCALED = "scaled"
    UNSCALED = "unscaled"
    CHECKED = "checked"


class LazyGrad(torch.Tensor):
    """A master's fp32 gradient that the fused step has not made yet (see the module docstring).

    ``_room``: the ``MasterGrads`` that makes it (weakly held), None once user code kept it past
    a ``zero_grad()`` (it is then made); ``_index``: its master's place there; ``_value``: the real
    tensor once made."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, room: "MasterGrads", index: int):
        master = room.masters[index]
        lazy = torch.Tensor._make_wrapper_subclass(
            cls, master.shape, strides=master.stride(), dtype=master.dtype,
            device=master.device, requires_grad=False)
        lazy._room = weakref.ref(room)
        lazy._index = index
        lazy._value = None
        # C code that reads its memory directly (torch._C._to_dlpack) raises torch's error
        # instead of reading an address that holds nothing.
        _throw_on_data_access(lazy)
        return lazy

    def _make(self) -> torch.Tensor:
        value = self._value
        if value is None:
            room = None if self._room is None else self._room()
            if room is not None:
                room.make_all()   # the optimizer's: every lazy gradient of this step, clipped
                if self._value is None:   # zeros, of a zero_grad(set_to_none=False)
                    room.make(room.factor)
            value = self._value
            if value is None:
                raise RuntimeError(
                    "this gradient of an O2 master weight belongs to a training run that is "
                    "gone (amp.initialize was called again since): read the master's .grad of "
                    "the current run")
        return value

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return func(*_real(args), **(_real(kwargs) if kwargs else {}))

    # Python-level reads that bypass the dispatcher.
    def tolist(self):
        return self._make().tolist()

    def numpy(self, *args, **kwargs):
        return self._make().numpy(*args, **kwargs)

    def data_ptr(self):
        return self._make().data_ptr()

    def untyped_storage(self):
        return self._make().untyped_storage()

    def __dlpack__(self, *args, **kwargs):
        return self._make().__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._make().__dlpack_device__()

    def __reduce_ex__(self, protocol):
        return self._make().__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        return copy.deepcopy(self._make(), memo)

    def __repr__(self, **kwargs):
        return repr(self._make())


def export_made(to_dlpack: Callable) -> Callable:
    """``to_dlpack`` (torch's legacy DLPack export, a C function that reads a tensor's memory
    directly) that makes a lazy gradient before exporting it: the capsule holds the gradient's
    values, which the step applies."""
    if getattr(to_dlpack, "_makes_lazy_grads", False):
        return to_dlpack

    @functools.wraps(to_dlpack)
    def to_dlpack_made(tensor, *args, **kwargs):
        if type(tensor) is LazyGrad:
            tensor = tensor._make()
        return to_dlpack(tensor, *args, **kwargs)
    to_dlpack_made._makes_lazy_grads = True
    return to_dlpack_made


def _export_made_through_dlpack() -> None:
    """Wraps torch's legacy DLPack export where user code finds it (``export_made``)."""
    import torch.utils.dlpack as dlpack
    original = dlpack.to_dlpack
    dlpack.to_dlpack = export_made(original)
    if getattr(torch, "to_dlpack", None) is original:
        torch.to_dlpack = dlpack.to_dlpack


_export_made_through_dlpack()


def _throw_on_data_access(tensor: torch.Tensor) -> None:
    setter = getattr(torch._C, "_set_throw_on_mutable_data_ptr", None)
    if setter is not None:
        setter(tensor)


def _real(x):
    """``x`` (an argument of an operation) with every ``LazyGrad`` in it replaced by its real
    tensor; lists and tuples are looked into one level down (the foreach ops' lists)."""
    kind = type(x)
    if kind is LazyGrad:
        return x._make()
    if kind is tuple or kind is list:
        if any(type(e) is LazyGrad or type(e) is list or type(e) is tuple for e in x):
            return kind(map(_real, x))
        return x
    if kind is dict:
        return {k: _real(v) for k, v in x.items()}
    return x


def is_lazy(grad: Optional[torch.Tensor]) -> bool:
    """Whether ``grad`` is a gradient the fused step has not made (yet)."""
    return type(grad) is LazyGrad and grad._value is None


def resolve(grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``grad`` as a real tensor (making a lazy one); None stays None."""
    return grad._make() if type(grad) is LazyGrad else grad


# torch's foreach utilities (clip_grad_norm_, clip_grad_value_) take the fused path only for
# lists of the types listed here and fall back to one call per tensor otherwise: list this one,
# whose operations reach __torch_dispatch__ with the whole list.
try:
    from torch.utils import _foreach_utils
    if LazyGrad not in _foreach_utils._foreach_supported_types:
        _foreach_utils._foreach_supported_types.append(LazyGrad)
except (ImportError, AttributeError):   # a torch without the list: the per-tensor fallback
    pass


class MasterGrads:
    """The gradients of one amp optimizer's O2 masters on one device (``pairs``, pairs.py).

    ``make_all``: how a lazy gradient asks to be made (the optimizer's, so that every lazy
    gradient of the optimizer is made in one pass and its state moves on)."""

    def __init__(self, device: torch.device, pairs: Sequence, make_all: Callable[[], None]):
        self.device = device
        self.pairs = list(pairs)
        self.models = [pair.model for pair in self.pairs]
        self.masters = [pair.master for pair in self.pairs]
        self.make_all = make_all
        self.lazies: Optional[List[LazyGrad]] = None
        self.slots = None          # ops.lazy_grad_slots(models, masters, lazies)
        # Per master, the fp32 tensor its made values were last written to (reused while amp
        # holds the only reference), or None.
        self.values: List[Optional[torch.Tensor]] = [None] * len(self.pairs)
        # The inverse loss scale of the lazy gradients given (a snapshot: a device scale changes
        # in place at the step).
        self.factor: Scale = 1.0
        # zero_grad(set_to_none=False) since the last backward: the lazy gradients on the
        # masters read as zeros, and a master keeps its .grad tensor (torch's live gradient).
        self.zeroed = False
        self.live = False
        self.made: List[int] = []  # the lazy gradients made since they were given
        self.used = False          # something made this step's gradients (values kept)
        # The references amp's own structures hold to a lazy gradient that is no master's
        # .grad (measured when they are made: torch versions count C++ holders differently).
        self._own = 1
        self._sink: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return len(self.pairs)

    def _lazies(self) -> List[LazyGrad]:
        if self.lazies is None:
            self.lazies = [LazyGrad(self, i) for i in range(len(self.pairs))]
            self.slots = ops_for(self.device).lazy_grad_slots(self.models, self.masters,
                                                              self.lazies)
            if self.lazies:
                self._own = sys.getrefcount(self.lazies[0]) - 1   # less getrefcount's own
        return self.lazies

    def sink(self) -> torch.Tensor:
        """A flag for kernel calls whose inputs were checked already."""
        if self._sink is None:
            with torch.inference_mode(False):
                self._sink = torch.zeros(1, dtype=torch.float32, device=self.device)
        return self._sink

    # ---- the end of a scale_loss on the fused step --------------------------------------------
    def give(self, factor: Scale, carried_inf: torch.Tensor) -> bool:
        """Each master whose half parameter got a gradient gets its lazy gradient, standing for
        ``factor`` times the half gradient; a master that holds another gradient (set by hand,
        made, or left by ``zero_grad(set_to_none=False)``) has the new one added to it, as
        torch adds a backward to a gradient there. True when every new gradient is lazy; False
        when some were added (every lazy one is then made too: the step reads the masters')."""
        self._lazies()
        if self.made and not self.live:
            # Lazy gradients an earlier step made and no zero_grad() let go (the half
            # gradients were cleared by hand): their values are that step's.
            self._retire(self.made)
            self.made = []
        holding = list(self.slots.give())
        self.factor = factor.clone() if isinstance(factor, torch.Tensor) else float(factor)
        # Made lazy gradients still on their masters (after zero_grad(set_to_none=False)); a
        # made one whose master holds its value is among ``holding``.
        made = [i for i in self.made if self.models[i].grad is not None
                and self.masters[i].grad is self.lazies[i]]
        self.zeroed = False
        if not holding and not made:
            return True
        targets = [resolve(self.masters[i].grad) for i in holding]
        targets += [self.lazies[i]._value for i in made]
        indices = holding + made
        self.make(factor)   # the lazy ones
        with torch.no_grad():
            fused_accumulate([self.models[i].grad for i in indices], targets, factor,
                             carried_inf)
        return False

    # ---- making lazy gradients ----------------------------------------------------------------
    def make(self, factor: Scale) -> None:
        """Make every lazy gradient given since (zeros after ``zero_grad(set_to_none=False)``,
        else ``factor`` times its half gradient) into its own fp32 tensor: the one of the last
        step where amp holds the only reference, else a new one. The masters' ``.grad`` become
        those tensors (but after ``zero_grad(set_to_none=False)``, where a master keeps its
        gradient tensor)."""
        if self.lazies is None:
            return
        todo = []
        for i, lazy in enumerate(self.lazies):
            if lazy._value is None:
                if self.models[i].grad is not None:
                    todo.append(i)
                elif self.masters[i].grad is lazy:
                    self.masters[i].grad = None   # its half gradient was cleared since
        if not todo:
            return
        values = self._fresh(todo)
        with torch.inference_mode(False), torch.no_grad():
            if self.zeroed:
                torch._foreach_zero_(values)
            else:
                fused_scale([self.models[i].grad for i in todo], values, factor, self.sink())
        for i, value in zip(todo, values):
            lazy = self.lazies[i]
            lazy._value = value
            if not self.live and self.masters[i].grad is lazy:
                self.masters[i].grad = value
        self.made.extend(todo)
        self.used = True

    def _fresh(self, indices: List[int], reuse: bool = True) -> List[torch.Tensor]:
        """An fp32 tensor per master of ``indices`` for made values: the last one where nothing
        outside amp holds it (``reuse``), else a new one with storage of its own. Never an
        inference tensor, wherever the first use happens."""
        held = set(ops_for(self.device).referenced_elsewhere(self.values, 1)) if reuse else ()
        out = []
        with torch.inference_mode(False):
            for i in indices:
                value = self.values[i]
                if value is None or i in held or value.shape != self.masters[i].shape:
                    value = torch.empty_like(self.masters[i],
                                             memory_format=torch.preserve_format)
                    if reuse:
                        self.values[i] = value
                out.append(value)
        return out

    def fresh_grads(self, indices: List[int]) -> List[torch.Tensor]:
        """New gradients for the masters of ``indices`` (the unfused step's unscale writes them):
        each master's last one where nothing outside amp holds it, else a new tensor."""
        return self._fresh(indices)

    # ---- zero_grad ----------------------------------------------------------------------------
    def release(self, factor: Scale) -> None:
        """Before the half gradients are dropped (``zero_grad()``, after ``take_back``): a lazy
        gradient that user code holds is made now (``factor`` times its half gradient, into a
        tensor of its own) and let go, its master taking a new one; the others are reset for
        the next step."""
        if self.lazies is None:
            return
        held = ops_for(self.device).referenced_elsewhere(self.lazies, self._own)
        unmade = [i for i in held if self.lazies[i]._value is None
                  and self.models[i].grad is not None]
        if unmade:
            values = self._fresh(unmade, reuse=False)
            with torch.inference_mode(False), torch.no_grad():
                if self.zeroed:
                    torch._foreach_zero_(values)
                else:
                    fused_scale([self.models[i].grad for i in unmade], values, factor,
                                self.sink())
            for i, value in zip(unmade, values):
                self.lazies[i]._value = value
        self._retire(sorted(set(held) | set(self.made)), held)
        self.made = []
        self.zeroed = self.live = False

    def _retire(self, indices: Sequence[int], held: Optional[Sequence[int]] = None) -> None:
        """The lazy gradients of ``indices`` are done with: one that user code holds (``held``,
        counted now when None) is let go, its master taking a new one; the others are reset,
        unmade, for the next step."""
        if held is None:
            held = ops_for(self.device).referenced_elsewhere(self.lazies, self._own)
        held = set(held)
        for i in indices:
            if i in held:
                self.lazies[i]._room = None
                lazy = self.lazies[i] = LazyGrad(self, i)
                self.slots.replace(i, lazy)
            else:
                self.lazies[i]._value = None

    def take_back(self) -> None:
        """``zero_grad()``: the lazy gradients come off the masters (torch's own ``zero_grad``
        finds nothing to drop or zero there)."""
        if self.slots is not None:
            self.slots.take_back()

    def put_back_zeroed(self) -> None:
        """``zero_grad(set_to_none=False)``, after torch's own zeroed the masters' other
        gradients in place: the lazy gradients ``take_back`` took go back and read as zeros
        (``zeroed``), a made one that stayed on its master has its value zeroed in place, and a
        master keeps its gradient tensor from now on (``live``), as torch's does."""
        if self.slots is None:
            return
        self.slots.put_back()
        made = [self.lazies[i]._value for i in self.made
                if self.masters[i].grad is self.lazies[i]]
        if made:
            with torch.no_grad():
                torch._foreach_zero_(made)
        self.zeroed = self.live = True

    def after_step(self) -> None:
        """The values of a step whose gradients nothing made go back (the fused step keeps fp32
        training's memory); those of a step that made them are kept for the next."""
        if not self.used:
            self.values = [None] * len(self.pairs)
        self.used = False

    def written(self) -> bool:
        """Whether user code replaced, deleted or set to None a master's ``.grad`` since the
        lazy gradients were given."""
        return self.slots is not None and self.slots.changed() >= 0
