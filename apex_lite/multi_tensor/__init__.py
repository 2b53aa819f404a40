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

import operator
from typing import Sequence, Tuple, Union

import torch

from . import _python
from ._backend import NativeBackendUnavailable, backend, ops_for

__all__ = ["scale", "axpby", "l2norm", "nonfinite_flags", "backend", "NativeBackendUnavailable"]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

Tensors = Sequence[torch.Tensor]


def _check_list(name: str, tensors: Tensors) -> None:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(tensors).__name__}")


def _check_tensors(device: torch.device, anchor: str, **lists: Tensors) -> None:
    """Per-tensor checks for the Python backend (the native kernels make them in C++, so the
    fast path pays nothing per tensor here)."""
    for name, tensors in lists.items():
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}[{i}] is a {type(t).__name__}, not a tensor")
            if t.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"{name}[{i}] has dtype {t.dtype}; multi-tensor kernels take "
                                f"float32, float16 and bfloat16 tensors only")
            if t.device != device:
                raise ValueError(f"{name}[{i}] is on {t.device} but {anchor} is on {device}; "
                                 f"all tensors of a call must be on one device. Call once per "
                                 f"device.")


def _check_pairs(name_a: str, a: Tensors, name_b: str, b: Tensors, shapes: bool) -> None:
    if len(a) != len(b):
        raise ValueError(f"{name_a} has {len(a)} tensors but {name_b} has {len(b)}; "
                         f"they are used pairwise")
    if shapes:
        for i, (x, y) in enumerate(zip(a, b)):
            if x.shape != y.shape:
                raise ValueError(f"{name_a}[{i}] has shape {tuple(x.shape)} but {name_b}[{i}] "
                                 f"has {tuple(y.shape)}")


def _found_inf_device(found_inf: torch.Tensor) -> torch.device:
    if not isinstance(found_inf, torch.Tensor) or found_inf.numel() != 1 \
            or found_inf.dtype != torch.float32:
        raise TypeError("found_inf must be a 1-element float32 tensor (create it with "
                        "torch.zeros(1, device=...) and zero it yourself between steps)")
    return found_inf.device


def _same_tensors(a: Tensors, b: Tensors) -> bool:
    """True when ``b`` is ``a`` element by element (the in-place form)."""
    return a is b or all(map(operator.is_, a, b))


def scale(inputs: Tensors, outputs: Tensors, scale: float, found_inf: torch.Tensor) -> None:
    """``out = in * scale`` for each pair (``outputs`` may be ``inputs``); flags non-finite inputs."""
    _check_list("inputs", inputs)
    _check_list("outputs", outputs)
    device = _found_inf_device(found_inf)
    in_place = _same_tensors(inputs, outputs)
    ops = ops_for(device)
    if ops is _python:
        _check_tensors(device, "found_inf", inputs=inputs, **({} if in_place else {"outputs": outputs}))
    _check_pairs("inputs", inputs, "outputs", outputs, shapes=ops is _python and not in_place)
    if not inputs:
        return
    if in_place:
        ops.scale_(list(inputs), float(scale), found_inf)
    else:
        ops.scale_out(list(inputs), list(outputs), float(scale), found_inf)


def axpby(xs: Tensors, ys: Tensors, outputs: Tensors, a: float, b: float,
          found_inf: torch.Tensor) -> None:
    """``out = a*x + b*y`` for each triple (``outputs`` may be ``xs`` or ``ys``); flags non-finite
    elements of ``xs`` and ``ys``."""
    for name, tensors in (("xs", xs), ("ys", ys), ("outputs", outputs)):
        _check_list(name, tensors)
    device = _found_inf_device(found_inf)
    ops = ops_for(device)
    if ops is _python:
        _check_tensors(device, "found_inf", xs=xs, ys=ys, outputs=outputs)
    _check_pairs("xs", xs, "ys", ys, shapes=ops is _python)
    _check_pairs("xs", xs, "outputs", outputs, shapes=ops is _python)
    if not xs:
        return
    if _same_tensors(ys, outputs):
        ops.axpby_(list(xs), list(ys), float(a), float(b), found_inf)
    elif _same_tensors(xs, outputs):
        ops.axpby_(list(ys), list(xs), float(b), float(a), found_inf)
    else:
        ops.axpby_out(list(xs), list(ys), list(outputs), float(a), float(b), found_inf)


def _ops_checked(tensors: Tensors):
    """The backend for a non-empty list of tensors on the device of its first one."""
    if not isinstance(tensors[0], torch.Tensor):
        raise TypeError(f"tensors[0] is a {type(tensors[0]).__name__}, not a tensor")
    device = tensors[0].device
    ops = ops_for(device)
    if ops is _python:
        _check_tensors(device, "tensors[0]", tensors=tensors)
    return ops


def l2norm(tensors: Tensors, per_tensor: bool = False
           ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """The L2 norm of all elements of ``tensors`` together, accumulated in fp32, as a 1-element
    fp32 tensor; with ``per_tensor=True``, ``(total, norms)`` with one fp32 norm per tensor."""
    _check_list("tensors", tensors)
    if not tensors:
        total = torch.zeros(1, dtype=torch.float32)
        return (total, torch.zeros(0, dtype=torch.float32)) if per_tensor else total
    ops = _ops_checked(tensors)
    total, norms = ops.l2norm(list(tensors), bool(per_tensor))
    return (total, norms) if per_tensor else total


def nonfinite_flags(tensors: Tensors) -> torch.Tensor:
    """A bool tensor with one entry per tensor: True where that tensor holds an inf or NaN."""
    _check_list("tensors", tensors)
    if not tensors:
        return torch.zeros(0, dtype=torch.bool)
    return _ops_checked(tensors).nonfinite_flags(list(tensors))
