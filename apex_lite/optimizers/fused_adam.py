"""Adam and AdamW as one fused op per device: ``FusedAdam`` (apex's) and ``AdamUpdate``, the
per-device update it and amp's O2 step share.

``AdamUpdate(params, grad_sources=None, model_params=None)(state, inv_scale, found_inf, hyper)``
(see ``apex_lite.optimizers.update`` for the arguments) computes torch.optim.Adam's update
(``adam_w_mode=False``: L2 weight decay added to the gradient) or AdamW's (``adam_w_mode=True``:
decoupled weight decay), with ``hyper = AdamHyper(lr, beta1, beta2, eps, weight_decay,
adam_w_mode, bias_correction)``. State per parameter, torch's layout, fp32 whatever the
parameter's dtype (an fp16 ``exp_avg_sq`` underflows): ``exp_avg``, ``exp_avg_sq`` and ``step``,
a 0-dim fp32 tensor on the parameter's device (as torch's fused Adam keeps it) that the op
increments.
"""
from __future__ import annotations

from typing import List, NamedTuple

import torch

from ..apex_compat.optimizer_attributes import ApexMode, ApexOp
from ..multi_tensor import _torch_fused
from ._optimizer import FusedOptimizer
from .update import FusedUpdate, moment_lists

__all__ = ["FusedAdam", "AdamHyper", "AdamUpdate"]


class AdamHyper(NamedTuple):
    """Adam's hyper-parameters, in the order ``fused_adam_`` takes them."""
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adam_w_mode: bool
    bias_correction: bool

    @classmethod
    def from_group(cls, group: dict) -> "AdamHyper":
        """From a param group of FusedAdam (``adam_w_mode``, ``bias_correction``) or of
        torch.optim.Adam / AdamW (``decoupled_weight_decay``; bias correction always on)."""
        beta1, beta2 = group["betas"]
        adam_w_mode = group["adam_w_mode"] if "adam_w_mode" in group \
            else group.get("decoupled_weight_decay", False)
        return cls(float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                   float(group["weight_decay"]), bool(adam_w_mode),
                   bool(group.get("bias_correction", True)))


class AdamUpdate(FusedUpdate):
    """One ``fused_adam_`` call for one param group on one device. The arguments (``params``,
    ``grad_sources``, ``model_params``, ``label``, ``ops``) are :class:`FusedUpdate`'s."""

    kind = "adam"
    held_step = "fused_adam_"
    torch_kernels = True

    @classmethod
    def torch_kernels_reason(cls, hyper: AdamHyper) -> str:
        """Why torch's fused kernels cannot compute this update for the hyper-parameters
        ``hyper``; "" (or None) when they can."""
        if not _torch_fused.serves_adam(hyper.bias_correction):
            return "bias_correction=False, and torch's Adam kernels always correct the bias"
        return ""

    def _state_lists(self, params: List[torch.Tensor], state, hyper: AdamHyper) -> tuple:
        return moment_lists(self, params, state)

    def _launch(self, ops, plan, state, grads, inv_scale, found_inf, hyper: AdamHyper) -> None:
        exp_avgs, exp_avg_sqs, steps = plan.lists
        ops.fused_adam_(plan.params, grads, exp_avgs, exp_avg_sqs, plan.model_params, steps,
                        inv_scale, found_inf, *hyper)


class FusedAdam(FusedOptimizer):
    r"""Adam and AdamW, apex's ``FusedAdam``: one fused op per param group and device.

    With ``adam_w_mode=True`` (the default) it matches torch.optim.AdamW, with ``False``
    torch.optim.Adam (``weight_decay`` then is an L2 penalty added to the gradient).

    Args:
        params: parameters or param groups (fp32, fp16 and bf16, mixed freely).
        lr, betas, eps, weight_decay: as torch.optim.Adam.
        bias_correction: divide the moments by ``1 - beta**step`` (torch always does).
        adam_w_mode: decoupled weight decay (AdamW) instead of L2 (Adam).
        amsgrad: not supported (refused, as apex did): use torch.optim.Adam(amsgrad=True).
        set_grad_none: what ``zero_grad()`` without arguments does: set gradients to None
            (True, apex's default) or zero them in place.
        capturable, master_weights: apex's options for CUDA graphs and fp32 copies of half
            parameters; accepted when False, refused when True with the alternative.

    State (``exp_avg``, ``exp_avg_sq``, ``step``) is fp32 for every parameter dtype; the update
    is computed in fp32 and rounded once to the parameter's dtype. ``state_dict()`` loads into
    torch.optim.Adam / AdamW and back. Under ``torch.amp.GradScaler`` the op unscales the
    gradients and skips on the scaler's ``found_inf`` itself (``_step_supports_amp_scaling``),
    for half parameters too.
    """

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 adam_w_mode=True, weight_decay=0., amsgrad=False, set_grad_none=True, *,
                 capturable=False, master_weights=False):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant; use "
                               "torch.optim.Adam(..., amsgrad=True) (or AdamW) instead.")
        if capturable:
            raise RuntimeError("FusedAdam(capturable=True) (CUDA graph capture) is not "
                               "supported by apex_lite; use torch.optim.AdamW(..., fused=True, "
                               "capturable=True) for a step inside a CUDA graph.")
        if master_weights:
            raise RuntimeError("FusedAdam(master_weights=True) is not supported by apex_lite: "
                               "for fp32 master weights of a half model use "
                               "amp.initialize(model, optimizer, opt_level='O2') with this "
                               "optimizer (the fused step updates the masters and writes the "
                               "half parameters in one pass), or keep the parameters fp32.")
        self._check_adam_hyper(lr, betas, eps, weight_decay)
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, adam_w_mode=adam_w_mode)
        super().__init__(params, defaults, set_grad_none)

    _update_class = AdamUpdate
    # apex's per-instance attributes (fairseq's FusedAdamV2 steps through them).
    multi_tensor_adam = ApexOp("multi_tensor_adam")
    adam_w_mode = ApexMode("adam_w_mode")

    def _hyper(self, group: dict) -> AdamHyper:
        return AdamHyper.from_group(group)
