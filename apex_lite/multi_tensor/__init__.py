"""Fused operations over lists of tensors, the kernels under amp's bookkeeping.

Every function takes tensors on one device and is served there by the native extension when it
is built, else by torch foreach ops (``backend(device)`` says which, and why). Both give the same
answers: ``scale`` and ``axpby`` bit for bit, ``l2norm`` within fp32 rounding.

Arithmetic is in fp32 whatever the storage dtype (fp32, fp16 or bf16, mixed freely), rounded once
to the output dtype. ``found_inf`` is a 1-element fp32 tensor on the tensors' device that the
caller zeroes; a kernel sets it to 1 when an input element is inf or NaN and never writes 0, so
one flag can collect several calls. Nothing here synchronises with the host.
"""
from __future__ import annotations

from typing import Sequence, Tuple, Union

import torch

from ._backend import NativeBackendUnavailable, backend, ops_for

__all__ = ["scale", "axpby", "l2norm", "nonfinite_flags", "backend", "NativeBackendUnavailable"]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

Tensors = Sequence[torch.Tensor]


def _check_list(name: str, tensors: Tensors) -> None:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(tensors).__name__}")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] is a {type(t).__name__}, not a tensor")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}[{i}] has dtype {t.dtype}; multi-tensor kernels take "
                            f"float32, float16 and bfloat16 tensors only")


def _check_pairs(name_a: str, a: Tensors, name_b: str, b: Tensors) -> None:
    if len(a) != len(b):
        raise ValueError(f"{name_a} has {len(a)} tensors but {name_b} has {len(b)}; "
                         f"they are used pairwise")
    for i, (x, y) in enumerate(zip(a, b)):
        if x.shape != y.shape:
            raise ValueError(f"{name_a}[{i}] has shape {tuple(x.shape)} but {name_b}[{i}] has "
                             f"{tuple(y.shape)}")


def _device_of(found_inf: torch.Tensor, *lists: Tensors) -> torch.device:
    if not isinstance(found_inf, torch.Tensor) or found_inf.numel() != 1 \
            or found_inf.dtype != torch.float32:
        raise TypeError("found_inf must be a 1-element float32 tensor (create it with "
                        "torch.zeros(1, device=...) and zero it yourself between steps)")
    device = found_inf.device
    for tensors in lists:
        for t in tensors:
            if t.device != device:
                raise ValueError(f"all tensors must be on found_inf's device ({device}); one is "
                                 f"on {t.device}. Call once per device.")
    return device


def _same_tensors(a: Tensors, b: Tensors) -> bool:
    """True when ``b`` is ``a`` element by element (the in-place form)."""
    return a is b or (len(a) == len(b) and all(x is y for x, y in zip(a, b)))


def _refuse_partial_alias(name_a: str, a: Tensors, name_b: str, b: Tensors) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x is not y and x.numel() and y.numel() and x.data_ptr() == y.data_ptr():
            raise ValueError(f"{name_a}[{i}] and {name_b}[{i}] share storage but are different "
                             f"tensor objects; pass the same list for an in-place call")


def scale(inputs: Tensors, outputs: Tensors, scale: float, found_inf: torch.Tensor) -> None:
    """``out = in * scale`` for each pair (``outputs`` may be ``inputs``); flags non-finite inputs."""
    _check_list("inputs", inputs)
    _check_list("outputs", outputs)
    _check_pairs("inputs", inputs, "outputs", outputs)
    device = _device_of(found_inf, inputs, outputs)
    if not inputs:
        return
    ops = ops_for(device)
    if _same_tensors(inputs, outputs):
        ops.scale_(list(inputs), float(scale), found_inf)
    else:
        _refuse_partial_alias("inputs", inputs, "outputs", outputs)
        ops.scale_out(list(inputs), list(outputs), float(scale), found_inf)


def axpby(xs: Tensors, ys: Tensors, outputs: Tensors, a: float, b: float,
          found_inf: torch.Tensor) -> None:
    """``out = a*x + b*y`` for each triple (``outputs`` may be ``xs`` or ``ys``); flags non-finite
    elements of ``xs`` and ``ys``."""
    for name, tensors in (("xs", xs), ("ys", ys), ("outputs", outputs)):
        _check_list(name, tensors)
    _check_pairs("xs", xs, "ys", ys)
    _check_pairs("xs", xs, "outputs", outputs)
    device = _device_of(found_inf, xs, ys, outputs)
    if not xs:
        return
    ops = ops_for(device)
    if _same_tensors(ys, outputs):
        ops.axpby_(list(xs), list(ys), float(a), float(b), found_inf)
    elif _same_tensors(xs, outputs):
        ops.axpby_(list(ys), list(xs), float(b), float(a), found_inf)
    else:
        _refuse_partial_alias("xs", xs, "outputs", outputs)
        _refuse_partial_alias("ys", ys, "outputs", outputs)
        ops.axpby_out(list(xs), list(ys), list(outputs), float(a), float(b), found_inf)


def l2norm(tensors: Tensors, per_tensor: bool = False
           ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """The L2 norm of all elements of ``tensors`` together, accumulated in fp32, as a 1-element
    fp32 tensor; with ``per_tensor=True``, ``(total, norms)`` with one fp32 norm per tensor."""
    _check_list("tensors", tensors)
    if not tensors:
        total = torch.zeros(1, dtype=torch.float32)
        return (total, torch.zeros(0, dtype=torch.float32)) if per_tensor else total
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise ValueError(f"all tensors must be on one device; found {device} and {t.device}")
    total, norms = ops_for(device).l2norm(list(tensors), bool(per_tensor))
    return (total, norms) if per_tensor else total


def nonfinite_flags(tensors: Tensors) -> torch.Tensor:
    """A bool tensor with one entry per tensor: True where that tensor holds an inf or NaN."""
    _check_list("tensors", tensors)
    if not tensors:
        return torch.zeros(0, dtype=torch.bool)
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise ValueError(f"all tensors must be on one device; found {device} and {t.device}")
    return ops_for(device).nonfinite_flags(list(tensors))
