"""``fused_sgd_``, ``fused_adam_`` and ``fused_adagrad_`` through torch's own fused optimizer
kernels: the route of amp's O2 fused step where apex_lite's native kernels do not serve a device
(the default ``pip install .`` builds none).

torch ships the kernels that ``torch.optim.SGD/Adam/AdamW/Adagrad(fused=True)`` run, for the CPU
and CUDA: ``torch._fused_sgd_``, ``_fused_adam_``, ``_fused_adamw_`` and ``_fused_adagrad_``.
Each reads a parameter, its gradient and its state once and writes them once, and takes a
``grad_scale`` (the gradient is divided by it) and a ``found_inf`` (1.0: write nothing). What
they lack for O2 is a gradient in another dtype than the parameter: an O2 master is fp32, its
gradient (the half model parameter's, still multiplied by the loss scale) is fp16 or bf16. So
here the gradients are converted to fp32 in chunks of at most ``chunk_elements(device)`` (1 MiB on
the CPU, 32 MiB on a GPU) into one fp32 buffer, and each chunk is stepped right after its
conversion, while it is still in cache;
then the chunk's masters are rounded into the half model parameters (one foreach copy). A
parameter larger than a chunk is stepped in slices (its step count, which the kernel only reads,
is shared by the slices and incremented once). No fp32 copy of all gradients exists at any time:
O2 holds fp32 master weights, half weights, half gradients and the fp32 state, which is fp32
training's bytes per parameter.

The signatures and the meaning are the native ops' (``_python.py`` is their reference):
``grad * inv_scale`` is the true gradient, a set ``found_inf`` writes nothing at all (parameters,
state, step counts, model parameters), the step counts are incremented by the op, the model
parameters receive the updated values rounded once. The results match the native kernels to fp32
rounding, not bit for bit: torch's kernels order their arithmetic their own way (one ulp of a
parameter per step, measured) and divide by the scale where the native kernels multiply by its
inverse (the same for loss scales that are powers of two).

What torch's kernels do not compute goes to the Python reference, per call: Adam without bias
correction (FusedAdam's ``bias_correction=False``), apex's ``wd_after_momentum`` and
``adagrad_w_mode`` with a weight decay, parameters that are not fp32. ``serves_adam``,
``serves_sgd`` and ``serves_adagrad`` say which, so that amp can choose the unfused step for
them instead. (Adagrad's lists are not held: its update takes the list path on every backend.)

Skips: nothing is read on the host, on any device (a GPU step must not sync): the kernels skip on
the device, each step count adds ``1 - found_inf``, and the half parameters are written from the
masters, which they already round (their bits do not change). A skipped step therefore costs the
conversions; skips are rare. fp32 gradients (the masters' materialised ones, parameters kept in
fp32, FSDP2's shards) go through the buffer too: torch's kernels write the unscaled gradient
back where they read it, and the gradients are the op's inputs, read only.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from . import _checks, _python
from ._layout import dense

Tensors = Sequence[torch.Tensor]

# Elements of fp32 gradient converted per chunk on the CPU: 1 MiB of buffer, which stays in cache
# with the chunk's parameters and state between the conversion, the step and the copy into the
# model. On the 2-core AVX512 host (bench/o2_step.py, 8M parameters, AdamW) 1 MiB chunks gave the
# same step time as 4 MiB ones and a peak 1.00x fp32's against 1.05x.
CHUNK_ELEMENTS = 1 << 18
# On a GPU (any device but the CPU): 32 MiB. A chunk costs three or more kernel launches (the
# conversion, torch's fused kernel, the rounding into the model), each a few microseconds of host
# time, and no cache holds a chunk between them there: 1 MiB chunks made about 5,000 chunks and
# 15,000 launches per step for 1.3B parameters, a host-bound step; 32 MiB chunks make about 155
# (tests/test_torch_fused_route.py counts them), and the buffer stays small beside the model.
GPU_CHUNK_ELEMENTS = 1 << 23

__all__ = ["fused_sgd_", "fused_adam_", "fused_adagrad_", "serves_adam", "serves_sgd",
           "serves_adagrad", "hold_lists", "chunk_elements", "CHUNK_ELEMENTS",
           "GPU_CHUNK_ELEMENTS"]


def chunk_elements(device: torch.device) -> int:
    """The fp32 elements of one chunk on ``device``: ``CHUNK_ELEMENTS`` on the CPU (sized for its
    cache), ``GPU_CHUNK_ELEMENTS`` elsewhere (sized against the launches per step)."""
    return CHUNK_ELEMENTS if torch.device(device).type == "cpu" else GPU_CHUNK_ELEMENTS


def serves_adam(bias_correction: bool) -> bool:
    """Whether torch's kernels compute this Adam (they always correct the bias)."""
    return bool(bias_correction)


def serves_sgd(weight_decay: float, wd_after_momentum: bool) -> bool:
    """Whether torch's kernel computes this SGD (weight decay before the momentum only)."""
    return not (wd_after_momentum and weight_decay != 0.0)


def serves_adagrad(weight_decay: float, adagrad_w_mode: bool) -> bool:
    """Whether torch's kernel computes this Adagrad (an L2 weight decay only: torch.optim's)."""
    return not (adagrad_w_mode and weight_decay != 0.0)


def hold_lists(params: Tensors, grad_sources: Tensors, model_params: Tensors,
               state: Sequence[Tensors]) -> Optional["_HeldLists"]:
    """The lists of a plan, held between steps with their chunk layout (``_HeldLists``); None
    where torch's kernels do not take them (tensors other than fp32, for the Python reference's
    list path)."""
    if not params or not _all_fp32(params, *state[:2]):
        return None
    if len(state) == 3:   # Adam's: exp_avgs, exp_avg_sqs, steps
        _checks.check_own_step_counts("fused_adam_", state[2])
    return _HeldLists(list(params), list(grad_sources), list(model_params),
                      [list(tensors) for tensors in state])


def _all_fp32(*lists: Tensors) -> bool:
    return all(t.dtype == torch.float32 for tensors in lists for t in tensors)


def _scales(inv_scale: torch.Tensor, found_inf: torch.Tensor
            ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(grad_scale, found_inf)`` as torch's kernels take them: the divisor of the gradient, and
    a flag that is exactly 1.0 where it is set (the kernels compare with 1.0). Nothing is read
    on the host, on any device."""
    grad_scale = torch.reciprocal(inv_scale.reshape(1).to(torch.float32))
    return grad_scale, (found_inf.reshape(1) != 0).to(torch.float32)


def _count_steps(steps: Tensors, flag: torch.Tensor) -> None:
    """Each step count + (1 - found_inf): nothing read on the host."""
    if steps:
        torch._foreach_add_(list(steps), (1.0 - flag).reshape(()))


def _pieces(lists: List[List[torch.Tensor]], limit: int) -> List[List[Tuple[int, Optional[slice]]]]:
    """The chunks of one call: lists of ``(index, part)`` whose elements total at most
    ``limit``, ``part`` a slice of the flattened tensor, or None for the whole tensor. A tensor
    is sliced only when every list's tensor at its index is contiguous; one that cannot be
    sliced and exceeds ``limit`` is a chunk of its own."""
    chunks: List[List[Tuple[int, Optional[slice]]]] = []
    current: List[Tuple[int, Optional[slice]]] = []
    room = limit
    for i, t in enumerate(lists[0]):
        n = t.numel()
        if n <= room:
            current.append((i, None))
            room -= n
            continue
        if not all(tensors[i].is_contiguous() for tensors in lists):
            if current:
                chunks.append(current)
            current, room = [(i, None)], limit - n
            if room <= 0:
                chunks.append(current)
                current, room = [], limit
            continue
        start = 0
        while start < n:
            if room == 0:
                chunks.append(current)
                current, room = [], limit
            stop = min(n, start + room)
            current.append((i, slice(start, stop)))
            room -= stop - start
            start = stop
    if current:
        chunks.append(current)
    return chunks


class _Chunk:
    """One chunk's pieces and where each piece's fp32 gradient goes in the buffer.

    A piece is a slice of a contiguous tensor (flat views of the parameter, its state and its
    model parameter), or a whole tensor as it is laid out when its state shares its strides and
    it is dense (torch's kernels walk each tensor's memory in order, so the parameter, its
    gradient and its state must share one layout: a mismatch pairs the wrong elements, without
    an error). Any other tensor is staged: stepped through contiguous copies, copied back."""
    __slots__ = ("where", "params", "states", "steps", "models", "outs", "staged")

    def __init__(self, where, params, states, steps, model_params, buffer: torch.Tensor,
                 offset: int):
        self.where = where                               # (index, part) per piece
        self.params, self.outs, self.staged = [], [], []
        self.states = [[] for _ in states]
        self.models = []
        for k, (i, part) in enumerate(where):
            p = params[i]
            n = _numel(p, part)
            if part is not None:
                self.params.append(_piece(p, part))
                for mine, state in zip(self.states, states):
                    mine.append(_piece(state[i], part))
                self.outs.append(buffer[offset:offset + n])
            else:
                self.params.append(p)
                for mine, state in zip(self.states, states):
                    mine.append(state[i])
                if dense(p) and all(state[i].stride() == p.stride() for state in states):
                    self.outs.append(buffer.as_strided(p.shape, p.stride(), offset))
                else:
                    self.staged.append(k)
                    self.outs.append(buffer[offset:offset + n].view(p.shape))
            if model_params:
                self.models.append(_piece(model_params[i], part) if part is not None
                                   else model_params[i])
            offset += n
        self.steps = [steps[i] for i, _ in where] if steps else []

    def grads(self, grads: List[torch.Tensor]) -> List[torch.Tensor]:
        """This chunk's pieces of ``grads`` (reshape: a view of a contiguous gradient, a copy of
        another)."""
        return [grads[i] if part is None else grads[i].reshape(-1)[part]
                for i, part in self.where]

    def step(self, kernel, grads, grad_scale, flag) -> None:
        torch._foreach_copy_(self.outs, self.grads(grads))
        if not self.staged:
            kernel(self.params, self.outs, self.states, self.steps, grad_scale, flag)
        else:
            originals = [self.params] + self.states
            copies = [list(tensors) for tensors in originals]
            for k in self.staged:
                for tensors in copies:
                    tensors[k] = tensors[k].contiguous()
            kernel(copies[0], self.outs, copies[1:], self.steps, grad_scale, flag)
            for k in self.staged:
                for original, copy in zip(originals, copies):
                    original[k].copy_(copy[k])
        if self.models:
            torch._foreach_copy_(self.models, self.params)


def _numel(t: torch.Tensor, part: Optional[slice]) -> int:
    return t.numel() if part is None else part.stop - part.start


def _piece(t: torch.Tensor, part: slice) -> torch.Tensor:
    """A slice of a contiguous tensor, flattened."""
    return t.view(-1)[part]


class _Layout:
    """How a call's tensors are stepped in chunks (``_pieces``), the views built once (a held
    list, ``hold_lists``, keeps its layout between steps). The fp32 buffer's memory exists
    only during a step: its storage is resized to nothing after it, so that it does not add to
    the forward's peak, and every view of it stays valid."""

    def __init__(self, params, states, steps, model_params):
        lists = [params, *states] + ([model_params] if model_params else [])
        chunks = _pieces(lists, chunk_elements(params[0].device))
        size = max((sum(_numel(params[i], part) for i, part in chunk) for chunk in chunks),
                   default=0)
        self.buffer = torch.empty(size, dtype=torch.float32, device=params[0].device)
        self.nbytes = self.buffer.untyped_storage().nbytes()
        # Every chunk uses the buffer from its start: one chunk's gradients at a time.
        self.chunks = [_Chunk(where, params, states, steps, model_params, self.buffer, 0)
                       for where in chunks]
        self.buffer.untyped_storage().resize_(0)

    def step(self, kernel, grads: List[torch.Tensor], grad_scale, flag) -> None:
        """Convert each chunk's gradients into the fp32 buffer, step the chunk, round its
        masters into the model parameters."""
        storage = self.buffer.untyped_storage()
        storage.resize_(self.nbytes)
        try:
            for chunk in self.chunks:
                chunk.step(kernel, grads, grad_scale, flag)
        finally:
            storage.resize_(0)


def _step(kernel, grads: List[torch.Tensor], inv_scale: torch.Tensor, found_inf: torch.Tensor,
          steps: List[torch.Tensor], layout: _Layout) -> None:
    """One step of ``kernel`` over ``layout``'s chunks: the scales as torch's kernels take them,
    the step counts advanced unless skipped, nothing read on the host. The list path and the
    held lists both step through here."""
    grad_scale, flag = _scales(inv_scale, found_inf)
    _count_steps(steps, flag)
    layout.step(kernel, grads, grad_scale, flag)


def _adam_kernel(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                 adam_w_mode: bool):
    fused = torch._fused_adamw_ if adam_w_mode else torch._fused_adam_

    def kernel(params, grads, states, steps, grad_scale, found_inf):
        fused(params, grads, states[0], states[1], [], steps, lr=lr, beta1=beta1, beta2=beta2,
              weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False,
              grad_scale=grad_scale, found_inf=found_inf)
    return kernel


def _sgd_kernel(lr: float, momentum: float, dampening: float, weight_decay: float,
                nesterov: bool, first_run: bool):
    def kernel(params, grads, states, steps, grad_scale, found_inf):
        torch._fused_sgd_(params, grads, states[0] if states else [], weight_decay=weight_decay,
                          momentum=momentum, lr=lr, dampening=dampening, nesterov=nesterov,
                          maximize=False, is_first_step=first_run, grad_scale=grad_scale,
                          found_inf=found_inf)
    return kernel


def fused_adam_(params: Tensors, grads: Tensors, exp_avgs: Tensors, exp_avg_sqs: Tensors,
                model_params: Tensors, steps: Tensors, inv_scale: torch.Tensor,
                found_inf: torch.Tensor, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, adam_w_mode: bool, bias_correction: bool) -> None:
    _checks.check_own_step_counts("fused_adam_", steps)
    if not params:
        return
    if not serves_adam(bias_correction) or not _all_fp32(params, exp_avgs, exp_avg_sqs):
        _python.fused_adam_(params, grads, exp_avgs, exp_avg_sqs, model_params, steps,
                            inv_scale, found_inf, lr, beta1, beta2, eps, weight_decay,
                            adam_w_mode, bias_correction)
        return
    states, steps = [list(exp_avgs), list(exp_avg_sqs)], list(steps)
    _step(_adam_kernel(lr, beta1, beta2, eps, weight_decay, adam_w_mode), list(grads), inv_scale,
          found_inf, steps, _Layout(list(params), states, steps, list(model_params)))


def fused_sgd_(params: Tensors, grads: Tensors, momentum_buffers: Tensors, model_params: Tensors,
               inv_scale: torch.Tensor, found_inf: torch.Tensor, lr: float, momentum: float,
               dampening: float, weight_decay: float, nesterov: bool, wd_after_momentum: bool,
               first_run: bool) -> None:
    if not params:
        return
    if not serves_sgd(weight_decay, wd_after_momentum) or \
            not _all_fp32(params, momentum_buffers):
        _python.fused_sgd_(params, grads, momentum_buffers, model_params, inv_scale, found_inf,
                           lr, momentum, dampening, weight_decay, nesterov, wd_after_momentum,
                           first_run)
        return
    states = [list(momentum_buffers)] if momentum != 0.0 else []
    _step(_sgd_kernel(lr, momentum, dampening, weight_decay, nesterov, first_run), list(grads),
          inv_scale, found_inf, [], _Layout(list(params), states, [], list(model_params)))


def fused_adagrad_(params: Tensors, grads: Tensors, sums: Tensors, model_params: Tensors,
                   steps: Tensors, inv_scale: torch.Tensor, found_inf: torch.Tensor, lr: float,
                   eps: float, weight_decay: float, adagrad_w_mode: bool) -> None:
    _checks.check_own_step_counts("fused_adagrad_", steps)
    if not params:
        return
    if not serves_adagrad(weight_decay, adagrad_w_mode) or not _all_fp32(params, sums):
        _python.fused_adagrad_(params, grads, sums, model_params, steps, inv_scale, found_inf,
                               lr, eps, weight_decay, adagrad_w_mode)
        return
    def kernel(params, grads, states, steps, grad_scale, found_inf):
        torch._fused_adagrad_(params, grads, states[0], steps, lr=lr, lr_decay=0.0,
                              weight_decay=weight_decay, eps=eps, maximize=False,
                              grad_scale=grad_scale, found_inf=found_inf)

    states, steps = [list(sums)], list(steps)
    _step(kernel, list(grads), inv_scale, found_inf, steps,
          _Layout(list(params), states, steps, list(model_params)))


class _HeldLists:
    """One plan's lists, held between its steps (``hold_lists``): the chunk layout and its views
    are built once, and a step reads the gradients of ``grad_sources`` itself. Each step method
    returns False, having done nothing, where the list path must take the step (a gradient
    missing, sparse, or of mixed dtypes; a flavour torch's kernels do not compute)."""

    def __init__(self, params, grad_sources, model_params, state):
        self.params = params
        self.grad_sources = grad_sources
        self.model_params = model_params
        self.state = state
        self._layout: Optional[_Layout] = None

    def _grads(self) -> Optional[List[torch.Tensor]]:
        grads = [source.grad for source in self.grad_sources]
        dtypes = {None if g is None or g.layout != torch.strided else g.dtype for g in grads}
        return grads if len(dtypes) == 1 and None not in dtypes else None

    def _step(self, kernel, grads, inv_scale, found_inf, states, steps) -> None:
        if self._layout is None:
            self._layout = _Layout(self.params, states, steps, self.model_params)
        _step(kernel, grads, inv_scale, found_inf, steps, self._layout)

    def fused_adam_(self, inv_scale, found_inf, lr, beta1, beta2, eps, weight_decay,
                    adam_w_mode, bias_correction) -> bool:
        grads = self._grads()
        if grads is None or not serves_adam(bias_correction):
            return False
        exp_avgs, exp_avg_sqs, steps = self.state
        self._step(_adam_kernel(lr, beta1, beta2, eps, weight_decay, adam_w_mode), grads,
                   inv_scale, found_inf, [exp_avgs, exp_avg_sqs], steps)
        return True

    def fused_sgd_(self, inv_scale, found_inf, lr, momentum, dampening, weight_decay, nesterov,
                   wd_after_momentum, first_run) -> bool:
        grads = self._grads()
        if grads is None or not serves_sgd(weight_decay, wd_after_momentum) or \
                (momentum != 0.0) != bool(self.state and self.state[0]):
            return False
        self._step(_sgd_kernel(lr, momentum, dampening, weight_decay, nesterov, first_run),
                   grads, inv_scale, found_inf, [self.state[0]] if momentum != 0.0 else [], [])
        return True
