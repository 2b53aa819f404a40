"""O2 on the fused step: the masters' true gradients, made when something reads them.

The fused step holds no fp32 master gradient: its kernel reads the half model gradients, still
multiplied by the loss scale, and unscales them as it updates the masters (``step_path.py``).
Code that drives an optimizer reads the gradients of its parameters between ``scale_loss`` and
``step()``, as it did with apex, where every parameter of ``optimizer.param_groups`` held its
unscaled fp32 gradient: mmengine's OptimWrapper clips them and logs their norm, apex's LARC
scales them, training loops log a gradient norm. So a master of an optimizer on the fused step is
a ``FusedMaster``: a tensor whose ``.grad``, read while the step's gradients are still only
checked (CHECKED), first unscales them into every master's fp32 gradient, exactly as
``amp.master_params(optimizer)`` does (``AmpOptimizer.materialize_master_grads``); the step then
applies those gradients, with whatever was done to them. Where nothing reads them, nothing is
made, and the fused step keeps its memory (no fp32 gradient beside the half one).

The class differs from a plain tensor in ``.grad`` only: torch functions see a plain tensor
(``__torch_function__`` disabled, results are plain tensors), pickling and ``deepcopy`` give plain
tensors, and the kernels read the tensor itself. The other parameters of such an optimizer (those
kept in fp32, FSDP2's shards) are the model's own and hold their true gradient after
``scale_loss`` already: the end of the block unscales them in place.

amp's own code reads a master's stored gradient, without making it, through ``stored_grad``.
"""
from __future__ import annotations

import copy
import weakref
from typing import Iterable, Optional

import torch

_TENSOR_GRAD = torch._C.TensorBase.grad
_get_grad = _TENSOR_GRAD.__get__
_set_grad = _TENSOR_GRAD.__set__

__all__ = ["FusedMaster", "adopt", "release", "stored_grad"]


def stored_grad(tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """``tensor.grad`` as stored: for a ``FusedMaster``, without making it."""
    return _get_grad(tensor)


class FusedMaster(torch.Tensor):
    """An O2 fp32 master of an optimizer on the fused step (see the module docstring)."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    # The AmpOptimizer (a weak reference: the master must not keep amp's run alive), or None.
    _apex_lite_owner: Optional[weakref.ref] = None
    # Whether a gradient may be stored: set by the setter, and by a backward that reaches the
    # master (a hook). Where none is, .grad answers None without torch's getter, which costs a
    # tensor subclass several times a plain tensor's read (its __torch_function__ lookup): an
    # optimizer's zero_grad() reads every master's .grad each step.
    _apex_lite_held = False

    @property
    def grad(self):
        ref = self._apex_lite_owner
        if ref is not None:
            amp_opt = ref()
            if amp_opt is not None and amp_opt.grad_state == "checked":
                amp_opt.materialize_master_grads()
        return _get_grad(self) if self._apex_lite_held else None

    @grad.setter
    def grad(self, value):
        _set_grad(self, value)
        self._apex_lite_held = value is not None

    @grad.deleter
    def grad(self):
        _TENSOR_GRAD.__delete__(self)
        self._apex_lite_held = False

    def _plain(self) -> torch.Tensor:
        plain = self.detach()     # a plain tensor on the same storage (torch functions disabled)
        return plain.requires_grad_(self.requires_grad)

    def __reduce_ex__(self, protocol):
        return self._plain().__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            out = self.detach().clone()
        out.requires_grad_(self.requires_grad)
        grad = _get_grad(self)
        if grad is not None:
            out.grad = copy.deepcopy(grad, memo)
        memo[id(self)] = out
        return out

    def __repr__(self, **kwargs):
        return torch.Tensor.__repr__(self._plain(), **kwargs)


def _grad_arrived(master: torch.Tensor) -> None:
    """A backward accumulated into a FusedMaster (autograd sets .grad in C++, past the setter)."""
    master._apex_lite_held = True


def adopt(masters: Iterable[torch.Tensor], amp_opt) -> None:
    """Make ``masters`` (cast parameters' fp32 masters, plain tensors that amp made) the fused
    step's: their ``.grad`` materialises ``amp_opt``'s pending gradients when read. The objects
    stay the same (``param_groups``, ``optimizer.state`` and amp's maps key on them)."""
    ref = weakref.ref(amp_opt)
    for master in masters:
        if type(master) is torch.Tensor:
            held = _get_grad(master) is not None
            master.__class__ = FusedMaster
            master._apex_lite_held = held
            if master.requires_grad:
                master.register_post_accumulate_grad_hook(_grad_arrived)
        if type(master) is FusedMaster:
            master._apex_lite_owner = ref


def release(masters: Iterable[torch.Tensor]) -> None:
    """Give ``masters`` back their plain ``.grad`` (the optimizer leaves the fused step, or a
    later ``initialize`` takes it over)."""
    for master in masters:
        if type(master) is FusedMaster:
            master.__dict__.pop("_apex_lite_owner", None)
            master.__dict__.pop("_apex_lite_held", None)
            master.__class__ = torch.Tensor
