"""The skip decision: one overflow check per unscale, read once, shared by its optimizers.

A ``scale_loss`` that unscales gradients leaves one ``OverflowCheck`` on each optimizer it was
given: the ``found_inf`` flags the unscale kernels wrote (one 1-element fp32 tensor per device,
zeroed here) and the loss. ``resolve()`` reads them in the only host sync of the step (after an
all-reduce MAX when torch.distributed is initialised), updates the loss scaler once, logs a skip,
and answers whether the optimizers that hold it must skip their step.
"""
from __future__ import annotations

import logging
from typing import Dict, Optional, Sequence

import torch
import torch.distributed as dist

from .scaler import LossScaler

logger = logging.getLogger("apex_lite.amp")

# Bits of the value read at the decision.
_GRADS_NONFINITE = 1.0
_LOSS_NONFINITE = 2.0


def distributed_active() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_logging_rank() -> bool:
    return not distributed_active() or dist.get_rank() == 0


class OverflowCheck:
    """The flags of one unscale, for one loss scaler."""

    def __init__(self, scaler: LossScaler, loss: torch.Tensor, *, verbosity: int,
                 process_group=None, inherited: Sequence["OverflowCheck"] = ()):
        self.scaler = scaler
        # Checks of earlier losses whose unscaled gradients this unscale adds to: the kernels
        # flag those too, so an overflow they carried in is charged to their scalers, not ours.
        self.inherited = list(inherited)
        self.loss = loss.detach()
        self.found_infs: Dict[torch.device, torch.Tensor] = {}
        self.verbosity = verbosity
        self.process_group = process_group
        self.overflow: Optional[bool] = None
        self.loss_nonfinite: Optional[bool] = None

    def found_inf(self, device: torch.device) -> torch.Tensor:
        """The zeroed flag the kernels working on ``device`` write to."""
        flag = self.found_infs.get(device)
        if flag is None:
            flag = self.found_infs[device] = torch.zeros(1, dtype=torch.float32, device=device)
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
        loss_bad = torch.isfinite(self.loss).logical_not().to(torch.float32).reshape(1)
        flags = loss_bad * _LOSS_NONFINITE
        if grads_bad is not None:
            flags = flags + grads_bad
        if distributed_active():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.process_group)
        value = flags.item()
        self.overflow = value != 0.0
        self.loss_nonfinite = value >= _LOSS_NONFINITE
        if self.overflow and not self.loss_nonfinite \
                and any([check.resolve() for check in self.inherited]):
            return self.overflow    # skipped, and already charged to the earlier loss's scaler
        old_scale = self.scaler.loss_scale
        self.scaler.update(self.overflow)
        if self.overflow and self.verbosity >= 1 and is_logging_rank():
            logger.warning(skip_message(self.scaler, old_scale, self.loss_nonfinite))
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
