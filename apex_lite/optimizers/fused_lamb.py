"""LAMB as one fused op per device: ``FusedLAMB`` (apex's), ``LambUpdate``, the per-device
update it and amp's O2 step share, and ``global_grad_norm``, the norm LAMB clips by.

``LambUpdate(params, grad_sources=None, model_params=None)(state, inv_scale, found_inf, hyper,
grad_norm)`` (see ``apex_lite.optimizers.update`` for the arguments) computes apex's LAMB with
``hyper = LambHyper(lr, beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction,
grad_averaging, max_grad_norm, use_nvlamb)``:

- the gradients are divided by ``grad_norm / max_grad_norm`` when ``grad_norm`` (the norm of all
  the optimizer's true gradients, every group and device: ``global_grad_norm``) exceeds
  ``max_grad_norm`` > 0;
- Adam's direction from the moments, with the weight decay added to the gradient
  (``adam_w_mode=False``) or to the direction (``True``);
- per tensor the trust ratio ``||p|| / ||direction||`` (fp32 norms; 1 when either is 0) scales
  the learning rate, for groups with ``weight_decay != 0`` or with ``use_nvlamb``.

State as Adam's (``exp_avg``, ``exp_avg_sq``, ``step`` per parameter, fp32 whatever the
parameter's dtype).
"""
from __future__ import annotations

import itertools
import operator
from typing import Dict, Iterable, List, NamedTuple, Optional, Tuple

import torch

from ..apex_compat.optimizer_attributes import ApexMode, ApexOp
from ..multi_tensor._backend import ops_for
from ._optimizer import FusedOptimizer, Scalars
from .fused_adam import AdamHyper
from .update import FusedUpdate, moment_lists
from .watched_state import watch_state

__all__ = ["FusedLAMB", "LambHyper", "LambUpdate", "global_grad_norm"]


_LambFields = NamedTuple("_LambFields", [
    *AdamHyper.__annotations__.items(),
    ("grad_averaging", bool), ("max_grad_norm", float), ("use_nvlamb", bool)])


class LambHyper(_LambFields):
    """LAMB's hyper-parameters, in the order ``fused_lamb_`` takes them (after grad_norm):
    Adam's, then ``grad_averaging``, ``max_grad_norm``, ``use_nvlamb``."""
    __slots__ = ()

    @classmethod
    def from_group(cls, group: dict) -> "LambHyper":
        """From a param group of FusedLAMB."""
        return cls(*AdamHyper.from_group(group), bool(group["grad_averaging"]),
                   float(group["max_grad_norm"]), bool(group["use_nvlamb"]))


class LambUpdate(FusedUpdate):
    """One ``fused_lamb_`` call for one param group on one device. The arguments (``params``,
    ``grad_sources``, ``model_params``, ``label``, ``ops``) are :class:`FusedUpdate`'s."""

    kind = "lamb"
    needs_whole_parameters = True   # the trust ratio: ||param|| / ||update|| per parameter
    whole_norm = "the trust ratio"

    @torch.no_grad()
    def __call__(self, state: Dict[torch.Tensor, dict], inv_scale: torch.Tensor,
                 found_inf: torch.Tensor, hyper: LambHyper, grad_norm: torch.Tensor, *,
                 grads: Optional[List[Optional[torch.Tensor]]] = None) -> None:
        self._run(state, inv_scale, found_inf, hyper, grads, (grad_norm,))

    def _state_lists(self, params: List[torch.Tensor], state, hyper: LambHyper) -> tuple:
        return moment_lists(self, params, state)

    def _launch(self, ops, plan, state, grads, inv_scale, found_inf, hyper: LambHyper,
                grad_norm: torch.Tensor) -> None:
        exp_avgs, exp_avg_sqs, steps = plan.lists
        ops.fused_lamb_(plan.params, grads, exp_avgs, exp_avg_sqs, plan.model_params, steps,
                        inv_scale, found_inf, grad_norm, *hyper)


_has_grad = operator.is_not


def global_grad_norm(device_grads: Iterable[Tuple[torch.device, List[Optional[torch.Tensor]]]],
                     scalars: Scalars) -> Dict[torch.device, torch.Tensor]:
    """The L2 norm of all true gradients, as an fp32 [1] tensor on each device that has any.

    ``device_grads`` holds ``(device, gradients)`` pairs (None entries are skipped), such as
    each update's ``(update.device, update.read_grads())``; a gradient times
    ``scalars(device)[0]`` (the inverse loss scale) is the true one. Each device's norm is one
    multi-tensor op accumulated in fp32; the devices' norms are combined on the first device and
    copied to the others, without a host read."""
    per_device: Dict[torch.device, List[torch.Tensor]] = {}
    for device, grads in device_grads:
        present = itertools.compress(grads, map(_has_grad, grads, itertools.repeat(None)))
        per_device.setdefault(device, []).extend(present)
    norms = {}
    for device, grads in per_device.items():
        if grads:
            total, _ = ops_for(device).l2norm(grads, False)
            norms[device] = total.reshape(1) * scalars(device)[0]
    if len(norms) <= 1:
        return norms
    first = next(iter(norms))
    squares = torch.cat([norm.to(first) for norm in norms.values()]).square()
    combined = squares.sum().sqrt().reshape(1)
    return {device: combined.to(device) for device in norms}


def grads_and_global_norm(updates: List[Tuple[dict, FusedUpdate]], scalars: Scalars
                          ) -> Tuple[List[List[Optional[torch.Tensor]]],
                                     Dict[torch.device, torch.Tensor]]:
    """Each update's gradients (``read_grads``) and ``global_grad_norm`` over them, for the
    LAMB optimizers' own step; a gradient the norm's op refuses is named by the update that
    holds it (``check_grads``)."""
    grads = [update.read_grads() for _, update in updates]
    try:
        norms = global_grad_norm(zip([update.device for _, update in updates], grads), scalars)
    except (RuntimeError, TypeError, ValueError) as exc:
        for (_, update), update_grads in zip(updates, grads):
            update.check_grads(update_grads, cause=exc)
        raise
    return grads, norms


class FusedLAMB(FusedOptimizer):
    r"""LAMB, apex's ``FusedLAMB``: one fused op per param group and device, after one global
    gradient norm.

    Args:
        params: parameters or param groups (fp32, fp16 and bf16, mixed freely; apex refused
            bf16).
        lr, betas, eps, weight_decay: as Adam's (``eps`` 1e-6, ``weight_decay`` 0.01 by
            default, as apex).
        bias_correction: divide the moments by ``1 - beta**step``.
        amsgrad: not supported (refused, as apex did).
        adam_w_mode: weight decay added to the Adam direction (True) or to the gradient (False).
        grad_averaging: ``exp_avg`` takes ``(1 - beta1) * g`` (True) or ``g`` (False).
        set_grad_none: what ``zero_grad()`` without arguments does: set gradients to None
            (True, apex's default) or zero them in place.
        max_grad_norm: the gradients are scaled by ``max_grad_norm / norm`` when the global norm
            of all gradients (every group, every dtype, accumulated in fp32) exceeds it; 0
            turns clipping off. Read from each group at every step (apex read only the
            constructor's value).
        use_nvlamb: apply the trust ratio to groups with ``weight_decay == 0`` too.

    State (``exp_avg``, ``exp_avg_sq``, ``step`` per parameter) is fp32 for every parameter
    dtype; the update is computed in fp32 and rounded once to the parameter's dtype. Under
    ``torch.amp.GradScaler`` the op unscales the gradients (and the norm) and skips on the
    scaler's ``found_inf`` itself (``_step_supports_amp_scaling``).
    """

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6,
                 weight_decay=0.01, amsgrad=False, adam_w_mode=True, grad_averaging=True,
                 set_grad_none=True, max_grad_norm=1.0, use_nvlamb=False):
        if amsgrad:
            raise RuntimeError("FusedLAMB does not support the AMSGrad variant; use "
                               "FusedLAMB(amsgrad=False), or torch.optim.Adam(amsgrad=True) "
                               "if AMSGrad is what you need.")
        self._check_adam_hyper(lr, betas, eps, weight_decay)
        self._check_number("max_grad_norm", max_grad_norm)
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging,
                        max_grad_norm=max_grad_norm, adam_w_mode=adam_w_mode,
                        use_nvlamb=use_nvlamb)
        super().__init__(params, defaults, set_grad_none)

    _update_class = LambUpdate
    # apex's per-instance attributes.
    multi_tensor_lamb = ApexOp("multi_tensor_lamb")
    multi_tensor_l2norm = ApexOp("multi_tensor_l2norm")
    adam_w_mode = ApexMode("adam_w_mode")
    use_nvlamb = ApexMode("use_nvlamb", to_apex=bool, values=(False, True))

    def _hyper(self, group: dict) -> LambHyper:
        return LambHyper.from_group(group)

    def _fused_step(self, scalars: Scalars) -> None:
        updates = self._fused_updates()
        grads, norms = grads_and_global_norm(updates, scalars)
        state = watch_state(self)
        for (group, update), update_grads in zip(updates, grads):
            norm = norms.get(update.device)
            if norm is None:
                continue     # no gradient on that device
            inv_scale, found_inf = scalars(update.device)
            update(state, inv_scale, found_inf, self._hyper(group), norm, grads=update_grads)
