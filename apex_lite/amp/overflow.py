"""The skip decision: one overflow check per backward, read once, per optimizer and per scaler.

A ``scale_loss`` that unscales gradients leaves one ``OverflowCheck`` on each optimizer it was
given. The check holds one ``found_inf`` flag (a 1-element fp32 tensor, zeroed here) per
optimizer and device, which the unscale kernels set when the gradients that THIS backward added
to that optimizer's parameters hold inf or NaN, and the loss. ``resolve()`` reads them all in the
only host sync of the step (after an all-reduce MAX when torch.distributed is initialised), and
decides, as apex did:
- whether this backward overflowed: any flag of this backward, or a non-finite loss. Its loss
  scaler is updated once with that decision (it backs off only for its own backward), and the
  decision is handed to its ``SkipLog`` (what to log; whether steps are stuck overflowing at the
  lowest scale, then ``OverflowStuckError``);
- which optimizers skip: when this backward overflowed, every optimizer given to its
  ``scale_loss`` (what the loss fed is suspect, whichever optimizer's gradient held the inf),
  never one that was not given to it.
When a backward adds to gradients that an earlier backward of the same step left non-finite, the
accumulation re-flags them in a ``carried`` flag, which makes that optimizer skip (what it would
apply is not finite) without charging this loss's scaler, or the other optimizers of this
``scale_loss``, for another backward's overflow. The flags are all-reduced before anything is
decided, so every rank of a distributed run skips the same optimizers.

When the scaler keeps its scale on the device (every optimizer of the run takes the fused step),
``resolve`` makes the same two decisions on the device instead, reading nothing on the host: the
scaler is updated there, and each optimizer gets a device flag (``skip_flag``) that its fused
step kernel reads; the host learns of the decisions later (``LossScaler.sync``).
"""
from __future__ import annotations

import collections
import functools
import math
from typing import Dict, List, Optional, Sequence, Set, Tuple

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
    """The flags of one backward, for one loss scaler and the optimizers it fed."""

    def __init__(self, scaler: LossScaler, loss: torch.Tensor, *, optimizers: Sequence = (),
                 flag_pool: Optional[FlagPool] = None, process_group=None,
                 delayed_losses: Sequence[torch.Tensor] = (), reduced: bool = False):
        self.scaler = scaler
        # The AmpOptimizers whose gradients the flags cover (OverflowStuckError names their
        # parameters).
        self.optimizers = list(optimizers)
        self.loss = loss.detach()
        # Losses of earlier delay_unscale=True backwards whose gradients this unscale finishes.
        self.losses = [l.detach().reshape(1).to(torch.float32)
                       for l in list(delayed_losses) + [loss]]
        # (AmpOptimizer, device) -> flag. An AmpOptimizer hashes by identity.
        self.found_infs: Dict[Tuple[object, torch.device], torch.Tensor] = {}
        self.carried_infs: Dict[Tuple[object, torch.device], torch.Tensor] = {}
        self.flag_pool = flag_pool if flag_pool is not None else FlagPool()
        self.process_group = process_group
        # The gradients were all-reduced by the backward (DDP): every rank holds the same, and
        # decides from its own, without a collective; a rank's own loss only names the cause.
        self.reduced = reduced
        self.overflow: Optional[bool] = None          # the scaler's decision, once resolved
        self.loss_nonfinite: Optional[bool] = None
        # The optimizers that skip because of this backward (once resolved on the host), and
        # those whose own gradients held inf or NaN (the diagnostics name their parameters).
        self.skipping: Set[object] = set()
        self.nonfinite: Set[object] = set()
        # A device decision: per optimizer, the 1-element flag its step reads (1: skip).
        self.resolved_on_device = False
        self.skip_flags: Dict[object, torch.Tensor] = {}
        # Per optimizer, the per-tensor flags the fused step's check computed: [(model
        # parameters, flags)], kept with a device decision so that OverflowStuckError, read on
        # the host later, names the parameters of the step it reports (keep_flags).
        self.evidence: Dict[object, List[Tuple[List[torch.Tensor], torch.Tensor]]] = {}

    def found_inf(self, amp_optimizer, device: torch.device) -> torch.Tensor:
        """The zeroed flag the kernels write for ``amp_optimizer``'s gradients on ``device``."""
        return self._flag(self.found_infs, amp_optimizer, device)

    def carried_inf(self, amp_optimizer, device: torch.device) -> torch.Tensor:
        """The zeroed flag for non-finite values an earlier backward left in the gradients this
        one adds to: it makes ``amp_optimizer`` skip, and is not this scaler's overflow."""
        return self._flag(self.carried_infs, amp_optimizer, device)

    def _flag(self, flags, amp_optimizer, device: torch.device) -> torch.Tensor:
        key = (amp_optimizer, device)
        flag = flags.get(key)
        if flag is None:
            flag = flags[key] = self.flag_pool.take(device)
        return flag

    def keep_flags(self, amp_optimizer, params: List[torch.Tensor], flags: torch.Tensor) -> None:
        """Keep the per-tensor non-finite ``flags`` (device bools, no read) of ``params``'
        gradients, which this backward's check computed for ``amp_optimizer``."""
        self.evidence.setdefault(amp_optimizer, []).append((params, flags))

    def known_clean(self, amp_optimizer) -> bool:
        """True when this check is resolved on the host and found ``amp_optimizer``'s gradients
        finite (no sync: False while unresolved, or decided on the device)."""
        return self.overflow is not None and not self.loss_nonfinite \
            and amp_optimizer not in self.nonfinite

    def skips(self, amp_optimizer) -> bool:
        """Whether ``amp_optimizer`` must skip its step because of this backward (resolves on
        the host)."""
        self.resolve()
        return amp_optimizer in self.skipping

    def skip_flag(self, amp_optimizer) -> torch.Tensor:
        """The device flag (1-element fp32, 1: skip) of ``amp_optimizer``'s step, for a scaler
        on the device (resolves there)."""
        self.resolve()
        return self.skip_flags[amp_optimizer]

    def resolve(self) -> Optional[bool]:
        """Decide once, update the scaler, log a skip: on the host (one sync; returns True when
        this backward overflowed, the scaler's decision), or on the device when the scaler is
        there (returns None: nothing is known on the host)."""
        if self.scaler.on_device:
            self._resolve_on_device()
            return None
        if self.overflow is not None:
            return self.overflow
        device = self.loss.device
        keys = list(self.found_infs)
        carried_keys = list(self.carried_infs)
        flags = [self.found_infs[key].to(device) for key in keys] + \
            [self.carried_infs[key].to(device) for key in carried_keys]
        if distributed_active() and not self.reduced:
            # Every rank must reach the same decisions: reduce the flags, not the loss.
            losses = torch.cat([l.to(device) for l in self.losses])
            loss_bad = torch.isfinite(losses).logical_not().any().to(torch.float32).reshape(1)
            reduced = torch.cat(flags + [loss_bad])
            dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=self.process_group)
            *flag_values, loss_flag = reduced.tolist()
            self.loss_nonfinite = loss_flag != 0.0
        else:
            # One small copy to the host carries the flags and the loss values.
            values = torch.cat(flags + [l.to(device) for l in self.losses]).tolist()
            flag_values, loss_values = values[:len(flags)], values[len(flags):]
            self.loss_nonfinite = not all(math.isfinite(v) for v in loss_values)
        own, carried = flag_values[:len(keys)], flag_values[len(keys):]
        own_bad = {key[0] for key, value in zip(keys, own) if value != 0.0}
        carried_bad = {key[0] for key, value in zip(carried_keys, carried) if value != 0.0}
        self.overflow = bool(own_bad) or (self.loss_nonfinite and not self.reduced)
        self.loss_nonfinite = self.loss_nonfinite and self.overflow
        self.nonfinite = own_bad | carried_bad
        self.skipping = (set(self.optimizers) if self.overflow else set()) | carried_bad
        self.flag_pool.give_back(list(self.found_infs.values()) +
                                 list(self.carried_infs.values()))
        self.found_infs, self.carried_infs = {}, {}
        old_scale = self.scaler.loss_scale
        self.scaler.update(self.overflow)
        self.decision_log(old_scale, self.overflow, self.loss_nonfinite, self.optimizers)
        return self.overflow

    def _resolve_on_device(self) -> None:
        """``resolve``'s decisions as device flags: the flags of this backward (all-reduced with
        MAX when distributed) and whether a loss was not finite. No host read."""
        if self.resolved_on_device:
            return
        self.resolved_on_device = True
        device = self.scaler.device()
        keys = list(self.found_infs)
        carried_keys = list(self.carried_infs)
        losses = torch.cat([l.to(device) for l in self.losses])
        loss_bad = torch.isfinite(losses).logical_not().any().to(torch.float32).reshape(1)
        flags = torch.cat([self.found_infs[key].to(device) for key in keys] +
                          [self.carried_infs[key].to(device) for key in carried_keys] +
                          [loss_bad])
        if distributed_active() and not self.reduced:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.process_group)
        loss_bad = flags[-1:]
        own = flags[:len(keys)]
        # After an all-reduced backward a rank's own loss does not decide (ranks would part).
        overflow = torch.cat([own, loss_bad * (0.0 if self.reduced else 1.0)]).amax().reshape(1)
        if self.reduced:
            loss_bad = loss_bad * overflow
        for amp_opt in self.optimizers:
            # Views and elementwise maxima only (indexing with a host list would copy it to
            # the device, a sync).
            rows = [flags[i:i + 1] for i, key in enumerate(carried_keys, start=len(keys))
                    if key[0] is amp_opt]
            self.skip_flags[amp_opt] = functools.reduce(torch.maximum, rows, overflow)
        self.flag_pool.give_back(list(self.found_infs.values()) +
                                 list(self.carried_infs.values()))
        self.found_infs, self.carried_infs = {}, {}
        log = self.scaler.on_decision
        if isinstance(log, DecisionLog):   # before the update, which may replay at once
            log.evidence.append(self.evidence)
        self.evidence = {}
        self.scaler.update_on_device(overflow, loss_bad)

    @property
    def decision_log(self) -> "DecisionLog":
        """The run's ``DecisionLog`` of this scaler (``initialize`` sets it)."""
        return self.scaler.on_decision


class DecisionLog:
    """What a run does with each decision of one loss scaler, on the host: log it by the skip
    log's policy, and raise ``OverflowStuckError`` when steps are stuck overflowing at the floor
    (naming the non-finite gradients of ``optimizers``, by default all of the run's). A scaler on
    the device calls it when it replays its decisions (``LossScaler.sync``)."""

    def __init__(self, run, skip_log: diagnostics.SkipLog):
        self.run = run
        self.skip_log = skip_log
        # The checks' per-tensor flags of the device decisions not yet replayed, in order.
        self.evidence: collections.deque = collections.deque()

    def __call__(self, old_scale: float, overflow: bool, loss_nonfinite: bool,
                 optimizers: Optional[Sequence] = None) -> None:
        # A replayed device decision (no optimizers given) takes the flags kept with it.
        evidence = self.evidence.popleft() if optimizers is None and self.evidence else None
        scaler = self.skip_log.scaler
        message = skip_message(scaler, old_scale, loss_nonfinite) if overflow else ""
        if self.skip_log.record(old_scale, overflow, loss_nonfinite, message):
            raise diagnostics.stuck_error(
                self.run, self.run.optimizers if optimizers is None else optimizers,
                self.skip_log, loss_nonfinite, evidence)


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
