"""``optimizer.step(closure)`` under amp (``torch.optim.LBFGS`` needs one).

The closure computes the loss and runs its backward inside ``amp.scale_loss``, as any backward
under amp does. amp calls it first (``first_call``) and decides on its gradients as for any step
(a non-finite one is skipped, nothing changed); then the optimizer's own step gets a closure
(``replayed``) whose first call returns that loss, and whose later calls (LBFGS's further
evaluations within one step) first round the masters the step has moved into the half model
(O2), then run the closure again, and raise if that backward's gradients are not finite (the
step is under way: it cannot be skipped). A closure whose backward runs outside ``scale_loss``
is refused: amp has no gradients it unscaled and checked.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .master_grads import GradState


def first_call(amp_opt, closure: Callable) -> torch.Tensor:
    """Run ``closure`` for ``amp_opt``'s step; its loss. Raises when its backward ran outside
    ``scale_loss``."""
    with torch.enable_grad():
        loss = closure()
    if amp_opt.foreign_backward or amp_opt.grad_state is GradState.CLEAN:
        raise RuntimeError(
            f"{amp_opt.label()}.step(closure): the closure did not run its backward inside "
            f"`with amp.scale_loss(loss, optimizer) as scaled_loss: scaled_loss.backward()`, so "
            f"amp has no gradients it unscaled and checked. Write the closure as: "
            f"optimizer.zero_grad(); loss = loss_fn(model(x), y); with amp.scale_loss(loss, "
            f"optimizer) as scaled_loss: scaled_loss.backward(); return loss.")
    return loss


def replayed(amp_opt, closure: Optional[Callable], first_loss) -> Optional[Callable]:
    """The closure handed to the optimizer's own step (None without one)."""
    if closure is None:
        return None
    calls = []

    def replay():
        if not calls:
            calls.append(1)
            return first_loss
        amp_opt.copy_masters_to_model()
        with torch.enable_grad():
            loss = closure()
        checks, amp_opt.checks = amp_opt.checks, []
        if any([check.skips(amp_opt) for check in checks]):
            raise RuntimeError(
                f"{amp_opt.label()}.step(closure): a later evaluation of the closure within "
                f"this step ({type(amp_opt.optimizer).__name__} evaluates it more than once) "
                f"gave gradients that are not finite, and the step is already under way, so it "
                f"cannot be skipped. Lower the learning rate or the loss scale (loss_scale=... "
                f"in amp.initialize), or run this optimizer at O0.")
        return loss
    return replay
