"""The skip decision: one overflow check per unscale, read once, shared by its optimizers.

A ``scale_loss`` that unscales gradients leaves one ``OverflowCheck`` on each optimizer it was
given: the ``found_inf`` flags the unscale kernels wrote (one 1-element fp32 tensor per device,
zeroed here) and the loss. ``resolve()`` reads them in the only host sync of the step (after an
all-reduce MAX when torch.distributed is initialised), updates the loss scaler once, hands the
decision to the scaler's ``SkipLog`` (what to log; whether steps are stuck overflowing at the
lowest scale, then raises ``OverflowStuckError``), and answers whether the optimizers that hold
it must skip their step.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from . import diagnostics
from .scaler import LossScaler

def distributed_active() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_logging_rank() -> bool:
    return not distributed_active() or dist.get_rank() == 0


class FlagPool:
    """Reused ``found_inf`` flags: a resolved check gives its flags back, the next check zeroes
    one instead of allocating (several checks can be pending at once, hence a pool)."""

    def __init__(self):
        self.free: Dict[torch.device, List[torch.Tensor]] = {}

    def take(self, device: torch.device) -> torch.Tensor:
        free = self.free.get(device)
        if free:
            return free.pop().zero_()
        return torch.zeros(1, dtype=torch.float32, device=device)

    def give_back(self, flags) -> None:
        for flag in flags:
            self.free.setdefault(flag.device, []).append(flag)


class OverflowCheck:
    """The flags of one unscale, for one loss scaler."""

    def __init__(self, scaler: LossScaler, loss: torch.Tensor, *,
                 skip_log: diagnostics.SkipLog, run=None, optimizers: Sequence = (),
                 flag_pool: Optional[FlagPool] = None,
                 process_group=None, inherited: Sequence["OverflowCheck"] = (),
                 delayed_losses: Sequence[torch.Tensor] = ()):
        self.scaler = scaler
        self.skip_log = skip_log
        # The run and the AmpOptimizers whose gradients the flags cover (to name the parameters
        # in OverflowStuckError).
        self.run = run
        self.optimizers = list(optimizers)
        # Checks of earlier losses whose unscaled gradients this unscale adds to: the kernels
        # flag those too, so an overflow they carried in is charged to their scalers, not ours.
        self.inherited = list(inherited)
        self.loss = loss.detach()
        # Losses of earlier delay_unscale=True backwards whose gradients this unscale finishes.
        self.losses = [l.detach().reshape(1).to(torch.float32)
                       for l in list(delayed_losses) + [loss]]
        self.found_infs: Dict[torch.device, torch.Tensor] = {}
        self.flag_pool = flag_pool if flag_pool is not None else FlagPool()
        self.process_group = process_group
        self.overflow: Optional[bool] = None
        self.loss_nonfinite: Optional[bool] = None

    def found_inf(self, device: torch.device) -> torch.Tensor:
        """The zeroed flag the kernels working on ``device`` write to."""
        flag = self.found_infs.get(device)
        if flag is None:
            flag = self.found_infs[device] = self.flag_pool.take(device)
        return flag

    def resolve(self) -> bool:
        """Decide once (one host sync), update the scaler, log a skip; True to skip the step."""
        if self.overflow is not None:
            return self.overflow
        device = self.loss.device
        grads_bad = None
        for flag in self.found_infs.values():
            flag = flag.to(device)
            grads_bad = flag if grads_bad is None else torch.maximum(grads_bad, flag)
        if grads_bad is None:
            grads_bad = torch.zeros(1, dtype=torch.float32, device=device)
        if distributed_active():
            # Every rank must reach the same decision: reduce the two flags, not the loss.
            losses = torch.cat([l.to(device) for l in self.losses])
            loss_bad = torch.isfinite(losses).logical_not().any().to(torch.float32).reshape(1)
            flags = torch.cat([grads_bad, loss_bad])
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.process_group)
            grads_flag, loss_flag = flags.tolist()
            self.loss_nonfinite = loss_flag != 0.0
        else:
            # One small copy to the host carries the flag and the loss values.
            grads_flag, *loss_values = torch.cat(
                [grads_bad] + [l.to(device) for l in self.losses]).tolist()
            self.loss_nonfinite = not all(math.isfinite(v) for v in loss_values)
        self.overflow = grads_flag != 0.0 or self.loss_nonfinite
        self.flag_pool.give_back(self.found_infs.values())
        self.found_infs = {}
        if self.overflow and not self.loss_nonfinite \
                and any([check.resolve() for check in self.inherited]):
            return self.overflow    # skipped, and already charged to the earlier loss's scaler
        old_scale = self.scaler.loss_scale
        self.scaler.update(self.overflow)
        message = skip_message(self.scaler, old_scale, self.loss_nonfinite) \
            if self.overflow else ""
        if self.skip_log.record(old_scale, self.overflow, self.loss_nonfinite, message):
            raise diagnostics.stuck_error(self.run, self.optimizers, self.skip_log,
                                          self.loss_nonfinite)
        return self.overflow


def skip_message(scaler: LossScaler, old_scale: float, loss_nonfinite: bool) -> str:
    """apex's skip line, with the cause named and what happened to the scale."""
    cause = ("Loss is inf or NaN (the forward produced a non-finite loss, not a scaling "
             "problem).  Skipping step" if loss_nonfinite else
             "Gradient overflow.  Skipping step")
    new_scale = scaler.loss_scale
    if not scaler.dynamic:
        what = f"keeping its static loss scale {new_scale}"
    elif new_scale < old_scale:
        what = f"reducing loss scale to {new_scale}"
    elif scaler.min_loss_scale is not None and new_scale <= scaler.min_loss_scale:
        what = f"keeping loss scale at min_loss_scale {new_scale}"
    else:
        what = (f"keeping loss scale {new_scale} (hysteresis: {scaler.hysteresis_left} more "
                f"overflow(s) before it is reduced)")
    return f"{cause}, loss scaler {scaler.loss_id} {what}"
