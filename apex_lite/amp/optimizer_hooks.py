"""What amp puts on the user's optimizer, and how it finds the one that steps.

- ``stepping_optimizer``: an optimizer that wraps another and shares its ``param_groups``
  (LARC, Lookahead, SAM, torch's PostLocalSGDOptimizer) steps through the inner one, which amp
  takes over; ``amp_optimizer_of`` finds amp's state from the wrapper too (one built after
  ``initialize``).
- ``_make_method``: the ``step``, ``zero_grad`` and ``add_param_group`` amp sets on the instance
  (a fresh function per optimizer, bound with MethodType, as torch's LR schedulers expect);
  ``_wrapper_step``: a wrapper's own step, after which its writes to the masters reach the model.
- ``_StepInPlace``: a step pre-hook and post-hook with which amp's update runs inside the
  optimizer's own ``step`` in place of the class's update, so that a wrapper set on the
  instance before ``initialize`` and torch's step hooks run on every step path.
"""
from __future__ import annotations

import contextlib
from typing import Callable, List, Optional, Tuple

import torch

# The attribute that marks what ``initialize`` took over: on an optimizer, its ``AmpOptimizer``
# (``optimizer._apex_lite_amp``); on a model, the opt level.
MARK = "_apex_lite_amp"


def stepping_optimizer(optimizer) -> Tuple[torch.optim.Optimizer, List]:
    """The optimizer whose ``step`` updates ``optimizer``'s parameters, and the wrappers above
    it: an optimizer that wraps another and shares its ``param_groups`` (LARC, Lookahead, SAM,
    torch's PostLocalSGDOptimizer) steps through it, as ``optimizer`` itself does otherwise."""
    wrappers = []
    while True:
        inner = _wrapped(optimizer)
        if inner is None:
            return optimizer, wrappers
        wrappers.append(optimizer)
        optimizer = inner


def _wrapped(optimizer) -> Optional[torch.optim.Optimizer]:
    """The optimizer that ``optimizer`` holds as an attribute and shares ``param_groups`` with."""
    groups = getattr(optimizer, "param_groups", None)
    if groups is None:
        return None
    for value in vars(optimizer).values():
        if value is not optimizer and isinstance(value, torch.optim.Optimizer) \
                and getattr(value, "param_groups", None) is groups:
            return value
    return None


def amp_optimizer_of(optimizer):
    """The ``AmpOptimizer`` of ``optimizer``: its own mark, or that of the optimizer it wraps
    and shares ``param_groups`` with (a Lookahead built around an amp optimizer after
    ``initialize``); None when neither went through ``initialize``."""
    while optimizer is not None:
        amp_opt = getattr(optimizer, MARK, None)
        if amp_opt is not None:
            return amp_opt
        optimizer = _wrapped(optimizer)
    return None


class _StepInPlace:
    """A step pre-hook and post-hook on an optimizer, with which amp runs its own update inside
    the optimizer's own ``step`` (``AmpOptimizer._own_step``): armed with an update, the
    pre-hook runs it and hides the optimizer's param groups (an empty list in their place), so
    that the class's update finds nothing to do; the post-hook gives them back. Disarmed, the
    hooks do nothing (the unfused step runs the class's update itself)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.update: Optional[Callable[[], None]] = None
        self.hidden = None
        self.pre = optimizer.register_step_pre_hook(self._pre)
        self.post = optimizer.register_step_post_hook(self._post)

    @staticmethod
    def applies(optimizer) -> bool:
        """Whether ``optimizer``'s class step runs torch's step hooks (torch.optim.Optimizer's
        ``profile_hook_step``, put on the class by ``Optimizer.__init__``)."""
        return isinstance(optimizer, torch.optim.Optimizer) and \
            getattr(type(optimizer).step, "hooked", False) and \
            hasattr(optimizer, "_optimizer_step_pre_hooks")

    @contextlib.contextmanager
    def armed(self, update: Callable[[], None]):
        # The last pre-hook and the first post-hook: hooks registered after initialize see the
        # parameters as any step shows them.
        self.optimizer._optimizer_step_pre_hooks.move_to_end(self.pre.id)
        self.optimizer._optimizer_step_post_hooks.move_to_end(self.post.id, last=False)
        self.update = update
        try:
            # A wrapper that does not call the class step (one that skips it) steps nothing,
            # as it would without amp.
            yield
        finally:
            self.update = None
            self._give_back()

    def _pre(self, optimizer, args, kwargs):
        update, self.update = self.update, None
        if update is not None:
            update()
            self.hidden = optimizer.param_groups
            optimizer.param_groups = []
        return None

    def _post(self, optimizer, args, kwargs):
        self._give_back()

    def _give_back(self) -> None:
        if self.hidden is not None:
            self.optimizer.param_groups, self.hidden = self.hidden, None


def _wrapper_step(original: Callable):
    """The ``step`` of an optimizer that wraps the one amp took over (given to ``initialize``):
    its own (``original``), which calls amp's through the inner optimizer, then the writes it
    made to the masters after that (Lookahead's sync of its slow weights) reach the model at
    once, as they would be the model's own weights in fp32 training."""
    def step(optimizer, *args, **kwargs):
        result = original(*args, **kwargs)
        optimizer._apex_lite_amp.run.copies.sync(f"{type(optimizer).__name__}.step()")
        return result
    if hasattr(original, "_wrapped_by_lr_sched"):
        step._wrapped_by_lr_sched = True
    return torch.compiler.disable(step)


def _make_method(name: str):
    """A fresh function per optimizer (so attributes set on one do not leak to another) that
    delegates to the optimizer's ``AmpOptimizer``; bound to the instance with MethodType, the
    form torch's LR schedulers expect of ``optimizer.step``. ``torch.compile`` of code that calls
    ``optimizer.step()`` runs amp's step as it is (a graph break there): it is host bookkeeping
    around one fused kernel call per bucket, nothing a compiler would speed up, and the host
    decisions it makes (skips, refusals) must happen each step, not once at tracing."""
    if name == "step":
        def step(optimizer, closure=None):
            return optimizer._apex_lite_amp.step(closure)
        return torch.compiler.disable(step)
    if name == "zero_grad":
        def zero_grad(optimizer, set_to_none: bool = True):
            return optimizer._apex_lite_amp.zero_grad(set_to_none)
        return zero_grad

    def add_param_group(optimizer, param_group):
        return optimizer._apex_lite_amp.add_param_group(param_group)
    return add_param_group
