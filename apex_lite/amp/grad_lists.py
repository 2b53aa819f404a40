"""The multi-tensor calls amp makes on lists it built itself (the unscale, the accumulation, the
check, the copy back to the half model).

They skip ``multi_tensor``'s argument checks (Python loops over every tensor, every step): amp
builds these lists itself, on one device, in fp32/fp16/bf16, with outputs that are either the
inputs or distinct tensors of the same shapes. A scale may be a 1-element device tensor (a loss
scale kept on the device): torch's check-and-unscale op takes it without a host read, through the
Python backend (the native kernels' reference, bit for bit). DTensors (FSDP2's shards) are
passed as their local shards (``local_shards``).
"""
from __future__ import annotations

from typing import List, Union

import torch

from ..multi_tensor import _python
from ..multi_tensor._backend import ops_for
from ..optimizers.update import local_shards

Scale = Union[float, torch.Tensor]


def _ops(scale: Scale, found_inf: torch.Tensor):
    return _python if isinstance(scale, torch.Tensor) else ops_for(found_inf.device)


def _on_flag_device(scale: Scale, found_inf: torch.Tensor) -> Scale:
    """A device scale moved where the flag (each device group's) is, as the flags are: a group
    added on another GPU after ``initialize`` unscales there (a no-op on the same device)."""
    return scale.to(found_inf.device) if isinstance(scale, torch.Tensor) else float(scale)


def fused_scale(inputs: List[torch.Tensor], outputs: List[torch.Tensor], scale: Scale,
                found_inf: torch.Tensor) -> None:
    """``multi_tensor.scale`` for lists amp built."""
    ops = _ops(scale, found_inf)
    scale = _on_flag_device(scale, found_inf)
    same = outputs is inputs
    inputs = local_shards(inputs)
    outputs = inputs if same else local_shards(outputs)
    if same:
        ops.scale_(inputs, scale, found_inf)
    else:
        ops.scale_out(inputs, outputs, scale, found_inf)


def fused_accumulate(new: List[torch.Tensor], into: List[torch.Tensor], scale: Scale,
                     found_inf: torch.Tensor) -> None:
    """``into += scale * new`` (``multi_tensor.axpby`` in place) for lists amp built."""
    ops = _ops(scale, found_inf)
    ops.axpby_(local_shards(new), local_shards(into), _on_flag_device(scale, found_inf), 1.0,
               found_inf)


def flag_nonfinite(tensors: List[torch.Tensor], found_inf: torch.Tensor) -> torch.Tensor:
    """Set ``found_inf`` when one of ``tensors`` holds inf or NaN; reads only, no sync. Returns
    the per-tensor flags (a bool tensor on the device)."""
    flags = ops_for(found_inf.device).nonfinite_flags(local_shards(tensors))
    torch.maximum(found_inf, flags.any().to(found_inf.dtype).reshape(1), out=found_inf)
    return flags


def present_grads(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """The gradients of ``tensors`` that exist, in order. Each ``.grad`` is read once: it is a
    property call (~80 ns), and these lists are built every step."""
    return [g for g in (t.grad for t in tensors) if g is not None]
