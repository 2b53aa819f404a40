"""Adagrad as one fused op per device: ``FusedAdagrad`` (apex's) and ``AdagradUpdate``, the
per-device update it and amp's O2 step share.

``AdagradUpdate(params, grad_sources=None, model_params=None)(state, inv_scale, found_inf,
hyper)`` (see ``apex_lite.optimizers.update`` for the arguments) computes apex's Adagrad with
``hyper = AdagradHyper(lr, eps, weight_decay, adagrad_w_mode)``: ``sum += g * g`` and
``p -= lr * g / (sqrt(sum) + eps)``, the weight decay added to the gradient
(``adagrad_w_mode=False``, torch.optim.Adagrad's L2 penalty) or to the update (``True``,
decoupled as AdamW's). State per parameter in torch.optim.Adagrad's layout, fp32 whatever the
parameter's dtype: ``sum`` and ``step`` (a 0-dim tensor that the op increments; apex kept no
count, torch does).
"""
from __future__ import annotations

from typing import List, NamedTuple, Tuple

import torch

from ..apex_compat.optimizer_attributes import ApexMode, ApexOp
from ..multi_tensor import _torch_fused
from ._optimizer import FusedOptimizer
from .update import FusedUpdate, fp32_like, state_entry, step_tensor

__all__ = ["FusedAdagrad", "AdagradHyper", "AdagradUpdate"]


class AdagradHyper(NamedTuple):
    """Adagrad's hyper-parameters, the first four in the order ``fused_adagrad_`` takes them;
    ``initial_accumulator_value`` fills a new ``sum``."""
    lr: float
    eps: float
    weight_decay: float
    adagrad_w_mode: bool
    initial_accumulator_value: float = 0.0

    @classmethod
    def from_group(cls, group: dict) -> "AdagradHyper":
        """From a param group of FusedAdagrad."""
        return cls(float(group["lr"]), float(group["eps"]), float(group["weight_decay"]),
                   bool(group["adagrad_w_mode"]),
                   float(group.get("initial_accumulator_value", 0.0)))


def adagrad_lists(update: FusedUpdate, params: List[torch.Tensor], state, initial: float
                  ) -> Tuple[list, list]:
    """``(sums, steps)``, initialising missing entries (``sum`` filled with ``initial``). A
    state without ``step`` (apex's FusedAdagrad kept none) counts from 0."""
    sums, steps = [], []
    for p in params:
        s = state_entry(state, p)
        if "sum" not in s:
            if "step" in s:
                raise ValueError(f"{update.label}: the state of a parameter of shape "
                                 f"{tuple(p.shape)} holds {sorted(s)} but needs sum and step; "
                                 f"load a state_dict saved by Adagrad")
            s["sum"] = torch.full_like(p, initial, dtype=torch.float32,
                                       memory_format=torch.preserve_format)
            s["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        else:
            s["sum"] = fp32_like(s["sum"], p, "sum", update.label)
            s["step"] = step_tensor(s.get("step", 0.0), p)
        sums.append(s["sum"])
        steps.append(s["step"])
    return sums, steps


class AdagradUpdate(FusedUpdate):
    """One ``fused_adagrad_`` call for one param group on one device. The arguments (``params``,
    ``grad_sources``, ``model_params``, ``label``, ``ops``) are :class:`FusedUpdate`'s."""

    kind = "adagrad"
    torch_kernels = True

    @classmethod
    def torch_kernels_reason(cls, hyper: AdagradHyper) -> str:
        """Why torch's fused kernels cannot compute this update for the hyper-parameters
        ``hyper``; "" (or None) when they can."""
        if not _torch_fused.serves_adagrad(hyper.weight_decay, hyper.adagrad_w_mode):
            return ("adagrad_w_mode=True, and torch's Adagrad kernel adds the weight decay to "
                    "the gradient")
        return ""

    def _state_lists(self, params: List[torch.Tensor], state, hyper: AdagradHyper) -> tuple:
        return adagrad_lists(self, params, state, hyper.initial_accumulator_value)

    def _launch(self, ops, plan, state, grads, inv_scale, found_inf,
                hyper: AdagradHyper) -> None:
        sums, steps = plan.lists
        ops.fused_adagrad_(plan.params, grads, sums, plan.model_params, steps, inv_scale,
                           found_inf, *hyper[:4])


class FusedAdagrad(FusedOptimizer):
    r"""Adagrad, apex's ``FusedAdagrad``: one fused op per param group and device.

    With ``adagrad_w_mode=False`` (the default) it computes torch.optim.Adagrad's update
    (``weight_decay`` an L2 penalty added to the gradient; ``lr_decay`` 0); with ``True`` the
    weight decay is decoupled (added to the update, as AdamW's).

    Args:
        params: parameters or param groups (fp32, fp16 and bf16, mixed freely; apex took fp32
            and fp16).
        lr, eps, weight_decay: as torch.optim.Adagrad (apex's defaults: 1e-2, 1e-10, 0).
        set_grad_none: what ``zero_grad()`` without arguments does: set gradients to None
            (True, apex's default) or zero them in place.
        adagrad_w_mode: decoupled weight decay instead of L2.
        initial_accumulator_value: the starting value of ``sum`` (torch's; apex starts at 0).
        lr_decay: torch's; only 0 is computed (refused otherwise: use torch.optim.Adagrad).

    State (``sum``, ``step``) is fp32 per parameter, in torch.optim.Adagrad's layout:
    ``state_dict()`` loads into torch.optim.Adagrad and back. The update is computed in fp32 and
    rounded once to the parameter's dtype. Under ``torch.amp.GradScaler`` the op unscales the
    gradients and skips on the scaler's ``found_inf`` itself (``_step_supports_amp_scaling``);
    under amp at O2 it takes the fused step.
    """

    def __init__(self, params, lr=1e-2, eps=1e-10, weight_decay=0., set_grad_none=True,
                 adagrad_w_mode=False, *, initial_accumulator_value=0.0, lr_decay=0.0):
        self._check_number("lr", lr)
        self._check_number("eps", eps)
        self._check_number("weight_decay", weight_decay)
        self._check_number("initial_accumulator_value", initial_accumulator_value)
        self._check_lr_decay(lr_decay, "FusedAdagrad(lr_decay=...)")
        defaults = dict(lr=lr, eps=eps, weight_decay=weight_decay, adagrad_w_mode=adagrad_w_mode,
                        lr_decay=0.0, initial_accumulator_value=initial_accumulator_value)
        super().__init__(params, defaults, set_grad_none)

    _update_class = AdagradUpdate
    # apex's per-instance attributes.
    multi_tensor_adagrad = ApexOp("multi_tensor_adagrad")
    adagrad_w_mode = ApexMode("adagrad_w_mode")

    @staticmethod
    def _check_lr_decay(lr_decay, where: str) -> None:
        if lr_decay != 0:
            raise ValueError(f"{where}: lr_decay={lr_decay!r}; FusedAdagrad computes apex's "
                             f"Adagrad, whose learning rate does not decay (lr_decay=0). Use "
                             f"torch.optim.Adagrad(lr_decay=...), or an LR scheduler.")

    def _hyper(self, group: dict) -> AdagradHyper:
        return AdagradHyper.from_group(group)

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads ``state_dict``, a state dict of this optimizer or of torch.optim.Adagrad
        (``lr_decay`` 0; another raises ValueError)."""
        for index, group in enumerate(state_dict.get("param_groups", ())):
            self._check_lr_decay(group.get("lr_decay", 0.0),
                                 f"FusedAdagrad: the state dict's param group {index}")
        super().load_state_dict(state_dict)
