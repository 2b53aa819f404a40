"""The argument checks of the multi-tensor ops, in Python: the same checks, in the same order, with
the same exception types and messages as the native kernels make in C++
(csrc/multi_tensor_checks.h).

Who runs them: the public API before the Python backend (which checks nothing itself); the fake
(meta) kernels, which the dispatcher calls instead of the C++ ones for meta tensors; the CUDA
staging path, on the caller's tensors before it copies them; and the public API after the native
kernels refused a call, to name the arguments as the caller passed them (the in-place forms reach
the kernels under other names). The native kernels' success path runs none of them.
"""
from __future__ import annotations

import operator
from array import array
from typing import List, Optional, Sequence, Tuple

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

Tensors = Sequence[torch.Tensor]
NamedList = Tuple[str, Tensors]


def check_list(name: str, tensors: Tensors) -> None:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(tensors).__name__}")


def found_inf_device(found_inf: torch.Tensor) -> torch.device:
    if not isinstance(found_inf, torch.Tensor) or found_inf.numel() != 1 \
            or found_inf.dtype != torch.float32:
        raise TypeError("found_inf must be a 1-element float32 tensor (create it with "
                        "torch.zeros(1, device=...) and zero it yourself between steps)")
    return found_inf.device


def first_device(tensors: Tensors) -> torch.device:
    """The device of ``tensors[0]``, the anchor of a reduction's tensors (a non-empty list)."""
    if not isinstance(tensors[0], torch.Tensor):
        raise TypeError(f"tensors[0] is a {type(tensors[0]).__name__}, not a tensor")
    return tensors[0].device


def check_lengths(a: NamedList, b: NamedList) -> None:
    if len(a[1]) != len(b[1]):
        raise ValueError(f"{a[0]} has {len(a[1])} tensors but {b[0]} has {len(b[1])}; "
                         f"they are used pairwise")


def check_tensors(device: torch.device, anchor: str, *lists: NamedList) -> None:
    """Per tensor, list by list and in index order: a tensor, of a supported dtype, on ``device``
    (the device of the argument named ``anchor``)."""
    for name, tensors in lists:
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


def check_shapes(a: NamedList, b: NamedList) -> None:
    for i, (x, y) in enumerate(zip(a[1], b[1])):
        if x.shape != y.shape:
            raise ValueError(f"{a[0]}[{i}] has shape {tuple(x.shape)} but {b[0]}[{i}] "
                             f"has {tuple(y.shape)}")


# --- overlap --------------------------------------------------------------------------------

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


def check_no_overlap(outputs: NamedList, *inputs: NamedList) -> None:
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


# --- step counts (the fused Adam-like optimizer steps) -------------------------------------------

def check_own_step_counts(op: str, steps: Tensors) -> None:
    """Refuse a step count shared by two parameters: at one address (the same tensor, or views of
    one element; distinct elements of one buffer are distinct counts). A shared count would
    advance once per parameter in a step, and their bias corrections would depend on the order
    they are stepped in. Every op that advances step counts makes this check, on every backend
    (the native kernels, this backend, torch's kernels' route). Names the lowest j whose address
    an earlier index holds, and the first such index i, and the counts' device in the fix: the
    same check, message and pair as csrc/multi_tensor_checks.h's. Reads addresses only (no
    device work).

    Raises:
        ValueError: two counts share an element."""
    addresses = list(map(_data_ptr, steps))
    if len(set(addresses)) == len(addresses):
        return
    first = {}
    for j, address in enumerate(addresses):
        i = first.setdefault(address, j)
        if i != j:
            raise ValueError(
                f"apex_lite::{op}: steps[{j}] shares its memory with steps[{i}]: each parameter "
                f"needs a step count of its own (a shared count would advance once per parameter "
                f"in a step, and their bias corrections would depend on the order they are "
                f"stepped in). Give each parameter its own tensor: torch.zeros((), "
                f"dtype=torch.float32, device='{steps[j].device}') per parameter, or a clone() "
                f"of the shared one.")


# --- the checks of each call --------------------------------------------------------------------
# ``names`` are the arguments' names in the messages: the public API's by default, the op's
# (csrc/ops.cpp) where an op is checked (the ops' checks below). ``memory=False`` leaves out the overlap rule, for tensors
# that have no memory to compare (the fake kernels' meta and fake tensors).

def check_scale(inputs: Tensors, outputs: Tensors, found_inf: torch.Tensor, in_place: bool,
                names: Tuple[str, str] = ("inputs", "outputs"), memory: bool = True) -> None:
    """``scale`` / the ops ``scale_`` (``in_place``: outputs are the inputs) and ``scale_out``."""
    device = found_inf_device(found_inf)
    named_inputs, named_outputs = (names[0], inputs), (names[1], outputs)
    check_lengths(named_inputs, named_outputs)
    if in_place:
        check_tensors(device, "found_inf", named_inputs)
    else:
        check_tensors(device, "found_inf", named_inputs, named_outputs)
        check_shapes(named_inputs, named_outputs)
    if memory:
        check_no_overlap(named_outputs, named_inputs)


def check_axpby(xs: Tensors, ys: Tensors, outputs: Tensors, found_inf: torch.Tensor,
                names: Tuple[str, str, str] = ("xs", "ys", "outputs"), memory: bool = True
                ) -> None:
    """``axpby`` / the ops ``axpby_`` (``outputs`` is ``ys``) and ``axpby_out``."""
    device = found_inf_device(found_inf)
    named_xs, named_ys, named_outputs = (names[0], xs), (names[1], ys), (names[2], outputs)
    check_lengths(named_xs, named_ys)
    if outputs is ys:
        check_tensors(device, "found_inf", named_xs, named_ys)
        check_shapes(named_xs, named_ys)
    else:
        check_lengths(named_xs, named_outputs)
        check_tensors(device, "found_inf", named_xs, named_ys, named_outputs)
        check_shapes(named_xs, named_ys)
        check_shapes(named_xs, named_outputs)
    if memory:
        check_no_overlap(named_outputs, named_xs, named_ys)


def check_reduction(tensors: Tensors) -> None:
    """``l2norm`` and ``nonfinite_flags``: read only, on the device of ``tensors[0]``."""
    if tensors:
        check_tensors(first_device(tensors), "tensors[0]", ("tensors", tensors))


# The ops' checks under the ops' argument names, as csrc/multi_tensor_checks.h names them (for
# the reductions, ``check_reduction`` serves both).

def check_scale_(tensors: Tensors, found_inf: torch.Tensor, memory: bool = True) -> None:
    check_scale(tensors, tensors, found_inf, True, ("tensors", "tensors"), memory)


def check_scale_out(inputs: Tensors, outputs: Tensors, found_inf: torch.Tensor,
                    memory: bool = True) -> None:
    check_scale(inputs, outputs, found_inf, False, memory=memory)


def check_axpby_(xs: Tensors, ys: Tensors, found_inf: torch.Tensor, memory: bool = True) -> None:
    check_axpby(xs, ys, ys, found_inf, ("xs", "ys", "ys"), memory)


def check_axpby_out(xs: Tensors, ys: Tensors, outputs: Tensors, found_inf: torch.Tensor,
                    memory: bool = True) -> None:
    check_axpby(xs, ys, outputs, found_inf, memory=memory)
