"""Which Linear layers of a model run in fp8, and putting them there: ``install`` (after
``initialize`` cast the models; init_checks.check_fp8 refused what cannot work before), and
``Fp8Run``, the run's fp8 part that the report and the checkpoints read.

A layer is eligible when it is a ``torch.nn.Linear`` whose class keeps Linear's ``forward``
(a subclass with its own forward computes something else), its in and out features are
multiples of 16 and at least ``min_features``, it is in the half model (not inside a module
kept fp32), ``exclude`` does not name it, and nothing else replaced its forward.
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..casting import CastForward
from ..overflow import is_logging_rank
from . import cast as cast_module
from .cast import ROLES
from .config import FP8, MULTIPLE
from .linear import Fp8Forward
from .scaled_mm import runs_natively
from .state import Fp8ForwardFold, Fp8Group, Fp8StepFold

logger = logging.getLogger("apex_lite.amp")


def why_not(name: str, module: torch.nn.Module, kept: Sequence[str],
            config: FP8) -> Optional[str]:
    """Why the Linear ``module`` (``name``) stays in half, or None when it runs in fp8."""
    if type(module).forward is not torch.nn.Linear.forward:
        return f"{type(module).__name__} has its own forward"
    if any(name == k or k == "" or name.startswith(k + ".") for k in kept):
        return "kept fp32"
    if config.excludes(name, module):
        return "excluded"
    dims = {"in_features": module.in_features, "out_features": module.out_features}
    odd = [f"{k}={v}" for k, v in dims.items() if v % MULTIPLE]
    if odd:
        return f"{', '.join(odd)} not a multiple of {MULTIPLE}"
    small = [f"{k}={v}" for k, v in dims.items() if v < config.min_features]
    if small:
        return f"{', '.join(small)} below min_features={config.min_features}"
    forward = module.__dict__.get("forward")
    if forward is not None and not isinstance(forward, CastForward):   # amp's own: the root
        return "its forward was replaced"
    return None


def plan(models: Sequence[torch.nn.Module], kept: Sequence[Sequence[str]], config: FP8):
    """Per model, the eligible layers ``[(name, module)]``, and the Linears left in half
    ``[(label, why)]`` over all models."""
    chosen, left = [], []
    for i, model in enumerate(models):
        prefix = f"model {i}: " if len(models) > 1 else ""
        layers = []
        for name, module in model.named_modules():
            if not isinstance(module, torch.nn.Linear):
                continue
            why = why_not(name, module, kept[i], config)
            if why is None:
                layers.append((name, module))
            else:
                left.append((prefix + (name or "(the model)"), why))
        chosen.append(layers)
    return chosen, left


class Fp8Run:
    """What fp8 set up in one run: the config, per model its ``Fp8Group`` (None without fp8
    layers) and the fp8 ``Fp8Forward`` of its layers, and the Linears left in half, and why."""

    def __init__(self, config: FP8, groups: List[Optional[Fp8Group]],
                 layers: List[List[Tuple[str, Fp8Forward]]], left: List[Tuple[str, str]],
                 model_count: int):
        self.config = config
        self.groups = groups
        self.layers = layers
        self.left = left
        self.model_count = model_count

    def layer_count(self) -> int:
        return sum(len(layers) for layers in self.layers)

    def counts(self) -> Dict[str, Dict[str, Dict[str, int]]]:
        """layer name -> role -> {"saturated": n, "underflow": n} (one host read per model)."""
        out: Dict[str, Dict[str, Dict[str, int]]] = {}
        for i, group in enumerate(self.groups):
            if group is None:
                continue
            prefix = f"model {i}: " if self.model_count > 1 else ""
            values = group.counts.tolist()
            for name, per_role in zip(group.names, values):
                out[prefix + name] = {role: {"saturated": sat, "underflow": under}
                                      for role, (sat, under) in zip(ROLES, per_role)}
        return out

    def report_lines(self) -> List[str]:
        """The report's lines: the recipe, the fp8 layers, those left in half and why, and the
        counts that are not zero."""
        lines = [f"fp8: {self.layer_count()} Linear layer(s) in fp8, {self.config.describe()}"]
        names = [name for layers in self.layers for name, _ in layers]
        if names:
            lines.append("  in fp8: " + _listing(names))
        for label, why in self.left[:20]:
            lines.append(f"  in half: {label} ({why})")
        if len(self.left) > 20:
            lines.append(f"  in half: {len(self.left) - 20} more")
        if not self.config.counts:
            lines.append("  counts: off (amp.FP8(counts=False))")
            return lines
        clipped = [(layer, role, c) for layer, per_role in self.counts().items()
                   for role, c in per_role.items() if c["saturated"] or c["underflow"]]
        if not clipped:
            lines.append("  counts: no element clipped or flushed to zero so far")
        for layer, role, c in clipped:
            lines.append(f"  counts: {layer} {role}: {c['saturated']} clipped at the fp8 "
                         f"maximum, {c['underflow']} flushed to zero")
        return lines


def _listing(names: List[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def install(run, config: FP8) -> Fp8Run:
    """Swap the forwards of ``run``'s eligible Linears for ``Fp8Forward`` (after the models
    were cast and the optimizers taken over), hang the delayed recipe's fold on each optimizer
    (``Fp8StepFold``; without optimizers on each model, ``Fp8ForwardFold``), and return the
    ``Fp8Run``."""
    chosen, left = plan(run.models, run.kept_fp32, config)
    groups: List[Optional[Fp8Group]] = []
    layers: List[List[Tuple[str, Fp8Forward]]] = []
    for model, eligible in zip(run.models, chosen):
        if not eligible:
            groups.append(None)
            layers.append([])
            continue
        device = eligible[0][1].weight.device
        group = Fp8Group([name for name, _ in eligible], device, config)
        native = runs_natively(device)
        compiled = device.type == "cuda" and config.compile_casts is not False \
            and cast_module.triton_importable()
        forwards = []
        for i, (name, module) in enumerate(eligible):
            forward = Fp8Forward(module, group.layer(i), native, compiled)
            existing = module.__dict__.get("forward")
            if existing is not None:   # the model itself is the Linear: inside its cast
                existing.forward = forward
            else:
                module.forward = forward
            forwards.append((name, forward))
        groups.append(group)
        layers.append(forwards)
    fp8_run = Fp8Run(config, groups, layers, left, len(run.models))
    delayed = [group for group in groups if group is not None and group.delayed]
    if delayed and run.optimizers:
        fold = Fp8StepFold(delayed, run)
        for amp_opt in run.optimizers:
            amp_opt.optimizer.register_step_pre_hook(fold)
    elif delayed:   # no optimizer, no step: a step is a forward
        for model, group in zip(run.models, groups):
            if group is not None:
                model.register_forward_pre_hook(Fp8ForwardFold(group))
    if run.verbosity >= 1:
        _log_setup(fp8_run)
    return fp8_run


def _log_setup(fp8_run: Fp8Run) -> None:
    if not is_logging_rank():
        return
    count = fp8_run.layer_count()
    if count == 0:
        logger.warning("amp fp8: no Linear layer is eligible for fp8 (in and out features "
                       "multiples of %d and at least min_features=%d), so every matmul stays "
                       "in half; amp.report() lists each Linear and why. Pass "
                       "fp8=amp.FP8(min_features=...) for smaller layers.", MULTIPLE,
                       fp8_run.config.min_features)
        return
    logger.info("amp fp8: %d Linear layer(s) in fp8 (%s), %d left in half",
                count, fp8_run.config.describe(), len(fp8_run.left))
    devices = {g.counts.device.type for g in fp8_run.groups if g is not None}
    if "cpu" in devices:
        logger.info("amp fp8: on the CPU the fp8 matmuls are torch's emulated reference (an "
                    "fp32 matmul of the fp8 values): the numerics of a GPU run, not its speed")
    if "cuda" in devices and fp8_run.config.compile_casts is not False \
            and not cast_module.triton_importable():
        logger.warning("amp fp8: triton is not importable, so the casts to fp8 run eagerly "
                       "(about twice the bytes of compiled ones): fp8 is likely slower than "
                       "half on most layers here. Install triton.")
