"""Opt levels O0-O3 and the validation of their overrides (apex.amp's ``Properties``, stricter).

An opt level is a small frozen object: a one-line description plus the five properties apex users
know. ``resolve_properties`` applies a user's overrides to a level and refuses combinations that
make no sense, naming the reason; it also accepts apex's argparse strings ("True", "128.0",
"dynamic").
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Union

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)

LossScale = Union[float, str]


@dataclasses.dataclass(frozen=True)
class OptLevel:
    """One opt level: apex's properties and what they mean in a line."""
    name: str
    brief: str
    cast_model_type: Optional[torch.dtype]   # None: not cast; torch.float32 or "half" via HALF
    patch_torch_functions: bool               # True: forward under torch.autocast
    keep_batchnorm_fp32: Optional[bool]
    master_weights: Optional[bool]
    loss_scale: LossScale


# Marks "the run's half dtype" in a level's cast_model_type (fp16 on CUDA, bf16 on CPU by default).
HALF = torch.float16

OPT_LEVELS = {
    "O0": OptLevel("O0", "Pure fp32 training (a baseline: nothing is cast, loss scale 1.0).",
                   torch.float32, False, None, False, 1.0),
    "O1": OptLevel("O1", "Mixed precision by autocast: fp32 weights, the forward runs under "
                   "torch.autocast, dynamic loss scaling.", None, True, None, None, "dynamic"),
    "O2": OptLevel("O2", "Almost half: model cast to half with BatchNorm kept fp32, fp32 master "
                   "weights in the optimizer, dynamic loss scaling.", HALF, False, True, True,
                   "dynamic"),
    "O3": OptLevel("O3", "Pure half training (a speed baseline: no master weights, loss scale "
                   "1.0).", HALF, False, False, False, 1.0),
}


@dataclasses.dataclass
class Properties:
    """The resolved configuration of one ``amp.initialize`` call."""
    opt_level: str
    half_dtype: torch.dtype
    cast_model_type: Optional[torch.dtype]
    patch_torch_functions: bool
    keep_batchnorm_fp32: Optional[bool]
    master_weights: bool
    loss_scale: LossScale
    cast_model_outputs: Optional[torch.dtype]

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == "dynamic"

    def describe(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))


def unknown_opt_level_message(opt_level) -> str:
    return (f"Unexpected optimization level {opt_level!r}. Options are 'O0', 'O1', 'O2', 'O3'. "
            f"Note that in `O0`, `O1`, etc., the prefix O is the letter O, not the number zero.")


def _parse_bool(name: str, value) -> Optional[bool]:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value in ("True", "False"):
        return value == "True"
    raise ValueError(f"{name} must be True, False, the string 'True' or 'False', or None; "
                     f"got {value!r}")


def _parse_loss_scale(value) -> Optional[LossScale]:
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() == "dynamic":
        return "dynamic"
    try:
        scale = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"loss_scale must be a positive number, a string holding one "
                         f"(e.g. '128.0'), or 'dynamic'; got {value!r}") from None
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"loss_scale must be positive and finite, got {value!r}; use "
                         f"'dynamic' to let amp choose it")
    return scale


def _parse_dtype(name: str, value, allowed) -> Optional[torch.dtype]:
    if value is None:
        return None
    if value not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise ValueError(f"{name} must be one of {names} or None; got {value!r}")
    return value


def default_half_dtype(device_type: str) -> torch.dtype:
    """The half dtype amp uses on ``device_type`` unless told otherwise: fp16 on CUDA (apex's),
    bf16 elsewhere."""
    return torch.float16 if device_type == "cuda" else torch.bfloat16


def resolve_properties(opt_level, *, device_type: str, half_dtype=None, cast_model_type=None,
                       patch_torch_functions=None, keep_batchnorm_fp32=None, master_weights=None,
                       loss_scale=None, cast_model_outputs=None) -> Properties:
    """The level's properties with the overrides applied; raises ValueError naming the reason when
    the level is unknown or the overrides contradict each other or the level."""
    if not isinstance(opt_level, str) or opt_level not in OPT_LEVELS:
        raise ValueError(unknown_opt_level_message(opt_level))
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

    if half_dtype is None:
        if cast_model_type in HALF_DTYPES:
            half_dtype = cast_model_type
        else:
            half_dtype = default_half_dtype(device_type)
    elif cast_model_type in HALF_DTYPES and cast_model_type != half_dtype:
        raise ValueError(f"cast_model_type={cast_model_type} contradicts half_dtype={half_dtype}; "
                         f"pass only one of them")

    if opt_level == "O1":
        if cast_model_type not in (None, torch.float32):
            raise ValueError(f"O1 runs the forward under torch.autocast with fp32 model weights, "
                             f"so cast_model_type must stay None (got {cast_model_type}). To cast "
                             f"the model itself use opt_level='O2' or 'O3'.")
        if keep_batchnorm_fp32 is not None:
            raise ValueError(f"With opt_level O1, autocast already runs batchnorm in fp32, so "
                             f"keep_batchnorm_fp32 must be None (got {keep_batchnorm_fp32}).")
        if master_weights is not None:
            raise ValueError("It doesn't make sense to use master_weights with O1: the model "
                             "weights themselves stay fp32. Use opt_level='O2' for a half model "
                             "with fp32 master weights.")
    elif patch_torch_functions:
        raise ValueError(f"patch_torch_functions=True (the autocast forward) belongs to "
                         f"opt_level='O1'; it cannot be combined with {opt_level}, which casts "
                         f"the model instead.")

    resolved_cast = level.cast_model_type if cast_model_type is None else cast_model_type
    if resolved_cast is HALF:
        resolved_cast = half_dtype
    if no_cast:
        resolved_cast = None
    resolved_master = level.master_weights if master_weights is None else master_weights
    resolved_keep_bn = level.keep_batchnorm_fp32 if keep_batchnorm_fp32 is None \
        else keep_batchnorm_fp32

    # master_weights=True on a model left in fp32 (cast_model_type=False or torch.float32) is
    # accepted, as apex did: the fp32 parameters are their own masters, no copies are made.
    if resolved_cast == torch.float32 and keep_batchnorm_fp32 is False:
        raise ValueError(f"keep_batchnorm_fp32=False asks for half batchnorm, but {opt_level} "
                         f"keeps the whole model in fp32; use opt_level='O3' for a pure half "
                         f"model.")

    return Properties(
        opt_level=opt_level,
        half_dtype=half_dtype,
        cast_model_type=resolved_cast,
        patch_torch_functions=(level.patch_torch_functions if patch_torch_functions is None
                               else patch_torch_functions),
        keep_batchnorm_fp32=resolved_keep_bn,
        master_weights=bool(resolved_master),
        loss_scale=level.loss_scale if loss_scale is None else loss_scale,
        cast_model_outputs=cast_model_outputs,
    )
