"""apex.normalization: ``FusedLayerNorm``, ``FusedRMSNorm``, ``MixedFusedLayerNorm``,
``MixedFusedRMSNorm`` and their functional forms, with apex's names, signatures and defaults, on
any device. Where the input and the parameters share a dtype, the norm is torch's own
``layer_norm`` / ``rms_norm``, forward and backward (RMS norms on the CPU excepted: see
``_RMS_NORM_NOT_BY_TORCH``); otherwise, and with ``memory_efficient``, it is apex_lite's
autograd Function on torch's fused ops (``_autograd.NormFunction``), statistics and gradients in
fp32, differentiable to any order and under ``torch.func``.

Dtypes, as apex's CUDA kernels give them:
- ``FusedLayerNorm`` / ``FusedRMSNorm`` and ``fused_layer_norm[_affine]`` /
  ``fused_rms_norm[_affine]``: the output in the input's dtype. fp32 parameters with a half input
  are fine (statistics in fp32).
- ``MixedFused*`` and ``mixed_dtype_fused_*_affine``: the output in the parameters' dtype (fp32
  parameters with a half input give an fp32 output). They always have parameters:
  ``elementwise_affine=False`` is refused, as apex refuses it.
- Under ``torch.autocast`` (apex_lite's O1 forward) the functional forms, and so the modules, run
  in autocast's dtype: input and parameters cast to it, the output in it (apex's
  ``_cast_if_autocast_enabled``; apex did it for CUDA autocast, apex_lite on the input's device).
  Gradients reach the fp32 parameters through the cast. Under amp's O2 the modules are cast to
  half with the rest of the model (apex kept only BatchNorm in fp32); name them in
  ``keep_fp32_modules`` to keep them fp32.

``memory_efficient=True`` keeps the output instead of the input for the backward (see
``_autograd``). Under ``torch.jit.script`` and ``torch.jit.trace`` the modules run torch's ops
(``_scripted_norm``), as apex's do.
"""
from __future__ import annotations

import numbers
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch.nn import init
from torch.nn.parameter import Parameter

from ..amp.casting import half_function
from ._autograd import (FusedLayerNormAffineFunction,  # noqa: F401 (apex's names)
                        FusedLayerNormAffineMixedDtypesFunction, FusedLayerNormFunction,
                        FusedRMSNormAffineFunction, FusedRMSNormAffineMixedDtypesFunction,
                        FusedRMSNormFunction, check_shapes, compute_dtype, norm)

__all__ = ["FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm", "MixedFusedRMSNorm",
           "fused_layer_norm_affine", "fused_layer_norm", "fused_rms_norm_affine",
           "fused_rms_norm", "mixed_dtype_fused_layer_norm_affine",
           "mixed_dtype_fused_rms_norm_affine", "manual_rms_norm"]

# torch.nn.functional.rms_norm appeared in torch 2.4. On the CPU its backward is composed of many
# ops: apex's Function (torch's fused layer-norm backward, see _autograd) takes about 0.6x its
# time there (bench/normalization.py), so the CPU takes the Function.
_TORCH_RMS_NORM = getattr(F, "rms_norm", None)
_RMS_NORM_NOT_BY_TORCH = ("cpu",)


def manual_rms_norm(input, normalized_shape, weight, eps):
    """RMS norm composed of torch ops, statistics in fp32 (apex's reference implementation):
    ``input / sqrt(mean(input**2) + eps) * weight`` over the trailing ``normalized_shape``
    dimensions (``weight`` may be None), in the input's dtype."""
    shape = check_shapes(input, normalized_shape, weight, None)
    dtype = compute_dtype(input, weight)
    x = input.to(dtype)
    out = x * torch.rsqrt(x.square().mean(tuple(range(-len(shape), 0)), keepdim=True) + eps)
    if weight is not None:
        out = out * weight.to(dtype)
    return out.to(input.dtype)


def _norm(input, normalized_shape, weight, bias, eps, *, rms: bool, mixed: bool,
          memory_efficient: bool) -> torch.Tensor:
    """The norm of ``input`` with the parameters: torch's own op where every dtype is the input's
    (its output is then in the input's dtype, which the parameters share), except RMS norms on
    the CPU; apex's Function otherwise, and for ``memory_efficient``. (torch's CPU layer norm
    takes a half input with fp32 parameters itself, but rounds the parameters' gradients to the
    half dtype.)"""
    if not memory_efficient and all(p is None or p.dtype == input.dtype for p in (weight, bias)):
        if not rms:
            return F.layer_norm(input, normalized_shape, weight, bias, eps)
        if _TORCH_RMS_NORM is not None and input.device.type not in _RMS_NORM_NOT_BY_TORCH:
            return _TORCH_RMS_NORM(input, normalized_shape, weight, eps)
    return norm(input, weight, bias, normalized_shape, eps, memory_efficient, rms=rms,
                mixed=mixed)


def _scripted_norm(input: torch.Tensor, normalized_shape: List[int],
                   weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float,
                   rms: bool, mixed: bool) -> torch.Tensor:
    """The norms under ``torch.jit.script`` and ``torch.jit.trace`` (apex's modules, too, leave
    their kernels there): composed of torch ops, statistics in fp32 (fp64 for fp64 tensors), the
    output in the weight's dtype when ``mixed``, else the input's. ``memory_efficient`` has no
    effect there.

    Args:
        input: the tensor to normalise.
        normalized_shape: the trailing dimensions normalised over.
        weight: the scale, or None.
        bias: the shift, or None (RMS norms have none).
        eps: added to the variance (the mean square for RMS norms).
        rms: an RMS norm rather than a layer norm.
        mixed: the output in the weight's dtype (apex's MixedFused norms).

    Returns:
        The normalised tensor.
    """
    dtype = torch.promote_types(input.dtype, torch.float32)
    x = input.to(dtype)
    w: Optional[torch.Tensor] = None
    if weight is not None:
        w = weight.to(dtype)
    if rms:
        dims = [-1 - i for i in range(len(normalized_shape))]
        out = x * torch.rsqrt(x.square().mean(dims, keepdim=True) + eps)
        if w is not None:
            out = out * w
    else:
        b: Optional[torch.Tensor] = None
        if bias is not None:
            b = bias.to(dtype)
        out = F.layer_norm(x, normalized_shape, w, b, eps)
    if mixed and weight is not None:
        return out.to(weight.dtype)
    return out.to(input.dtype)


# ---- apex's functional forms ------------------------------------------------------------------
# half_function: under torch.autocast, every floating tensor argument is cast to autocast's
# dtype and the call runs with autocast off (apex's _cast_if_autocast_enabled).

@half_function
def fused_layer_norm_affine(input, weight, bias, normalized_shape, eps=1e-6,
                            memory_efficient=False):
    """Layer norm over the trailing ``normalized_shape`` dimensions with ``weight`` and
    ``bias``; output in the input's dtype.

    Args:
        input: the tensor to normalise; its trailing dimensions are ``normalized_shape``.
        weight: the scale, of shape ``normalized_shape``.
        bias: the shift, of shape ``normalized_shape``.
        normalized_shape: an int or a shape: the trailing dimensions normalised over.
        eps: added to the variance (the mean square for RMS norms).
        memory_efficient: keep the output, not the input, for the backward.

    Returns:
        The normalised tensor, in the input's dtype.

    Raises:
        RuntimeError: the shapes do not fit.
    """
    return _norm(input, normalized_shape, weight, bias, eps, rms=False, mixed=False,
                 memory_efficient=memory_efficient)


@half_function
def fused_layer_norm(input, normalized_shape, eps=1e-6, memory_efficient=False):
    """Layer norm over the trailing ``normalized_shape`` dimensions of ``input``, no parameters.
    ``eps``, ``memory_efficient``, the result (in the input's dtype) and the errors are those of
    :func:`apex_lite.normalization.fused_layer_norm.fused_layer_norm_affine`."""
    return _norm(input, normalized_shape, None, None, eps, rms=False, mixed=False,
                 memory_efficient=memory_efficient)


@half_function
def mixed_dtype_fused_layer_norm_affine(input, weight, bias, normalized_shape, eps=1e-6,
                                        memory_efficient=False):
    """``fused_layer_norm_affine`` with the output in the parameters' dtype: ``input``,
    ``weight``, ``bias``, ``normalized_shape``, ``eps``, ``memory_efficient`` and the errors as
    :func:`apex_lite.normalization.fused_layer_norm.fused_layer_norm_affine`."""
    return _norm(input, normalized_shape, weight, bias, eps, rms=False, mixed=True,
                 memory_efficient=memory_efficient)


@half_function
def fused_rms_norm_affine(input, weight, normalized_shape, eps=1e-6, memory_efficient=False):
    """RMS norm over the trailing ``normalized_shape`` dimensions of ``input``, scaled by
    ``weight`` (no bias; ``eps`` added to the mean square); output in the input's dtype.
    ``memory_efficient`` and the errors are those of
    :func:`apex_lite.normalization.fused_layer_norm.fused_layer_norm_affine`."""
    return _norm(input, normalized_shape, weight, None, eps, rms=True, mixed=False,
                 memory_efficient=memory_efficient)


@half_function
def fused_rms_norm(input, normalized_shape, eps=1e-6, memory_efficient=False):
    """RMS norm over the trailing ``normalized_shape`` dimensions of ``input``, no weight (``eps``
    added to the mean square). ``memory_efficient``, the result (in the input's dtype) and the
    errors are those of :func:`apex_lite.normalization.fused_layer_norm.fused_layer_norm_affine`."""
    return _norm(input, normalized_shape, None, None, eps, rms=True, mixed=False,
                 memory_efficient=memory_efficient)


@half_function
def mixed_dtype_fused_rms_norm_affine(input, weight, normalized_shape, eps=1e-6,
                                      memory_efficient=False):
    """``fused_rms_norm_affine`` with the output in the weight's dtype: ``input``, ``weight``,
    ``normalized_shape``, ``eps``, ``memory_efficient`` and the errors as
    :func:`apex_lite.normalization.fused_layer_norm.fused_layer_norm_affine`."""
    return _norm(input, normalized_shape, weight, None, eps, rms=True, mixed=True,
                 memory_efficient=memory_efficient)


# ---- the modules ------------------------------------------------------------------------------

class _Norm(torch.nn.Module):
    """What apex's two norm modules share: the shape, ``eps``, ``memory_efficient`` and the
    parameters (``weight`` of ones, and ``bias`` of zeros where the norm has one)."""

    def _init_norm(self, normalized_shape, eps, elementwise_affine, memory_efficient,
                   with_bias: bool) -> None:
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = torch.Size(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.memory_efficient = memory_efficient
        names = ("weight", "bias") if with_bias else ("weight",)
        for name in names:
            if self.elementwise_affine:
                setattr(self, name, Parameter(torch.empty(*normalized_shape)))
            else:
                self.register_parameter(name, None)
        self.reset_parameters()

    def reset_parameters(self):
        """Weight to ones, bias (where there is one) to zeros."""
        if self.elementwise_affine:
            init.ones_(self.weight)
            if getattr(self, "bias", None) is not None:
                init.zeros_(self.bias)

    def extra_repr(self):
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}")


class FusedLayerNorm(_Norm):
    """Layer normalisation over the trailing ``normalized_shape`` dimensions (apex's
    ``FusedLayerNorm``; torch.nn.LayerNorm's maths), on any device.

    Args:
        normalized_shape: int or shape of the trailing dimensions to normalise.
        eps: added to the variance (default 1e-5).
        elementwise_affine: learnable ``weight`` (ones) and ``bias`` (zeros) of
            ``normalized_shape`` (default True).
        memory_efficient: keep the output instead of the input for the backward.
    The output has the input's dtype and shape.
    """

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True,
                 memory_efficient=False):
        super().__init__()
        self._init_norm(normalized_shape, eps, elementwise_affine, memory_efficient,
                        with_bias=True)

    def forward(self, input):
        """The normalised input, in its dtype."""
        if torch.jit.is_scripting() or torch.jit.is_tracing():
            return _scripted_norm(input, list(self.normalized_shape), self.weight, self.bias,
                                  self.eps, False, False)
        if self.elementwise_affine:
            return fused_layer_norm_affine(input, self.weight, self.bias, self.normalized_shape,
                                           self.eps, self.memory_efficient)
        return fused_layer_norm(input, self.normalized_shape, self.eps, self.memory_efficient)


class FusedRMSNorm(_Norm):
    """RMS normalisation over the trailing ``normalized_shape`` dimensions:
    ``x / sqrt(mean(x**2) + eps) * weight`` (apex's ``FusedRMSNorm``; torch.nn.RMSNorm's maths).

    Args:
        normalized_shape: int or shape of the trailing dimensions to normalise.
        eps: added to the mean square (default 1e-5).
        elementwise_affine: a learnable ``weight`` (ones) of ``normalized_shape``.
        memory_efficient: keep the output instead of the input for the backward.
    The output has the input's dtype and shape.
    """

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True,
                 memory_efficient=False):
        super().__init__()
        self._init_norm(normalized_shape, eps, elementwise_affine, memory_efficient,
                        with_bias=False)

    def forward(self, input):
        """The normalised input, in its dtype."""
        if torch.jit.is_scripting() or torch.jit.is_tracing():
            return _scripted_norm(input, list(self.normalized_shape), self.weight, None, self.eps,
                                  True, False)
        if self.elementwise_affine:
            return fused_rms_norm_affine(input, self.weight, self.normalized_shape, self.eps,
                                         self.memory_efficient)
        return fused_rms_norm(input, self.normalized_shape, self.eps, self.memory_efficient)


def _mixed_affine(cls_name: str, kwargs: dict) -> None:
    """apex's Mixed* norms always have parameters: refuse ``elementwise_affine=False`` (apex's
    RuntimeError) and any other keyword (apex dropped them silently)."""
    affine = kwargs.pop("elementwise_affine", True)
    if kwargs:
        raise TypeError(f"{cls_name}() got unexpected keyword arguments {sorted(kwargs)}")
    if not affine:
        raise RuntimeError(f"{cls_name} does not support `elementwise_affine = False`: its "
                           f"output takes the parameters' dtype, so it needs them. Use "
                           f"{cls_name[len('Mixed'):]}(..., elementwise_affine=False) instead.")


class MixedFusedLayerNorm(FusedLayerNorm):
    """``FusedLayerNorm`` whose output has the parameters' dtype: fp32 parameters with a half
    input give fp32 (apex's Megatron-style mixed-dtype layer norm). ``normalized_shape``,
    ``eps`` and ``memory_efficient`` as ``FusedLayerNorm``; ``elementwise_affine=False`` raises
    RuntimeError."""

    def __init__(self, normalized_shape, eps=1e-5, *, memory_efficient=False, **kwargs):
        _mixed_affine(type(self).__name__, kwargs)
        super().__init__(normalized_shape=normalized_shape, eps=eps, elementwise_affine=True,
                         memory_efficient=memory_efficient)

    def forward(self, input: torch.Tensor):
        """The normalised input, in the parameters' dtype."""
        if torch.jit.is_scripting() or torch.jit.is_tracing():
            return _scripted_norm(input, list(self.normalized_shape), self.weight, self.bias,
                                  self.eps, False, True)
        return mixed_dtype_fused_layer_norm_affine(input, self.weight, self.bias,
                                                   self.normalized_shape, self.eps,
                                                   self.memory_efficient)


class MixedFusedRMSNorm(FusedRMSNorm):
    """``FusedRMSNorm`` whose output has the weight's dtype. ``normalized_shape``, ``eps`` and
    ``memory_efficient`` as ``FusedRMSNorm``; ``elementwise_affine=False`` raises RuntimeError."""

    def __init__(self, normalized_shape, eps=1e-5, *, memory_efficient=False, **kwargs):
        _mixed_affine(type(self).__name__, kwargs)
        super().__init__(normalized_shape=normalized_shape, eps=eps, elementwise_affine=True,
                         memory_efficient=memory_efficient)

    def forward(self, input: torch.Tensor):
        """The normalised input, in the weight's dtype."""
        if torch.jit.is_scripting() or torch.jit.is_tracing():
            return _scripted_norm(input, list(self.normalized_shape), self.weight, None, self.eps,
                                  True, True)
        return mixed_dtype_fused_rms_norm_affine(input, self.weight, self.normalized_shape,
                                                 self.eps, self.memory_efficient)
