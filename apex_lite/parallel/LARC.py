"""``LARC``: apex's layer-wise adaptive rate clipping/scaling around any optimizer
(``from apex.parallel.LARC import LARC``; https://arxiv.org/abs/1708.03888).

Each parameter's gradient is rescaled before the wrapped optimizer steps, by its local learning
rate ``trust_coefficient * ||p|| / (||g|| + weight_decay * ||p|| + eps)``: as a factor
(``clip=False``, scaling) or capped so that the effective rate is ``min(local_lr, lr)``
(``clip=True``, the factor ``min(local_lr / lr, 1)``). The group's weight decay is folded into
the gradient first (``g + weight_decay * p``) and hidden from the wrapped optimizer during its
step (its ``weight_decay`` is 0 then, and restored after, also when the step raises). A
parameter or gradient of norm 0 is left as it is (its weight decay too, as apex does).

Differences from apex, none in the update:

- LARC is a ``torch.optim.Optimizer`` (sharing the wrapped optimizer's ``param_groups``,
  ``state`` and ``defaults``), so torch's LR schedulers accept it (apex's was a plain object they
  refuse), and ``amp.initialize(model, LARC(optimizer), ...)`` takes it as apex's amp did. Under
  amp it takes the unfused step: at O2 it reads and rescales the true fp32 gradients of the
  master weights, so its updates are an fp32 run's.
- The norms and the rescaling stay on the device: no host read per parameter (apex compared each
  norm with 0 on the host).
- ``step(closure=None)`` takes torch's closure (evaluated once, with gradients enabled, before
  the rescaling); ``zero_grad(set_to_none=True)`` forwards torch's argument.
- Hooks registered on the LARC (``register_step_pre_hook``, state-dict hooks) run around its
  forwarded calls; ``state_dict()`` is the wrapped optimizer's, as in apex (LARC's own
  hyper-parameters are constructor arguments, not state).
"""
from __future__ import annotations

from collections import OrderedDict

import torch

__all__ = ["LARC"]


def _forwarded(name: str) -> property:
    """The wrapped optimizer's attribute ``name`` (the same object), read and set through."""
    return property(lambda self: getattr(self.optim, name),
                    lambda self, value: setattr(self.optim, name, value),
                    doc=f"The wrapped optimizer's ``{name}`` (the same object).")


class LARC(torch.optim.Optimizer):
    """Rescale each parameter's gradient by its LARS local learning rate, then step ``optimizer``.

    Args:
        optimizer: the torch optimizer to wrap (any; its param groups are shared, not copied).
        trust_coefficient: the trust coefficient of the local learning rate (default 0.02).
        clip: ``True`` clips the effective rate at the group's ``lr`` (``min(local_lr, lr)``);
            ``False`` scales it (``local_lr * lr``).
        eps: added to the local rate's denominator (default 1e-8).

    Raises:
        TypeError: ``optimizer`` has no ``param_groups`` or ``step`` (model parameters passed
            instead of an optimizer, say).
    """

    def __init__(self, optimizer, trust_coefficient=0.02, clip=True, eps=1e-8):
        if not hasattr(optimizer, "param_groups") or not callable(getattr(optimizer, "step",
                                                                           None)):
            raise TypeError(f"LARC wraps an optimizer (param_groups and step()), got "
                            f"{type(optimizer).__name__}: build the optimizer first, then "
                            f"LARC(optimizer)")
        # Not Optimizer.__init__: the groups and state are the wrapped optimizer's own objects
        # (properties below). Only torch's hook registries, which its methods and LR schedulers
        # use on any optimizer, are made here.
        self.optim = optimizer
        self.trust_coefficient = trust_coefficient
        self.eps = eps
        self.clip = clip
        self._init_hook_registries()
        self._patch_step_function()

    def _init_hook_registries(self) -> None:
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                     "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                     "_optimizer_load_state_dict_pre_hooks",
                     "_optimizer_load_state_dict_post_hooks"):
            if name not in self.__dict__:
                setattr(self, name, OrderedDict())

    # ---- what is forwarded to the wrapped optimizer -----------------------------------------
    param_groups = _forwarded("param_groups")
    state = _forwarded("state")
    defaults = _forwarded("defaults")

    def __getstate__(self):
        return dict(self.__dict__)

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._init_hook_registries()
        self._patch_step_function()

    def __repr__(self):
        return self.optim.__repr__()

    def state_dict(self):
        """The wrapped optimizer's ``state_dict()``, with the hooks registered on this LARC run
        around it (torch's order: pre-hooks, the state, post-hooks that may replace it)."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        state_dict = self.optim.state_dict()
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict):
        """Load ``state_dict`` into the wrapped optimizer; this LARC's load hooks run around it
        (on a shallow copy, as torch's own ``load_state_dict``)."""
        state_dict = dict(state_dict)
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        self.optim.load_state_dict(state_dict)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def zero_grad(self, set_to_none: bool = True):
        """The wrapped optimizer's ``zero_grad(set_to_none)``."""
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group):
        """The wrapped optimizer's ``add_param_group(param_group)``."""
        self.optim.add_param_group(param_group)

    # ---- the step ---------------------------------------------------------------------------
    def step(self, closure=None):
        """Rescale the gradients of every group's parameters in place, then step the wrapped
        optimizer with each group's weight decay set to 0 (restored after). Returns the
        closure's loss, or None."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        decays = []
        try:
            with torch.no_grad():
                for group in self.optim.param_groups:
                    weight_decay = group.get("weight_decay", 0)
                    if "weight_decay" in group:
                        decays.append((group, weight_decay))
                        group["weight_decay"] = 0
                    for p in group["params"]:
                        if p.grad is not None:
                            self._rescale(p, group["lr"], weight_decay)
            self.optim.step()
        finally:
            for group, weight_decay in decays:
                group["weight_decay"] = weight_decay
        return loss

    def _rescale(self, p: torch.Tensor, lr, weight_decay) -> None:
        """apex's update of one gradient, decided on the device: ``(g + wd * p) * factor`` where
        both norms are non-zero, ``g`` untouched elsewhere."""
        grad = p.grad
        param_norm = torch.linalg.vector_norm(p)
        grad_norm = torch.linalg.vector_norm(grad)
        adaptive_lr = self.trust_coefficient * param_norm / (
            grad_norm + param_norm * weight_decay + self.eps)
        if self.clip:
            adaptive_lr = torch.clamp(adaptive_lr / lr, max=1)
        applies = (param_norm != 0) & (grad_norm != 0)
        if not (isinstance(weight_decay, (int, float)) and weight_decay == 0):
            decay = weight_decay * p
            grad.add_(torch.where(applies, decay, torch.zeros((), dtype=decay.dtype,
                                                              device=decay.device)))
        grad.mul_(torch.where(applies, adaptive_lr, torch.ones_like(adaptive_lr)))
