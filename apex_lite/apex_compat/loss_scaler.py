"""``amp._amp_state.loss_scalers[i]``: apex's ``LossScaler`` (apex/amp/scaler.py) as apex code
reads and writes it, over one of the run's ``apex_lite.amp.scaler.LossScaler``.

What apex code does with it, and what it does here:

- reads ``loss_scale()``, ``dynamic``, ``_loss_scale``, ``_unskipped``, ``_has_overflow``,
  ``_min_loss_scale``, ``_max_loss_scale``, ``_scale_seq_len``: the run's values;
- sets ``_loss_scale`` (DeepLearningExamples' GNMT and BERT, to their initial scale): the scale
  of the next backward, as in apex; the dynamic rule moves it from there (a scale above
  ``max_loss_scale``, BERT's 2**32, is used until the first growth caps it, as apex did);
- sets ``_scale_seq_len`` (GNMT's ``dls_upscale_interval``): the clean steps before the dynamic
  scale doubles (``scale_window``);
- swaps ``_overflow_buf`` and calls ``update_scale()`` (DLE BERT's
  ``--allreduce_post_accumulation``, after ``amp.scale_loss(..., delay_overflow_check=True)``
  and its own all-reduce of the master gradients, unscaled by ``multi_tensor_scale`` into its
  own buffer): ``update_scale()`` makes the skip decisions that ``delay_overflow_check`` left
  pending for this scaler now and returns whether the step must be skipped (apex's
  ``should_skip``). amp's own check of the gradients counts, and a non-zero ``_overflow_buf``
  counts as an overflow of the latest backward unless an earlier one already made the step
  skip (an inf it left in the accumulated gradients reaches the buffer too: one step backs the
  scale off once, as apex's one ``update_scale()`` did). The buffer is zeroed once read, as
  apex's next ``scale_loss`` zeroed it. amp's rule decides (a static scale also skips
  non-finite steps, which apex's ``update_scale`` did not); with several backwards pending
  (accumulation), each is one decision, as amp makes them without ``delay_overflow_check``. A
  ``step()`` after a decision to skip skips.
- sets any attribute apex's ``LossScaler`` did not have: kept on this object (apex's was a
  plain object; BERT's ``scaler._overfloat_buf = ...`` is one such write).

apex's other attributes (``dynamic``, ``_unskipped``, ``_has_overflow``, the bounds, the
methods) cannot be set: the error names what sets them in apex_lite. One object per scaler, so
that what is set on it stays.
"""
from __future__ import annotations

import math
import weakref
from typing import Dict, List, Tuple

import torch

from ..amp.scaler import FP32_MAX, LossScaler, fp32_scale_problem

__all__ = ["ApexLossScaler", "apex_loss_scaler"]

# apex's LossScaler attributes that apex_lite's run owns, and what sets each instead.
_OWNED = {
    "dynamic": "amp.initialize(loss_scale='dynamic' or a number)",
    "_unskipped": "amp.load_state_dict (apex's 'unskipped' entry)",
    "_has_overflow": "the run's overflow check: put a non-zero value into _overflow_buf and call "
                     "update_scale() after amp.scale_loss(..., delay_overflow_check=True)",
    "_min_loss_scale": "amp.initialize(min_loss_scale=...)",
    "_max_loss_scale": "amp.initialize(max_loss_scale=...)",
}
_METHODS = ("loss_scale", "update_scale", "unscale", "unscale_python", "unscale_with_stashed",
            "unscale_with_stashed_python", "clear_overflow_state", "has_fused_kernel",
            "warned_no_fused_kernel", "warned_unscaling_non_fp32_grad",
            "multi_tensor_scale_cuda", "multi_tensor_axpby_cuda")
_MAPPED = ("loss_scale", "update_scale", "dynamic", "_loss_scale", "_scale_seq_len",
           "_overflow_buf", "_unskipped", "_has_overflow", "_min_loss_scale", "_max_loss_scale")

_views: "weakref.WeakKeyDictionary[LossScaler, ApexLossScaler]" = weakref.WeakKeyDictionary()


def apex_loss_scaler(scaler: LossScaler, run) -> "ApexLossScaler":
    """The one ``ApexLossScaler`` of ``scaler`` (a scaler of ``run``)."""
    view = _views.get(scaler)
    if view is None:
        view = _views[scaler] = ApexLossScaler(scaler, run)
    return view


class ApexLossScaler:
    """apex's ``LossScaler`` names over ``scaler``, a loss scaler of ``run`` (see the module
    doc). Reads of a device scale sync, as ``amp.loss_scalers()`` does."""

    def __init__(self, scaler: LossScaler, run):
        d = self.__dict__
        d["_scaler"] = scaler
        d["_run_ref"] = weakref.ref(run)
        d["_buffer"] = None
        d["_extra"] = {}

    # ---- reads -----------------------------------------------------------------------------
    def loss_scale(self) -> float:
        """The current loss scale (apex's method)."""
        return self._scaler.loss_scale

    @property
    def dynamic(self) -> bool:
        return self._scaler.dynamic

    @property
    def _loss_scale(self) -> float:
        return self._scaler.loss_scale

    @property
    def _scale_seq_len(self) -> int:
        return self._scaler.scale_window

    @property
    def _unskipped(self) -> int:
        return self._scaler.apex_state()["unskipped"]

    @property
    def _has_overflow(self) -> bool:
        """Whether the latest step's gradients overflowed (read after ``step()``, as apex code
        does: apex's flag of the latest unscale, apex_lite's of the latest skip decision)."""
        return self._scaler.last_step_skipped

    @property
    def _min_loss_scale(self):
        return self._scaler.min_loss_scale

    @property
    def _max_loss_scale(self) -> float:
        return self._scaler.max_loss_scale

    @property
    def _overflow_buf(self) -> torch.Tensor:
        """The flag ``update_scale()`` reads: an int32 ``[0]`` on the scaler's device (a host
        scale: CUDA where there is one, as apex's ``torch.cuda.IntTensor``), or what was set."""
        buffer = self.__dict__["_buffer"]
        if buffer is None:
            device = self._scaler.device() or torch.device(
                "cuda" if torch.cuda.is_available() else "cpu")
            buffer = self.__dict__["_buffer"] = torch.zeros(1, dtype=torch.int32, device=device)
        return buffer

    # ---- update_scale ------------------------------------------------------------------------
    def update_scale(self) -> bool:
        """apex's ``update_scale()``: make the decisions that ``amp.scale_loss(...,
        delay_overflow_check=True)`` left pending for this scaler, counting a non-zero
        ``_overflow_buf`` as an overflow of the latest backward when no earlier one made the
        step skip (the buffer is then zeroed); returns whether the step must be skipped. One
        host read, as apex's.

        Raises:
            RuntimeError: no decision is pending for this scaler (amp made it when scale_loss
                exited), or its run is no longer the current one.
        """
        pending = self._pending()
        if not pending:
            raise RuntimeError(
                f"amp._amp_state.loss_scalers[{self._scaler.loss_id}].update_scale(): no skip "
                f"decision is pending for this loss scaler: amp made it when amp.scale_loss "
                f"exited (or an earlier update_scale() or step() did). update_scale() makes the "
                f"decision that amp.scale_loss(..., delay_overflow_check=True) leaves to the "
                f"caller: pass delay_overflow_check=True to the scale_loss of this step, then "
                f"call update_scale() once before optimizer.step().")
        # The earlier backwards decide first; the buffer then counts as an overflow of the latest
        # one only when none of them made the step skip already: an inf one of them left in
        # the accumulated gradients reaches the caller's buffer too, and one step backs the
        # scale off once, as apex's single update_scale() did.
        (*earlier, (latest_opt, latest)) = pending
        buffer = self.__dict__["_buffer"]
        if self._scaler.on_device:
            flags = [check.skip_flag(amp_opt).reshape(1) for amp_opt, check in earlier]
            if buffer is not None:
                flag = latest.found_inf(latest_opt, buffer.device)
                extra = buffer.reshape(1).ne(0).to(flag.dtype)
                if flags:
                    extra = extra * (1.0 - torch.stack(flags).amax().to(flag))
                torch.maximum(flag, extra, out=flag)
                buffer.zero_()
            flags.append(latest.skip_flag(latest_opt).reshape(1))
            return bool(torch.stack(flags).amax().item())   # the one host read
        skipped = any([check.skips(amp_opt) for amp_opt, check in earlier])   # each decides
        if buffer is not None:
            if not skipped and bool(buffer.reshape(()).item()):
                flag = latest.found_inf(latest_opt, buffer.device)
                flag.fill_(1.0)
            buffer.zero_()
        return latest.skips(latest_opt) or skipped

    def _pending(self) -> List[Tuple[object, object]]:
        """(AmpOptimizer, OverflowCheck) for each check of this scaler not decided yet, oldest
        first, each check once."""
        run = self._run_ref()
        if run is None or self._scaler not in getattr(run, "scalers", ()):
            raise RuntimeError("this loss scaler belongs to an amp run that has ended (amp."
                               "initialize was called again); read amp._amp_state.loss_scalers "
                               "again")
        pending, seen = [], set()
        for amp_opt in run.optimizers:
            for check in amp_opt.checks:
                if check.scaler is not self._scaler or id(check) in seen:
                    continue
                seen.add(id(check))
                if check.overflow is None and not check.resolved_on_device:
                    pending.append((amp_opt, check))
        return pending

    # ---- writes ------------------------------------------------------------------------------
    def __setattr__(self, name, value):
        if name == "_loss_scale":
            self._scaler.loss_scale = _checked_scale(self._scaler, value)
        elif name == "_scale_seq_len":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"loss scaler {self._scaler.loss_id}: _scale_seq_len = "
                                 f"{value!r}; it is the number of clean steps before the "
                                 f"dynamic loss scale doubles, a positive int")
            self._scaler.scale_window = value
        elif name == "_overflow_buf":
            if not isinstance(value, torch.Tensor) or value.numel() != 1 or value.is_complex():
                raise TypeError(f"loss scaler {self._scaler.loss_id}: _overflow_buf must be a "
                                f"1-element integer, bool or float tensor (apex's "
                                f"torch.cuda.IntTensor([0])); got {value!r}")
            self.__dict__["_buffer"] = value
        elif name in _OWNED:
            raise AttributeError(f"amp._amp_state.loss_scalers[i].{name} cannot be set in "
                                 f"apex_lite: {_OWNED[name]} sets it")
        elif name in _METHODS or name.startswith("__"):
            raise AttributeError(f"amp._amp_state.loss_scalers[i].{name} is apex's LossScaler "
                                 f"method or class attribute, which apex_lite's scaler does not "
                                 f"take a replacement for")
        else:
            self.__dict__["_extra"][name] = value   # apex's LossScaler was a plain object

    def __delattr__(self, name):
        if name in self.__dict__["_extra"]:
            del self.__dict__["_extra"][name]
            return
        self.__setattr__(name, None)

    def __getattr__(self, name):
        extra: Dict[str, object] = self.__dict__["_extra"]
        if name in extra:
            return extra[name]
        raise AttributeError(f"amp._amp_state.loss_scalers[i] (apex_lite's view of apex's "
                             f"LossScaler) has no attribute {name!r}; it maps "
                             f"{sorted(_MAPPED)}")

    def __repr__(self) -> str:
        return (f"<amp._amp_state.loss_scalers[{self._scaler.loss_id}] (apex_lite): "
                f"{'dynamic' if self.dynamic else 'static'}, loss scale {self._loss_scale}>")


def _checked_scale(scaler: LossScaler, value) -> float:
    """``value`` as a loss scale, or the error that names why it cannot be one."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"loss scaler {scaler.loss_id}: _loss_scale = {value!r}; a loss scale "
                        f"is a number")
    problem = None if math.isfinite(value) and value > 0 else "it is not a positive finite number"
    problem = problem or fp32_scale_problem(float(value))
    if problem:
        raise ValueError(f"loss scaler {scaler.loss_id}: _loss_scale = {value!r} cannot be a "
                         f"loss scale: {problem}. Loss scales lie between {1.0 / FP32_MAX:.3g} "
                         f"and {FP32_MAX:.3g}.")
    return float(value)

