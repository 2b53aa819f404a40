"""The native backend: thin wrappers over ``torch.ops.apex_lite``, with ``_python``'s signatures.

Two sets, one per staging policy for non-contiguous tensors:
- ``CPU_OPS`` call the ops directly: the CPU kernels accept any strides and stage non-contiguous
  tensors through contiguous copies in C++, so no Python loop runs over the tensors.
- ``STAGED_OPS`` (CUDA) check contiguity in Python and stage non-contiguous tensors through
  contiguous copies here, copying outputs back, because the CUDA kernels may require contiguous
  tensors. The check is the only per-tensor Python work on their common path.
Imported only after ``apex_lite._C`` is loaded.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import List, Sequence, Tuple

import torch

Tensors = Sequence[torch.Tensor]

_is_contiguous = torch.Tensor.is_contiguous
_scale_ = torch.ops.apex_lite.scale_.default
_scale_out = torch.ops.apex_lite.scale_out.default
_axpby_ = torch.ops.apex_lite.axpby_.default
_axpby_out = torch.ops.apex_lite.axpby_out.default
_l2norm = torch.ops.apex_lite.l2norm.default
_nonfinite_flags = torch.ops.apex_lite.nonfinite_flags.default

CPU_OPS = SimpleNamespace(scale_=_scale_, scale_out=_scale_out, axpby_=_axpby_,
                          axpby_out=_axpby_out, l2norm=_l2norm, nonfinite_flags=_nonfinite_flags)


def _contiguous(tensors: Tensors) -> bool:
    return all(map(_is_contiguous, tensors))


def _read_copies(tensors: Tensors) -> List[torch.Tensor]:
    """Contiguous tensors holding the values of ``tensors`` (the contiguous ones themselves)."""
    return [t if t.is_contiguous() else t.contiguous() for t in tensors]


def _write_buffers(tensors: Tensors) -> List[torch.Tensor]:
    """Contiguous tensors to write results for ``tensors`` into (the contiguous ones themselves)."""
    return [t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype, device=t.device)
            for t in tensors]


def _copy_back(targets: Tensors, buffers: Tensors) -> None:
    for target, buffer in zip(targets, buffers):
        if buffer is not target:
            target.copy_(buffer)


def scale_(tensors: Tensors, scale: float, found_inf: torch.Tensor) -> None:
    """``t *= scale`` for each tensor; flags non-finite elements."""
    if _contiguous(tensors):
        _scale_(tensors, scale, found_inf)
        return
    staged = _read_copies(tensors)
    _scale_(staged, scale, found_inf)
    _copy_back(tensors, staged)


def scale_out(inputs: Tensors, outputs: Tensors, scale: float, found_inf: torch.Tensor) -> None:
    """``out = in * scale`` for each pair; flags non-finite inputs."""
    if _contiguous(inputs) and _contiguous(outputs):
        _scale_out(inputs, outputs, scale, found_inf)
        return
    staged_out = _write_buffers(outputs)
    _scale_out(_read_copies(inputs), staged_out, scale, found_inf)
    _copy_back(outputs, staged_out)


def axpby_(xs: Tensors, ys: Tensors, a: float, b: float, found_inf: torch.Tensor) -> None:
    """``y = a*x + b*y`` for each pair; flags non-finite elements of xs and ys."""
    if _contiguous(xs) and _contiguous(ys):
        _axpby_(xs, ys, a, b, found_inf)
        return
    staged_ys = _read_copies(ys)
    _axpby_(_read_copies(xs), staged_ys, a, b, found_inf)
    _copy_back(ys, staged_ys)


def axpby_out(xs: Tensors, ys: Tensors, outputs: Tensors, a: float, b: float,
              found_inf: torch.Tensor) -> None:
    """``out = a*x + b*y`` for each triple; flags non-finite elements of xs and ys."""
    if _contiguous(xs) and _contiguous(ys) and _contiguous(outputs):
        _axpby_out(xs, ys, outputs, a, b, found_inf)
        return
    staged_out = _write_buffers(outputs)
    _axpby_out(_read_copies(xs), _read_copies(ys), staged_out, a, b, found_inf)
    _copy_back(outputs, staged_out)


def l2norm(tensors: Tensors, per_tensor: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(total, per_tensor_norms)`` in fp32; ``per_tensor_norms`` is empty unless asked for."""
    if not _contiguous(tensors):
        tensors = _read_copies(tensors)
    return _l2norm(tensors, per_tensor)


def nonfinite_flags(tensors: Tensors) -> torch.Tensor:
    """One bool per tensor: True where it holds an inf or NaN."""
    if not _contiguous(tensors):
        tensors = _read_copies(tensors)
    return _nonfinite_flags(tensors)


STAGED_OPS = SimpleNamespace(scale_=scale_, scale_out=scale_out, axpby_=axpby_,
                             axpby_out=axpby_out, l2norm=l2norm, nonfinite_flags=nonfinite_flags)
