"""O2 on the fused step: a master's gradient before anything uses it (``PendingGrad``).

The fused step holds no fp32 master gradient: its kernel reads the half model gradients, still
multiplied by the loss scale, and unscales them as it updates the masters (``step_path.py``).
Code that drives an optimizer reads the gradients of its parameters between ``scale_loss`` and
``step()``, as it did with apex, where every parameter of ``optimizer.param_groups`` held its
unscaled fp32 gradient: mmengine's OptimWrapper clips them and logs their norm, apex's LARC
scales them, a training loop logs a gradient norm or freezes a layer with ``p.grad = None``.

So the masters stay plain tensors (their class, their ``.grad`` attribute, their hooks are
torch's), and what the fused step gives each master's ``.grad`` at the end of ``scale_loss`` is a
``PendingGrad``: a tensor that stands for the master's true fp32 gradient and holds no memory.
``p.grad is not None``, its shape, dtype and device read as the gradient's, without any work.
The first operation on any of an optimizer's pending gradients (a norm, ``.data``, ``mul_``,
``print``) unscales all of them into true fp32 gradients in one fused pass, into one reused
buffer (``FusedStep.materialize``, as ``amp.master_params(optimizer)`` does), and replaces each
master's ``.grad`` with its real tensor; the operation then runs on that. ``step()`` applies
those gradients, with whatever was done to them. Where nothing uses them, nothing is made, and
the step keeps fp32 training's memory; a step that passes with none used gives the buffer back.

A write needs no interception: ``p.grad = None``, ``del p.grad``, ``p.grad = tensor`` replace the
pending gradient on the master, and ``step()`` sees the master's ``.grad`` is no longer its
``PendingGrad`` (``FusedStep.apply``; a watch of host integers, no sync): it then unscales the
others and applies what each master holds, as the unfused step would (None: not updated).

After ``zero_grad(set_to_none=False)`` a master's ``.grad`` is a zero ``PendingGrad``: it reads
as zeros, as the unfused step's and torch's do, without holding fp32 zeros for every parameter.

What differs from a plain tensor, and why it does not matter to readers: ``type(p.grad)`` is
``PendingGrad`` until the first use (``isinstance(p.grad, torch.Tensor)`` holds); torch's foreach
utilities, which take only listed types, list it (``_foreach_supported_types``), so that
``clip_grad_norm_`` keeps its one fused call per list.
"""
from __future__ import annotations

import copy
import weakref
from typing import Optional

import torch

from ..multi_tensor._backend import ops_for

__all__ = ["PendingGrad", "is_pending", "resolve", "pend", "written", "made", "zero"]


class PendingGrad(torch.Tensor):
    """A master's fp32 gradient that the fused step has not made yet (see the module docstring).

    ``_owner``: the ``FusedStep`` that makes it (weakly held), or None for a zero gradient;
    ``_value``: the real tensor once made."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, master: torch.Tensor, owner=None):
        pending = torch.Tensor._make_wrapper_subclass(
            cls, master.shape, strides=master.stride(), dtype=master.dtype,
            device=master.device, requires_grad=False)
        pending._owner = None if owner is None else weakref.ref(owner)
        pending._master = weakref.ref(master)
        pending._value = None
        return pending

    def _resolve(self) -> torch.Tensor:
        value = self._value
        if value is not None:
            return value
        if self._owner is None:                # a zero gradient: made on its own, where used
            master = self._master()
            with torch.inference_mode(False):
                value = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
            self._value = value
            if master is not None and master.grad is self:
                master.grad = value
            return value
        owner = self._owner()
        if owner is not None:
            owner.materialize_master_grads()
        if self._value is None:
            raise RuntimeError(
                "this gradient of an O2 master weight was the pending gradient of a step whose "
                "gradients are gone (optimizer.zero_grad() or a new backward since it was read): "
                "read the master's .grad again after the backward you want it from")
        return self._value

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return func(*_real(args), **(_real(kwargs) if kwargs else {}))

    # Python-level reads that bypass the dispatcher.
    def tolist(self):
        return self._resolve().tolist()

    def numpy(self, *args, **kwargs):
        return self._resolve().numpy(*args, **kwargs)

    def data_ptr(self):
        return self._resolve().data_ptr()

    def untyped_storage(self):
        return self._resolve().untyped_storage()

    def __reduce_ex__(self, protocol):
        return self._resolve().__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        return copy.deepcopy(self._resolve(), memo)

    def __repr__(self, **kwargs):
        return repr(self._resolve())


def _real(x):
    """``x`` (an argument of an operation) with every ``PendingGrad`` in it replaced by its real
    tensor; lists and tuples are looked into one level down (the foreach ops' lists)."""
    kind = type(x)
    if kind is PendingGrad:
        return x._resolve()
    if kind is tuple or kind is list:
        if any(type(e) is PendingGrad or type(e) is list or type(e) is tuple for e in x):
            return kind(map(_real, x))
        return x
    if kind is dict:
        return {k: _real(v) for k, v in x.items()}
    return x


def is_pending(grad: Optional[torch.Tensor]) -> bool:
    """Whether ``grad`` is a gradient the fused step has not made (yet)."""
    return type(grad) is PendingGrad and grad._value is None


def resolve(grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``grad`` as a real tensor (making a pending one); None stays None."""
    return grad._resolve() if type(grad) is PendingGrad else grad


# torch's foreach utilities (clip_grad_norm_, clip_grad_value_) take the fused path only for
# lists of the types listed here and fall back to one call per tensor otherwise: list this one,
# whose operations reach __torch_dispatch__ with the whole list.
try:
    from torch.utils import _foreach_utils
    if PendingGrad not in _foreach_utils._foreach_supported_types:
        _foreach_utils._foreach_supported_types.append(PendingGrad)
except (ImportError, AttributeError):   # a torch without the list: the per-tensor fallback
    pass


# ---- the fused step's use of them (step_path.FusedStep), per device group of an optimizer -----

def pend(amp_opt, groups) -> None:
    """End of a ``scale_loss`` on the fused step: each O2 master whose half parameter has a
    gradient gets its ``PendingGrad`` (made once per group, reused every step), and what each
    master's ``.grad`` is now is recorded (one C++ loop on the native backend)."""
    for device, group in groups.items():
        if not group.half_masters:
            continue
        if group.pending_watch is None:
            group.pending = [PendingGrad(master, amp_opt) for master in group.half_masters]
            group.pending_watch = ops_for(device).pending_grads(
                group.half_models, group.half_masters, group.pending)
        _forget_values(group)
        group.pending_watch.pend()


def written(groups) -> bool:
    """Whether user code replaced, deleted or set to None a master's ``.grad`` since ``pend``."""
    return any(group.pending_watch is not None and group.pending_watch.changed() >= 0
               for group in groups.values())


def made(group, index: int, value: torch.Tensor) -> None:
    """Master ``index`` of ``group`` now holds ``value`` (a real gradient) in place of its
    pending one, which answers with it from now on."""
    pending = group.pending[index]
    pending._value = value
    group.half_masters[index].grad = value
    group.made.append(pending)


def zero(group, indices) -> None:
    """Masters ``indices`` of ``group`` read as zero gradients, made only where used
    (``zero_grad(set_to_none=False)`` on the fused step)."""
    if group.zeros is None:
        group.zeros = [PendingGrad(master) for master in group.half_masters]
    for i in indices:
        zeros = group.zeros[i]
        if zeros._value is not None:
            zeros._value = None
        group.half_masters[i].grad = zeros


def _forget_values(group) -> None:
    """The values the pending gradients of an earlier step were made into belong to that step."""
    for pending in group.made:
        pending._value = None
    group.made.clear()
