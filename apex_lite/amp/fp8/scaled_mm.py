"""The scaled fp8 matmul, on every device and torch release amp supports, and which devices
can run one.

``torch._scaled_mm(a, b, scale_a, scale_b, bias=, out_dtype=, use_fast_accum=)`` computes
``(a * scale_a) @ (b * scale_b)`` from fp8 ``a`` (row-major) and ``b`` (column-major) with fp32
accumulation; its signature is the same from torch 2.4 (the floor is 2.5) to 2.13, where
``torch.nn.functional.scaled_mm`` joined it. On CUDA it needs sm_89 or newer and the 16-multiple
dimensions ``config.MULTIPLE`` names. On the CPU torch 2.7 added it (an emulation: fp32 matmul
of the fp8 values; oneDNN on CPUs with AMX); before 2.7 ``emulated`` computes the same here.
A CPU run is a numerics reference, never a speed path. The CPU's takes what CUDA's refuses
(any dimensions, E5M2 x E5M2, a row-major second operand), so amp keeps CUDA's rules itself on
every device: eligible layers, padded contractions, operand layouts, E4M3 in every product.

It is called as ``torch._scaled_mm`` at every call (not bound at import), so code that wraps it
(a counter in a test, a profiler) sees every fp8 matmul.
"""
from __future__ import annotations

from typing import Optional

import torch

HALF = (torch.float16, torch.bfloat16)


def unsupported(device: torch.device) -> Optional[str]:
    """Why fp8 matmuls cannot run on ``device``, or None when they can."""
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return (f"fp8 matmuls under amp run on CUDA GPUs of compute capability 8.9 or newer and "
                f"on the CPU (as a numerics reference); this model is on {device.type}")
    if torch.version.hip:
        return ("fp8 under amp supports NVIDIA GPUs (float8_e4m3fn / float8_e5m2); ROCm's fp8 "
                "matmuls take the fnuz formats, which amp does not implement")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return (f"{torch.cuda.get_device_name(device)} is sm_{major}{minor}: fp8 matmuls need "
                f"compute capability 8.9 or newer (Ada, Hopper, Blackwell)")
    return None


def runs_natively(device: torch.device) -> bool:
    """Whether this torch has a ``_scaled_mm`` kernel for ``device``'s type (CUDA; the CPU
    gained one in torch 2.7). Read from the dispatcher's registry: nothing is called, so a
    wrapper around ``torch._scaled_mm`` counts only amp's matmuls."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and \
        torch._C._dispatch_has_kernel_for_dispatch_key("aten::_scaled_mm", "CPU")


def emulated(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
             bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """What torch's CPU emulation of ``_scaled_mm`` computes, for torch releases without it: the
    fp8 values widened to fp32 and scaled, one fp32 matmul, the bias added in fp32, one
    rounding to ``out_dtype``."""
    out = torch.matmul(a.float() * scale_a, b.float() * scale_b)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              *, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None,
              fast_accum: bool = False, native: bool = True) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b) (+ bias)`` in ``out_dtype``: ``a`` (M, K) row-major and
    ``b`` (K, N) column-major fp8, ``scale_a``/``scale_b`` fp32 scalars (the inverse of the
    scales the tensors were multiplied by), fp32 accumulation. ``native=False`` computes it
    with ``emulated`` (a torch without a kernel for this device)."""
    # cuBLASLt adds a half bias in its epilogue (one rounding); torch refuses a bias with an
    # fp32 output, which is added after.
    inside = bias is not None and out_dtype in HALF and bias.dtype == out_dtype
    if not native:
        out = emulated(a, b, scale_a, scale_b, bias if inside else None, out_dtype)
    else:
        out = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b,
                               bias=bias if inside else None, out_dtype=out_dtype,
                               use_fast_accum=fast_accum)
    if bias is not None and not inside:
        out = out + bias.to(out_dtype)
    return out
