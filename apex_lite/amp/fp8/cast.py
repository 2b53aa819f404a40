"""One tensor's cast to fp8: its amax, its power-of-two scale, the cast, and the counts of what
the cast clipped or flushed to zero. Everything stays on the device (no host read).

A scale is the largest ``2**k`` that keeps ``amax * 2**k`` within the format's largest finite
value (``/ 2**margin``); it is built from exponent bits, so it and its inverse are exact on
every device and in compiled code (no ``log2``/``exp2`` rounding), and multiplying a half
tensor by it never rounds. A tensor whose amax is inf or NaN gets an inverse scale of NaN: the
matmul's output is then NaN, which amp's skip rule sees (a clip to the fp8 maximum would
otherwise hide an overflow).

On CUDA the cast is compiled (``torch.compile``) into a few fused kernels when the config asks;
inside a graph the user compiles, the plain function is traced into it.
"""
from __future__ import annotations

import logging
import math
from typing import Optional, Tuple

import torch

logger = logging.getLogger("apex_lite.amp")

INPUT, WEIGHT, GRAD = 0, 1, 2
ROLES = ("input", "weight", "grad")
# E4M3 for the forward's tensors (more precision), E5M2 for the gradient (more range).
FORMATS = (torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float8_e5m2)
# The bits of 2**127 * 2**127 / 2: a power of two's bits subtracted from it give its inverse's.
_INVERSE_BITS = 254 << 23


def pow2_scale(amax: torch.Tensor, fp8_dtype: torch.dtype, margin: int) -> torch.Tensor:
    """The largest power of two ``s`` with ``amax * s <= finfo(fp8_dtype).max / 2**margin``
    (``amax`` fp32, any shape), within [2**-126, 2**126]; 1.0 where ``amax`` is 0, inf or
    NaN."""
    top_mantissa, top_exponent = math.frexp(torch.finfo(fp8_dtype).max)
    mantissa, exponent = torch.frexp(amax)
    k = top_exponent - margin - exponent - (mantissa > top_mantissa).to(torch.int32)
    k = k.clamp(-126, 126)
    scale = ((k + 127) << 23).to(torch.int32).view(torch.float32)
    return torch.where((amax > 0) & torch.isfinite(amax), scale, torch.ones_like(scale))


def inverse_pow2(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` for a power of two in [2**-126, 2**126], exactly (from its bits)."""
    return (_INVERSE_BITS - scale.view(torch.int32)).view(torch.float32)


def cast(t: torch.Tensor, fp8_dtype: torch.dtype, margin: int, count: bool,
         counts: Optional[torch.Tensor], history_scale: Optional[torch.Tensor] = None,
         has_history: Optional[torch.Tensor] = None,
         pending: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``t`` (2-D, contiguous) as fp8, and the inverse of the scale it was multiplied by (the
    fp32 scalar ``torch._scaled_mm`` takes).

    Current scaling (``history_scale`` None): the scale comes from ``t``'s amax. Delayed:
    ``history_scale`` where ``has_history``, else from the amax; ``t``'s amax is folded into
    ``pending`` (the step's largest) and elements beyond the fp8 range are clipped. With
    ``count``, ``counts`` (int64, 2 elements) gains the elements clipped and the nonzero
    elements that became zero."""
    fp8_max = torch.finfo(fp8_dtype).max
    amax = torch.linalg.vector_norm(t, float("inf")).float()
    scale = pow2_scale(amax, fp8_dtype, margin)
    delayed = history_scale is not None
    if delayed:
        pending.copy_(torch.maximum(pending, amax))
        scale = torch.where(has_history, history_scale, scale)
    scaled = t * scale
    saturated = None
    if delayed:
        if count:
            saturated = torch.count_nonzero(scaled.abs() > fp8_max)
        scaled = scaled.clamp(-fp8_max, fp8_max)
    t8 = scaled.to(fp8_dtype)
    if count:
        # Nonzero in t, zero (either sign) in t8: flushed. The current recipe's scale keeps
        # every finite element within range, so it clips nothing.
        underflow = torch.count_nonzero(t) - torch.count_nonzero(t8.view(torch.uint8) & 0x7F)
        if saturated is None:
            counts[1].add_(underflow)
        else:
            counts.add_(torch.stack([saturated, underflow]))
    inverse = torch.where(torch.isfinite(amax), inverse_pow2(scale),
                          torch.full_like(scale, float("nan")))
    return t8, inverse


class _Compiled:
    """``cast`` compiled once per process (``torch.compile``, dynamic shapes); a compilation
    that fails is said once at WARNING and the casts stay eager."""

    def __init__(self):
        self.fn = None
        self.failed = False

    def __call__(self, *args):
        if self.failed or torch.compiler.is_compiling():
            return cast(*args)
        if self.fn is None:
            self.fn = torch.compile(cast, dynamic=True)
        try:
            return self.fn(*args)
        except Exception as exc:   # a backend that cannot build here (no compiler, no triton)
            self.failed = True
            logger.warning("amp fp8: compiling the casts to fp8 failed (%s: %s); they run "
                           "eagerly, which moves about twice the bytes. Pass "
                           "amp.FP8(compile_casts=False) to choose this.",
                           type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return cast(*args)


compiled_cast = _Compiled()


def triton_importable() -> bool:
    """Whether torch.compile can build CUDA kernels here (triton is importable)."""
    import importlib.util
    return importlib.util.find_spec("triton") is not None
