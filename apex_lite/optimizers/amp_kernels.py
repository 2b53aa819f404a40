"""The fused update amp's O2 step runs through, for the optimizers whose update a kernel computes.

``update_for(optimizer)`` returns ``(update, "")`` for ``torch.optim.SGD``, ``Adam`` and ``AdamW``
with the options the kernels compute, or ``(None, why)``. ``update(group, params, grads,
model_params, state, inv_scale, found_inf)`` runs one kernel call over tensors on one device:
``params`` the fp32 masters, ``grads`` the gradients to apply times ``1/inv_scale``,
``model_params`` the half parameters to write (or []), ``state`` the optimizer's state dict (its
entries are created in torch's layout on first use), the hyper-parameters read from ``group`` at
every call (LR schedulers keep working).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..multi_tensor._backend import ops_for

Update = Callable[..., None]

_UNSUPPORTED = ("maximize", "differentiable", "capturable", "amsgrad")


def _unsupported_options(group: dict) -> List[str]:
    bad = [name for name in _UNSUPPORTED if group.get(name)]
    if isinstance(group.get("lr"), torch.Tensor):
        bad.append("lr as a tensor")
    if any(isinstance(beta, torch.Tensor) for beta in group.get("betas", ())):
        bad.append("betas as tensors")
    return bad


class SGDUpdate:
    """torch.optim.SGD's update (momentum buffers in fp32). torch's first step sets a buffer to
    the gradient (``first_run``), later ones to ``momentum * buf + (1 - dampening) * grad``.
    Buffers are created before a step whose skip only the device may know; when that step is
    skipped they stay zero and the next step must again be a first one. With dampening 0 both
    formulas give the gradient bit for bit; otherwise the skip flag of the buffers' first step
    is read once, at their next step (one host read, once per parameter set)."""

    def __init__(self):
        # id(param) -> the found_inf flag of the step that created its buffer, until known.
        self._first_step_flag: Dict[int, torch.Tensor] = {}

    def __call__(self, group: dict, params: List[torch.Tensor], grads: List[torch.Tensor],
                 model_params: List[torch.Tensor], state: Dict, inv_scale: torch.Tensor,
                 found_inf: torch.Tensor) -> None:
        ops = ops_for(params[0].device)
        momentum = float(group["momentum"])
        dampening = float(group["dampening"])
        hyper = (float(group["lr"]), momentum, dampening, float(group["weight_decay"]),
                 bool(group["nesterov"]), False)
        if momentum == 0.0:
            ops.fused_sgd_(params, grads, [], model_params, inv_scale, found_inf, *hyper, False)
            return
        first = []
        for i, p in enumerate(params):
            if state[p].get("momentum_buffer") is None:
                state[p]["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
                first.append(i)
                if dampening != 0.0:
                    self._first_step_flag[id(p)] = found_inf
            elif self._first_step_flag and id(p) in self._first_step_flag:
                if float(self._first_step_flag.pop(id(p))) != 0.0:   # that step was skipped
                    self._first_step_flag[id(p)] = found_inf
                    first.append(i)
        rest = [i for i in range(len(params)) if i not in set(first)] if first else None
        for rows, first_run in ((first, True), (rest, False)):
            if rows == []:
                continue
            pick = (lambda tensors: tensors) if rows is None else \
                (lambda tensors: [tensors[i] for i in rows] if tensors else [])
            chosen = pick(params)
            ops.fused_sgd_(chosen, pick(grads), [state[p]["momentum_buffer"] for p in chosen],
                           pick(model_params), inv_scale, found_inf, *hyper, first_run)


def _adam_update(adam_w_mode: bool) -> Update:
    def update(group: dict, params: List[torch.Tensor], grads: List[torch.Tensor],
               model_params: List[torch.Tensor], state: Dict, inv_scale: torch.Tensor,
               found_inf: torch.Tensor) -> None:
        """torch.optim.Adam's / AdamW's update (state fp32; ``step`` on the device)."""
        for p in params:
            s = state[p]
            if "step" not in s:
                s["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                s["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                s["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        beta1, beta2 = group["betas"]
        decoupled = adam_w_mode or bool(group.get("decoupled_weight_decay", False))
        ops_for(params[0].device).fused_adam_(
            params, grads, [state[p]["exp_avg"] for p in params],
            [state[p]["exp_avg_sq"] for p in params], model_params,
            [state[p]["step"] for p in params], inv_scale, found_inf, float(group["lr"]),
            float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
            decoupled, True)
    return update


_TORCH_UPDATES = {torch.optim.SGD: SGDUpdate, torch.optim.Adam: lambda: _adam_update(False),
                  torch.optim.AdamW: lambda: _adam_update(True)}


def update_for(optimizer: torch.optim.Optimizer) -> Tuple[Optional[Update], str]:
    """The fused update of ``optimizer`` and "", or None and why there is none."""
    cls = type(optimizer)
    name = f"{cls.__module__}.{cls.__qualname__}"
    make = _TORCH_UPDATES.get(cls)
    if make is None:
        return None, (f"{name} is not an optimizer the fused kernels compute (torch.optim.SGD, "
                      f"Adam and AdamW are)")
    for group in optimizer.param_groups:
        bad = _unsupported_options(group)
        if bad:
            return None, f"{name} uses {', '.join(bad)}, which the fused kernels do not compute"
    return make(), ""
