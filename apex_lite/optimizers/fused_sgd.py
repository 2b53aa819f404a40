"""SGD with momentum as one fused op per device: ``FusedSGD`` (apex's) and ``SGDUpdate``, the
per-device update it and amp's O2 step share.

``SGDUpdate(params, grad_sources=None, model_params=None)(state, inv_scale, found_inf, hyper)``
(see ``apex_lite.optimizers.update`` for the arguments) computes torch.optim.SGD's update with
``hyper = SGDHyper(lr, momentum, dampening, weight_decay, nesterov, wd_after_momentum)``; with
``wd_after_momentum`` (apex's option) the weight decay is added after the momentum instead of
before it. The momentum buffer is ``state[p]["momentum_buffer"]``, fp32 whatever the parameter's
dtype, created at a parameter's first step as torch creates it (set to that step's gradient);
there is none while ``momentum`` is 0.

A skipped step must leave nothing behind, and whether a step is skipped (``found_inf``) may be
known only on the device. New buffers are created zero before the op runs. With
``dampening == 0`` a zero buffer updated by ``momentum * 0 + g`` is exactly torch's first buffer,
so they are stepped with the others: one op call, nothing read on the host, and a skipped first
step leaves zeros that the next step fills the same way. With ``dampening != 0`` the first update
(``buf = g``) differs from the later ones, so new buffers take a ``first_run`` call of their own;
the step's ``found_inf`` is kept (a device copy) and read on the host at those parameters' next
step, when it is long computed: if that first step was skipped, the next is a first step again.
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional

import torch
from torch.optim.optimizer import required

from ..apex_compat.optimizer_attributes import ApexMode, ApexOp
from ..multi_tensor import _torch_fused
from ._optimizer import FusedOptimizer
from .update import FusedUpdate, is_unit_found_inf, fp32_like, state_entry, zeros32

__all__ = ["FusedSGD", "SGDHyper", "SGDUpdate"]


class SGDHyper(NamedTuple):
    """SGD's hyper-parameters, in the order ``fused_sgd_`` takes them."""
    lr: float
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool
    wd_after_momentum: bool

    @classmethod
    def from_group(cls, group: dict) -> "SGDHyper":
        """From a param group of FusedSGD or torch.optim.SGD."""
        return cls(float(group["lr"]), float(group["momentum"]), float(group["dampening"]),
                   float(group["weight_decay"]), bool(group["nesterov"]),
                   bool(group.get("wd_after_momentum", False)))


class SGDUpdate(FusedUpdate):
    """One ``fused_sgd_`` call for one param group on one device (two while new momentum
    buffers with dampening take their first step)."""

    kind = "sgd"
    held_step = "fused_sgd_"
    torch_kernels = True

    @classmethod
    def torch_kernels_reason(cls, hyper: SGDHyper) -> str:
        """Why torch's fused kernels cannot compute this update for the hyper-parameters
        ``hyper``; "" (or None) when they can."""
        if not _torch_fused.serves_sgd(hyper.weight_decay, hyper.wd_after_momentum):
            return ("wd_after_momentum=True, and torch's SGD kernel adds the weight decay "
                    "before the momentum")
        return ""

    def __init__(self, *args, **kwargs):
        # id(param) -> a copy of the found_inf of the step that gave its buffer its first
        # (dampened) update, until read: if that step was skipped, the buffer is still zero.
        self._first_step_flags: Dict[int, torch.Tensor] = {}
        super().__init__(*args, **kwargs)

    def _new_state(self) -> None:
        self._first_step_flags.clear()

    def _flavour(self, hyper: SGDHyper) -> object:
        return hyper.momentum != 0.0

    def _state_lists(self, params: List[torch.Tensor], state, hyper: SGDHyper) -> tuple:
        """``(buffers, created)``: the momentum buffers (fp32, new ones zero) and the indices of
        those this build created."""
        if hyper.momentum == 0.0:
            return [], []
        buffers, created = [], []
        for i, p in enumerate(params):
            entry = state_entry(state, p)
            buf = entry.get("momentum_buffer")
            if buf is None:
                buf = zeros32(p)
                created.append(i)
            else:
                buf = fp32_like(buf, p, "momentum_buffer", self.label)
            entry["momentum_buffer"] = buf
            buffers.append(buf)
        return buffers, created

    def _launch(self, ops, plan, state, grads, inv_scale, found_inf, hyper: SGDHyper) -> None:
        buffers, created = plan.lists
        first = []
        if hyper.dampening != 0.0 and (created or self._first_step_flags):
            first = self._first_steps(plan.params, created)
        created.clear()      # stepped now: not new at the next call of this plan
        if not first:
            ops.fused_sgd_(plan.params, grads, buffers, plan.model_params, inv_scale, found_inf,
                           *hyper, False)
            return
        if not is_unit_found_inf(found_inf, self.device):
            flag = found_inf.clone()
            for i in first:
                self._first_step_flags[id(plan.params[i])] = flag
        chosen = set(first)
        rest = [i for i in range(len(plan.params)) if i not in chosen]
        for indices, first_run in ((first, True), (rest, False)):
            if indices:
                ops.fused_sgd_(*(_pick(tensors, indices) for tensors in (
                    plan.params, grads, buffers, plan.model_params)),
                    inv_scale, found_inf, *hyper, first_run)

    def _held_state(self, plan) -> list:
        return [plan.lists[0]]

    def _held_args(self, plan, hyper: SGDHyper, extra: tuple) -> Optional[tuple]:
        # A dampened buffer's first update (a new buffer, or one whose first step may have been
        # skipped) splits the call in _launch: the list path does that.
        if hyper.dampening != 0.0 and (plan.lists[1] or self._first_step_flags):
            return None
        return (*hyper, False)

    def _first_steps(self, params: List[torch.Tensor], created: List[int]) -> List[int]:
        """Indices of the parameters whose buffer takes its first update now: those created by
        this build, and those whose earlier first step turns out skipped (a host read of each
        kept flag, one step late: once per step that made first updates, not per parameter)."""
        first = set(created)
        skipped: Dict[int, bool] = {}
        if self._first_step_flags:
            for i, p in enumerate(params):
                flag = self._first_step_flags.pop(id(p), None)
                if flag is None:
                    continue
                if id(flag) not in skipped:
                    skipped[id(flag)] = float(flag) != 0.0
                if skipped[id(flag)]:
                    first.add(i)
        return sorted(first)


def _pick(tensors: List[torch.Tensor], indices: List[int]) -> List[torch.Tensor]:
    return [tensors[i] for i in indices] if tensors else []


class FusedSGD(FusedOptimizer):
    r"""SGD with momentum, apex's ``FusedSGD``: torch.optim.SGD's update in one fused op per
    param group and device.

    Args:
        params: parameters or param groups (fp32, fp16 and bf16, mixed freely).
        lr: learning rate (required: each group may give its own instead).
        momentum, dampening, weight_decay, nesterov: as torch.optim.SGD.
        wd_after_momentum: add the weight decay after the momentum instead of before (apex).
        materialize_master_grads: accepted for apex's signature; changes nothing. (apex's O2
            kept fp32 master gradients unless it was False; apex_lite's fused O2 step never
            keeps them, and ``amp.master_params`` makes them on request, to clip.)
        set_grad_none: what ``zero_grad()`` without arguments does: set gradients to None
            (True) or zero them in place (False, apex's default for FusedSGD).

    The momentum buffer (``state[p]["momentum_buffer"]``) is fp32 for every parameter dtype:
    a half buffer would round the running sum at every step. The update is computed in fp32 and
    rounded once to the parameter's dtype. ``state_dict()`` loads into torch.optim.SGD and back.
    Under ``torch.amp.GradScaler`` the op unscales the gradients and skips on the scaler's
    ``found_inf`` itself (``_step_supports_amp_scaling``), for half parameters too.
    """

    def __init__(self, params, lr=required, momentum=0., dampening=0., weight_decay=0.,
                 nesterov=False, wd_after_momentum=False, materialize_master_grads=True,
                 set_grad_none=False):
        if lr is not required:
            self._check_number("lr", lr)
        self._check_number("momentum", momentum)
        self._check_number("weight_decay", weight_decay)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov,
                        wd_after_momentum=wd_after_momentum)
        self.materialize_master_grads = materialize_master_grads
        super().__init__(params, defaults, set_grad_none)

    _update_class = SGDUpdate
    # apex's per-instance attributes.
    multi_tensor_sgd = ApexOp("multi_tensor_sgd")
    wd_after_momentum = ApexMode("wd_after_momentum", to_apex=bool, values=(False, True))
    _kept_attributes = FusedOptimizer._kept_attributes + ("materialize_master_grads",)

    def _hyper(self, group: dict) -> SGDHyper:
        return SGDHyper.from_group(group)
