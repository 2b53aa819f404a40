"""What ``initialize`` checks before it changes anything: its arguments, the models and the
optimizers. Each check raises an error naming the fix; ``slow_cpu_half`` only warns.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Dict, Optional

import torch

from . import casting
from .fp8 import FP8, cast as fp8_cast, scaled_mm as fp8_scaled_mm
from .fp8.config import resolve as resolve_fp8
from .opt_levels import HALF_DTYPES, OPT_LEVELS, OptLevelError, Properties
from .optimizer_hooks import MARK, stepping_optimizer


# The rule that initialize and add_param_group enforce, and why.
ONE_OPTIMIZER = ("under amp each parameter belongs to one optimizer (a scale_loss given both "
                 "would unscale its gradient twice, and each step() would apply it again). Give "
                 "each parameter to one optimizer, or use one optimizer with a param group per "
                 "learning rate.")


def as_list(value, kind: type, what: str):
    """(list, was_list) as apex accepts: one object or a list (or tuple) of them."""
    if isinstance(value, kind):
        return [value], False
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            if not isinstance(item, kind):
                raise TypeError(f"{what}[{i}] is a {type(item).__name__}, not a "
                                f"{kind.__module__}.{kind.__qualname__}")
        return list(value), True
    raise TypeError(f"{what} must be a single {kind.__qualname__} or a list of them, got "
                    f"{type(value).__name__}")


def describe(p: torch.Tensor) -> str:
    return f"shape {tuple(p.shape)}, dtype {p.dtype}, device {p.device}"


def check_models(models) -> None:
    """At least one model, each once, each fit for amp (``check_model``,
    ``refuse_sparse_gradients``)."""
    if not models:
        raise ValueError("amp.initialize needs at least one model")
    if len({id(m) for m in models}) != len(models):
        raise ValueError("the same model appears twice in models; pass each model once")
    for i, model in enumerate(models):
        check_model(model, i)
        refuse_sparse_gradients(model, i)


def check_model(model: torch.nn.Module, index: int) -> None:
    from apex_lite.parallel.distributed import DistributedDataParallel as ApexDDP
    for wrapper in (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel, ApexDDP):
        if isinstance(model, wrapper):
            raise RuntimeError(
                f"model {index} is already wrapped in {wrapper.__module__}.{wrapper.__name__}. "
                f"Parallel wrappers must be applied AFTER amp.initialize: "
                f"model, optimizer = amp.initialize(model, optimizer, ...); "
                f"model = {wrapper.__name__}(model, ...).")
    if getattr(model, MARK, None) is not None:
        raise RuntimeError(
            f"model {index} ({type(model).__name__}) was already passed to amp.initialize; it is "
            f"cast and its forward wrapped. To re-initialise, build a fresh model (load its fp32 "
            f"state_dict into it) and pass that.")
    devices = OrderedDict()
    for name, p in model.named_parameters():
        devices.setdefault(p.device, name)
    if len(devices) > 1:
        where = ", ".join(f"{name!r} on {device}" for device, name in devices.items())
        raise ValueError(
            f"model {index} has parameters on {len(devices)} devices ({where}); amp.initialize "
            f"needs each model on one device. Move it first with model.to(device); for one "
            f"process per GPU wrap the initialized model in DistributedDataParallel.")
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype != torch.float32:
            raise ValueError(
                f"amp.initialize needs models whose floating-point parameters are float32, but "
                f"{name!r} of model {index} is {p.dtype}. Build or load the model in fp32 and let "
                f"the opt level cast it: O1 keeps fp32 weights and runs the forward under "
                f"autocast; O2 casts the model to half and keeps fp32 master weights made from "
                f"the fp32 values (the way to train a half model safely); O3 is pure half. "
                f"Calling .half() or .bfloat16() yourself loses the fp32 values O2's masters are "
                f"made from.")


def refuse_sparse_gradients(model: torch.nn.Module, index: int) -> None:
    """Embeddings built with ``sparse=True`` make sparse gradients, which amp's unscale and
    inf/NaN check (dense multi-tensor kernels) cannot take: name the parameter now rather than
    let the first ``scale_loss`` fail inside torch's dispatcher."""
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse \
                and module.weight.requires_grad:
            param = f"{name}.weight" if name else "weight"
            raise ValueError(
                f"{param!r} of model {index} belongs to {type(module).__name__}(..., "
                f"sparse=True), which makes sparse gradients; amp unscales and checks dense "
                f"gradients only. Build it with sparse=False (the default: its gradient is then "
                f"a dense {tuple(module.weight.shape)} tensor), or freeze it with "
                f"model.{param}.requires_grad_(False) if it is not trained.")


def check_scale_args(num_losses, verbosity, min_loss_scale, max_loss_scale, hysteresis,
                      scale_window, overflow_patience, sync_interval) -> None:
    def positive_int(name, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    positive_int("num_losses", num_losses)
    positive_int("hysteresis", hysteresis)
    positive_int("scale_window", scale_window)
    positive_int("sync_interval", sync_interval)
    if overflow_patience is not None:
        positive_int("overflow_patience", overflow_patience)
    if isinstance(verbosity, bool) or not isinstance(verbosity, int) or verbosity < 0:
        raise ValueError(f"verbosity must be an int >= 0 (0 silences amp's log), got "
                         f"{verbosity!r}")
    for name, value in (("max_loss_scale", max_loss_scale), ("min_loss_scale", min_loss_scale)):
        if value is None and name == "min_loss_scale":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    if min_loss_scale is not None and min_loss_scale > max_loss_scale:
        raise ValueError(f"min_loss_scale={min_loss_scale} is above max_loss_scale="
                         f"{max_loss_scale}; the dynamic scale must fit between them")


def slow_cpu_half(device_type: str, properties: Properties) -> Optional[str]:
    """Why half matmuls will be slow on this CPU, or None. torch runs bf16/fp16 matmuls and
    convolutions through slow fallbacks on CPUs without the matching matrix instructions."""
    half = properties.half_dtype
    uses_half = properties.patch_torch_functions or properties.cast_model_type == half
    if device_type != "cpu" or not uses_half:
        return None
    def has(probe: str) -> bool:   # a torch too old to ask is given the benefit of the doubt
        return getattr(torch.cpu, probe, lambda: True)()

    if half == torch.bfloat16:
        fast = has("_is_avx512_bf16_supported") or has("_is_amx_tile_supported")
        needed = "AVX512-BF16 or AMX"
    else:
        fast = has("_is_amx_fp16_supported")
        needed = "AMX-FP16"
    if fast:
        return None
    return (f"this CPU lacks {needed} instructions, so torch runs {half} matmuls and "
            f"convolutions through slow fallbacks here, often many times slower than fp32: "
            f"{properties.opt_level} will still save memory but will likely train slower than "
            f"O0 on this machine.")


def static_scale_in_fp16(properties: Properties) -> Optional[str]:
    """Why a level made for bf16 (O4, O5), overridden into fp16, will likely lose gradients, or
    None. ROCm apex accepts ``cast_model_type=torch.float16`` at O5 and keeps O5's static loss
    scale 1.0; so does apex_lite, with this warning."""
    level = OPT_LEVELS[properties.opt_level]
    if level.half_dtype is None or properties.half_dtype == level.half_dtype \
            or properties.dynamic:
        return None
    return (f"{properties.opt_level} is made for {level.half_dtype}, whose range is fp32's; with "
            f"{properties.half_dtype} it keeps its static loss scale {properties.loss_scale}, so "
            f"gradients below 2**-24 flush to zero and those above 65504 overflow (every such "
            f"step is skipped). Pass loss_scale='dynamic', or use opt_level='{level.like}'.")


def check_fused_step(fused_step) -> None:
    if fused_step not in (None, True, False):
        raise ValueError(f"fused_step must be None (the fused step where it applies), True "
                         f"(required: an error names an optimizer that cannot take it) or "
                         f"False (the unfused step everywhere); got {fused_step!r}")


def keep_fp32_rules(keep_fp32_modules, properties: Properties, models) -> tuple:
    """``keep_fp32_modules`` as a tuple of rules, refused where the opt level casts no model to
    half or where a rule is of the wrong kind or matches no module."""
    if isinstance(keep_fp32_modules, (str, type)):
        keep_fp32_modules = (keep_fp32_modules,)
    keep_fp32_modules = tuple(keep_fp32_modules)
    if keep_fp32_modules and properties.cast_model_type not in HALF_DTYPES:
        raise ValueError(f"keep_fp32_modules keeps modules fp32 inside a model cast to half "
                         f"(O2, O3, O5), but {properties.opt_level} does not cast the model to "
                         f"half")
    casting.check_keep_rules(models, keep_fp32_modules)
    return keep_fp32_modules


def check_optimizers(optimizers) -> None:
    """Each optimizer once, and none that an earlier ``initialize`` took over."""
    if len({id(o) for o in optimizers}) != len(optimizers):
        raise ValueError("the same optimizer appears twice in optimizers; pass each once")
    for i, opt in enumerate(optimizers):
        if hasattr(opt, MARK) or hasattr(stepping_optimizer(opt)[0], MARK):
            raise RuntimeError(
                f"optimizer {i} ({type(opt).__name__}) was already passed to amp.initialize. "
                f"An optimizer can be initialised once: to re-initialise, create a new "
                f"optimizer over the new model's parameters and pass both.")


def check_optimizer_params(run, optimizers) -> None:
    """Every parameter of the optimizers belongs to a model of ``run``, and to one optimizer."""
    for i, opt in enumerate(optimizers):
        foreign = run.foreign_param([p for g in opt.param_groups for p in g["params"]])
        if foreign is not None:
            raise ValueError(
                f"optimizer {i} holds a parameter ({describe(foreign)}) that is not a "
                f"parameter of the model(s) passed to amp.initialize. Pass every model "
                f"whose parameters it updates, e.g. amp.initialize([model_a, model_b], "
                f"optimizer, ...), or build the optimizer from model.parameters().")
    owner: Dict[int, int] = {}
    for i, opt in enumerate(optimizers):
        for p in {id(p): p for g in opt.param_groups for p in g["params"]}.values():
            first = owner.setdefault(id(p), i)
            if first != i:
                raise ValueError(f"parameter {run.param_name(p)!r} is in optimizer {first} and "
                                 f"in optimizer {i}; {ONE_OPTIMIZER}")


# Why fp8 cannot run at each level that is not O2 or O5.
_NO_FP8 = {"O0": "O0 trains in fp32", "O1": "O1 runs the fp32 model under autocast",
           "O3": "O3 is pure half, with no fp32 master weights",
           "O4": "O4 runs the fp32 model under autocast in bf16"}


def check_fp8(fp8, properties: Properties, models) -> Optional[FP8]:
    """``initialize``'s ``fp8`` as a config (None: no fp8), refused where it cannot work: a
    level other than O2 and O5 (or one overridden not to cast the model to half), a device
    without fp8 matmuls, compiled casts required where triton is missing."""
    config = resolve_fp8(fp8)
    if config is None:
        return None
    level = properties.opt_level
    if level not in ("O2", "O5") or properties.cast_model_type not in HALF_DTYPES \
            or properties.patch_torch_functions:
        what = _NO_FP8.get(level, f"{level} was overridden here not to cast the model to half")
        raise OptLevelError(
            f"fp8=... runs the Linear matmuls of a model cast to half with fp32 master weights: "
            f"it works at opt_level 'O2' (fp16 or bf16) and 'O5' (bf16), not at {level} "
            f"({what}). Pass opt_level='O2' or 'O5' with fp8=, or drop fp8=.")
    devices = {p.device for m in models for p in m.parameters()}
    for device in sorted(devices, key=str):
        reason = fp8_scaled_mm.unsupported(device)
        if reason:
            raise ValueError(f"amp.initialize(fp8=...): {reason}. Train without fp8= (O2 runs "
                             f"the matmuls in half).")
        if device.type == "cuda" and config.compile_casts and not fp8_cast.triton_importable():
            raise ValueError("amp.FP8(compile_casts=True) needs torch.compile's CUDA backend, "
                             "and triton is not importable here: install triton, or pass "
                             "compile_casts=None (compiled where it can be) or False")
    return config
