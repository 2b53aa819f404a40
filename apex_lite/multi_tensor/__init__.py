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
from array import array
from typing import List, Optional, Sequence, Tuple, Union

import torch

from ._backend import NativeBackendUnavailable, backend, ops_for

__all__ = ["scale", "axpby", "l2norm", "nonfinite_flags", "backend", "NativeBackendUnavailable"]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

Tensors = Sequence[torch.Tensor]


def _check_list(name: str, tensors: Tensors) -> None:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(tensors).__name__}")


def _check_tensors(device: torch.device, anchor: str, **lists: Tensors) -> None:
    """Per-tensor checks, made here for every backend so that both refuse a bad call with the same
    exception and message (the native kernels repeat them in C++ for direct op calls, but do not
    compare devices across the lists)."""
    for name, tensors in lists.items():
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}[{i}] is a {type(t).__name__}, not a tensor")
            if t.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"{name}[{i}] has dtype {t.dtype}; multi-tensor kernels take "
                                f"float32, float16 and bfloat16 tensors only")
            if t.device != device:
                raise ValueError(f"{name}[{i}] is on {t.device} but {anchor} is on {device}; "
                                 f"all tensors of a call must be on one device. Call once per "
                                 f"device.")


def _check_pairs(name_a: str, a: Tensors, name_b: str, b: Tensors, shapes: bool) -> None:
    if len(a) != len(b):
        raise ValueError(f"{name_a} has {len(a)} tensors but {name_b} has {len(b)}; "
                         f"they are used pairwise")
    if shapes:
        for i, (x, y) in enumerate(zip(a, b)):
            if x.shape != y.shape:
                raise ValueError(f"{name_a}[{i}] has shape {tuple(x.shape)} but {name_b}[{i}] "
                                 f"has {tuple(y.shape)}")


def _found_inf_device(found_inf: torch.Tensor) -> torch.device:
    if not isinstance(found_inf, torch.Tensor) or found_inf.numel() != 1 \
            or found_inf.dtype != torch.float32:
        raise TypeError("found_inf must be a 1-element float32 tensor (create it with "
                        "torch.zeros(1, device=...) and zero it yourself between steps)")
    return found_inf.device


def _same_tensors(a: Tensors, b: Tensors) -> bool:
    """True when ``b`` is ``a`` element by element (the in-place form)."""
    return a is b or all(map(operator.is_, a, b))


# (first byte, one past the last byte, written?, list name, index, tensor) of one tensor's elements.
_Span = Tuple[int, int, bool, str, int, torch.Tensor]


def _spans(name: str, tensors: Tensors, written: bool, skip: Optional[Tensors] = None
           ) -> List[_Span]:
    """The memory spans of ``tensors`` (empty and meta tensors have none), leaving out each one
    that is ``skip[i]`` itself (an input computed in place: its output stands for it)."""
    spans = []
    for i, t in enumerate(tensors):
        if skip is not None and t is skip[i]:
            continue
        n = t.numel()
        if n == 0 or t.is_meta:
            continue
        start = t.data_ptr()
        if t.is_contiguous():
            end = start + n * t.element_size()
        else:
            extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
            end = start + extent * t.element_size()
            if written and torch._debug_has_internal_overlap(t) == 1:
                raise ValueError(f"{name}[{i}] has elements that share memory (an expand()ed or "
                                 f"as_strided view): writing it would race with itself. Write "
                                 f"into a tensor of its own (torch.empty_like) instead.")
        spans.append((start, end, written, name, i, t))
    return spans


def _same_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` view the same elements in the same layout (so an element is read
    where it is written: the in-place form, safe)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() \
        and a.element_size() == b.element_size()


_is_contiguous = torch.Tensor.is_contiguous
_data_ptr = torch.Tensor.data_ptr
_nbytes = operator.attrgetter("nbytes")


def _may_overlap(tensors: List[torch.Tensor]) -> bool:
    """Whether two of these contiguous tensors may share memory: their byte ranges, sorted by
    start (in CPU tensors of addresses: no device work), each compared with the furthest end
    before it. Costs a few attribute reads per tensor."""
    try:
        starts = torch.frombuffer(array("q", map(_data_ptr, tensors)), dtype=torch.int64)
    except OverflowError:
        return True   # an address beyond int64: let the exact sweep decide
    ends = starts + torch.frombuffer(array("q", map(_nbytes, tensors)), dtype=torch.int64)
    # (An empty tensor inside another's range counts as a meeting: the exact sweep clears it.)
    starts, order = torch.sort(starts)
    ends = ends.index_select(0, order)
    return bool((starts[1:] < torch.cummax(ends, 0).values[:-1]).any())


def _check_no_overlap(outputs: Tuple[str, Tensors], *inputs: Tuple[str, Tensors]) -> None:
    """Refuse an output that shares memory with another output, or with any input other than the
    one it is computed from in place (the same tensor, or the same elements in the same layout).
    The kernels read and write each pair on its own, in chunks and in parallel: an output that
    overlaps another pair's input would be read after it was written (wrong values, which differ
    between backends). The tensors are on one device (checked before)."""
    out_name, out_tensors = outputs
    if not out_tensors or out_tensors[0].is_meta:
        return   # meta tensors have no memory
    tensors = list(out_tensors)
    for _, input_tensors in inputs:
        tensors += [t for t, out in zip(input_tensors, out_tensors) if t is not out]
    if all(map(_is_contiguous, tensors)) and not _may_overlap(tensors):
        return   # the common case: no two byte ranges meet
    # Some ranges meet (or a tensor is strided): decide exactly, pair by pair, in one sorted sweep.
    spans = _spans(out_name, out_tensors, True)
    for name, input_tensors in inputs:
        spans += _spans(name, input_tensors, False, skip=out_tensors)
    spans.sort(key=operator.itemgetter(0))
    active: List[_Span] = []
    for span in spans:
        start = span[0]
        active = [a for a in active if a[1] > start]
        for other in active:
            if not (span[2] or other[2]):
                continue   # two inputs may share memory: they are only read
            first, second = (other, span) if other[2] else (span, other)
            if not second[2] and first[4] == second[4] and _same_elements(first[5], second[5]):
                continue   # an output computed in place from its own input
            raise ValueError(
                f"{first[3]}[{first[4]}] shares memory with {second[3]}[{second[4]}]: the "
                f"kernels would read elements that another output already overwrote (or write "
                f"one element twice), and the backends would disagree. Outputs may be their own "
                f"inputs (outputs is inputs, or outputs[i] is inputs[i]) but must not overlap "
                f"any other tensor of the call: write into separate tensors, or clone() the "
                f"inputs first.")
        active.append(span)


def scale(inputs: Tensors, outputs: Tensors, scale: float, found_inf: torch.Tensor) -> None:
    """``out = in * scale`` for each pair (``outputs`` may be ``inputs``); flags non-finite inputs."""
    _check_list("inputs", inputs)
    _check_list("outputs", outputs)
    device = _found_inf_device(found_inf)
    _check_pairs("inputs", inputs, "outputs", outputs, shapes=False)
    in_place = _same_tensors(inputs, outputs)
    _check_tensors(device, "found_inf", inputs=inputs, **({} if in_place else {"outputs": outputs}))
    if not in_place:
        _check_pairs("inputs", inputs, "outputs", outputs, shapes=True)
    _check_no_overlap(("outputs", outputs), ("inputs", inputs))
    if not inputs:
        return
    ops = ops_for(device)
    if in_place:
        ops.scale_(list(inputs), float(scale), found_inf)
    else:
        ops.scale_out(list(inputs), list(outputs), float(scale), found_inf)


def axpby(xs: Tensors, ys: Tensors, outputs: Tensors, a: float, b: float,
          found_inf: torch.Tensor) -> None:
    """``out = a*x + b*y`` for each triple (``outputs`` may be ``xs`` or ``ys``); flags non-finite
    elements of ``xs`` and ``ys``."""
    for name, tensors in (("xs", xs), ("ys", ys), ("outputs", outputs)):
        _check_list(name, tensors)
    device = _found_inf_device(found_inf)
    _check_pairs("xs", xs, "ys", ys, shapes=False)
    _check_pairs("xs", xs, "outputs", outputs, shapes=False)
    _check_tensors(device, "found_inf", xs=xs, ys=ys, outputs=outputs)
    _check_pairs("xs", xs, "ys", ys, shapes=True)
    _check_pairs("xs", xs, "outputs", outputs, shapes=True)
    _check_no_overlap(("outputs", outputs), ("xs", xs), ("ys", ys))
    if not xs:
        return
    ops = ops_for(device)
    if _same_tensors(ys, outputs):
        ops.axpby_(list(xs), list(ys), float(a), float(b), found_inf)
    elif _same_tensors(xs, outputs):
        ops.axpby_(list(ys), list(xs), float(b), float(a), found_inf)
    else:
        ops.axpby_out(list(xs), list(ys), list(outputs), float(a), float(b), found_inf)


def _ops_checked(tensors: Tensors):
    """The backend for a non-empty list of tensors on the device of its first one."""
    if not isinstance(tensors[0], torch.Tensor):
        raise TypeError(f"tensors[0] is a {type(tensors[0]).__name__}, not a tensor")
    device = tensors[0].device
    _check_tensors(device, "tensors[0]", tensors=tensors)
    return ops_for(device)


def l2norm(tensors: Tensors, per_tensor: bool = False
           ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """The L2 norm of all elements of ``tensors`` together, accumulated in fp32, as a 1-element
    fp32 tensor; with ``per_tensor=True``, ``(total, norms)`` with one fp32 norm per tensor."""
    _check_list("tensors", tensors)
    if not tensors:
        total = torch.zeros(1, dtype=torch.float32)
        return (total, torch.zeros(0, dtype=torch.float32)) if per_tensor else total
    ops = _ops_checked(tensors)
    total, norms = ops.l2norm(list(tensors), bool(per_tensor))
    return (total, norms) if per_tensor else total


def nonfinite_flags(tensors: Tensors) -> torch.Tensor:
    """A bool tensor with one entry per tensor: True where that tensor holds an inf or NaN."""
    _check_list("tensors", tensors)
    if not tensors:
        return torch.zeros(0, dtype=torch.bool)
    return _ops_checked(tensors).nonfinite_flags(list(tensors))
