"""apex.fp16_utils' loss scalers: ``LossScaler`` (a static scale) and ``DynamicLossScaler``
(apex's dynamic rule) for training loops that scale by hand, with apex's names, signatures and
defaults; and ``OptimizerLossScaler``, the scale ``FP16_Optimizer`` keeps (apex kept amp's
scaler there, whose interface and attribute names it has).

    scaler = DynamicLossScaler()
    scaler.backward(loss)                      # (loss * scale).backward()
    overflow = scaler.has_overflow(params)
    if not overflow:
        for p in params: p.grad.mul_(1 / scaler.loss_scale)
        optimizer.step()
    scaler.update_scale(overflow)

One difference from apex: ``LossScaler.has_overflow`` checks the gradients (apex's always said
False), so a loop written as above never applies a non-finite step with a static scale either.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Sequence

import torch

from .. import multi_tensor
from ..amp.scaler import SMALLEST_LOSS_SCALE, fp32_scale_problem
from .fp16util import to_python_float  # noqa: F401  (apex's loss_scaler defined it too)

__all__ = ["LossScaler", "DynamicLossScaler", "OptimizerLossScaler", "to_python_float",
           "grads_have_inf_or_nan", "scale_by_device"]


def scale_by_device(sources: Sequence[torch.Tensor], destinations: Sequence[torch.Tensor],
                    factor: float, flags: Dict[torch.device, torch.Tensor]) -> None:
    """``d = s * factor`` for each pair (``destinations`` may be ``sources``), one fused pass per
    device (``apex_lite.multi_tensor.scale``); an inf or NaN among the sources sets that device's
    flag in ``flags`` (made there when missing). No host sync."""
    groups: Dict[torch.device, tuple] = {}
    for src, dst in zip(sources, destinations):
        group = groups.setdefault(src.device, ([], []))
        group[0].append(src)
        group[1].append(dst)
    for device, (srcs, dsts) in groups.items():
        if device not in flags:
            flags[device] = torch.zeros(1, dtype=torch.float32, device=device)
        multi_tensor.scale(srcs, dsts, factor, flags[device])


def grads_have_inf_or_nan(params: Iterable[torch.Tensor]) -> bool:
    """Whether a gradient of ``params`` holds an inf or NaN: one fused pass per device, one host
    sync."""
    by_device: Dict[torch.device, List[torch.Tensor]] = {}
    found = False
    for p in params:
        grad = p.grad
        if grad is None:
            continue
        if grad.is_sparse:
            grad = grad.coalesce()._values()
        if grad.dtype in (torch.float32, torch.float16, torch.bfloat16):
            by_device.setdefault(grad.device, []).append(grad.detach())
        else:   # fp64 and other dtypes the multi-tensor kernels do not take
            found = found or not bool(torch.isfinite(grad).all())
    flags = [multi_tensor.nonfinite_flags(grads).any() for grads in by_device.values()]
    return found or any(bool(flag) for flag in flags)


class LossScaler:
    """A static loss scale (apex's ``fp16_utils.LossScaler``).

    Args:
        scale: the loss scale (default 1).
    """

    def __init__(self, scale=1):
        self.cur_scale = scale

    def has_overflow(self, params):
        """Whether a gradient of ``params`` holds an inf or NaN (apex's said False always)."""
        return grads_have_inf_or_nan(params)

    @staticmethod
    def _has_inf_or_nan(x):
        """Whether the tensor ``x`` holds an inf or NaN."""
        return not bool(torch.isfinite(x).all())

    def update_scale(self, overflow):
        """A static scale does not change, whatever ``overflow`` says."""

    @property
    def loss_scale(self):
        """The current loss scale."""
        return self.cur_scale

    def scale_gradient(self, module, grad_in, grad_out):
        """A backward hook on ``module`` (apex's signature): ``grad_in`` multiplied by the
        scale; ``grad_out`` is unused."""
        return tuple(self.loss_scale * g for g in grad_in)

    def backward(self, loss, retain_graph=False):
        """``(loss * loss_scale).backward(retain_graph=retain_graph)``."""
        scaled_loss = loss * self.loss_scale
        scaled_loss.backward(retain_graph=retain_graph)


class DynamicLossScaler:
    """apex's dynamic loss scale for hand-written loops.

    Args:
        init_scale: the first scale (default 2**32).
        scale_factor: on an overflow the scale is divided by it (floored at 1); after
            ``scale_window`` iterations since the last overflow it is multiplied by it.
        scale_window: iterations without overflow between two increases (default 1000).
    """

    def __init__(self, init_scale=2 ** 32, scale_factor=2., scale_window=1000):
        self.cur_scale = init_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window

    def has_overflow(self, params):
        """Whether a gradient of ``params`` holds an inf or NaN (one pass, one host sync)."""
        return grads_have_inf_or_nan(params)

    _has_inf_or_nan = staticmethod(LossScaler._has_inf_or_nan)

    def update_scale(self, overflow):
        """Count one iteration and move the scale by apex's rule (see the class): divided by
        ``scale_factor`` when ``overflow``, multiplied after ``scale_window`` clean ones."""
        if overflow:
            self.cur_scale = max(self.cur_scale / self.scale_factor, 1)
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    loss_scale = LossScaler.loss_scale
    scale_gradient = LossScaler.scale_gradient
    backward = LossScaler.backward


class OptimizerLossScaler:
    """The loss scale of an ``FP16_Optimizer`` (what its ``state_dict()['loss_scaler']`` holds),
    with the interface and attribute names of apex's amp ``LossScaler``, which apex's
    FP16_Optimizer kept there.

    Args:
        loss_scale: ``"dynamic"``, or a static scale (a positive number).
        init_scale: a dynamic scale's start, moved into ``[min_loss_scale, max_loss_scale]``.
        scale_factor: a dynamic scale is divided by it on an overflow (floored at
            ``min_loss_scale``, or at 2**-126) and multiplied by it (capped at
            ``max_loss_scale``) after ``scale_window`` clean steps in a row. apex accepted it and
            always used 2.
    Raises:
        ValueError: a scale, bound or factor that cannot work (a scale or its inverse not a
            finite fp32 number, a factor not above 1, a window below 1).

    Unlike apex's, a step whose gradients are not finite is skipped with a static scale too
    (``update_scale`` says so); the static scale stays as it is.
    """

    def __init__(self, loss_scale, init_scale=2. ** 16, scale_factor=2., scale_window=2000,
                 min_loss_scale=None, max_loss_scale=2. ** 24):
        self.dynamic = loss_scale == "dynamic"
        for name, value in (("loss_scale", None if self.dynamic else loss_scale),
                            ("init_scale", init_scale), ("min_loss_scale", min_loss_scale),
                            ("max_loss_scale", max_loss_scale)):
            if value is None:
                continue
            problem = fp32_scale_problem(float(value)) if float(value) > 0 else \
                "a loss scale must be positive"
            if problem:
                raise ValueError(f"{name}={value!r} cannot be used as a loss scale: {problem}")
        if not float(scale_factor) > 1 or float(scale_factor) == float("inf"):
            raise ValueError(f"scale_factor={scale_factor!r}: it must be a finite number above "
                             f"1 (the scale is divided by it on an overflow)")
        if int(scale_window) != scale_window or scale_window < 1:
            raise ValueError(f"scale_window={scale_window!r}: it must be a positive integer")
        start = min(float(max_loss_scale), float(init_scale))
        if min_loss_scale is not None:
            start = max(start, float(min_loss_scale))
        self._loss_scale = start if self.dynamic else float(loss_scale)
        self._scale_factor = float(scale_factor)
        self._scale_seq_len = int(scale_window)
        self._min_loss_scale = min_loss_scale
        self._max_loss_scale = float(max_loss_scale)
        self._unskipped = 0
        self._has_overflow = False
        self._found_inf: Dict[torch.device, torch.Tensor] = {}   # this step's device flags

    def loss_scale(self) -> float:
        """The current loss scale."""
        return self._loss_scale

    def clear_overflow_state(self) -> None:
        """Forget the overflow of an earlier unscale (a new step's gradients are coming)."""
        self._has_overflow = False
        self._found_inf = {}

    def unscale(self, model_grads, master_grads, scale) -> None:
        """``master = model / scale`` for each pair (``master_grads`` may be ``model_grads``), in
        one fused pass per device that also notes an inf or NaN among ``model_grads``; no sync."""
        scale_by_device(model_grads, master_grads, 1.0 / float(scale), self._found_inf)

    def update_scale(self) -> bool:
        """Decide the step: reads the overflow flags (one host sync), moves a dynamic scale by
        the rule, and returns True when the step must be skipped (an inf or NaN was seen)."""
        flags = list(self._found_inf.values())
        self._has_overflow = self._has_overflow or any(bool(f.item()) for f in flags)
        if self._has_overflow:
            if self.dynamic:
                floor = SMALLEST_LOSS_SCALE if self._min_loss_scale is None \
                    else float(self._min_loss_scale)
                self._loss_scale = max(floor, self._loss_scale / self._scale_factor)
            self._unskipped = 0
            return True
        self._unskipped += 1
        if self.dynamic and self._unskipped >= self._scale_seq_len:
            self._loss_scale = min(self._max_loss_scale, self._loss_scale * self._scale_factor)
            self._unskipped = 0
        return False

    @classmethod
    def from_saved(cls, saved) -> "OptimizerLossScaler":
        """A new scaler holding a saved one's state: an ``OptimizerLossScaler``, apex's amp
        ``LossScaler`` unpickled from an apex checkpoint (the same attribute names), or a dict of
        those attributes. Raises ValueError, naming what is wrong, for anything else."""
        attrs = saved if isinstance(saved, dict) else getattr(saved, "__dict__", None)
        if not isinstance(attrs, dict) or "_loss_scale" not in attrs or "dynamic" not in attrs:
            raise ValueError(f"state_dict['loss_scaler'] must be the loss scaler an "
                             f"FP16_Optimizer saved (with _loss_scale and dynamic); got "
                             f"{type(saved).__name__}")
        dynamic, scale = bool(attrs["dynamic"]), attrs["_loss_scale"]
        scaler = cls("dynamic" if dynamic else scale,
                     scale_factor=attrs.get("_scale_factor", 2.),
                     scale_window=attrs.get("_scale_seq_len", 2000),
                     min_loss_scale=attrs.get("_min_loss_scale"),
                     max_loss_scale=attrs.get("_max_loss_scale", 2. ** 24))
        if dynamic:
            problem = fp32_scale_problem(float(scale)) if float(scale) > 0 else \
                "it must be positive"
            if problem:
                raise ValueError(f"the saved loss scale {scale!r} cannot be used: {problem}")
            scaler._loss_scale = float(scale)
        unskipped = attrs.get("_unskipped", 0)
        if isinstance(unskipped, bool) or not isinstance(unskipped, int) or unskipped < 0:
            raise ValueError(f"the saved loss scaler's _unskipped must be a non-negative int, "
                             f"got {unskipped!r}")
        scaler._unskipped = unskipped
        scaler._has_overflow = bool(attrs.get("_has_overflow", False))
        return scaler

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_found_inf"] = {}   # device flags of one step, not state
        return state


# FP16_Optimizer.state_dict() holds an OptimizerLossScaler, as apex's held its scaler object:
# torch.load's default (weights_only=True, torch 2.6+) may rebuild it. (torch 2.3 has no
# allow-list, and loads everything by default.)
if hasattr(torch.serialization, "add_safe_globals"):
    torch.serialization.add_safe_globals([OptimizerLossScaler])
