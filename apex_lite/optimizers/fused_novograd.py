"""NovoGrad as one fused op per device: ``FusedNovoGrad`` (apex's) and ``NovoGradUpdate``, the
per-device update it and amp's O2 step share.

``NovoGradUpdate(params, grad_sources=None, model_params=None)(state, inv_scale, found_inf,
hyper)`` (see ``apex_lite.optimizers.update`` for the arguments) computes apex's NovoGrad with
``hyper = NovoGradHyper(lr, beta1, beta2, eps, weight_decay, bias_correction, grad_averaging,
reg_inside_moment, norm_type, init_zero)``:

- per parameter (per layer), the norm ``n`` of its true gradient (``norm_type`` 2: L2; 0: the
  inf norm) is blended into its second moment ``v``, one fp32 value: ``sqrt(beta2 * v**2 +
  (1 - beta2) * n**2)`` (L2) or ``beta2 * v + (1 - beta2) * n`` (inf); on a parameter's first
  step ``v = n`` unless ``init_zero`` (then ``v`` starts at 0);
- ``denom = v / sqrt(1 - beta2**step) + eps`` (no correction without ``bias_correction``; apex
  corrects ``v`` even when it starts at the first norm, and so does this);
- ``reg_inside_moment=False`` (apex's default): ``m = beta1 * m + beta3 * g``, ``p -= lr *
  (m / (1 - beta1**step) / denom + weight_decay * p)``; ``True``: the gradient is normalised and
  decayed first, ``g = g / denom + weight_decay * p``, then ``m`` as before and ``p -= lr * m /
  (1 - beta1**step)``. ``beta3`` is ``1 - beta1`` with ``grad_averaging``, else 1.

State per parameter, fp32 whatever the parameter's dtype: ``exp_avg`` (shaped like it),
``exp_avg_sq`` (a 0-dim tensor: the blended norm, not its square, as apex keeps it) and ``step``
(a 0-dim tensor). apex kept ``exp_avg_sq`` and ``step`` per param group and dtype; here they
are per parameter, so parameters may join a group, or get their first gradient, at any step.
"""
from __future__ import annotations

from typing import List, NamedTuple, Tuple

import torch

from ..apex_compat.optimizer_attributes import ApexMode, ApexOp
from ._optimizer import FusedOptimizer
from .update import FusedUpdate, fp32_like, state_entry, step_tensor, zeros32
from .watched_state import watch_state

__all__ = ["FusedNovoGrad", "NovoGradHyper", "NovoGradUpdate"]

NORM_TYPES = (0, 2)


class NovoGradHyper(NamedTuple):
    """NovoGrad's hyper-parameters, in the order ``fused_novograd_`` takes them."""
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    bias_correction: bool
    grad_averaging: bool
    reg_inside_moment: bool
    norm_type: int
    init_zero: bool

    @classmethod
    def from_group(cls, group: dict) -> "NovoGradHyper":
        """From a param group of FusedNovoGrad."""
        beta1, beta2 = group["betas"]
        if group["norm_type"] not in NORM_TYPES:
            raise ValueError(f"FusedNovoGrad: a param group has norm_type="
                             f"{group['norm_type']!r}; NovoGrad's per-layer norms are 2 (L2) "
                             f"and 0 (the inf norm)")
        return cls(float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
                   float(group["weight_decay"]), bool(group["bias_correction"]),
                   bool(group["grad_averaging"]), bool(group["reg_inside_moment"]),
                   int(group["norm_type"]), bool(group["init_zero"]))


def _scalar_state(value, param: torch.Tensor, name: str, label: str) -> torch.Tensor:
    """A per-parameter scalar of the state (``exp_avg_sq``) as a 0-dim fp32 tensor on
    ``param``'s device."""
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        raise ValueError(f"{label}: state '{name}' of a parameter of shape {tuple(param.shape)} "
                         f"has shape {tuple(value.shape)}; NovoGrad keeps one value per "
                         f"parameter (its gradient norm): load a state_dict saved by "
                         f"FusedNovoGrad")
    return step_tensor(value, param)


def novograd_lists(update: FusedUpdate, params: List[torch.Tensor], state
                   ) -> Tuple[list, list, list]:
    """``(exp_avgs, exp_avg_sqs, steps)``, initialising missing entries (all three at once)."""
    exp_avgs, exp_avg_sqs, steps = [], [], []
    for p in params:
        s = state_entry(state, p)
        present = [name for name in ("exp_avg", "exp_avg_sq", "step") if name in s]
        if not present:
            s["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            s["exp_avg"] = zeros32(p)
            s["exp_avg_sq"] = torch.zeros((), dtype=torch.float32, device=p.device)
        elif len(present) != 3:
            raise ValueError(f"{update.label}: the state of a parameter of shape "
                             f"{tuple(p.shape)} holds {sorted(s)} but needs exp_avg, exp_avg_sq "
                             f"and step; load a state_dict saved by FusedNovoGrad")
        else:
            s["exp_avg"] = fp32_like(s["exp_avg"], p, "exp_avg", update.label)
            s["exp_avg_sq"] = _scalar_state(s["exp_avg_sq"], p, "exp_avg_sq", update.label)
            s["step"] = step_tensor(s["step"], p)
        exp_avgs.append(s["exp_avg"])
        exp_avg_sqs.append(s["exp_avg_sq"])
        steps.append(s["step"])
    return exp_avgs, exp_avg_sqs, steps


class NovoGradUpdate(FusedUpdate):
    """One ``fused_novograd_`` call for one param group on one device. The arguments (``params``,
    ``grad_sources``, ``model_params``, ``label``, ``ops``) are :class:`FusedUpdate`'s."""

    kind = "novograd"
    needs_whole_parameters = True   # the per-layer norm of each parameter's gradient
    whole_norm = "its gradient norm per layer"

    def _state_lists(self, params: List[torch.Tensor], state, hyper: NovoGradHyper) -> tuple:
        return novograd_lists(self, params, state)

    def _launch(self, ops, plan, state, grads, inv_scale, found_inf,
                hyper: NovoGradHyper) -> None:
        exp_avgs, exp_avg_sqs, steps = plan.lists
        ops.fused_novograd_(plan.params, grads, exp_avgs, exp_avg_sqs, plan.model_params, steps,
                            inv_scale, found_inf, *hyper)


class FusedNovoGrad(FusedOptimizer):
    r"""NovoGrad, apex's ``FusedNovoGrad``: one fused op per param group and device.

    Args:
        params: parameters or param groups (fp32, fp16 and bf16, mixed freely; apex took fp32
            and fp16).
        lr, betas, eps, weight_decay: as apex's (``betas`` average the gradient and its
            per-layer norm).
        bias_correction: divide the moments by ``1 - beta**step``.
        amsgrad: not supported (refused, as apex does).
        reg_inside_moment: normalise and decay the gradient before the first moment (the
            NovoGrad paper) instead of the update (apex's default, False).
        grad_averaging: ``exp_avg`` takes ``(1 - beta1) * g`` (True) or ``g`` (False).
        norm_type: 2 (the L2 norm) or 0 (the inf norm) of each parameter's gradient.
        init_zero: start the norm's average at 0 (True) or at the first step's norm (False).
        set_grad_none: what ``zero_grad()`` without arguments does: set gradients to None
            (True, apex's default) or zero them in place.

    State (``exp_avg``, ``exp_avg_sq``: the blended norm as a 0-dim tensor, ``step``) is fp32
    per parameter; the update is computed in fp32 and rounded once to the parameter's dtype.
    Under ``torch.amp.GradScaler`` the op unscales the gradients (the norms are of the true
    gradients) and skips on the scaler's ``found_inf`` itself (``_step_supports_amp_scaling``);
    under amp at O2 it takes the fused step.
    """

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0., amsgrad=False, reg_inside_moment=False, grad_averaging=True,
                 norm_type=2, init_zero=False, set_grad_none=True):
        if amsgrad:
            raise RuntimeError("FusedNovoGrad does not support the AMSGrad variant; use "
                               "FusedNovoGrad(amsgrad=False), or torch.optim.Adam(amsgrad=True) "
                               "if AMSGrad is what you need.")
        if norm_type not in NORM_TYPES:
            raise ValueError(f"FusedNovoGrad: norm_type={norm_type!r}; NovoGrad's per-layer "
                             f"norms are 2 (L2) and 0 (the inf norm)")
        self._check_adam_hyper(lr, betas, eps, weight_decay)
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging,
                        reg_inside_moment=reg_inside_moment, norm_type=norm_type,
                        init_zero=init_zero)
        super().__init__(params, defaults, set_grad_none)

    _update_class = NovoGradUpdate
    # apex's per-instance attributes: moment_mode is 0 with reg_inside_moment, else 1.
    multi_tensor_novograd = ApexOp("multi_tensor_novograd")
    moment_mode = ApexMode("reg_inside_moment", to_apex=lambda inside: 0 if inside else 1,
                           from_apex=lambda mode: mode == 0)

    def _hyper(self, group: dict) -> NovoGradHyper:
        return NovoGradHyper.from_group(group)

    def _fused_step(self, scalars) -> None:
        # Every group's hyper-parameters are read (and checked) before any group steps.
        updates = self._fused_updates()
        hypers = [self._hyper(group) for group, _ in updates]
        state = watch_state(self)
        for (_, update), hyper in zip(updates, hypers):
            inv_scale, found_inf = scalars(update.device)
            update(state, inv_scale, found_inf, hyper)
