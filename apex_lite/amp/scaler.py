"""One loss scaler per ``loss_id``: the scale, apex's dynamic rule, and the step counters.

The scale lives on the host as a Python float: the skip decision needs the overflow flag on the
host anyway (the one sync per step), and a host scale lets ``scale_loss`` multiply the loss and
the unscale kernels take ``1/scale`` without further syncs.

Dynamic rule (apex's, plus hysteresis): start at ``min(2**16, max_loss_scale)``; after
``scale_window`` clean steps in a row double it, capped at ``max_loss_scale``; on an overflow the
step is skipped and, once ``hysteresis`` overflows have accumulated since the last growth, the
scale is halved, floored at ``min_loss_scale`` (without one, at ``SMALLEST_LOSS_SCALE`` =
2**-126, the smallest normal fp32 whose inverse, the unscale factor, is still finite in fp32).
A static scale never changes; its overflowing steps are still skipped.
"""
from __future__ import annotations

import math
from typing import Optional

DEFAULT_SCALE_WINDOW = 2000
SMALLEST_LOSS_SCALE = 2.0 ** -126


class LossScaler:
    """Scale state and counters of one loss. The counters are plain attributes for diagnostics:
    ``steps`` (decisions made), ``skipped_steps``, ``loss_scale``, ``last_step_skipped``."""

    def __init__(self, loss_id: int, loss_scale, *, min_loss_scale: Optional[float],
                 max_loss_scale: float, scale_window: int = DEFAULT_SCALE_WINDOW,
                 hysteresis: int = 1):
        self.loss_id = loss_id
        self.dynamic = loss_scale == "dynamic"
        self.min_loss_scale = min_loss_scale
        self.max_loss_scale = max_loss_scale
        self.scale_window = scale_window
        self.hysteresis = hysteresis
        self.loss_scale = min(2.0 ** 16, max_loss_scale) if self.dynamic else float(loss_scale)
        self.unskipped = 0                 # clean steps since the last growth or overflow (apex)
        self.hysteresis_left = hysteresis  # overflows still tolerated before the next halving
        self.steps = 0
        self.skipped_steps = 0
        self.last_step_skipped = False

    def update(self, overflow: bool) -> None:
        """Record one skip decision and move the scale by the dynamic rule."""
        self.steps += 1
        self.last_step_skipped = overflow
        if overflow:
            self.skipped_steps += 1
            self.unskipped = 0
            if self.dynamic:
                self.hysteresis_left -= 1
                if self.hysteresis_left <= 0:
                    halved = max(self.loss_scale / 2.0, SMALLEST_LOSS_SCALE
                                 if self.min_loss_scale is None else self.min_loss_scale)
                    self.loss_scale = halved
                    self.hysteresis_left = self.hysteresis
            return
        self.unskipped += 1
        if self.dynamic and self.unskipped >= self.scale_window:
            self.loss_scale = min(self.max_loss_scale, self.loss_scale * 2.0)
            self.unskipped = 0
            self.hysteresis_left = self.hysteresis

    # apex's checkpoint format, plus the counters a bitwise resume needs.
    def apex_state(self) -> dict:
        return {"loss_scale": self.loss_scale, "unskipped": self.unskipped}

    def extra_state(self) -> dict:
        return {"hysteresis_left": self.hysteresis_left, "steps": self.steps,
                "skipped_steps": self.skipped_steps,
                "last_step_skipped": self.last_step_skipped}

    def check_state(self, key: str, apex_state, extra_state: Optional[dict]) -> None:
        """Raise ValueError when the saved state cannot be loaded into this scaler."""
        if not isinstance(apex_state, dict) or set(apex_state) != {"loss_scale", "unskipped"}:
            raise ValueError(f"{key} must be a dict with keys 'loss_scale' and 'unskipped' "
                             f"(apex's format); got {apex_state!r}")
        scale, unskipped = apex_state["loss_scale"], apex_state["unskipped"]
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) \
                or not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"{key}['loss_scale'] must be a positive finite number, got "
                             f"{scale!r}")
        if isinstance(unskipped, bool) or not isinstance(unskipped, int) or unskipped < 0:
            raise ValueError(f"{key}['unskipped'] must be a non-negative int, got {unskipped!r}")
        if not self.dynamic and float(scale) != self.loss_scale:
            raise ValueError(f"{key} holds loss_scale {float(scale)} but this run uses the static "
                             f"loss scale {self.loss_scale}; initialize with "
                             f"loss_scale={float(scale)} or 'dynamic' to resume it")
        if self.dynamic:
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
            if extra_state["hysteresis_left"] > self.hysteresis \
                    or extra_state["hysteresis_left"] < 1:
                raise ValueError(f"the apex_lite counter 'hysteresis_left' for {key} is "
                                 f"{extra_state['hysteresis_left']}, outside this run's "
                                 f"1..hysteresis={self.hysteresis}")

    def load_state(self, apex_state: dict, extra_state: Optional[dict]) -> None:
        """Apply a state that ``check_state`` accepted."""
        self.loss_scale = float(apex_state["loss_scale"])
        self.unskipped = int(apex_state["unskipped"])
        if extra_state is not None:
            self.hysteresis_left = extra_state["hysteresis_left"]
            self.steps = extra_state["steps"]
            self.skipped_steps = extra_state["skipped_steps"]
            self.last_step_skipped = extra_state["last_step_skipped"]
