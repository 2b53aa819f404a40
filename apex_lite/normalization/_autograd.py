"""apex's layer-norm and RMS-norm autograd Functions, on torch's fused ops, with apex's
``apply`` signatures (Megatron-style code calls them directly). The norms take them for
``memory_efficient=True``, for an input whose dtype is not the parameters', and for RMS norms
on the CPU (fused_layer_norm.py says why).

``memory_efficient`` (apex's meaning): the backward keeps the norm's output instead of its input.
A network usually keeps that output anyway (the next layer saves it for its own backward), so the
input can be freed after the forward: one activation of the input's size saved per norm. The
backward rebuilds the normalised input ``x_hat`` from the output, ``(y - bias) / weight``, with
weights smaller in magnitude than ``eps`` taken as ``+-eps`` there (apex's kernels do the same);
such weights give approximate input gradients. Without it, the input is kept, as torch's
``layer_norm`` keeps it.

Statistics and the backward are computed in fp32 (fp64 for fp64 tensors) whatever the storage
dtype; one rounding to the output dtype.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch


def check_shapes(input: torch.Tensor, normalized_shape: Sequence[int],
                 weight: Optional[torch.Tensor], bias: Optional[torch.Tensor]) -> Tuple[int, ...]:
    """``normalized_shape`` as a tuple, after checking that it is the input's trailing shape and
    the parameters' shape (the errors torch's ``layer_norm`` gives, said the same way)."""
    shape = tuple(int(n) for n in normalized_shape)
    if not shape or input.dim() < len(shape) or tuple(input.shape[-len(shape):]) != shape:
        raise RuntimeError(f"normalized_shape {list(shape)} must be the trailing dimensions of "
                           f"the input, whose shape is {list(input.shape)}")
    for name, param in (("weight", weight), ("bias", bias)):
        if param is not None and tuple(param.shape) != shape:
            raise RuntimeError(f"{name} has shape {list(param.shape)}; it must be "
                               f"normalized_shape {list(shape)}")
    return shape


def compute_dtype(*tensors: Optional[torch.Tensor]) -> torch.dtype:
    """fp32, or fp64 where a tensor is fp64: what the statistics are computed in."""
    dtype = torch.float32
    for t in tensors:
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _clamp_by_magnitude(weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight`` with magnitudes below ``eps`` raised to ``eps``, keeping the sign (0 -> +eps):
    the divisor that rebuilds ``x_hat`` from the output."""
    return torch.where(weight >= 0, weight.clamp(min=eps), weight.clamp(max=-eps))


# torch's fused RMS-norm forward (torch 2.8+; it has no CPU backward): (output, rstd).
_FUSED_RMS_NORM = getattr(torch.ops.aten, "_fused_rms_norm", None)


def _rms_forward(x, shape, w, eps):
    if _FUSED_RMS_NORM is not None:
        return _FUSED_RMS_NORM(x, list(shape), w, eps)
    rstd = torch.rsqrt(x.square().mean(tuple(range(-len(shape), 0)), keepdim=True) + eps)
    out = x * rstd
    return (out if w is None else out * w), rstd


def _forward(ctx, input, weight, bias, normalized_shape, eps, memory_efficient, *, rms: bool,
             mixed: bool):
    """The norm's output (in the weight's dtype when ``mixed``, else the input's), with what
    the backward needs saved on ``ctx``."""
    shape = check_shapes(input, normalized_shape, weight, bias)
    dtype = compute_dtype(input, weight, bias)
    x = input.to(dtype)
    w = None if weight is None else weight.to(dtype)
    if rms:
        mean = None
        out, rstd = _rms_forward(x, shape, w, eps)
    else:
        out, mean, rstd = torch.native_layer_norm(x, list(shape), w,
                                                  None if bias is None else bias.to(dtype), eps)
    out = out.to(weight.dtype if mixed and weight is not None else input.dtype)
    ctx.rms, ctx.eps, ctx.shape = rms, eps, shape
    ctx.memory_efficient = bool(memory_efficient)
    ctx.input_dtype = input.dtype
    if ctx.memory_efficient:
        ctx.save_for_backward(out, weight, bias, rstd)
    else:
        ctx.save_for_backward(input, weight, bias, rstd, mean)
    return out


def _backward(ctx, grad_output):
    """(grad_input, grad_weight, grad_bias) for the norm ``_forward`` computed, by torch's fused
    layer-norm backward in fp32. Given ``x_hat`` with mean 0 and rstd 1 it gives
    ``gw - mean(gw) - x_hat * mean(gw * x_hat)`` (``gw = grad * weight``), the weight's and the
    bias' gradients; ``rstd`` times it is the layer norm's input gradient, and adding
    ``mean(gw)`` back first gives the RMS norm's."""
    if ctx.memory_efficient:
        out, weight, bias, rstd = ctx.saved_tensors
    else:
        input, weight, bias, rstd, mean = ctx.saved_tensors
    dtype = rstd.dtype
    w = None if weight is None else weight.to(dtype)
    b = None if bias is None else bias.to(dtype)
    g = grad_output.to(dtype)
    mask = [ctx.needs_input_grad[0], w is not None and ctx.needs_input_grad[1],
            b is not None and ctx.needs_input_grad[2]]
    shape = list(ctx.shape)
    if not ctx.rms and not ctx.memory_efficient:
        grad_input, grad_weight, grad_bias = torch.ops.aten.native_layer_norm_backward(
            g, input.to(dtype), shape, mean, rstd, w, b, mask)
    else:
        if ctx.memory_efficient:
            x_hat = out.to(dtype) if b is None else out.to(dtype) - b
            if w is not None:
                x_hat = x_hat / _clamp_by_magnitude(w, ctx.eps)
        else:
            x_hat = input.to(dtype) * rstd
        grad_input, grad_weight, grad_bias = torch.ops.aten.native_layer_norm_backward(
            g, x_hat, shape, torch.zeros_like(rstd), torch.ones_like(rstd), w, b, mask)
        if grad_input is not None and ctx.rms:
            features = math.prod(ctx.shape)
            rows = g.reshape(-1, features)
            mean_gw = (rows @ w.reshape(features) if w is not None else rows.sum(1)) / features
            grad_input = torch.addcmul(mean_gw.reshape(rstd.shape) * rstd, grad_input, rstd)
        elif grad_input is not None:
            grad_input = grad_input * rstd
    return (None if grad_input is None else grad_input.to(ctx.input_dtype),
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype))


class FusedLayerNormAffineFunction(torch.autograd.Function):
    """apex's layer norm with weight and bias: ``apply(input, weight, bias, normalized_shape,
    eps, memory_efficient=False)``; output in the input's dtype."""

    @staticmethod
    def forward(ctx, input, weight, bias, normalized_shape, eps, memory_efficient=False):
        return _forward(ctx, input, weight, bias, normalized_shape, eps, memory_efficient,
                        rms=False, mixed=False)

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, grad_weight, grad_bias = _backward(ctx, grad_output)
        return grad_input, grad_weight, grad_bias, None, None, None


class FusedLayerNormAffineMixedDtypesFunction(FusedLayerNormAffineFunction):
    """``FusedLayerNormAffineFunction`` with the output in the weight's dtype (apex's
    ``forward_affine_mixed_dtypes``: fp32 parameters, half input, fp32 output)."""

    @staticmethod
    def forward(ctx, input, weight, bias, normalized_shape, eps, memory_efficient=False):
        return _forward(ctx, input, weight, bias, normalized_shape, eps, memory_efficient,
                        rms=False, mixed=True)


class FusedLayerNormFunction(torch.autograd.Function):
    """apex's layer norm without parameters: ``apply(input, normalized_shape, eps,
    memory_efficient=False)``."""

    @staticmethod
    def forward(ctx, input, normalized_shape, eps, memory_efficient=False):
        return _forward(ctx, input, None, None, normalized_shape, eps, memory_efficient,
                        rms=False, mixed=False)

    @staticmethod
    def backward(ctx, grad_output):
        return _backward(ctx, grad_output)[0], None, None, None


class FusedRMSNormAffineFunction(torch.autograd.Function):
    """apex's RMS norm with a weight: ``apply(input, weight, normalized_shape, eps,
    memory_efficient=False)``; output in the input's dtype."""

    @staticmethod
    def forward(ctx, input, weight, normalized_shape, eps, memory_efficient=False):
        return _forward(ctx, input, weight, None, normalized_shape, eps, memory_efficient,
                        rms=True, mixed=False)

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, grad_weight, _ = _backward(ctx, grad_output)
        return grad_input, grad_weight, None, None, None


class FusedRMSNormAffineMixedDtypesFunction(FusedRMSNormAffineFunction):
    """``FusedRMSNormAffineFunction`` with the output in the weight's dtype."""

    @staticmethod
    def forward(ctx, input, weight, normalized_shape, eps, memory_efficient=False):
        return _forward(ctx, input, weight, None, normalized_shape, eps, memory_efficient,
                        rms=True, mixed=True)


class FusedRMSNormFunction(torch.autograd.Function):
    """apex's RMS norm without a weight: ``apply(input, normalized_shape, eps,
    memory_efficient=False)``."""

    @staticmethod
    def forward(ctx, input, normalized_shape, eps, memory_efficient=False):
        return _forward(ctx, input, None, None, normalized_shape, eps, memory_efficient,
                        rms=True, mixed=False)

    @staticmethod
    def backward(ctx, grad_output):
        return _backward(ctx, grad_output)[0], None, None, None
