"""Fused operations over lists of tensors, the kernels under amp's bookkeeping.

Every function takes tensors on one device and is served there by the native extension when it
is built, else by torch foreach ops (``backend(device)`` says which, and why). Both give the same
answers: ``scale`` and ``axpby`` bit for bit, ``l2norm`` within fp32 rounding.

Arithmetic is in fp32 whatever the storage dtype (fp32, fp16 or bf16, mixed freely), rounded once
to the output dtype. ``found_inf`` is a 1-element fp32 tensor on the tensors' device that the
caller zeroes; a kernel sets it to 1 when an input element is inf or NaN and never writes 0, so
one flag can collect several calls. Nothing here synchronises with the host.
"""
from __future__ import annotations

import operator
from typing import Callable, Sequence, Tuple, Union

import torch

from . import _checks, _python
from ._backend import NativeBackendUnavailable, backend, ops_for

__all__ = ["scale", "axpby", "l2norm", "nonfinite_flags", "backend", "NativeBackendUnavailable"]

Tensors = Sequence[torch.Tensor]


def _same_tensors(a: Tensors, b: Tensors) -> bool:
    """True when ``b`` is ``a`` element by element (the in-place form)."""
    return a is b or all(map(operator.is_, a, b))


def _checked(ops, check: Callable[[], None], op, *args):
    """``op(*args)`` with the per-tensor checks ``check`` makes: first, for the Python backend,
    which checks nothing itself; for the native kernels, only once they have refused the call.
    They check their own arguments in C++ (csrc/multi_tensor_checks.h, the same rules and
    messages) at no cost per tensor here; ``check`` then names the arguments as the caller passed
    them (an in-place call reaches the kernels as ``scale_(tensors)`` or ``axpby_(ys, xs)``) and
    names a non-tensor entry, which the op's schema refuses before the kernels see it."""
    if ops is _python:
        check()
        return op(*args)
    try:
        return op(*args)
    except Exception:
        try:
            check()
        except (TypeError, ValueError) as error:
            raise error from None
        raise


def scale(inputs: Tensors, outputs: Tensors, scale: float, found_inf: torch.Tensor) -> None:
    """``out = in * scale`` for each pair, in fp32, rounded once to the output's dtype.

    Args:
        inputs: fp32, fp16 or bf16 tensors on one device, mixed freely.
        outputs: tensors of the same shapes (``outputs`` may be ``inputs``: in place).
        scale: the factor.
        found_inf: a 1-element fp32 tensor on the tensors' device, set to 1 when an input
            element is inf or NaN (never to 0: the caller zeroes it).

    Raises:
        TypeError or ValueError: lists of different lengths, tensors on other devices, of other
            shapes or dtypes, or outputs that partly overlap another tensor of the call.
    """
    _checks.check_list("inputs", inputs)
    _checks.check_list("outputs", outputs)
    device = _checks.found_inf_device(found_inf)
    _checks.check_lengths(("inputs", inputs), ("outputs", outputs))
    if not inputs:
        return
    ops = ops_for(device)
    in_place = _same_tensors(inputs, outputs)

    def check():
        _checks.check_scale(inputs, outputs, found_inf, in_place)

    if in_place:
        _checked(ops, check, ops.scale_, list(inputs), float(scale), found_inf)
    else:
        _checked(ops, check, ops.scale_out, list(inputs), list(outputs), float(scale), found_inf)


def axpby(xs: Tensors, ys: Tensors, outputs: Tensors, a: float, b: float,
          found_inf: torch.Tensor) -> None:
    """``out = a*x + b*y`` for each triple, in fp32, rounded once to the output's dtype.

    Args:
        xs: fp32, fp16 or bf16 tensors on one device.
        ys: tensors of the same shapes.
        outputs: tensors of the same shapes (``outputs`` may be ``xs`` or ``ys``).
        a: the factor of ``xs``.
        b: the factor of ``ys``.
        found_inf: a 1-element fp32 tensor on the tensors' device, set to 1 when an element of
            ``xs`` or ``ys`` is inf or NaN (never to 0).

    Raises:
        TypeError or ValueError: as :func:`scale`.
    """
    for name, tensors in (("xs", xs), ("ys", ys), ("outputs", outputs)):
        _checks.check_list(name, tensors)
    device = _checks.found_inf_device(found_inf)
    _checks.check_lengths(("xs", xs), ("ys", ys))
    _checks.check_lengths(("xs", xs), ("outputs", outputs))
    if not xs:
        return
    ops = ops_for(device)

    def check():
        _checks.check_axpby(xs, ys, outputs, found_inf)

    if _same_tensors(ys, outputs):
        _checked(ops, check, ops.axpby_, list(xs), list(ys), float(a), float(b), found_inf)
    elif _same_tensors(xs, outputs):
        _checked(ops, check, ops.axpby_, list(ys), list(xs), float(b), float(a), found_inf)
    else:
        _checked(ops, check, ops.axpby_out, list(xs), list(ys), list(outputs), float(a),
                 float(b), found_inf)


def l2norm(tensors: Tensors, per_tensor: bool = False
           ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """The L2 norm of all elements of ``tensors`` together, accumulated in fp32.

    Args:
        tensors: fp32, fp16 or bf16 tensors on one device.
        per_tensor: also return each tensor's norm.

    Returns:
        A 1-element fp32 tensor; with ``per_tensor=True``, ``(total, norms)`` with one fp32
        norm per tensor.

    Raises:
        TypeError or ValueError: a non-tensor entry, or tensors on several devices.
    """
    _checks.check_list("tensors", tensors)
    if not tensors:
        total = torch.zeros(1, dtype=torch.float32)
        return (total, torch.zeros(0, dtype=torch.float32)) if per_tensor else total
    ops = ops_for(_checks.first_device(tensors))
    total, norms = _checked(ops, lambda: _checks.check_reduction(tensors), ops.l2norm,
                            list(tensors), bool(per_tensor))
    return (total, norms) if per_tensor else total


def nonfinite_flags(tensors: Tensors) -> torch.Tensor:
    """Which of ``tensors`` (on one device) hold an inf or NaN.

    Returns:
        A bool tensor with one entry per tensor: True where that tensor holds an inf or NaN.

    Raises:
        TypeError or ValueError: a non-tensor entry, or tensors on several devices.
    """
    _checks.check_list("tensors", tensors)
    if not tensors:
        return torch.zeros(0, dtype=torch.bool)
    ops = ops_for(_checks.first_device(tensors))
    return _checked(ops, lambda: _checks.check_reduction(tensors), ops.nonfinite_flags,
                    list(tensors))
