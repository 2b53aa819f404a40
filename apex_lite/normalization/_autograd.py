"""The norms' autograd Function on torch's fused ops, and apex's Function names with their
``apply`` signatures (Megatron-style code calls them directly). The norms take it for
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

Note: differentiating twice. The first-order backward is torch's fused layer-norm backward, whose
saved statistics autograd cannot see through. Where the backward itself is differentiated
(``create_graph=True``, ``torch.func.grad``), it is composed of torch ops instead: from the kept
input (statistics recomputed from it), or under ``memory_efficient`` from the kept output and the
inverse standard deviation ``rstd``, which the Function returns as a differentiable output for
that reason (``d rstd / dx = -rstd**2 * x_hat / n``), so every order is exact. The Function
defines ``setup_context``, ``jvp`` and ``generate_vmap_rule``, so ``torch.func`` (vmap, grad,
jacrev, jvp) and forward-mode AD work over it.
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


def _cast(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    return None if t is None else t.to(dtype)


def _sum_rows(t: torch.Tensor, features: int) -> torch.Tensor:
    """``t`` summed over its leading (row) dimensions, down to the normalised shape."""
    rows = t.dim() - features
    return t.sum(tuple(range(rows))) if rows else t


class NormFunction(torch.autograd.Function):
    """A layer norm, or an RMS norm (``rms``), over the trailing ``normalized_shape``
    dimensions: ``apply(input, weight, bias, normalized_shape, eps, memory_efficient, rms,
    mixed)`` gives ``(output, mean, rstd)``: the output in the weight's dtype when ``mixed``,
    else the input's; the statistics per row in the compute dtype (``mean`` zero for RMS norms,
    and not differentiable). ``norm`` gives the output alone."""

    generate_vmap_rule = True

    @staticmethod
    def forward(input, weight, bias, normalized_shape, eps, memory_efficient, rms, mixed):
        shape = check_shapes(input, normalized_shape, weight, bias)
        dtype = compute_dtype(input, weight, bias)
        x = input.to(dtype)
        w = _cast(weight, dtype)
        if rms:
            out, rstd = _rms_forward(x, shape, w, eps)
            mean = torch.zeros_like(rstd)
        else:
            out, mean, rstd = torch.native_layer_norm(x, list(shape), w, _cast(bias, dtype), eps)
        return out.to(weight.dtype if mixed and weight is not None else input.dtype), mean, rstd

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, weight, bias, normalized_shape, eps, memory_efficient, rms, _ = inputs
        out, mean, rstd = output
        ctx.mark_non_differentiable(mean)
        ctx.set_materialize_grads(False)
        ctx.rms, ctx.eps = rms, eps
        ctx.shape = tuple(int(n) for n in normalized_shape)
        ctx.memory_efficient = bool(memory_efficient)
        ctx.input_dtype, ctx.output_dtype = input.dtype, out.dtype
        kept = out if ctx.memory_efficient else input
        ctx.save_for_backward(kept, weight, bias, mean, rstd)
        ctx.save_for_forward(input, weight, bias, mean, rstd)

    @staticmethod
    def backward(ctx, grad_output, grad_mean, grad_rstd):
        kept, weight, bias, mean, rstd = ctx.saved_tensors
        if grad_output is None and grad_rstd is None:
            grads = (None, None, None)
        elif torch.is_grad_enabled() or grad_output is None or grad_rstd is not None:
            grads = _composed_backward(ctx, kept, weight, bias, rstd, grad_output, grad_rstd)
        else:
            grads = _fused_backward(ctx, kept, weight, bias, mean, rstd, grad_output)
        grad_input, grad_weight, grad_bias = grads
        return (_cast(grad_input, ctx.input_dtype),
                None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype),
                None, None, None, None, None)


def _composed_backward(ctx, kept, weight, bias, rstd, grad_output, grad_rstd):
    """(grad_input, grad_weight, grad_bias) composed of differentiable torch ops: the backward
    of a backward (see the module's note). ``grad_output`` or ``grad_rstd`` may be None."""
    dtype = rstd.dtype
    dims = tuple(range(-len(ctx.shape), 0))
    w, b = _cast(weight, dtype), _cast(bias, dtype)
    if ctx.memory_efficient:
        x_hat = kept.to(dtype) if b is None else kept.to(dtype) - b
        if w is not None:
            x_hat = x_hat / _clamp_by_magnitude(w, ctx.eps)
    else:
        x = kept.to(dtype)
        if not ctx.rms:
            x = x - x.mean(dims, keepdim=True)
        rstd = torch.rsqrt(x.square().mean(dims, keepdim=True) + ctx.eps)
        x_hat = x * rstd
    grad_input = grad_weight = grad_bias = None
    if grad_output is not None:
        g = grad_output.to(dtype)
        if ctx.needs_input_grad[0]:
            gw = g if w is None else g * w
            grad_input = gw - x_hat * (gw * x_hat).mean(dims, keepdim=True)
            if not ctx.rms:
                grad_input = grad_input - gw.mean(dims, keepdim=True)
            grad_input = grad_input * rstd
        if w is not None and ctx.needs_input_grad[1]:
            grad_weight = _sum_rows(g * x_hat, len(ctx.shape))
        if b is not None and ctx.needs_input_grad[2]:
            grad_bias = _sum_rows(g, len(ctx.shape))
    if grad_rstd is not None and ctx.needs_input_grad[0]:
        term = (grad_rstd.to(dtype) * rstd.square() / -math.prod(ctx.shape)) * x_hat
        grad_input = term if grad_input is None else grad_input + term
    return grad_input, grad_weight, grad_bias


def _fused_backward(ctx, kept, weight, bias, mean, rstd, grad_output):
    """(grad_input, grad_weight, grad_bias) by torch's fused layer-norm backward in fp32. Given
    ``x_hat`` with mean 0 and rstd 1 it gives ``gw - mean(gw) - x_hat * mean(gw * x_hat)``
    (``gw = grad * weight``), the weight's and the bias' gradients; ``rstd`` times it is the
    layer norm's input gradient, and adding ``mean(gw)`` back first gives the RMS norm's."""
    dtype = rstd.dtype
    w, b = _cast(weight, dtype), _cast(bias, dtype)
    g = grad_output.to(dtype)
    mask = [ctx.needs_input_grad[0], w is not None and ctx.needs_input_grad[1],
            b is not None and ctx.needs_input_grad[2]]
    shape = list(ctx.shape)
    if not ctx.rms and not ctx.memory_efficient:
        return torch.ops.aten.native_layer_norm_backward(g, kept.to(dtype), shape, mean, rstd,
                                                         w, b, mask)
    if ctx.memory_efficient:
        x_hat = kept.to(dtype) if b is None else kept.to(dtype) - b
        if w is not None:
            x_hat = x_hat / _clamp_by_magnitude(w, ctx.eps)
    else:
        x_hat = kept.to(dtype) * rstd
    grad_input, grad_weight, grad_bias = torch.ops.aten.native_layer_norm_backward(
        g, x_hat, shape, torch.zeros_like(rstd), torch.ones_like(rstd), w, b, mask)
    if grad_input is not None and ctx.rms:
        features = math.prod(ctx.shape)
        rows = g.reshape(-1, features)
        mean_gw = (rows @ w.reshape(features) if w is not None else rows.sum(1)) / features
        grad_input = torch.addcmul(mean_gw.reshape(rstd.shape) * rstd, grad_input, rstd)
    elif grad_input is not None:
        grad_input = grad_input * rstd
    return grad_input, grad_weight, grad_bias


def _jvp(ctx, input_t, weight_t, bias_t, *_):
    """The forward-mode derivative of ``(output, mean, rstd)`` (``mean`` has none)."""
    input, weight, bias, mean, rstd = ctx.saved_tensors
    dtype = rstd.dtype
    dims = tuple(range(-len(ctx.shape), 0))
    x_hat = (input.to(dtype) - mean) * rstd
    # A differentiable output's tangent is never None here: torch's forward AD asserts on one
    # that a Function leaves undefined.
    out_t, rstd_t = None, torch.zeros_like(rstd)
    if input_t is not None:
        dx = input_t.to(dtype)
        if not ctx.rms:
            dx = dx - dx.mean(dims, keepdim=True)
        projection = (x_hat * dx).mean(dims, keepdim=True)
        rstd_t = -rstd.square() * projection
        out_t = rstd * (dx - x_hat * projection)
        if weight is not None:
            out_t = out_t * weight.to(dtype)
    for param, tangent in ((weight, weight_t), (bias, bias_t)):
        if param is not None and tangent is not None:
            term = tangent.to(dtype) * x_hat if param is weight else tangent.to(dtype)
            out_t = term if out_t is None else out_t + term
    out_t = torch.zeros_like(x_hat) if out_t is None else out_t
    return out_t.to(ctx.output_dtype), None, rstd_t


class NormFunctionWithJvp(NormFunction):
    """``NormFunction`` with its forward-mode derivative (``torch.autograd.forward_ad``,
    ``torch.func.jvp``); eager code takes it. Dynamo refuses to trace a Function that defines
    ``jvp``, so what ``torch.compile`` traces is ``NormFunction``."""

    jvp = staticmethod(_jvp)


# Note: the C++ apply. ``Function.apply`` (Python) binds the arguments to ``forward``'s signature
# with ``inspect`` on every call of a Function that defines ``setup_context``, and unwraps
# tensors that outlived a torch.func transform, before it calls the C++ apply beneath it; outside
# transforms that is all it does. ``norm`` passes every argument, so where no transform is active
# and no input is such a tensor it calls the C++ apply itself: the binding doubled the time of a
# small norm's forward (8 x 64) here.
_apply_in_cpp = super(torch.autograd.Function, NormFunctionWithJvp).apply
_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", None)
_wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)


def _plain(*tensors: Optional[torch.Tensor]) -> bool:
    """No torch.func transform is active and no tensor is one of its wrappers."""
    if _transforms_active is None or _wrapped is None or _transforms_active():
        return False
    return not any(t is not None and _wrapped(t) for t in tensors)


def norm(input: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
         normalized_shape: Sequence[int], eps: float, memory_efficient: bool, *, rms: bool,
         mixed: bool) -> torch.Tensor:
    """The output of ``NormFunction`` (its arguments, in its order)."""
    args = (input, weight, bias, normalized_shape, eps, memory_efficient, rms, mixed)
    if torch.compiler.is_compiling():
        return NormFunction.apply(*args)[0]
    if _plain(input, weight, bias):
        return _apply_in_cpp(*args)[0]
    return NormFunctionWithJvp.apply(*args)[0]


# ---- apex's Function names ------------------------------------------------------------------
# apex's norms were autograd Functions called as ``X.apply(...)``; here each name is that call
# (one output, as apex's). ``forward`` is the same callable: Megatron-LM reads its argument
# names to learn whether ``memory_efficient`` is supported.

class FusedLayerNormAffineFunction:
    """apex's layer norm with weight and bias: ``apply(input, weight, bias, normalized_shape,
    eps, memory_efficient=False)``; output in the input's dtype."""

    @staticmethod
    def apply(input, weight, bias, normalized_shape, eps, memory_efficient=False):
        return norm(input, weight, bias, normalized_shape, eps, memory_efficient, rms=False,
                    mixed=False)

    forward = apply


class FusedLayerNormAffineMixedDtypesFunction:
    """``FusedLayerNormAffineFunction`` with the output in the weight's dtype (apex's
    ``forward_affine_mixed_dtypes``: fp32 parameters, half input, fp32 output)."""

    @staticmethod
    def apply(input, weight, bias, normalized_shape, eps, memory_efficient=False):
        return norm(input, weight, bias, normalized_shape, eps, memory_efficient, rms=False,
                    mixed=True)

    forward = apply


class FusedLayerNormFunction:
    """apex's layer norm without parameters: ``apply(input, normalized_shape, eps,
    memory_efficient=False)``."""

    @staticmethod
    def apply(input, normalized_shape, eps, memory_efficient=False):
        return norm(input, None, None, normalized_shape, eps, memory_efficient, rms=False,
                    mixed=False)

    forward = apply


class FusedRMSNormAffineFunction:
    """apex's RMS norm with a weight: ``apply(input, weight, normalized_shape, eps,
    memory_efficient=False)``; output in the input's dtype."""

    @staticmethod
    def apply(input, weight, normalized_shape, eps, memory_efficient=False):
        return norm(input, weight, None, normalized_shape, eps, memory_efficient, rms=True,
                    mixed=False)

    forward = apply


class FusedRMSNormAffineMixedDtypesFunction:
    """``FusedRMSNormAffineFunction`` with the output in the weight's dtype."""

    @staticmethod
    def apply(input, weight, normalized_shape, eps, memory_efficient=False):
        return norm(input, weight, None, normalized_shape, eps, memory_efficient, rms=True,
                    mixed=True)

    forward = apply


class FusedRMSNormFunction:
    """apex's RMS norm without a weight: ``apply(input, normalized_shape, eps,
    memory_efficient=False)``."""

    @staticmethod
    def apply(input, normalized_shape, eps, memory_efficient=False):
        return norm(input, None, None, normalized_shape, eps, memory_efficient, rms=True,
                    mixed=False)

    forward = apply
