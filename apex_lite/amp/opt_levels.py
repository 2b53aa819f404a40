"""Opt levels O0-O5 and the validation of their overrides (apex.amp's ``Properties``, stricter).

O0-O3 are NVIDIA apex's levels; O4 and O5 are ROCm apex's (AMD's fork, which still ships amp):
O4 is O1 in bfloat16 and O5 is O2 in bfloat16, each with a static loss scale of 1.0 (bf16 has
fp32's exponent range). An opt level is a small frozen object: a one-line description plus the
properties apex users know. ``resolve_properties`` applies a user's overrides to a level and
refuses combinations that make no sense, naming the reason (ROCm apex's rules for O4, O5 and
``patch_torch_functions_type``); it also accepts apex's argparse strings ("True", "128.0",
"dynamic"). The rest of amp reads the resolved properties, never a level's name, so that O4
takes every path O1 takes and O5 every path O2 takes.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Union

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)

LossScale = Union[float, str]

# Marks "the run's half dtype" in a level's cast_model_type (fp16 on CUDA, bf16 on CPU by default,
# the level's own half_dtype where it has one).
HALF = torch.float16


class OptLevelError(ValueError, RuntimeError):
    """An unknown opt level, or overrides that contradict each other or the level. A ValueError
    (apex_lite's refusals of bad arguments) and a RuntimeError (what NVIDIA's and ROCm's apex
    raised for these), so that code written for either catches it."""


@dataclasses.dataclass(frozen=True)
class OptLevel:
    """One opt level: apex's properties and what they mean in a line.

    Attributes:
        name: "O0" ... "O5".
        brief: what the level does, in a line.
        cast_model_type: the dtype the model is cast to (None: not cast).
        patch_torch_functions: whether the forward runs under ``torch.autocast``.
        keep_batchnorm_fp32: whether BatchNorm stays fp32 in a half model.
        master_weights: whether the optimizer steps fp32 master weights.
        loss_scale: a number (static) or "dynamic".
        half_dtype: the level's own half type (O4, O5: bf16), None where the device chooses
            (``default_half_dtype``).
        like: the level it otherwise is (O4: O1, O5: O2), or None.
    """
    name: str
    brief: str
    cast_model_type: Optional[torch.dtype]   # None: not cast; torch.float32 or "half" via HALF
    patch_torch_functions: Optional[bool]     # True: forward under torch.autocast
    keep_batchnorm_fp32: Optional[bool]
    master_weights: Optional[bool]
    loss_scale: LossScale
    half_dtype: Optional[torch.dtype] = None
    like: Optional[str] = None

    @property
    def autocasts(self) -> bool:
        """Whether the level runs the forward under autocast (O1, O4): apex's "patching"."""
        return bool(self.patch_torch_functions)

    @property
    def patch_type(self) -> torch.dtype:
        """The one ``patch_torch_functions_type`` a user may pass at an autocasting level (ROCm
        apex's rule: float16 at O1, bfloat16 at O4)."""
        return self.half_dtype or torch.float16


_O1 = OptLevel("O1", "Mixed precision by autocast: fp32 weights, the forward runs under "
               "torch.autocast, dynamic loss scaling.", None, True, None, None, "dynamic")
_O2 = OptLevel("O2", "Almost half: model cast to half with BatchNorm kept fp32, fp32 master "
               "weights in the optimizer, dynamic loss scaling.", HALF, False, True, True,
               "dynamic")

OPT_LEVELS = {
    "O0": OptLevel("O0", "Pure fp32 training (a baseline: nothing is cast, loss scale 1.0).",
                   torch.float32, False, None, False, 1.0),
    "O1": _O1,
    "O2": _O2,
    "O3": OptLevel("O3", "Pure half training (a speed baseline: no master weights, loss scale "
                   "1.0).", HALF, False, False, False, 1.0),
    # ROCm apex's levels: O1 and O2 in bf16 on every device, with bf16's static scale 1.0.
    "O4": dataclasses.replace(
        _O1, name="O4", brief="O1 in bfloat16 (ROCm apex): fp32 weights, the forward runs under "
        "torch.autocast in bf16, static loss scale 1.0.", loss_scale=1.0,
        half_dtype=torch.bfloat16, like="O1"),
    "O5": dataclasses.replace(
        _O2, name="O5", brief="O2 in bfloat16 (ROCm apex): model cast to bf16 with BatchNorm kept "
        "fp32, fp32 master weights in the optimizer, static loss scale 1.0.",
        patch_torch_functions=None, loss_scale=1.0, half_dtype=torch.bfloat16, like="O2"),
}


@dataclasses.dataclass
class Properties:
    """The resolved configuration of one ``amp.initialize`` call: the level's properties with
    the user's overrides applied (``amp._amp_state.opt_properties`` shows them as apex did).

    Attributes:
        opt_level: the level's name.
        half_dtype: the run's half dtype.
        cast_model_type: the dtype the model is cast to (None: not cast).
        patch_torch_functions: whether the forward runs under ``torch.autocast``.
        patch_torch_functions_type: the dtype the forward runs in under autocast, None where
            there is no autocast.
        keep_batchnorm_fp32: whether BatchNorm stays fp32 in a half model.
        master_weights: whether the optimizer steps fp32 master weights.
        loss_scale: a number (static) or "dynamic".
        cast_model_outputs: the dtype the model's outputs are cast to, or None.
    """
    opt_level: str
    half_dtype: torch.dtype
    cast_model_type: Optional[torch.dtype]
    patch_torch_functions: Optional[bool]
    patch_torch_functions_type: Optional[torch.dtype]
    keep_batchnorm_fp32: Optional[bool]
    master_weights: Optional[bool]
    loss_scale: LossScale
    cast_model_outputs: Optional[torch.dtype]

    @property
    def dynamic(self) -> bool:
        """Whether the loss scale is dynamic."""
        return self.loss_scale == "dynamic"

    @property
    def keeps_master_weights(self) -> bool:
        """fp32 master weights kept the way O2 and O5 keep them: at a level that makes them, not
        turned off (the fused step's rule; O0 and O3 with ``master_weights=True`` take the
        unfused step)."""
        return bool(self.master_weights) and bool(OPT_LEVELS[self.opt_level].master_weights)

    def describe(self) -> str:
        """One line: every property and its value."""
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))


def unknown_opt_level_message(opt_level) -> str:
    """The error for an opt level that is not one of ``OPT_LEVELS``."""
    names = ", ".join(f"'{name}'" for name in OPT_LEVELS)
    return (f"Unexpected optimization level {opt_level!r}. Options are {names}. Note that in "
            f"`O0`, `O1`, etc., the prefix O is the letter O, not the number zero.")


def _parse_bool(name: str, value) -> Optional[bool]:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value in ("True", "False"):
        return value == "True"
    raise OptLevelError(f"{name} must be True, False, the string 'True' or 'False', or None; "
                        f"got {value!r}")


def _parse_loss_scale(value) -> Optional[LossScale]:
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() == "dynamic":
        return "dynamic"
    try:
        scale = float(value)
    except (TypeError, ValueError):
        raise OptLevelError(f"loss_scale must be a positive number, a string holding one "
                            f"(e.g. '128.0'), or 'dynamic'; got {value!r}") from None
    if not (math.isfinite(scale) and scale > 0):
        raise OptLevelError(f"loss_scale must be positive and finite, got {value!r}; use "
                            f"'dynamic' to let amp choose it")
    return scale


def _parse_dtype(name: str, value, allowed) -> Optional[torch.dtype]:
    if value is None:
        return None
    if value not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise OptLevelError(f"{name} must be one of {names} or None; got {value!r}")
    return value


def default_half_dtype(device_type: str) -> torch.dtype:
    """The half dtype amp uses on ``device_type`` unless told otherwise: fp16 on CUDA (apex's),
    bf16 elsewhere."""
    return torch.float16 if device_type == "cuda" else torch.bfloat16


def _levels_that_autocast() -> str:
    return " or ".join(f"'{name}'" for name, level in OPT_LEVELS.items() if level.autocasts)


def _check_autocast_overrides(level: OptLevel, cast_model_type, keep_batchnorm_fp32,
                              master_weights, patch_torch_functions, patch_type) -> None:
    """ROCm apex's rules for the overrides that only fit, or never fit, a level whose forward
    runs under autocast (O1, O4)."""
    name = level.name
    if level.autocasts:
        casting_levels = "'O2' or 'O3'" if level.half_dtype is None else "'O5'"
        if cast_model_type not in (None, torch.float32):
            raise OptLevelError(f"{name} runs the forward under torch.autocast with fp32 model "
                                f"weights, so cast_model_type must stay None, False or "
                                f"torch.float32 (got {cast_model_type}). To cast the model itself "
                                f"use opt_level={casting_levels}.")
        if keep_batchnorm_fp32 is not None:
            raise OptLevelError(f"With opt_level {name}, autocast already runs batchnorm in fp32, "
                                f"so keep_batchnorm_fp32 must be None (got {keep_batchnorm_fp32}).")
        if master_weights is not None:
            raise OptLevelError(f"It doesn't make sense to use master_weights with O1 and O4 (got "
                                f"master_weights={master_weights} at {name}): the model weights "
                                f"themselves stay fp32. Use opt_level={casting_levels} for a half "
                                f"model with fp32 master weights.")
        if patch_type is not None and patch_type != level.patch_type:
            other = next(n for n, lv in OPT_LEVELS.items()
                         if lv.autocasts and lv.patch_type == patch_type) \
                if patch_type in HALF_DTYPES else None
            fix = f" For {patch_type} autocast use opt_level='{other}'." if other else ""
            raise OptLevelError(f"patch_torch_functions_type must be {level.patch_type} at "
                                f"opt_level '{name}' (ROCm apex's rule), got {patch_type!r}.{fix}")
        return
    if patch_torch_functions:
        raise OptLevelError(f"patch_torch_functions=True (the forward under torch.autocast) "
                            f"belongs to opt_level={_levels_that_autocast()}; it cannot be "
                            f"combined with {name}, which runs no autocast.")
    if patch_type is not None:
        raise OptLevelError(f"patch_torch_functions_type (autocast's dtype) should only be set by "
                            f"selecting opt_level={_levels_that_autocast()}; {name} runs no "
                            f"autocast, so it must be None (got {patch_type!r}).")


def _resolve_half(level: OptLevel, device_type: str, half_dtype, cast_model_type,
                  patch_type) -> torch.dtype:
    """The run's half dtype: the one asked for (``half_dtype``, a half ``cast_model_type``, a
    ``patch_torch_functions_type``), else the level's own, else the device's default."""
    if half_dtype is not None and level.half_dtype is not None and half_dtype != level.half_dtype:
        raise OptLevelError(f"opt_level {level.name} is {level.like} in {level.half_dtype}, so "
                            f"half_dtype={half_dtype} contradicts it; use opt_level='{level.like}' "
                            f"with half_dtype={half_dtype} instead")
    asked = [(name, value) for name, value in (("half_dtype", half_dtype),
                                               ("cast_model_type", cast_model_type),
                                               ("patch_torch_functions_type", patch_type))
             if value in HALF_DTYPES]
    for (name, value), (other, other_value) in zip(asked, asked[1:]):
        if value != other_value:
            raise OptLevelError(f"{other}={other_value} contradicts {name}={value}; pass only one "
                                f"of them")
    if asked:
        return asked[0][1]
    return level.half_dtype or default_half_dtype(device_type)


def resolve_properties(opt_level, *, device_type: str, half_dtype=None, cast_model_type=None,
                       patch_torch_functions=None, patch_torch_functions_type=None,
                       keep_batchnorm_fp32=None, master_weights=None, loss_scale=None,
                       cast_model_outputs=None) -> Properties:
    """The level's properties with the overrides applied.

    Args:
        opt_level: "O0" to "O5".
        device_type: where the model lives ("cpu", "cuda"): chooses the half dtype of O1-O3.
        half_dtype, cast_model_type, patch_torch_functions, patch_torch_functions_type,
        keep_batchnorm_fp32, master_weights, loss_scale, cast_model_outputs: the overrides of
            ``amp.initialize`` (None: the level's default).

    Returns:
        The resolved ``Properties``.

    Raises:
        OptLevelError (a ValueError and a RuntimeError) naming the reason when the level is
        unknown or the overrides contradict each other or the level.
    """
    if not isinstance(opt_level, str) or opt_level not in OPT_LEVELS:
        raise OptLevelError(unknown_opt_level_message(opt_level))
    level = OPT_LEVELS[opt_level]

    half_dtype = _parse_dtype("half_dtype", half_dtype, HALF_DTYPES)
    # apex's cast_model_type=False: leave the model as it is (None: the level's default).
    no_cast = cast_model_type is False or cast_model_type == "False"
    cast_model_type = None if no_cast else _parse_dtype(
        "cast_model_type", cast_model_type, (torch.float32,) + HALF_DTYPES)
    cast_model_outputs = _parse_dtype("cast_model_outputs", cast_model_outputs,
                                      (torch.float32,) + HALF_DTYPES)
    keep_batchnorm_fp32 = _parse_bool("keep_batchnorm_fp32", keep_batchnorm_fp32)
    master_weights = _parse_bool("master_weights", master_weights)
    patch_torch_functions = _parse_bool("patch_torch_functions", patch_torch_functions)
    loss_scale = _parse_loss_scale(loss_scale)

    _check_autocast_overrides(level, cast_model_type, keep_batchnorm_fp32, master_weights,
                              patch_torch_functions, patch_torch_functions_type)
    half_dtype = _resolve_half(level, device_type, half_dtype, cast_model_type,
                               patch_torch_functions_type)

    resolved_cast = level.cast_model_type if cast_model_type is None else cast_model_type
    if resolved_cast is HALF:
        resolved_cast = half_dtype
    if no_cast:
        resolved_cast = None
    resolved_master = level.master_weights if master_weights is None else master_weights
    resolved_keep_bn = level.keep_batchnorm_fp32 if keep_batchnorm_fp32 is None \
        else keep_batchnorm_fp32
    resolved_patch = level.patch_torch_functions if patch_torch_functions is None \
        else patch_torch_functions

    # master_weights=True on a model left in fp32 (cast_model_type=False or torch.float32) is
    # accepted, as apex did: the fp32 parameters are their own masters, no copies are made.
    if resolved_cast == torch.float32 and keep_batchnorm_fp32 is False:
        raise OptLevelError(f"keep_batchnorm_fp32=False asks for half batchnorm, but {opt_level} "
                            f"keeps the whole model in fp32; use opt_level='O3' for a pure half "
                            f"model.")

    return Properties(
        opt_level=opt_level,
        half_dtype=half_dtype,
        cast_model_type=resolved_cast,
        patch_torch_functions=resolved_patch,
        patch_torch_functions_type=half_dtype if resolved_patch else None,
        keep_batchnorm_fp32=resolved_keep_bn,
        master_weights=resolved_master,
        loss_scale=level.loss_scale if loss_scale is None else loss_scale,
        cast_model_outputs=cast_model_outputs,
    )
