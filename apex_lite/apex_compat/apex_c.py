"""NVIDIA apex's compiled ``apex_C`` module: ``flatten`` and ``unflatten``, over torch's own
``_flatten_dense_tensors`` / ``_unflatten_dense_tensors`` (apex's C++ called the same torch
functions, torch/csrc/utils/tensor_flatten.h).

This module is what ``import apex_C`` gives through apex_lite's ``apex`` (the ``compat/apex``
distribution, or ``apex_lite.install_apex_alias()``), for code that packs gradients into one
buffer before a collective (BERT's and Megatron's scripts, apex's DDP)::

    import apex_C
    flat = apex_C.flatten(grads)                       # one contiguous 1-D tensor
    for g, synced in zip(grads, apex_C.unflatten(flat, grads)):
        g.copy_(synced)
"""
from __future__ import annotations

from typing import List, Sequence

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["flatten", "unflatten"]


def _check_tensors(name: str, tensors) -> List[torch.Tensor]:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"apex_C: {name} must be a list or tuple of tensors, got "
                        f"{type(tensors).__name__}")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"apex_C: {name}[{i}] is a {type(t).__name__}, not a tensor")
        if t.is_sparse:
            raise TypeError(f"apex_C: {name}[{i}] is sparse; flatten and unflatten take dense "
                            f"tensors (torch._utils._flatten_sparse_tensors packs sparse ones)")
    return list(tensors)


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' elements, in order, in one new contiguous 1-D tensor (apex's
    ``apex_C.flatten``).

    Args:
        tensors: a non-empty list of dense tensors on one device, of one dtype.
    Returns:
        The flat tensor, of the tensors' dtype and device.
    Raises:
        TypeError: ``tensors`` is not a list of dense tensors.
        ValueError: it is empty (there would be no dtype or device for the result).
    """
    tensors = _check_tensors("tensors", tensors)
    if not tensors:
        raise ValueError("apex_C.flatten: the list of tensors is empty")
    return _flatten_dense_tensors(tensors)


def unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Views of ``flat`` shaped like ``tensors``, in order (apex's ``apex_C.unflatten``, the
    inverse of ``flatten``).

    Args:
        flat: a 1-D tensor holding exactly as many elements as ``tensors`` together.
        tensors: the tensors whose shapes to give the pieces (their values are not read).
    Returns:
        A list of views into ``flat``, one per tensor, each of its tensor's shape.
    Raises:
        TypeError: ``flat`` is not a tensor, or ``tensors`` is not a list of dense tensors.
        ValueError: ``flat`` is not 1-D or its size is not the tensors' total.
    """
    if not isinstance(flat, torch.Tensor):
        raise TypeError(f"apex_C.unflatten: flat must be a tensor, got {type(flat).__name__}")
    tensors = _check_tensors("tensors", tensors)
    total = sum(t.numel() for t in tensors)
    if flat.dim() != 1 or flat.numel() != total:
        raise ValueError(f"apex_C.unflatten: flat must be 1-D with {total} elements (the "
                         f"tensors' total); got shape {tuple(flat.shape)}")
    return list(_unflatten_dense_tensors(flat, tensors))
