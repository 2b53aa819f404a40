"""The pure-Python backend: torch foreach ops, no per-tensor host sync.

This is the reference the native kernels are tested against, so its arithmetic is the contract:
every value is computed in fp32 (``opmath``) and rounded once to the output dtype.

- scale: ``out = round(float(x) * float(scale))``
- axpby: ``out = round(float(a) * float(x) + float(b) * float(y))``, two products then one sum,
  no fused multiply-add (so the native kernels build with ``-ffp-contract=off``).
- found_inf: set to 1.0 when an *input* element is inf or NaN; never written 0.

The caller (``apex_lite.multi_tensor``) has validated the arguments: equal-length lists, one device,
floating tensors of fp32/fp16/bf16, matching shapes, ``found_inf`` a 1-element fp32 tensor there.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

Tensors = Sequence[torch.Tensor]


def _as_fp32(tensors: Tensors) -> List[torch.Tensor]:
    """fp32 copies of ``tensors`` (the upcast of fp16/bf16 is exact); fp32 tensors are cloned."""
    out = [torch.empty_like(t, dtype=torch.float32) for t in tensors]
    if out:
        torch._foreach_copy_(out, list(tensors))
    return out


def _check_and_scale_(tensors: List[torch.Tensor], scale: float, found_inf: torch.Tensor) -> None:
    """In place ``t *= scale`` in fp32 opmath, flagging non-finite elements (torch's fused op)."""
    if not tensors:
        return
    factor = torch.full((1,), scale, dtype=torch.float32, device=found_inf.device)
    torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, factor)


def scale_(tensors: Tensors, scale: float, found_inf: torch.Tensor) -> None:
    # fp32 tensors are scaled where they stand; the others through an fp32 temporary (torch's
    # CUDA kernel has no bf16 version), which rounds the product once, as the native kernels do.
    _check_and_scale_([t for t in tensors if t.dtype == torch.float32], scale, found_inf)
    staged = [t for t in tensors if t.dtype != torch.float32]
    if staged:
        tmp = _as_fp32(staged)
        _check_and_scale_(tmp, scale, found_inf)
        torch._foreach_copy_(staged, tmp)


def scale_out(inputs: Tensors, outputs: Tensors, scale: float, found_inf: torch.Tensor) -> None:
    # Outputs in fp32 are scaled where they stand; any other output dtype goes through an fp32
    # temporary so that the product is rounded once, to the output dtype.
    direct = [i for i, o in enumerate(outputs) if o.dtype == torch.float32]
    staged = [i for i, o in enumerate(outputs) if o.dtype != torch.float32]
    if direct:
        outs = [outputs[i] for i in direct]
        torch._foreach_copy_(outs, [inputs[i] for i in direct])
        _check_and_scale_(outs, scale, found_inf)
    if staged:
        tmp = _as_fp32([inputs[i] for i in staged])
        _check_and_scale_(tmp, scale, found_inf)
        torch._foreach_copy_([outputs[i] for i in staged], tmp)


def _axpby_fp32(xs: Tensors, ys: Tensors, a: float, b: float,
                found_inf: torch.Tensor) -> List[torch.Tensor]:
    """fp32 ``a*x + b*y`` for each pair, flagging non-finite elements of x and of y."""
    ax = _as_fp32(xs)
    by = _as_fp32(ys)
    _check_and_scale_(ax, a, found_inf)
    _check_and_scale_(by, b, found_inf)
    torch._foreach_add_(ax, by)
    return ax


def axpby_(xs: Tensors, ys: Tensors, a: float, b: float, found_inf: torch.Tensor) -> None:
    if xs:
        torch._foreach_copy_(list(ys), _axpby_fp32(xs, ys, a, b, found_inf))


def axpby_out(xs: Tensors, ys: Tensors, outputs: Tensors, a: float, b: float,
              found_inf: torch.Tensor) -> None:
    if xs:
        torch._foreach_copy_(list(outputs), _axpby_fp32(xs, ys, a, b, found_inf))


def l2norm(tensors: Tensors, per_tensor: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    norms = torch._foreach_norm(list(tensors), 2, dtype=torch.float32)
    stacked = torch.stack(norms)
    total = torch.linalg.vector_norm(stacked).reshape(1)
    per = stacked if per_tensor else stacked.new_zeros(0)
    return total, per


def nonfinite_flags(tensors: Tensors) -> torch.Tensor:
    # The max-abs of a tensor is inf or NaN exactly when one of its elements is; it has no value
    # for an empty tensor, which is finite by definition.
    flags = torch.zeros(len(tensors), dtype=torch.bool, device=tensors[0].device)
    filled = [i for i, t in enumerate(tensors) if t.numel() > 0]
    if filled:
        norms = torch._foreach_norm([tensors[i] for i in filled], float("inf"))
        index = torch.tensor(filled, device=flags.device)
        flags[index] = ~torch.isfinite(torch.stack([n.float() for n in norms]))
    return flags
