"""What amp tells the user about skipped steps: the log policy, the error when the scale cannot
go lower and steps keep overflowing, and the locator of the first non-finite module output.

Log policy per loss scaler (``verbosity`` of ``initialize``):
- 0: silent.
- 1 (default): the skips of the start-of-training calibration (a dynamic scale halving from its
  start until the first clean step) are folded into one INFO line when it ends; a skip whose
  loss is inf or NaN, and any skip of a static scale, is a WARNING with apex's line; other skips
  are INFO lines with apex's text; WARNINGs for an abnormal skip rate (more than
  ``SKIP_RATE_LIMIT`` of the last ``SKIP_RATE_WINDOW`` decisions after calibration) and for a
  scale ``FAR_BELOW_FACTOR`` or more below its start.
- 2 and more: apex's behaviour, every skip a WARNING with apex's line, calibration included.
"""
from __future__ import annotations

import collections
import logging
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from .. import multi_tensor
from ..optimizers.update import local_shards
from .casting import apply_to_floats
from .master_grads import is_lazy
from .scaler import SMALLEST_LOSS_SCALE

logger = logging.getLogger("apex_lite.amp")

SKIP_RATE_WINDOW = 100     # decisions looked back on for the skip-rate warning
SKIP_RATE_LIMIT = 5        # skips within that window above which the rate is abnormal
FAR_BELOW_FACTOR = 2.0 ** 12
DEFAULT_OVERFLOW_PATIENCE = 100
MAX_NAMES = 10


class OverflowStuckError(RuntimeError):
    """Steps kept overflowing with the loss scale at its floor; the message says why and where."""


class SkipLog:
    """The log state of one loss scaler (host values only; nothing here syncs)."""

    def __init__(self, scaler, *, verbosity: int, overflow_patience: Optional[int]):
        self.scaler = scaler
        self.verbosity = verbosity
        self.overflow_patience = overflow_patience
        self.start_scale = scaler.loss_scale
        self.recent: collections.deque = collections.deque(maxlen=SKIP_RATE_WINDOW)
        self.rate_warned_at = -SKIP_RATE_WINDOW   # scaler.steps of the last rate warning
        self.far_below_warned = False
        self.floor_warned = False       # the skip-at-the-floor warning is given once
        self.floor_skips = 0            # consecutive skips with the scale at its floor
        self.floor_nonfinite_losses = 0   # how many of those had a non-finite loss

    def record(self, old_scale: float, overflow: bool, loss_nonfinite: bool,
               message: str) -> bool:
        """Log what the decision just recorded by the scaler calls for; True when the scale sat
        at its floor for ``overflow_patience`` skipped steps in a row (the caller raises)."""
        scaler = self.scaler
        steps_before = scaler.steps - 1
        skipped_before = scaler.skipped_steps - (1 if overflow else 0)
        # Skips are calibration only while the scale can still fall: at its floor they are not.
        floor = scaler.min_loss_scale if scaler.min_loss_scale is not None \
            else SMALLEST_LOSS_SCALE
        calibrating = scaler.dynamic and steps_before == skipped_before and old_scale > floor
        # Only rank 0 logs in a distributed run (every rank reaches the same decisions).
        verbosity = self.verbosity if _logging_rank() else 0
        verbose = verbosity >= 1
        if overflow:
            if verbosity >= 2 or (verbose and (loss_nonfinite or not scaler.dynamic)):
                logger.warning(message)
            elif verbose and not calibrating:
                logger.info(message)
        elif calibrating and skipped_before and verbose:
            logger.info("loss scaler %d: first %d steps skipped while the loss scale "
                        "calibrated to %s", scaler.loss_id, skipped_before, scaler.loss_scale)
        if overflow and scaler.dynamic and old_scale <= floor and not self.floor_warned:
            self.floor_warned = True
            if verbose:
                logger.warning(
                    "loss scaler %d: a step was skipped with the loss scale at its floor %s "
                    "(%s), so lowering the scale can no longer make the gradients finite: the "
                    "backward produces inf/NaN at any scale (%d of %d steps skipped so far). "
                    "Check the learning rate and the inputs, and locate the layer with "
                    "amp.locate_nonfinite(model); a lower min_loss_scale helps only if the "
                    "gradients are merely large.", scaler.loss_id, old_scale,
                    "min_loss_scale" if scaler.min_loss_scale is not None else
                    "the smallest scale whose inverse is finite in fp32",
                    scaler.skipped_steps, scaler.steps)
        if not (calibrating and overflow):
            self.recent.append(overflow)
            self._warn_rate(verbose)
        self._warn_far_below(verbose)
        return self._stuck(old_scale, overflow, loss_nonfinite)

    def _warn_rate(self, verbose: bool) -> None:
        scaler = self.scaler
        skips = sum(self.recent)
        if skips <= SKIP_RATE_LIMIT or scaler.steps - self.rate_warned_at < SKIP_RATE_WINDOW:
            return
        self.rate_warned_at = scaler.steps
        if verbose:
            logger.warning(
                "loss scaler %d: %d of the last %d steps were skipped (inf/NaN gradients or "
                "loss), loss scale now %s. Normal dynamic scaling skips about one step per "
                "scale_window; this many point at the model or the data: check the learning "
                "rate and the inputs, and locate the layer with amp.locate_nonfinite(model) or "
                "amp.initialize(..., locate_nonfinite=True)", scaler.loss_id, skips,
                len(self.recent), scaler.loss_scale)

    def _warn_far_below(self, verbose: bool) -> None:
        scaler = self.scaler
        far_below = scaler.dynamic and scaler.loss_scale * FAR_BELOW_FACTOR <= self.start_scale
        if far_below and not self.far_below_warned and verbose:
            logger.warning(
                "loss scaler %d: the loss scale fell to %s, %dx below its start %s: gradients "
                "overflow even at small scales, so the backward itself produces inf/NaN (a "
                "too-large learning rate, a bad batch, or a layer that overflows in half "
                "precision: keep it fp32 with keep_fp32_modules, or find it with "
                "amp.locate_nonfinite(model))", scaler.loss_id, scaler.loss_scale,
                int(self.start_scale / scaler.loss_scale), self.start_scale)
        self.far_below_warned = far_below

    def _stuck(self, old_scale: float, overflow: bool, loss_nonfinite: bool) -> bool:
        scaler = self.scaler
        if not overflow:
            self.floor_skips = self.floor_nonfinite_losses = 0
            return False
        at_floor = (not scaler.dynamic or scaler.min_loss_scale is None
                    or old_scale <= scaler.min_loss_scale)
        if not at_floor:
            return False
        self.floor_skips += 1
        self.floor_nonfinite_losses += bool(loss_nonfinite)
        return self.overflow_patience is not None and self.floor_skips >= self.overflow_patience


def _logging_rank() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def floor_description(scaler) -> str:
    if not scaler.dynamic:
        return f"its static value {scaler.loss_scale}"
    if scaler.min_loss_scale is not None:
        return f"min_loss_scale {scaler.min_loss_scale}"
    return f"{scaler.loss_scale} (halved on every skip, no min_loss_scale)"


def nonfinite_gradient_names(run, amp_optimizers, evidence=None) -> List[str]:
    """The names of the parameters whose (unscaled) gradients hold inf or NaN, from the kernels'
    per-tensor flags; one host copy per device. Only called on the error path. ``evidence``:
    ``{amp_optimizer: [(model parameters, their per-tensor flags)]}`` that the fused step's
    check kept of the decision being reported (``OverflowCheck.keep_flags``; the gradients may
    have been cleared since); an optimizer without evidence is read from its gradients now."""
    names: List[str] = []
    seen = set()
    for amp_opt in amp_optimizers:
        kept = (evidence or {}).get(amp_opt)
        if kept:
            for params, flags in kept:
                for p, bad in zip(params, flags.tolist()):
                    if bad and id(p) not in seen:
                        seen.add(id(p))
                        names.append(run.param_name(p))
            continue
        for group in amp_opt.groups().values():
            # The master's gradient, or on the fused step (a lazy one) the model's (still
            # scaled, which does not change whether it is finite).
            pairs = [(model_param, model_param.grad if master.grad is None
                      or is_lazy(master.grad) else master.grad)
                     for model_param, master in zip(group.model_params, group.masters)
                     if id(master) not in seen]
            pairs = [(p, grad) for p, grad in pairs if grad is not None]
            seen.update(id(master) for master in group.masters)
            if not pairs:
                continue
            # This rank's shards of FSDP2's gradients.
            flags = multi_tensor.nonfinite_flags(
                local_shards([grad for _, grad in pairs])).tolist()
            names.extend(run.param_name(p) for (p, _), bad in zip(pairs, flags) if bad)
    return names


def half_copies_out_of_range(run, amp_optimizers) -> List[str]:
    """The names of O2's half model parameters that hold inf or NaN while their fp32 master is
    finite: a master beyond the half dtype's range, rounded to inf by the copy (which flags only
    its inputs). One host copy per device; only called on the error path."""
    names: List[str] = []
    for amp_opt in amp_optimizers:
        for group in amp_opt.groups().values():
            if not group.half_models:
                continue
            flags = multi_tensor.nonfinite_flags(local_shards(
                list(group.half_models) + list(group.half_masters))).tolist()
            n = len(group.half_models)
            names.extend(run.param_name(p) for p, half_bad, master_bad
                         in zip(group.half_models, flags[:n], flags[n:])
                         if half_bad and not master_bad)
    return names


def stuck_error(run, amp_optimizers, log: SkipLog, loss_nonfinite: bool,
                evidence=None) -> OverflowStuckError:
    """The error for ``overflow_patience`` skips in a row at the floor, with the locator turned
    on for the next forward (``evidence``: see ``nonfinite_gradient_names``)."""
    scaler = log.scaler
    n, bad_losses = log.floor_skips, log.floor_nonfinite_losses
    if loss_nonfinite:
        cause = (f"The loss itself was inf or NaN (in {bad_losses} of these {n} steps, the last "
                 f"included): the forward produces it, so this is not a loss-scaling problem. "
                 f"Check the inputs, the loss function and the layers' outputs.")
    else:
        cause = ("The loss was finite in the last step: the backward overflows, in fp32 as much "
                 "as in half, whatever the scale. Check the learning rate (diverged weights), "
                 "the inputs, and layers that overflow in half precision (keep them fp32 with "
                 "keep_fp32_modules).")
    names = nonfinite_gradient_names(run, amp_optimizers, evidence)
    if names:
        shown = ", ".join(repr(name) for name in names[:MAX_NAMES])
        more = f" and {len(names) - MAX_NAMES} more" if len(names) > MAX_NAMES else ""
        where = f"Parameters whose gradients were inf or NaN: {shown}{more}."
    elif loss_nonfinite:
        where = "No parameter's gradient held inf or NaN (only the loss did)."
    else:
        where = ("amp cannot name the parameters: no gradient it holds now is inf or NaN (the "
                 "gradients of the skipped step were cleared or overwritten before the decision "
                 "was read on the host).")
    halves = half_copies_out_of_range(run, amp_optimizers)
    if halves:
        half = run.properties.half_dtype
        where += (f" Half parameters that hold inf or NaN while their fp32 master weight is "
                  f"finite (the master is beyond the range of {half}, whose largest value is "
                  f"{torch.finfo(half).max:g}; the forward then overflows): "
                  f"{', '.join(repr(name) for name in halves[:MAX_NAMES])}. The weights "
                  f"diverged: lower the learning rate, or keep those modules fp32 "
                  f"(keep_fp32_modules).")
    run.locate_nonfinite()
    return OverflowStuckError(
        f"loss scaler {scaler.loss_id}: {n} steps in a row were skipped with the loss scale at "
        f"{floor_description(scaler)} (overflow_patience={log.overflow_patience}). {cause} "
        f"{where} amp has turned on the non-finite locator (amp.locate_nonfinite) on the "
        f"model(s): run the next forward and it logs the first module whose output holds inf "
        f"or NaN. Pass overflow_patience=None to amp.initialize to keep training instead.")


class NonfiniteLocator:
    """Forward hooks that name the first module whose output holds inf or NaN in each forward
    of ``model``. Costs one host sync per module per forward: turn it on to debug, not to train.
    ``first_module`` is the name found in the latest forward (None when it was finite).

    Args:
        model: the module whose forwards are watched.
        label: how the log names the model ("the model", "model 1").
    """

    def __init__(self, model: torch.nn.Module, label: str = "the model"):
        self.model = model
        self.label = label
        self.first_module: Optional[str] = None
        self.reported = set()
        self._found = False
        names: Dict[int, str] = {id(m): name for name, m in model.named_modules()}
        self._handles = [model.register_forward_pre_hook(self._start)]
        for module in model.modules():
            self._handles.append(module.register_forward_hook(
                _NamedHook(self, names[id(module)] or "<root>")))

    def _start(self, module, args) -> None:
        self._found = False
        self.first_module = None

    def check(self, name: str, module: torch.nn.Module, args, output) -> None:
        """The forward hook of the submodule ``name`` (``module``, called with ``args``): logs
        it when ``output`` is the first non-finite output of this forward."""
        if self._found or all_finite(output):
            return
        self._found = True
        self.first_module = name
        if name in self.reported:
            return
        self.reported.add(name)
        inputs = ("its inputs were finite, so this module produced the inf/NaN"
                  if all_finite(args) else
                  "its inputs already held inf or NaN (they came from outside the model, or "
                  "from a functional op between modules)")
        logger.warning("amp.locate_nonfinite: the first module of %s whose forward output "
                       "holds inf or NaN is %r (%s); %s", self.label, name,
                       type(module).__name__, inputs)

    def remove(self) -> None:
        """Take the hooks off."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


class _NamedHook:
    """A forward hook that knows its module's name (a class, so the model still pickles)."""

    def __init__(self, locator: NonfiniteLocator, name: str):
        self.locator = locator
        self.name = name

    def __call__(self, module, args, output):
        self.locator.check(self.name, module, args, output)


def all_finite(value) -> bool:
    tensors: List[torch.Tensor] = []
    apply_to_floats(value, lambda t: tensors.append(t) or t)
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def locate_nonfinite(models: Sequence[torch.nn.Module]) -> List[NonfiniteLocator]:
    return [NonfiniteLocator(m, f"model {i}" if len(models) > 1 else "the model")
            for i, m in enumerate(models)]
