"""SGD with momentum as one fused op per device: ``FusedSGD`` (apex's) and ``SGDUpdate``, the
per-device update it and amp's O2 step share.

``SGDUpdate(params, grad_sources=None, model_params=None)(state, inv_scale, found_inf, hyper)``
(see ``apex_lite.optimizers.update`` for the arguments) computes torch.optim.SGD's update with
``hyper = SGDHyper(lr, momentum, dampening, weight_decay, nesterov, wd_after_momentum)``; with
``wd_after_momentum`` (apex's option) the weight decay is added after the momentum instead of
before it. The momentum buffer is ``state[p]["momentum_buffer"]``, fp32 whatever the parameter's
dtype, created at a parameter's first step as torch creates it (set to that step's gradient);
there is none while ``momentum`` is 0.

A first step must leave nothing behind when ``found_inf`` is set. With ``dampening == 0`` a zeroed
buffer updated by ``momentum * 0 + g`` is exactly torch's first buffer, so new buffers are zeroed
and stepped with the others (one op call, nothing read on the host). With ``dampening != 0`` the
first update differs, so a step that creates buffers reads ``found_inf`` on the host once (a sync
on CUDA, at that step only) and creates them only when it is not set.
"""
from __future__ import annotations

from typing import List, NamedTuple

import torch
from torch.optim.optimizer import required

from ._optimizer import FusedOptimizer
from .update import FusedUpdate, _is_unit_found_inf, fp32_like, zeros32

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
    """One ``fused_sgd_`` call for one param group on one device."""

    kind = "sgd"

    def _flavour(self, hyper: SGDHyper) -> object:
        return hyper.momentum != 0.0

    def _state_lists(self, params: List[torch.Tensor], state, hyper: SGDHyper) -> tuple:
        """``(buffers, fresh)``: the momentum buffers (None where one is still to be created at
        a first step with dampening) and the indices of those."""
        if hyper.momentum == 0.0:
            return [], []
        buffers, fresh = [], []
        for i, p in enumerate(params):
            entry = state.get(p)
            buf = None if entry is None else entry.get("momentum_buffer")
            if buf is None:
                if hyper.dampening != 0.0:
                    fresh.append(i)
                    buffers.append(None)
                    continue
                buf = zeros32(p)
            else:
                buf = fp32_like(buf, p, "momentum_buffer", self.label)
            if entry is None:
                entry = state[p] = {}
            entry["momentum_buffer"] = buf
            buffers.append(buf)
        return buffers, fresh

    def _launch(self, ops, plan, state, grads, inv_scale, found_inf, hyper: SGDHyper) -> None:
        buffers, fresh = plan.lists
        if not fresh:
            ops.fused_sgd_(plan.params, grads, buffers, plan.model_params, inv_scale, found_inf,
                           *hyper, False)
            return
        self._first_run(ops, plan, state, grads, inv_scale, found_inf, hyper)

    def _first_run(self, ops, plan, state, grads, inv_scale, found_inf, hyper: SGDHyper) -> None:
        """A step that creates momentum buffers with ``dampening != 0``: the new buffers take the
        gradient (torch's first step), the others the usual update."""
        self.invalidate()    # the next step sees the buffers made here
        if not _is_unit_found_inf(found_inf, self.device) and float(found_inf) != 0.0:
            return           # a skipped step creates no state
        buffers, fresh = plan.lists
        for i in fresh:
            p = plan.params[i]
            buffers[i] = state.setdefault(p, {})["momentum_buffer"] = zeros32(p)
        new = set(fresh)
        old = [i for i in range(len(plan.params)) if i not in new]
        for indices, first_run in ((fresh, True), (old, False)):
            if not indices:
                continue
            pick = lambda tensors: [tensors[i] for i in indices]  # noqa: E731
            models = pick(plan.model_params) if plan.model_params else []
            ops.fused_sgd_(pick(plan.params), pick(grads), pick(buffers), models, inv_scale,
                           found_inf, *hyper, first_run)


class FusedSGD(FusedOptimizer):
    r"""SGD with momentum, apex's ``FusedSGD``: torch.optim.SGD's update in one fused op per
    param group and device.

    Args:
        params: parameters or param groups (fp32, fp16 and bf16, mixed freely).
        lr: learning rate (required: each group may give its own instead).
        momentum, dampening, weight_decay, nesterov: as torch.optim.SGD.
        wd_after_momentum: add the weight decay after the momentum instead of before (apex).
        materialize_master_grads: read by amp under O2, as apex's amp reads it (whether fp32
            master gradients are materialised); no effect without amp.
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
    _kept_attributes = FusedOptimizer._kept_attributes + ("materialize_master_grads",)

    def _hyper(self, group: dict) -> SGDHyper:
        return SGDHyper.from_group(group)
