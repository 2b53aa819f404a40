"""One loss scaler per ``loss_id``: the scale, apex's dynamic rule, and the step counters.

Two places the scale can live, chosen once per run by ``initialize``:
- on the host (a Python float), when some optimizer of the run takes the unfused step: its skip
  decision needs the overflow flag on the host anyway (the one sync per step), and a host scale
  lets ``scale_loss`` multiply the loss and the unscale kernels take ``1/scale`` with no more
  syncs. ``update`` applies a decision.
- on the device (``use_device``), when every optimizer takes the fused step: nothing reads the
  overflow flag on the host, so the scale, its counters and the decision history are 1-element
  tensors updated by ``update_on_device`` without a sync. The host counters (``loss_scale``,
  ``steps``, ``skipped_steps``, ``last_step_skipped``) are brought up to date (``sync``) when they
  are read, and every ``sync_interval`` decisions, when the history buffer is full: one small copy
  to the host, whose decisions are then replayed, in order, to ``on_decision`` (the skip log).

Dynamic rule (apex's, plus hysteresis): start at 2**16 moved into ``[min_loss_scale,
max_loss_scale]`` (apex started at ``min(2**16, max_loss_scale)`` even below its floor); after
``scale_window`` clean steps in a row double it, capped at ``max_loss_scale``; on an overflow the
step is skipped and, once ``hysteresis`` overflows have accumulated since the last growth, the
scale is halved, floored at ``min_loss_scale`` (without one, at ``SMALLEST_LOSS_SCALE`` =
2**-126, the smallest normal fp32 whose inverse, the unscale factor, is still finite in fp32).
A static scale never changes; its overflowing steps are still skipped.

Every scale (static, ``min_loss_scale``, ``max_loss_scale``, or loaded from a state) must be a
finite fp32 number whose inverse is too: the loss is multiplied by the scale in fp32 and the
gradients by its inverse, so a larger scale makes the scaled loss inf, and a smaller one (below
about 2.9e-39) makes every unscaled gradient inf or NaN, unseen by the overflow check, which
looks at the gradients before they are unscaled.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, List, Optional, Union

import torch

DEFAULT_SCALE_WINDOW = 2000
DEFAULT_SYNC_INTERVAL = 100
SMALLEST_LOSS_SCALE = 2.0 ** -126
FP32_MAX = float(torch.finfo(torch.float32).max)


def fp32_scale_problem(scale: float) -> Optional[str]:
    """Why ``scale`` cannot be a loss scale (it or its inverse is not a finite fp32 number), or
    None."""
    if scale > FP32_MAX:
        return (f"it is above fp32's largest number {FP32_MAX:.6g}, so the scaled loss would be "
                f"inf")
    if 1.0 / scale > FP32_MAX:
        return (f"its inverse {1.0 / scale:.6g}, the factor that unscales the gradients, is above "
                f"fp32's largest number {FP32_MAX:.6g}, so every unscaled gradient would be inf "
                f"or NaN")
    return None

# Columns of the device decision history: what the host replays at a sync.
_OVERFLOW, _LOSS_NONFINITE, _OLD_SCALE, _NEW_SCALE, _UNSKIPPED, _HYSTERESIS_LEFT = range(6)


@dataclasses.dataclass
class BackwardScale:
    """The loss scale of one backward, taken when its ``scale_loss`` began: ``multiplier``
    scales the loss, ``inv`` (its inverse) brings the gradients back to true values. Both are
    host floats, or 1-element fp32 device tensors when the scaler is on the device. ``token``
    tells two scales apart on the host without reading the device: gradients of two backwards may
    be accumulated still scaled only when their tokens are equal."""
    loss_id: int
    multiplier: Union[float, torch.Tensor]
    inv: Union[float, torch.Tensor]
    token: object

    def describe(self) -> str:
        value = "" if isinstance(self.multiplier, torch.Tensor) else f" {self.multiplier}"
        return f"loss scaler {self.loss_id}'s scale{value}"


class LossScaler:
    """Scale state and counters of one loss. ``loss_scale``, ``steps`` (decisions made),
    ``skipped_steps`` and ``last_step_skipped`` are host values for diagnostics; on a device scale
    reading one first brings them up to date (one sync). ``initialize`` makes one per loss;
    ``amp.loss_scalers()`` returns them.

    Args:
        loss_id: the loss this scaler scales.
        loss_scale: a number (static) or "dynamic".
        min_loss_scale: keyword-only; the dynamic scale's floor (None: none).
        max_loss_scale: keyword-only; the dynamic scale's ceiling.
        scale_window: keyword-only; clean steps before the dynamic scale doubles.
        hysteresis: keyword-only; overflows tolerated before it halves.
        sync_interval: keyword-only; on a device scale, the most decisions between two syncs.

    Raises:
        ValueError: a scale whose inverse is not a finite fp32 number, or above fp32's largest.
    """

    def __init__(self, loss_id: int, loss_scale, *, min_loss_scale: Optional[float],
                 max_loss_scale: float, scale_window: int = DEFAULT_SCALE_WINDOW,
                 hysteresis: int = 1, sync_interval: int = DEFAULT_SYNC_INTERVAL):
        self.loss_id = loss_id
        self.dynamic = loss_scale == "dynamic"
        for name, value in (("loss_scale", None if self.dynamic else loss_scale),
                            ("min_loss_scale", min_loss_scale),
                            ("max_loss_scale", max_loss_scale)):
            problem = None if value is None else fp32_scale_problem(float(value))
            if problem:
                raise ValueError(f"{name}={value!r} cannot be used as a loss scale: {problem}. "
                                 f"Loss scales must lie between {1.0 / FP32_MAX:.3g} and "
                                 f"{FP32_MAX:.3g}; in practice 1 to 2**24, or loss_scale="
                                 f"'dynamic' to let amp choose.")
        self.min_loss_scale = min_loss_scale
        self.max_loss_scale = max_loss_scale
        self.scale_window = scale_window
        self.hysteresis = hysteresis
        self.sync_interval = sync_interval
        if self.dynamic:
            # 2**16, moved into [min_loss_scale, max_loss_scale]: a scale that started below its
            # floor would rise on its first overflow, and the run's own state would not load.
            start = min(2.0 ** 16, max_loss_scale)
            self._loss_scale = float(start if min_loss_scale is None
                                     else max(start, min_loss_scale))
        else:
            self._loss_scale = float(loss_scale)
        self.unskipped = 0                 # clean steps since the last growth or overflow (apex)
        self.hysteresis_left = hysteresis  # overflows still tolerated before the next halving
        self._steps = 0
        self._skipped_steps = 0
        self._last_step_skipped = False
        # The device state (use_device): [scale, unskipped, hysteresis_left] and the decisions
        # not yet replayed on the host (``_pending`` rows of ``_history``).
        self._state: Optional[torch.Tensor] = None
        self._history: Optional[torch.Tensor] = None
        self._pending = 0
        self._decisions = 0   # update_on_device calls so far (a host count)
        # Called once per decision, in order, with (old_scale, overflow, loss_nonfinite) after
        # the host counters took it in (the run's skip log; it may raise OverflowStuckError).
        self.on_decision: Optional[Callable[[float, bool, bool], None]] = None

    # ---- the host counters (a device scale syncs before they are read) ---------------------
    @property
    def loss_scale(self) -> float:
        """The current loss scale (a host float; settable)."""
        self.sync()
        return self._loss_scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self.sync()
        self._loss_scale = float(value)
        if self._state is not None:
            self._state[0].fill_(self._loss_scale)

    @property
    def steps(self) -> int:
        """Skip decisions made so far (steps taken or skipped)."""
        self.sync()
        return self._steps

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far because their gradients held inf or NaN."""
        self.sync()
        return self._skipped_steps

    @property
    def last_step_skipped(self) -> bool:
        """Whether the latest step was skipped."""
        self.sync()
        return self._last_step_skipped

    @property
    def on_device(self) -> bool:
        """Whether the scale lives on the device (the fused step's), read by syncing."""
        return self._state is not None

    # ---- the host scale ----------------------------------------------------------------------
    def update(self, overflow: bool) -> None:
        """Record one skip decision and move the host scale by the dynamic rule; ``overflow``:
        whether the step's gradients held inf or NaN (it was skipped)."""
        self._steps += 1
        self._last_step_skipped = overflow
        if overflow:
            self._skipped_steps += 1
            self.unskipped = 0
            if self.dynamic:
                self.hysteresis_left -= 1
                if self.hysteresis_left <= 0:
                    self._loss_scale = max(self._loss_scale / 2.0, self.floor())
                    self.hysteresis_left = self.hysteresis
            return
        self.unskipped += 1
        if self.dynamic and self.unskipped >= self.scale_window:
            self._loss_scale = min(self.max_loss_scale, self._loss_scale * 2.0)
            self.unskipped = 0
            self.hysteresis_left = self.hysteresis

    def floor(self) -> float:
        """The lowest scale the dynamic rule goes to."""
        return SMALLEST_LOSS_SCALE if self.min_loss_scale is None else self.min_loss_scale

    # ---- the device scale --------------------------------------------------------------------
    def use_device(self, device: torch.device) -> None:
        """Keep the scale and its counters on ``device`` from now on (see the module doc)."""
        self._state = torch.tensor([self._loss_scale, float(self.unskipped),
                                    float(self.hysteresis_left)], dtype=torch.float32,
                                   device=device)
        self._history = torch.zeros(self.sync_interval, 6, dtype=torch.float32, device=device)
        self._pending = 0

    def device(self) -> Optional[torch.device]:
        """Where the scale lives: its device, or None on the host."""
        return None if self._state is None else self._state.device

    def backward_scale(self) -> BackwardScale:
        """The scale for a backward starting now (no sync)."""
        if self._state is None:
            scale = self._loss_scale
            return BackwardScale(self.loss_id, scale, 1.0 / scale, scale)
        scale = self._state[0:1].clone()   # the next decision changes the state in place
        return BackwardScale(self.loss_id, scale, torch.reciprocal(scale),
                             (self.loss_id, self._decisions))

    def update_on_device(self, overflow: torch.Tensor, loss_nonfinite: torch.Tensor) -> None:
        """The dynamic rule of ``update`` on the device: ``overflow`` and ``loss_nonfinite`` are
        1-element fp32 flags (0 or 1) on the device; no host sync. Every ``sync_interval``
        decisions the history is full and is replayed on the host (one sync)."""
        state = self._state
        scale, unskipped, hysteresis_left = state[0], state[1], state[2]
        overflow, loss_nonfinite = overflow.to(state.device), loss_nonfinite.to(state.device)
        skipped = overflow.reshape(()) != 0
        unskipped_after = torch.where(skipped, torch.zeros_like(unskipped), unskipped + 1)
        if self.dynamic:
            hysteresis_after = torch.where(skipped, hysteresis_left - 1, hysteresis_left)
            halve = skipped & (hysteresis_after <= 0)
            grow = ~skipped & (unskipped_after >= self.scale_window)
            new_scale = torch.where(halve, torch.clamp(scale * 0.5, min=self.floor()), scale)
            new_scale = torch.where(grow, torch.clamp(scale * 2.0, max=self.max_loss_scale),
                                    new_scale)
            reset = halve | grow
            hysteresis_after = torch.where(reset, torch.full_like(hysteresis_left,
                                                                  self.hysteresis),
                                           hysteresis_after)
            unskipped_after = torch.where(grow, torch.zeros_like(unskipped), unskipped_after)
        else:
            new_scale, hysteresis_after = scale, hysteresis_left
        self._history[self._pending].copy_(torch.stack(
            [skipped.to(torch.float32), loss_nonfinite.reshape(()).to(torch.float32), scale,
             new_scale, unskipped_after, hysteresis_after]))
        state.copy_(torch.stack([new_scale, unskipped_after, hysteresis_after]))
        self._decisions += 1
        self._pending += 1
        if self._pending == self.sync_interval:
            self.sync()

    def sync(self) -> None:
        """Replay on the host the decisions the device made since the last sync (one copy)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, 0
        rows: List[List[float]] = self._history[:pending].tolist()
        raised: Optional[BaseException] = None
        for row in rows:
            overflow = row[_OVERFLOW] != 0.0
            self._steps += 1
            self._last_step_skipped = overflow
            self._skipped_steps += overflow
            self._loss_scale = row[_NEW_SCALE]
            self.unskipped = int(row[_UNSKIPPED])
            self.hysteresis_left = int(row[_HYSTERESIS_LEFT])
            if self.on_decision is not None:
                try:
                    self.on_decision(row[_OLD_SCALE], overflow, row[_LOSS_NONFINITE] != 0.0)
                except Exception as exc:   # OverflowStuckError: after every row is counted
                    raised = raised or exc
        if raised is not None:
            raise raised

    # apex's checkpoint format, plus the counters a bitwise resume needs.
    def apex_state(self) -> dict:
        """apex's checkpoint entry: ``{"loss_scale": ..., "unskipped": ...}``."""
        self.sync()
        return {"loss_scale": self._loss_scale, "unskipped": self.unskipped}

    def extra_state(self) -> dict:
        """The counters a bitwise resume needs beside apex's entry."""
        self.sync()
        return {"hysteresis_left": self.hysteresis_left, "steps": self.steps,
                "skipped_steps": self.skipped_steps,
                "last_step_skipped": self.last_step_skipped}

    def check_state(self, key: str, apex_state, extra_state: Optional[dict], *,
                    fit: bool = True) -> None:
        """Raise ValueError when the saved state (``apex_state``, apex's entry under ``key``, and
        ``extra_state``, apex_lite's counters or None) is damaged or, with ``fit``, cannot be
        loaded into this scaler (``fit=False``: a state that will not be loaded, checked for
        damage only)."""
        if not isinstance(apex_state, dict) or set(apex_state) != {"loss_scale", "unskipped"}:
            raise ValueError(f"{key} must be a dict with keys 'loss_scale' and 'unskipped' "
                             f"(apex's format); got {apex_state!r}")
        scale, unskipped = apex_state["loss_scale"], apex_state["unskipped"]
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) \
                or not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"{key}['loss_scale'] must be a positive finite number, got "
                             f"{scale!r}")
        problem = fp32_scale_problem(float(scale))
        if problem:
            raise ValueError(f"{key}['loss_scale'] is {float(scale)!r}, which cannot be a loss "
                             f"scale: {problem}. amp never writes such a scale: the state is "
                             f"damaged or was edited.")
        if isinstance(unskipped, bool) or not isinstance(unskipped, int) or unskipped < 0:
            raise ValueError(f"{key}['unskipped'] must be a non-negative int, got {unskipped!r}")
        if fit and not self.dynamic and float(scale) != self.loss_scale:
            raise ValueError(f"{key} holds loss_scale {float(scale)} but this run uses the static "
                             f"loss scale {self.loss_scale}; initialize with "
                             f"loss_scale={float(scale)} or 'dynamic' to resume it")
        if fit and self.dynamic:
            low = self.min_loss_scale if self.min_loss_scale is not None else 0.0
            if not low <= scale <= self.max_loss_scale:
                raise ValueError(f"{key} holds loss_scale {float(scale)}, outside this run's "
                                 f"[min_loss_scale, max_loss_scale] = [{self.min_loss_scale}, "
                                 f"{self.max_loss_scale}]; initialize with bounds that contain it")
        if extra_state is not None:
            expected = {"hysteresis_left": int, "steps": int, "skipped_steps": int,
                        "last_step_skipped": bool}
            if not isinstance(extra_state, dict) or set(extra_state) != set(expected):
                raise ValueError(f"the apex_lite counters for {key} must be a dict with keys "
                                 f"{sorted(expected)}; got {extra_state!r}")
            for name, kind in expected.items():
                if type(extra_state[name]) is not kind or (kind is int and extra_state[name] < 0):
                    raise ValueError(f"the apex_lite counter {name!r} for {key} must be a "
                                     f"non-negative {kind.__name__}, got {extra_state[name]!r}")
            if extra_state["hysteresis_left"] < 1 \
                    or (fit and extra_state["hysteresis_left"] > self.hysteresis):
                raise ValueError(f"the apex_lite counter 'hysteresis_left' for {key} is "
                                 f"{extra_state['hysteresis_left']}, outside this run's "
                                 f"1..hysteresis={self.hysteresis}")

    def load_state(self, apex_state: dict, extra_state: Optional[dict]) -> None:
        """Apply ``apex_state`` and ``extra_state`` once ``check_state`` accepted them (decisions
        not yet replayed are replayed first, so that their log lines are not lost)."""
        self.sync()
        self._loss_scale = float(apex_state["loss_scale"])
        self.unskipped = int(apex_state["unskipped"])
        if extra_state is not None:
            self.hysteresis_left = extra_state["hysteresis_left"]
            self._steps = extra_state["steps"]
            self._skipped_steps = extra_state["skipped_steps"]
            self._last_step_skipped = extra_state["last_step_skipped"]
        if self._state is not None:
            self._state.copy_(torch.tensor([self._loss_scale, float(self.unskipped),
                                            float(self.hysteresis_left)]))
