"""apex's flat collectives (``apex.parallel.distributed``'s helpers): tensors grouped by dtype and
device, flattened into one buffer per group, one collective per buffer, the result copied back.

``flat_dist_call(tensors, call, extra_args=None)`` is what apex's ``Reducer`` and DDP's
constructor run; with ``call=dist.all_reduce`` it averages (divides the sum by the world size),
with ``dist.broadcast, (0,)`` every rank gets rank 0's values. Built on torch's
``_flatten_dense_tensors`` / ``_unflatten_dense_tensors`` (apex's ``apex_C.flatten`` is the same
operation).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import List, Tuple

import torch
import torch.distributed as dist

__all__ = ["flatten", "unflatten", "apply_flat_dist_call", "split_by_type",
           "split_half_float_double", "flat_dist_call", "extract_tensors"]


def flatten(bucket: List[torch.Tensor]) -> torch.Tensor:
    """One contiguous 1-D tensor holding ``bucket``'s tensors (all of one dtype and device)."""
    return torch._utils._flatten_dense_tensors(bucket)


def unflatten(coalesced: torch.Tensor, bucket: List[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    """Views of ``coalesced`` shaped as ``bucket``'s tensors, in order."""
    return torch._utils._unflatten_dense_tensors(coalesced, bucket)


def apply_flat_dist_call(bucket: List[torch.Tensor], call, extra_args=None) -> None:
    """``call(flat, *extra_args)`` on ``bucket`` flattened (one dtype and device), then the
    result copied back into the tensors; after ``dist.all_reduce`` divided by the world size."""
    coalesced = flatten(bucket)
    if extra_args is not None:
        call(coalesced, *extra_args)
    else:
        call(coalesced)
    if call is dist.all_reduce:
        coalesced /= dist.get_world_size()
    for buf, synced in zip(bucket, unflatten(coalesced, bucket)):
        buf.copy_(synced)


def split_by_type(tensors) -> "OrderedDict[Tuple[torch.device, torch.dtype], List[torch.Tensor]]":
    """``tensors`` grouped by (device, dtype), groups in order of first appearance (apex keyed
    them by ``tensor.type()``, the same partition)."""
    buckets: "OrderedDict[Tuple[torch.device, torch.dtype], List[torch.Tensor]]" = OrderedDict()
    for tensor in tensors:
        buckets.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    return buckets


_APEX_DTYPE_ORDER = {torch.float16: 0, torch.float32: 1, torch.float64: 2}


def split_half_float_double(tensors) -> List[List[torch.Tensor]]:
    """``tensors`` as buckets of one dtype and device: fp16, fp32, fp64 first (apex's order),
    then the others (bf16, which apex's CUDA-type list left out and so never reduced)."""
    groups = split_by_type(tensors)
    keys = sorted(groups, key=lambda key: _APEX_DTYPE_ORDER.get(key[1], 3))
    return [groups[key] for key in keys]


def flat_dist_call(tensors, call, extra_args=None) -> None:
    """``apply_flat_dist_call`` once per (device, dtype) group of ``tensors``, with ``call`` the
    collective and ``extra_args`` its further arguments: with
    ``dist.all_reduce`` every tensor ends as the average over the ranks, with ``dist.broadcast``
    and ``extra_args=(src,)`` as rank ``src``'s. Every rank must pass tensors of the same
    shapes, dtypes and order."""
    for bucket in split_by_type(tensors).values():
        apply_flat_dist_call(bucket, call, extra_args)


def extract_tensors(maybe_tensor, tensor_list: List[torch.Tensor]) -> None:
    """Append every tensor found in ``maybe_tensor`` (a tensor, or nested iterables of them) to
    ``tensor_list``; anything else is skipped."""
    if torch.is_tensor(maybe_tensor):
        tensor_list.append(maybe_tensor)
        return
    try:
        items = iter(maybe_tensor)
    except TypeError:
        return
    for item in items:
        extract_tensors(item, tensor_list)
