"""Norms over whole tensors when some are FSDP2 shards (DTensors): each rank's local shards
reduced over the mesh, so that every rank gets the same norm, the one of the unsharded tensors.
amp uses them to refuse unscaled gradients (``squared_norm``) and to clip (``clip_grad_norm_``).
"""
from __future__ import annotations

import functools
import math
from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from ..multi_tensor._backend import ops_for
from ..optimizers.update import local_shards
from .fsdp import is_sharded


def _shard_groups(tensor) -> Tuple:
    """``(mesh, dims)``: the mesh dimensions ``tensor`` is sharded over (summing over them gives
    the whole tensor's sum; replicated dimensions hold copies)."""
    dims = tuple(i for i, placement in enumerate(tensor.placements) if placement.is_shard())
    return tensor.device_mesh, dims


def _sum_over_shards(value: torch.Tensor, key, op=dist.ReduceOp.SUM) -> torch.Tensor:
    mesh, dims = key
    for dim in dims:
        dist.all_reduce(value, op=op, group=mesh.get_group(dim))
    return value


def _by_shard_groups(tensors) -> Tuple[List[torch.Tensor], Dict[tuple, List[torch.Tensor]]]:
    """(plain tensors, local shards per ``_shard_groups`` key), in first-seen order (the same on
    every rank, so the collectives match)."""
    plain: List[torch.Tensor] = []
    groups: Dict[tuple, List[torch.Tensor]] = {}
    for t in tensors:
        if is_sharded(t):
            groups.setdefault(_shard_groups(t), []).append(t)
        else:
            plain.append(t)
    return plain, {key: local_shards(shards) for key, shards in groups.items()}


def squared_norm(tensors: List[torch.Tensor]) -> torch.Tensor:
    """The sum of squares of the whole ``tensors`` (fp32, 1 element, on their device): a
    DTensor's local shards summed over its mesh (one all-reduce per group of shards), a plain
    tensor counted once. Every rank must call it with the same tensors."""
    ops = ops_for(tensors[0].device)
    plain, groups = _by_shard_groups(tensors)
    parts = [ops.l2norm(plain, False)[0].square()] if plain else []
    parts += [_sum_over_shards(ops.l2norm(shards, False)[0].square(), key)
              for key, shards in groups.items()]
    return functools.reduce(torch.add, parts)


def _global_norm(tensors: List[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The ``norm_type``-norm of all of ``tensors`` as whole tensors (0-dim fp32)."""
    if norm_type == 2.0:
        return squared_norm(tensors).sqrt().reshape(())
    plain, groups = _by_shard_groups(tensors)
    parts = [(plain, None)] + [(shards, key) for key, shards in groups.items()]
    device = tensors[0].device
    total = torch.zeros(1, dtype=torch.float32, device=device)
    for part, key in parts:
        if not part:
            continue
        norms = torch.stack([torch.linalg.vector_norm(t.float(), norm_type) for t in part])
        if math.isinf(norm_type):
            value = norms.max().reshape(1)
            if key is not None:
                _sum_over_shards(value, key, dist.ReduceOp.MAX)
            total = torch.maximum(total, value)
        else:
            value = norms.pow(norm_type).sum().reshape(1)
            if key is not None:
                _sum_over_shards(value, key)
            total = total + value
    if math.isinf(norm_type):
        return total.reshape(())
    return total.pow(1.0 / norm_type).reshape(())


def clip_grad_norm_(params: Sequence[torch.Tensor], max_norm: float,
                    norm_type: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for gradients of which some are DTensors: the norm of
    the whole gradients (reduced over the mesh), every rank scaling its shards by the same
    coefficient; a plain (0-dim, fp32) tensor is returned."""
    grads = [p.grad for p in params if p.grad is not None]
    if not any(is_sharded(g) for g in grads):
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    total = _global_norm(grads, norm_type)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_(local_shards(grads), coefficient)
    return total
