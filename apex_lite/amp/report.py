"""``amp.report``: what an ``initialize`` set up, in numbers a user can check (memory per dtype,
the modules kept fp32, the kernel backend per device, shapes that miss the tensor cores)."""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .. import multi_tensor
from ..optimizers.update import local_shards
from .master_grads import LazyGrad

TENSOR_CORE_MULTIPLE = 8


@dataclasses.dataclass
class AmpReport:
    """What ``amp.report()`` returns; ``str()`` gives the readable report. ``opt_level`` and
    ``half_dtype`` are the run's; ``tensors[kind][dtype] = (count, bytes)`` for kind "parameters", "gradients", "master
    weights" and "optimizer state"; ``bytes_per_parameter`` all of them over the number of model
    parameter elements (fp32 training with Adam holds 16: 4 weight, 4 gradient, 8 state);
    ``step_paths`` one line per optimizer (fused or unfused step, and why);
    ``kept_fp32`` the modules kept fp32 per model; ``backends[device] = (name, why)``;
    ``not_multiple_of_8`` one line per Linear/Conv whose matmul dimensions are not multiples of 8
    (fp16/bf16 tensor cores want them); ``sharding`` lines on a model sharded with FSDP2, whose
    tensors are counted as this rank's shards; ``patch_torch_functions`` and
    ``patch_torch_functions_type``, whether the forward runs under autocast and in which dtype
    (None: no autocast); ``fp8``, with ``initialize(fp8=...)``, per fp8 layer and role
    ("input", "weight", "grad") the elements clipped at the fp8 maximum and the nonzero
    elements flushed to zero so far, ``{layer: {role: {"saturated": n, "underflow": n}}}``
    (this rank's; empty without fp8), and ``fp8_lines`` what the text says of fp8 (the recipe,
    the layers in fp8 and those left in half, and why). ``str()`` gives the readable report."""
    opt_level: str
    half_dtype: torch.dtype
    tensors: Dict[str, Dict[torch.dtype, Tuple[int, int]]]
    kept_fp32: List[List[str]]
    backends: Dict[str, Tuple[str, str]]
    not_multiple_of_8: List[str]
    bytes_per_parameter: float = 0.0
    step_paths: List[str] = dataclasses.field(default_factory=list)
    sharding: List[str] = dataclasses.field(default_factory=list)
    patch_torch_functions: Optional[bool] = None
    patch_torch_functions_type: Optional[torch.dtype] = None
    fp8: Dict[str, Dict[str, Dict[str, int]]] = dataclasses.field(default_factory=dict)
    fp8_lines: List[str] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"apex_lite.amp report: opt_level {self.opt_level}, half dtype {self.half_dtype}"]
        autocast = f"under torch.autocast in {self.patch_torch_functions_type}" \
            if self.patch_torch_functions_type is not None else "not under autocast"
        lines.append(f"  forward: {autocast} (patch_torch_functions={self.patch_torch_functions}, "
                     f"patch_torch_functions_type={self.patch_torch_functions_type})")
        for kind, per_dtype in self.tensors.items():
            if not per_dtype:
                lines.append(f"  {kind}: none")
            for dtype, (count, nbytes) in sorted(per_dtype.items(), key=lambda kv: str(kv[0])):
                lines.append(f"  {kind}: {count} {dtype} tensors, {_size(nbytes)}")
        lines.append(f"  bytes held per model parameter: {self.bytes_per_parameter:.2f}")
        lines.extend(f"  {line}" for line in self.sharding)
        lines.extend(f"  {line}" for line in self.step_paths)
        for i, names in enumerate(self.kept_fp32):
            label = f"model {i}" if len(self.kept_fp32) > 1 else "model"
            lines.append(f"  {label} modules kept fp32: {', '.join(names) if names else 'none'}")
        for device, (name, why) in self.backends.items():
            lines.append(f"  kernels on {device}: {name} ({why})")
        if self.not_multiple_of_8:
            lines.append(f"  dimensions not multiples of {TENSOR_CORE_MULTIPLE} (slower on "
                         f"tensor cores; pad them where you can):")
            lines.extend(f"    {line}" for line in self.not_multiple_of_8)
        else:
            lines.append(f"  every Linear/Conv dimension is a multiple of {TENSOR_CORE_MULTIPLE}")
        lines.extend(f"  {line}" for line in self.fp8_lines)
        return "\n".join(lines)


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if nbytes < 1024:
            return f"{nbytes} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} GiB"


def _tally(tensors) -> Dict[torch.dtype, Tuple[int, int]]:
    """Count and bytes per dtype (a DTensor's bytes are this rank's shard's)."""
    out: Dict[torch.dtype, Tuple[int, int]] = {}
    seen = set()
    unique = []
    for t in tensors:
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            unique.append(t)
    for t in local_shards(unique):
        count, nbytes = out.get(t.dtype, (0, 0))
        out[t.dtype] = (count + 1, nbytes + t.numel() * t.element_size())
    return out


def _dimension_lines(models: Sequence[torch.nn.Module]) -> List[str]:
    lines = []
    for i, model in enumerate(models):
        prefix = f"model {i}: " if len(models) > 1 else ""
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                dims = {"in_features": module.in_features, "out_features": module.out_features}
            elif isinstance(module, torch.nn.modules.conv._ConvNd):
                dims = {"in_channels": module.in_channels // module.groups,
                        "out_channels": module.out_channels // module.groups}
            else:
                continue
            odd = [f"{k}={v}" for k, v in dims.items() if v % TENSOR_CORE_MULTIPLE]
            if odd:
                lines.append(f"{prefix}{name} ({type(module).__name__}): {', '.join(odd)}")
    return lines


def _held_grads(grads, values) -> list:
    """The gradients ``grads`` (the masters') hold in memory, and the tensors amp keeps for made
    master gradients that none of them is: those the fused step keeps after a step that made
    them. A lazy gradient holds nothing (a made one, what it was made into)."""
    held = [resolve_made(g) for g in grads if g is not None]
    held = [g for g in held if g is not None]
    ids = {id(g) for g in held}
    held.extend(v for v in values if v is not None and id(v) not in ids)
    return held


def resolve_made(grad):
    """A master's gradient as held in memory: a made lazy gradient's value, None for a lazy one
    not made."""
    if type(grad) is LazyGrad:
        return grad._value
    return grad


def build_report(run, models: Sequence[torch.nn.Module],
                 optimizers: Sequence[torch.optim.Optimizer]) -> AmpReport:
    params = [p for m in models for p in m.parameters()]
    # Every fp32 copy amp holds for these models: the masters of their parameters (those of
    # frozen weights too, with frozen_master_weights=True), and any optimizer parameter that is
    # a master.
    masters = [pair.master for m in models if m in run.models
               for pair in run.pairs.per_model[run.models.index(m)]]
    masters += [p for opt in optimizers for g in opt.param_groups for p in g["params"]
                if run.pairs.is_master(p)]
    # The masters' gradients as held (a lazy one holds nothing; reading it would make it), and
    # the tensors amp keeps for made ones while it keeps them.
    values = []
    for opt in optimizers:
        amp_opt = getattr(opt, "_apex_lite_amp", None)
        if amp_opt is not None:
            values.extend(v for group in amp_opt.groups().values() if group.grads is not None
                          for v in group.grads.values)
    grads = [p.grad for p in params] + _held_grads([p.grad for p in masters], values)
    # The stepping optimizer's state (a wrapper's, such as Lookahead's slow weights, too).
    states = {}
    for opt in optimizers:
        amp_opt = getattr(opt, "_apex_lite_amp", None)
        for holder in (opt, None if amp_opt is None else amp_opt.optimizer):
            if holder is not None and isinstance(getattr(holder, "state", None), dict):
                states[id(holder.state)] = holder.state
    state = [v for st in states.values() for per_param in st.values()
             for v in per_param.values() if isinstance(v, torch.Tensor)]
    tensors = {"parameters": _tally(params), "gradients": _tally(grads),
               "master weights": _tally(masters), "optimizer state": _tally(state)}
    elements = sum(p.numel() for p in local_shards(list({id(p): p for p in params}.values())))
    held = sum(nbytes for per_dtype in tensors.values() for _, nbytes in per_dtype.values())
    paths = []
    for i, opt in enumerate(optimizers):
        amp_opt = getattr(opt, "_apex_lite_amp", None)
        if amp_opt is not None:
            paths.append(f"optimizer {i} ({type(opt).__name__}): {amp_opt.path.describe()}")
    devices = sorted({str(p.device) for p in params})
    fp8 = getattr(run, "fp8", None)
    kept = [run.kept_fp32[run.models.index(m)] if m in run.models else [] for m in models]
    return AmpReport(
        opt_level=run.properties.opt_level,
        half_dtype=run.properties.half_dtype,
        tensors=tensors,
        bytes_per_parameter=held / elements if elements else 0.0,
        step_paths=paths,
        kept_fp32=kept,
        backends={d: multi_tensor.backend(torch.device(d)) for d in devices},
        not_multiple_of_8=_dimension_lines(models),
        sharding=[] if run.sharding is None else _sharding_lines(run.sharding, held),
        patch_torch_functions=run.properties.patch_torch_functions,
        patch_torch_functions_type=run.properties.patch_torch_functions_type,
        fp8={} if fp8 is None else fp8.counts(),
        fp8_lines=[] if fp8 is None else fp8.report_lines(),
    )


def _sharding_lines(sharding, held: int) -> List[str]:
    """This rank's memory on FSDP2: ``held`` (its shards of parameters, gradients and optimizer
    state) plus the unsharded parameters of the unit computing."""
    label, nbytes, dtypes = sharding.largest_unit()
    return [
        f"FSDP2: {len(sharding.units)} fully_shard unit(s) over {sharding.world_size()} "
        f"rank(s); the sizes above are this rank's shards",
        f"this rank holds {_size(held)}, plus the parameters of the unit being computed, "
        f"all-gathered in {', '.join(dtypes)}: at most {_size(nbytes)} ({label}; units left "
        f"unsharded after forward, such as the root by default, keep theirs until their "
        f"backward, and prefetching can hold the next unit too)",
    ]
