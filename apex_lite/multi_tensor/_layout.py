"""Memory layouts the kernels can step without copies: one dense layout shared by the tensors of
a parameter (its gradient, state and model parameter).

A dense tensor covers its memory without gaps or overlaps in some order of its dims
(contiguous, channels_last, a permutation): its elements are the ``numel`` consecutive ones from
its first address, in an order its strides give. Two dense tensors of one shape and the same
strides (dims of size 1 aside, whose strides mean nothing) put each element at the same offset:
an elementwise kernel may walk them as flat arrays together. The CUDA kernels and torch's fused
kernels do; csrc/cuda/multi_tensor_apply.cuh makes the same test (``laid_out_as``).
"""
from __future__ import annotations

import torch


def dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers its memory without gaps or overlaps, in some order of its dims."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def laid_out_as(t: torch.Tensor, like: torch.Tensor) -> bool:
    """Whether ``t`` is dense with ``like``'s shape and strides (dims of size 1 aside), so that
    the two can be walked as flat arrays together (``like`` itself dense)."""
    if t.shape != like.shape or not dense(t):
        return False
    return all(a == b for a, b, size in zip(t.stride(), like.stride(), t.shape) if size != 1)
