"""SyncBatchNorm's arithmetic: the batch statistics over a process group (``batch_stats``) and the
normalisation with its backward (``SyncBatchnormFunction``), in torch ops on any device.

Statistics are computed in fp32 for fp16/bf16 inputs (fp64 stays fp64). Each rank's per-channel
mean, biased variance and element count are all-gathered (in fp64: counts stay exact past 2**24)
and combined weighted by the counts, so ranks with different batch sizes give the statistics of
the concatenated batch (apex's CUDA build did this; its Python fallback averaged the ranks' means
and was wrong for unequal batches). A rank with an empty batch contributes nothing.

Backward, with ``xhat = (x - mean) * invstd`` and N the group's element count per channel:
``dx = w * invstd * (dy - sum(dy) / N - xhat * sum(dy * xhat) / N)``, the two sums all-reduced
over the group (one collective), which is the gradient through the global statistics. The
weight and bias gradients are this rank's sums; DistributedDataParallel averages them as any
gradient. With statistics from the running buffers (eval) ``dx = w * invstd * dy``.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["SyncBatchnormFunction", "batch_stats", "stat_dtype", "synced_group_size"]


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics and the normalisation are computed in for an input of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def synced_group_size(process_group) -> int:
    """The number of ranks statistics are synchronised over: 1 without torch.distributed."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(process_group)


def _reduce_dims(input: torch.Tensor, channel_dim: int) -> List[int]:
    return [d for d in range(input.dim()) if d != channel_dim]


def _channel_shape(input: torch.Tensor, channel_dim: int) -> List[int]:
    shape = [1] * input.dim()
    shape[channel_dim] = input.shape[channel_dim]
    return shape


def batch_stats(input: torch.Tensor, channel_dim: int, process_group,
                group_size: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean, biased variance, element count) per channel of the batch spread over the group,
    the first two in ``stat_dtype``, the count a 0-dim fp64 tensor on the input's device."""
    channels = input.shape[channel_dim]
    dtype = stat_dtype(input.dtype)
    count = input.numel() // channels if channels else 0
    if count:
        var, mean = torch.var_mean(input.to(dtype), dim=_reduce_dims(input, channel_dim),
                                   correction=0)
    else:
        mean = var = torch.zeros(channels, dtype=dtype, device=input.device)
    if group_size == 1:
        return mean, var, torch.tensor(float(count), dtype=torch.float64, device=input.device)
    local = torch.cat([mean.double(), var.double(),
                       torch.tensor([float(count)], dtype=torch.float64, device=input.device)])
    gathered = [torch.empty_like(local) for _ in range(group_size)]
    dist.all_gather(gathered, local, group=process_group)
    stacked = torch.stack(gathered)
    means, variances = stacked[:, :channels], stacked[:, channels:2 * channels]
    counts = stacked[:, 2 * channels:]
    total = counts.sum()
    weights = counts / total.clamp(min=1.0)
    mean64 = (means * weights).sum(0)
    var64 = ((variances + (means - mean64) ** 2) * weights).sum(0)
    return mean64.to(dtype), var64.to(dtype), total


def update_running_stats(running_mean: Optional[torch.Tensor],
                         running_var: Optional[torch.Tensor], mean: torch.Tensor,
                         var: torch.Tensor, count: torch.Tensor, factor: float) -> None:
    """``running = (1 - factor) * running + factor * batch`` (torch's rule), the variance
    unbiased with the group's count (``var * N / (N - 1)``); nothing changes when N is 0."""
    with torch.no_grad():
        factor_t = (count > 0).to(mean.dtype) * factor
        if running_mean is not None:
            new = running_mean.to(mean.dtype) * (1 - factor_t) + mean * factor_t
            running_mean.copy_(new)
        if running_var is not None:
            unbiased = var * (count / (count - 1).clamp(min=1.0)).to(var.dtype)
            new = running_var.to(var.dtype) * (1 - factor_t) + unbiased * factor_t
            running_var.copy_(new)


class SyncBatchnormFunction(torch.autograd.Function):
    """``out = [relu]((x - mean) * invstd * weight + bias [+ z])`` in ``stat_dtype``, returned
    in the input's dtype; backward through the group's statistics when ``batch``."""

    @staticmethod
    def forward(ctx, input, z, weight, bias, mean, invstd, count, process_group, channel_dim,
                fuse_relu, batch, group_size):
        shape = _channel_shape(input, channel_dim)
        dtype = mean.dtype
        out = (input.to(dtype) - mean.view(shape)) * invstd.view(shape)
        if weight is not None:
            out = out * weight.to(dtype).view(shape)
        if bias is not None:
            out = out + bias.to(dtype).view(shape)
        if z is not None:
            out = out + z.to(dtype)
        if fuse_relu:
            out = torch.relu(out)
        out = out.to(input.dtype)
        ctx.save_for_backward(input, weight, mean, invstd, count, out if fuse_relu else None)
        ctx.process_group = process_group
        ctx.channel_dim = channel_dim
        ctx.fuse_relu = fuse_relu
        ctx.batch = batch
        ctx.group_size = group_size
        ctx.has_z = z is not None
        ctx.z_dtype = z.dtype if z is not None else None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return out

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, mean, invstd, count, out = ctx.saved_tensors
        channel_dim = ctx.channel_dim
        shape = _channel_shape(input, channel_dim)
        dims = _reduce_dims(input, channel_dim)
        dtype = mean.dtype
        dy = grad_output.to(dtype)
        if ctx.fuse_relu:
            dy = dy.masked_fill(out <= 0, 0)
        grad_z = dy.to(ctx.z_dtype) if ctx.has_z and ctx.needs_input_grad[1] else None
        xhat = (input.to(dtype) - mean.view(shape)) * invstd.view(shape)
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * xhat).sum(dims)
        grad_weight = grad_bias = None
        if weight is not None and ctx.needs_input_grad[2]:
            grad_weight = sum_dy_xhat.to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[3]:
            grad_bias = sum_dy.to(ctx.bias_dtype)
        grad_input = None
        if ctx.needs_input_grad[0]:
            scale = invstd if weight is None else invstd * weight.to(dtype)
            if ctx.batch:
                if ctx.group_size > 1:
                    channels = sum_dy.shape[0]
                    both = torch.cat([sum_dy, sum_dy_xhat])
                    dist.all_reduce(both, group=ctx.process_group)
                    sum_dy, sum_dy_xhat = both[:channels], both[channels:]
                n = count.to(dtype).clamp(min=1)
                dy = dy - (sum_dy / n).view(shape) - xhat * (sum_dy_xhat / n).view(shape)
            grad_input = (dy * scale.view(shape)).to(input.dtype)
        return (grad_input, grad_z, grad_weight, grad_bias, None, None, None, None, None, None,
                None, None)
