"""Which optimizers' updates the fused ops compute, and with which hyper-parameters (for amp's
O2 step).

- ``update_class(optimizer)``: ``SGDUpdate``, ``AdamUpdate``, ``LambUpdate``,
  ``NovoGradUpdate`` or ``AdagradUpdate`` for torch.optim.SGD, Adam, AdamW and apex_lite's
  FusedSGD, FusedAdam, FusedLAMB, FusedNovoGrad, FusedAdagrad; None for any other optimizer or
  option, and then ``unfused_reason(optimizer)`` says why.
- ``torch_kernels_reason(optimizer)``: "" when torch's own fused kernels (``torch._fused_sgd_``,
  ``_fused_adam_``, ``_fused_adamw_``, ``_fused_adagrad_``) compute its update too, the route of
  amp's fused step without native kernels (``multi_tensor/_torch_fused.py``); else why not.
- ``hyper_parameters(optimizer, group)``: the group's hyper-parameters as that class takes them
  (torch's names: lr, momentum, dampening, weight_decay, nesterov; betas, eps, weight_decay,
  AdamW / decoupled_weight_decay; torch's Adam always corrects the bias). Read it at every step:
  LR schedulers change the groups.

torch's ``foreach`` and ``fused`` flags choose an implementation of the same update and do not
matter here. Exact classes only: a subclass may change the update in its own ``step()``.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Type

import torch

from .fused_adagrad import AdagradHyper, AdagradUpdate, FusedAdagrad
from .fused_adam import AdamHyper, AdamUpdate, FusedAdam
from .fused_lamb import FusedLAMB, LambHyper, LambUpdate
from .fused_novograd import FusedNovoGrad, NovoGradHyper, NovoGradUpdate
from .fused_sgd import FusedSGD, SGDHyper, SGDUpdate
from .update import FusedUpdate

__all__ = ["update_class", "unfused_reason", "hyper_parameters", "torch_kernels_reason"]


def _adamw_hyper(group: dict) -> AdamHyper:
    return AdamHyper.from_group(group)._replace(adam_w_mode=True)


_SERVED: Dict[type, Type[FusedUpdate]] = {
    torch.optim.SGD: SGDUpdate, torch.optim.Adam: AdamUpdate, torch.optim.AdamW: AdamUpdate,
    FusedSGD: SGDUpdate, FusedAdam: AdamUpdate, FusedLAMB: LambUpdate,
    FusedNovoGrad: NovoGradUpdate, FusedAdagrad: AdagradUpdate,
}
_HYPER: Dict[type, Callable[[dict], object]] = {
    torch.optim.SGD: SGDHyper.from_group, torch.optim.Adam: AdamHyper.from_group,
    torch.optim.AdamW: _adamw_hyper, FusedSGD: SGDHyper.from_group,
    FusedAdam: AdamHyper.from_group, FusedLAMB: LambHyper.from_group,
    FusedNovoGrad: NovoGradHyper.from_group, FusedAdagrad: AdagradHyper.from_group,
}
_TORCH_FLAGS = ("maximize", "differentiable", "capturable", "amsgrad")


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _group_problems(group: dict) -> List[str]:
    """The options of a torch optimizer's param group that the fused ops do not compute."""
    problems = [f"{flag}=True" for flag in _TORCH_FLAGS if group.get(flag)]
    for key in ("lr", "weight_decay", "momentum", "dampening", "eps"):
        if isinstance(group.get(key), torch.Tensor):
            problems.append(f"{key} as a tensor")
    if any(isinstance(beta, torch.Tensor) for beta in group.get("betas", ())):
        problems.append("betas as tensors")
    return problems


def unfused_reason(optimizer: torch.optim.Optimizer) -> str:
    """Why the fused ops cannot compute ``optimizer``'s update; "" when they can."""
    cls = type(optimizer)
    if cls not in _SERVED:
        served = next((base for base in cls.__mro__[1:] if base in _SERVED), None)
        if served is not None:
            return (f"{_name(cls)} subclasses {_name(served)} and may change its update; only "
                    f"the exact classes are fused")
        return (f"{_name(cls)} is not an optimizer the fused ops compute (torch.optim.SGD, "
                f"Adam, AdamW and apex_lite.optimizers.FusedSGD, FusedAdam, FusedLAMB, "
                f"FusedNovoGrad, FusedAdagrad are)")
    for index, group in enumerate(optimizer.param_groups):
        problems = _group_problems(group)
        if problems:
            return (f"{_name(cls)} param group {index} uses {', '.join(problems)}, which the "
                    f"fused ops do not compute")
    return ""


def update_class(optimizer: torch.optim.Optimizer) -> Optional[Type[FusedUpdate]]:
    """The update class that computes ``optimizer``'s step, or None (see ``unfused_reason``)."""
    return None if unfused_reason(optimizer) else _SERVED[type(optimizer)]


def hyper_parameters(optimizer: torch.optim.Optimizer, group: dict):
    """``group``'s hyper-parameters (``SGDHyper``, ``AdamHyper``, ``LambHyper``, ...) for the
    update class of ``optimizer``, which must be served (``update_class`` not None)."""
    return _HYPER[type(optimizer)](group)


def torch_kernels_reason(optimizer: torch.optim.Optimizer) -> str:
    """Why torch's own fused kernels do not compute ``optimizer``'s update (the update class's
    ``torch_kernels`` and ``torch_kernels_reason`` say: SGD, Adam/AdamW and Adagrad, with the
    options they take); "" when they do. Read at ``initialize``: a group changed later to an
    option they lack is stepped by the Python reference, per call."""
    why = unfused_reason(optimizer)
    if why:
        return why
    update = _SERVED[type(optimizer)]
    if not update.torch_kernels:
        return (f"torch has no fused kernel for {_name(type(optimizer))}'s update (it has "
                f"SGD's, Adam's, AdamW's and Adagrad's)")
    for index, group in enumerate(optimizer.param_groups):
        why = update.torch_kernels_reason(hyper_parameters(optimizer, group))
        if why:
            return f"param group {index} has {why}"
    return ""
