"""apex's ``SyncBatchNorm``: BatchNorm whose batch statistics span the ranks of a process group,
on CPU (gloo) and CUDA (nccl), and ``convert_syncbn_model`` / ``create_syncbn_process_group``
to put it in a model. The arithmetic is in sync_batchnorm_kernel.py.

It is a ``torch.nn.modules.batchnorm._BatchNorm``, so amp keeps it fp32 at O2 as it keeps
BatchNorm (``keep_batchnorm_fp32``), and torch's code that recognises BatchNorm recognises it.
Its arithmetic upcasts a half input itself, so amp hands it O2's half activations as they are
(``register_half_input_forward`` below): its parameters and statistics stay fp32, it saves the
half input for backward, and its output is half.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ..amp.casting import ANY_LAYOUT, CONTIGUOUS, register_half_input_forward
from .sync_batchnorm_kernel import (SyncBatchnormFunction, batch_stats, stat_dtype,
                                    synced_group_size, update_running_stats)

__all__ = ["SyncBatchNorm", "convert_syncbn_model", "create_syncbn_process_group"]


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over the whole batch of a process group: in training (and without running
    statistics) each channel is normalised with the mean and biased variance of all ranks'
    inputs together, weighted by each rank's count; the running variance is unbiased with the
    group's count; eval normalises with the running statistics and communicates nothing.
    Statistics are fp32 for fp16/bf16 inputs, and the output has the input's dtype. Without
    torch.distributed initialised it is BatchNorm over the local batch.

    Args:
        num_features: C, the number of channels.
        eps: added to the variance (default 1e-5).
        momentum: the running statistics' update factor; None for a cumulative average.
        affine: learn a weight and a bias per channel.
        track_running_stats: keep running statistics (else batch statistics in eval too).
        process_group: the ranks whose batches are normalised together (None: all).
        channel_last: the channel is the input's last dimension (N, ..., C) instead of its
            second (N, C, ...); 2-D inputs (N, C) are both.
        fuse_relu: apply ReLU to the output (apex's fused bn + add + relu).

    ``forward(input, z=None)``: with ``z`` (the input's shape), ``z`` is added before the
    ReLU, as apex's fused kernel does.

    Raises (forward):
        ValueError: the input's channel dimension is not ``num_features`` (or ``channel_last``
            names the wrong one); ``z`` of another shape; one value per channel in training on
            a single rank.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, process_group=None, channel_last=False,
                 fuse_relu=False):
        super().__init__(num_features, eps=eps, momentum=momentum, affine=affine,
                         track_running_stats=track_running_stats)
        self.process_group = process_group
        self.channel_last = channel_last
        self.fuse_relu = fuse_relu

    def _specify_process_group(self, process_group):
        """apex's setter: normalise over ``process_group`` from now on."""
        self.process_group = process_group

    def _specify_channel_last(self, channel_last):
        """apex's setter: the channel is the last dimension (or not) from now on."""
        self.channel_last = channel_last

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of at least 2 dimensions (N, C, "
                             f"...), got {input.dim()}")

    def extra_repr(self):
        return (super().extra_repr() + f", channel_last={self.channel_last}"
                f"{', fuse_relu=True' if self.fuse_relu else ''}")

    def forward(self, input, z=None):
        """Normalise ``input`` (N, C, ...) with the statistics of the whole group's batch; ``z``,
        when given, is added to the output before the ReLU of ``fuse_relu`` (apex's fused
        add-ReLU). Returns a tensor of the input's shape and dtype.

        Raises:
            ValueError: the input's channel count is not ``num_features``.
        """
        self._check_input_dim(input)
        channel_last = self.channel_last if input.dim() != 2 else True
        channel_dim = input.dim() - 1 if channel_last else 1
        if input.shape[channel_dim] != self.num_features:
            raise ValueError(
                f"SyncBatchNorm({self.num_features}, channel_last={self.channel_last}) got an "
                f"input of shape {tuple(input.shape)}, whose channel dimension ({channel_dim}) "
                f"has {input.shape[channel_dim]} entries; "
                + ("channel_last=True takes (N, ..., C)" if channel_last else
                   "channel-first takes (N, C, ...); pass channel_last=True for (N, ..., C)"))
        if z is not None and z.shape != input.shape:
            raise ValueError(f"SyncBatchNorm's z is added to the output and needs the input's "
                             f"shape {tuple(input.shape)}, got {tuple(z.shape)}")
        use_batch = self.training or not self.track_running_stats
        if not use_batch and not channel_last and not self.fuse_relu and z is None:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, False, 0.0, self.eps)
        group_size = synced_group_size(self.process_group) if use_batch else 1
        if use_batch:
            if group_size == 1 and input.numel() == input.shape[channel_dim]:
                raise ValueError(f"Expected more than 1 value per channel when training, got "
                                 f"input size {input.size()}")
            # No graph through the statistics: SyncBatchnormFunction's backward is the gradient
            # through them, and a graph would keep var_mean's fp32 copy of a half input alive
            # until backward.
            with torch.no_grad():
                mean, var, count = batch_stats(input, channel_dim, self.process_group,
                                               group_size)
            if self.training and self.track_running_stats:
                self.num_batches_tracked.add_(1)
                factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                          else self.momentum)
                update_running_stats(self.running_mean, self.running_var, mean, var, count,
                                     factor)
        else:
            dtype = stat_dtype(input.dtype)
            mean, var = self.running_mean.to(dtype), self.running_var.to(dtype)
            count = None
        with torch.no_grad():
            invstd = torch.rsqrt(var + self.eps)
        return SyncBatchnormFunction.apply(input, z, self.weight, self.bias, mean, invstd, count,
                                           self.process_group, channel_dim, self.fuse_relu,
                                           use_batch, group_size)


# Its statistics and normalisation are fp32 for a half input on any device; eval's shortcut is
# torch's batch_norm, whose mix is exact on the CPU for contiguous inputs only (casting.py).
register_half_input_forward(SyncBatchNorm.forward, {"cpu": CONTIGUOUS, "cuda": ANY_LAYOUT})


def convert_syncbn_model(module, process_group=None, channel_last=False):
    """``module`` with every ``_BatchNorm`` inside (torch's BatchNorm1d/2d/3d, torch's
    SyncBatchNorm, an apex_lite SyncBatchNorm) replaced by an apex_lite ``SyncBatchNorm`` with its
    hyper-parameters, its weight and bias (the same Parameter objects, so an optimizer built
    before still updates them, ``requires_grad`` kept), its buffers and its train/eval mode, under
    the same names (state_dict keys do not change). Instance norms are left alone.

    Args:
        module: the model (or a BatchNorm itself, which is returned replaced).
        process_group: the group the new layers synchronise over (None: all ranks).
        channel_last: the new layers' ``channel_last``.

    Returns:
        The converted module (``module`` itself unless it was a BatchNorm).
    """
    if isinstance(module, torch.nn.modules.instancenorm._InstanceNorm):
        return module
    converted = module
    if isinstance(module, _BatchNorm):
        converted = SyncBatchNorm(module.num_features, module.eps, module.momentum,
                                  module.affine, module.track_running_stats, process_group,
                                  channel_last=channel_last,
                                  fuse_relu=getattr(module, "fuse_relu", False))
        if module.affine:
            converted.weight = module.weight
            converted.bias = module.bias
        converted.running_mean = module.running_mean
        converted.running_var = module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.train(module.training)
        if hasattr(module, "qconfig"):
            converted.qconfig = module.qconfig
    for name, child in module.named_children():
        converted.add_module(name, convert_syncbn_model(child, process_group=process_group,
                                                        channel_last=channel_last))
    return converted


def create_syncbn_process_group(group_size):
    """The process group of ``group_size`` consecutive ranks that this rank belongs to, for
    ``SyncBatchNorm(process_group=...)``. Call it on every rank: it creates every group (torch's
    ``new_group`` is collective).

    Args:
        group_size: ranks per group, dividing the world size; 0 means all ranks.

    Returns:
        This rank's group, or None for ``group_size=0`` (the default group).

    Raises:
        ValueError: ``group_size`` does not divide the world size.
    """
    if group_size == 0:
        return None
    world_size = dist.get_world_size()
    if group_size < 0 or group_size > world_size or world_size % group_size:
        raise ValueError(f"group_size={group_size} must divide the world size {world_size} "
                         f"(0 for one group of all ranks)")
    rank = dist.get_rank()
    group = None
    for number in range(world_size // group_size):
        ranks = list(range(number * group_size, (number + 1) * group_size))
        created = dist.new_group(ranks=ranks)
        if rank // group_size == number:
            group = created
    return group
