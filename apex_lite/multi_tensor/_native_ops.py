"""The native backend: thin wrappers over ``torch.ops.apex_lite``, with ``_python``'s signatures.

Two sets, one per staging policy for non-contiguous tensors:
- ``CPU_OPS`` call the ops directly: the CPU kernels accept any strides and stage non-contiguous
  tensors through contiguous copies in C++, so no Python loop runs over the tensors.
- ``STAGED_OPS`` (CUDA) check contiguity in Python and stage non-contiguous tensors through
  contiguous copies here, copying outputs back, because the CUDA kernels may require contiguous
  tensors. The check is the only per-tensor Python work on their common path. Where they stage,
  the op sees copies, not the caller's tensors, and cannot tell whether those overlap: so a call
  that writes is checked here first (``_checks``, all the op's checks in its order, with its
  argument names), on the caller's tensors. Staging copies every non-contiguous tensor; the
  checks' Python loop is small beside that, and the common, contiguous path does not run it.
The fused optimizer ops take, without copies, a parameter whose tensors (parameter, gradient,
state, model parameter) share one dense layout (``_layout.laid_out_as``: channels_last
parameters with their gradients and state, as torch makes them); a parameter whose tensors do
not, they stage: every tensor of that parameter through a contiguous copy of its current
values, copied back after the step (parameters, state, model parameters): a skipped step
(``found_inf`` not 0, which the kernels read on the device) writes nothing into the copies, so
the copy back leaves the caller's tensors as they were, bit for bit, without the host reading
``found_inf``. Fresh, uninitialised buffers serve only outputs the kernel writes in full whatever
``found_inf`` holds (``scale_out``'s and ``axpby_out``'s).
Both sets offer ``hold_lists``: an update's lists held in C++ between steps
(``torch.classes.apex_lite.HeldLists``, csrc/held_lists.cpp), whose steps pass no list through
Python; and the host-side watches amp runs every step, one C++ loop each: ``watch_grads``
(csrc/grad_watch.cpp), ``lazy_grad_slots`` and ``watch_tensors`` (csrc/master_watches.cpp), with
``_watches``' signatures; and ``referenced_elsewhere``, a reference count read in C
(csrc/module.cpp).

Imported only after ``apex_lite._C`` is loaded.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import List, Sequence, Tuple

import torch

from . import _checks
from ._layout import dense, laid_out_as

Tensors = Sequence[torch.Tensor]

_is_contiguous = torch.Tensor.is_contiguous
_scale_ = torch.ops.apex_lite.scale_.default
_scale_out = torch.ops.apex_lite.scale_out.default
_axpby_ = torch.ops.apex_lite.axpby_.default
_axpby_out = torch.ops.apex_lite.axpby_out.default
_l2norm = torch.ops.apex_lite.l2norm.default
_nonfinite_flags = torch.ops.apex_lite.nonfinite_flags.default
_fused_sgd_ = torch.ops.apex_lite.fused_sgd_.default
_fused_adam_ = torch.ops.apex_lite.fused_adam_.default
_fused_lamb_ = torch.ops.apex_lite.fused_lamb_.default
_HeldLists = torch.classes.apex_lite.HeldLists
_GradWatch = torch.classes.apex_lite.GradWatch
_LazyGradSlots = torch.classes.apex_lite.LazyGradSlots
_TensorWatch = torch.classes.apex_lite.TensorWatch


def watch_grads(sources: Tensors):
    """The gradients' watch held in C++ (csrc/grad_watch.cpp): record() / changed() /
    cleared() / clear() as ``_watches.GradWatch``, one call each instead of a Python read per
    tensor."""
    return _GradWatch(list(sources))


def lazy_grad_slots(sources: Tensors, masters: Tensors, lazies: Tensors):
    """``_watches.LazyGradSlots`` held in C++ (csrc/master_watches.cpp)."""
    return _LazyGradSlots(list(sources), list(masters), list(lazies))


def _referenced_elsewhere():
    """``_watches.referenced_elsewhere`` in C (csrc/module.cpp: one loop, no Python call per
    object) where ``apex_lite._C`` is the built module; a JIT build (APEX_LITE_JIT=1) loads the
    ops without it, and takes the Python loop."""
    try:
        from .. import _C
        return _C.referenced_elsewhere
    except (ImportError, AttributeError):
        from ._watches import referenced_elsewhere
        return referenced_elsewhere


referenced_elsewhere = _referenced_elsewhere()


def watch_tensors(tensors: Tensors):
    """``_watches.TensorWatch`` held in C++ (csrc/master_watches.cpp)."""
    return _TensorWatch(list(tensors))


def _hold_lists_any_strides(params: Tensors, grad_sources: Tensors, model_params: Tensors,
                            state: Sequence[Tensors]):
    """The lists held in C++ (CPU kernels: any strides; the step itself stages non-contiguous
    tensors)."""
    return _HeldLists(list(params), list(grad_sources), list(model_params),
                      [list(tensors) for tensors in state])


CPU_OPS = SimpleNamespace(scale_=_scale_, scale_out=_scale_out, axpby_=_axpby_,
                          axpby_out=_axpby_out, l2norm=_l2norm, nonfinite_flags=_nonfinite_flags,
                          fused_sgd_=_fused_sgd_, fused_adam_=_fused_adam_,
                          fused_lamb_=_fused_lamb_, hold_lists=_hold_lists_any_strides,
                          watch_grads=watch_grads, lazy_grad_slots=lazy_grad_slots,
                          referenced_elsewhere=referenced_elsewhere,
                          watch_tensors=watch_tensors)


def _contiguous(tensors: Tensors) -> bool:
    return all(map(_is_contiguous, tensors))


def _read_copies(tensors: Tensors) -> List[torch.Tensor]:
    """Contiguous tensors holding the values of ``tensors`` (the contiguous ones themselves)."""
    return [t if t.is_contiguous() else t.contiguous() for t in tensors]


def _write_buffers(tensors: Tensors) -> List[torch.Tensor]:
    """Contiguous tensors to write results for ``tensors`` into (the contiguous ones themselves),
    uninitialised: only for outputs the op writes in full on every call. What an op may leave
    unwritten (a fused step skipped by ``found_inf``) is staged by ``_read_copies`` instead."""
    return [t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype, device=t.device)
            for t in tensors]


def _copy_back(targets: Tensors, buffers: Tensors) -> None:
    for target, buffer in zip(targets, buffers):
        if buffer is not target:
            target.copy_(buffer)


def scale_(tensors: Tensors, scale: float, found_inf: torch.Tensor) -> None:
    """``t *= scale`` for each tensor; flags non-finite elements."""
    if _contiguous(tensors):
        _scale_(tensors, scale, found_inf)
        return
    _checks.check_scale_(tensors, found_inf)
    staged = _read_copies(tensors)
    _scale_(staged, scale, found_inf)
    _copy_back(tensors, staged)


def scale_out(inputs: Tensors, outputs: Tensors, scale: float, found_inf: torch.Tensor) -> None:
    """``out = in * scale`` for each pair; flags non-finite inputs."""
    if _contiguous(inputs) and _contiguous(outputs):
        _scale_out(inputs, outputs, scale, found_inf)
        return
    _checks.check_scale_out(inputs, outputs, found_inf)
    staged_out = _write_buffers(outputs)
    _scale_out(_read_copies(inputs), staged_out, scale, found_inf)
    _copy_back(outputs, staged_out)


def axpby_(xs: Tensors, ys: Tensors, a: float, b: float, found_inf: torch.Tensor) -> None:
    """``y = a*x + b*y`` for each pair; flags non-finite elements of xs and ys."""
    if _contiguous(xs) and _contiguous(ys):
        _axpby_(xs, ys, a, b, found_inf)
        return
    _checks.check_axpby_(xs, ys, found_inf)
    staged_ys = _read_copies(ys)
    _axpby_(_read_copies(xs), staged_ys, a, b, found_inf)
    _copy_back(ys, staged_ys)


def axpby_out(xs: Tensors, ys: Tensors, outputs: Tensors, a: float, b: float,
              found_inf: torch.Tensor) -> None:
    """``out = a*x + b*y`` for each triple; flags non-finite elements of xs and ys."""
    if _contiguous(xs) and _contiguous(ys) and _contiguous(outputs):
        _axpby_out(xs, ys, outputs, a, b, found_inf)
        return
    _checks.check_axpby_out(xs, ys, outputs, found_inf)
    staged_out = _write_buffers(outputs)
    _axpby_out(_read_copies(xs), _read_copies(ys), staged_out, a, b, found_inf)
    _copy_back(outputs, staged_out)


def l2norm(tensors: Tensors, per_tensor: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(total, per_tensor_norms)`` in fp32; ``per_tensor_norms`` is empty unless asked for."""
    if not _contiguous(tensors):
        tensors = _read_copies(tensors)
    return _l2norm(tensors, per_tensor)


def nonfinite_flags(tensors: Tensors) -> torch.Tensor:
    """One bool per tensor: True where it holds an inf or NaN."""
    if not _contiguous(tensors):
        tensors = _read_copies(tensors)
    return _nonfinite_flags(tensors)


def _shared_layouts(params: Tensors, others: Sequence[Tensors]) -> List[bool]:
    """Per parameter: whether it and its tensors in ``others`` (lists aligned with ``params``,
    or empty) share one dense layout, which the CUDA kernels step without copies. A
    per-parameter scalar (a step count, NovoGrad's second moment: one element, another shape)
    has no layout to share."""
    def follows(t: torch.Tensor, p: torch.Tensor) -> bool:
        return laid_out_as(t, p) or (t.numel() == 1 and t.shape != p.shape)
    return [dense(p) and all(not tensors or follows(tensors[i], p) for tensors in others)
            for i, p in enumerate(params)]


def _step_staged(op, lists: Sequence[Tensors], written: Sequence[int], *rest) -> None:
    """``op(*lists, *rest)`` with the lists (aligned per parameter; ``written`` their indices
    that the op writes) as the CUDA kernels take them: every tensor of a parameter whose tensors
    share one dense layout as it is, the others' through contiguous copies of their current
    values (a skipped step leaves them unwritten), copied back after."""
    if all(_contiguous(tensors) for tensors in lists):
        op(*lists, *rest)
        return
    shared = _shared_layouts(lists[0], lists[1:])
    staged = [[t if keep else t.contiguous() for t, keep in zip(tensors, shared)]
              if tensors else tensors for tensors in lists]
    op(*staged, *rest)
    for k in written:
        _copy_back(lists[k], staged[k])


def fused_sgd_(params: Tensors, grads: Tensors, momentum_buffers: Tensors, model_params: Tensors,
               *rest) -> None:
    """SGD step; see csrc/ops.cpp."""
    _step_staged(_fused_sgd_, (params, grads, momentum_buffers, model_params), (0, 2, 3), *rest)


def _adam_like(op):
    def step(params: Tensors, grads: Tensors, exp_avgs: Tensors, exp_avg_sqs: Tensors,
             model_params: Tensors, steps: Tensors, *rest) -> None:
        def call(params, grads, exp_avgs, exp_avg_sqs, model_params, *rest):
            op(params, grads, exp_avgs, exp_avg_sqs, model_params, steps, *rest)
        _step_staged(call, (params, grads, exp_avgs, exp_avg_sqs, model_params), (0, 2, 3, 4),
                     *rest)
    return step


fused_adam_ = _adam_like(_fused_adam_)
fused_adam_.__doc__ = "Adam step; see csrc/ops.cpp."
fused_lamb_ = _adam_like(_fused_lamb_)
fused_lamb_.__doc__ = "LAMB step; see csrc/ops.cpp."


def hold_lists(params: Tensors, grad_sources: Tensors, model_params: Tensors,
               state: Sequence[Tensors]):
    """The lists held in C++, or None when a parameter's tensors do not share one dense layout
    (staged per call by the list path; the held step passes the tensors to the op as they are,
    and takes a gradient only when it is laid out as its parameter: csrc/held_lists.cpp)."""
    if not all(_shared_layouts(params, [model_params, *state])):
        return None
    return _hold_lists_any_strides(params, grad_sources, model_params, state)


STAGED_OPS = SimpleNamespace(scale_=scale_, scale_out=scale_out, axpby_=axpby_,
                             axpby_out=axpby_out, l2norm=l2norm, nonfinite_flags=nonfinite_flags,
                             fused_sgd_=fused_sgd_, fused_adam_=fused_adam_,
                             fused_lamb_=fused_lamb_, hold_lists=hold_lists,
                             watch_grads=watch_grads, lazy_grad_slots=lazy_grad_slots,
                             referenced_elsewhere=referenced_elsewhere,
                             watch_tensors=watch_tensors)


# ---- issue 27: fused_lamb_mp_ (apex's FusedMixedPrecisionLamb) ----
_fused_lamb_mp_ = torch.ops.apex_lite.fused_lamb_mp_.default
CPU_OPS.fused_lamb_mp_ = _fused_lamb_mp_
# The 6th argument is the one step tensor (not a list), passed through as it is.
STAGED_OPS.fused_lamb_mp_ = _adam_like(_fused_lamb_mp_)
STAGED_OPS.fused_lamb_mp_.__doc__ = "LAMB step with lr and step as tensors; see csrc/ops.cpp."
# ---- end issue 27 ----
# ---- NovoGrad and Adagrad ----------------------------------------------------------------------
_fused_novograd_ = torch.ops.apex_lite.fused_novograd_.default
_fused_adagrad_ = torch.ops.apex_lite.fused_adagrad_.default

# NovoGrad's lists sit where Adam's do (its exp_avg_sqs are 1-element tensors: no layout).
fused_novograd_ = _adam_like(_fused_novograd_)
fused_novograd_.__doc__ = "NovoGrad step; see csrc/ops.cpp."


def fused_adagrad_(params: Tensors, grads: Tensors, sums: Tensors, model_params: Tensors,
                   steps: Tensors, *rest) -> None:
    """Adagrad step; see csrc/ops.cpp."""
    def call(params, grads, sums, model_params, *rest):
        _fused_adagrad_(params, grads, sums, model_params, steps, *rest)
    _step_staged(call, (params, grads, sums, model_params), (0, 2, 3), *rest)


CPU_OPS.fused_novograd_ = _fused_novograd_
CPU_OPS.fused_adagrad_ = _fused_adagrad_
STAGED_OPS.fused_novograd_ = fused_novograd_
STAGED_OPS.fused_adagrad_ = fused_adagrad_
