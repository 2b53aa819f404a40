"""The fp8 forward of an ``nn.Linear``: ``Fp8Forward``, set on the layer instance as its
``forward``, runs ``_Fp8Linear``, whose forward and both backward matmuls are scaled fp8
matmuls.

    forward      out    = x8 @ w8.T                    (E4M3 x E4M3, in x's dtype)
    backward     grad_x = g8 @ w8                      (E5M2 x E4M3)
                 grad_w = g8.T @ x8                    (E5M2 x E4M3, in the weight's dtype)
                 grad_b = g.sum(0)                     (from the unrounded gradient)

The layer keeps its class, parameters, hooks and ``state_dict`` keys; what is saved for the
backward is the fp8 input (a byte per element, half what a half Linear keeps) and the weight
itself, cast again in the backward (with the same scale: nothing folds between the two), so
that no fp8 copy of the weights outlives the forward (under FSDP2 that would be a byte per
parameter of the whole model).
``Fp8Forward`` is a module-level class holding its layer and state, so the model pickles and
deep-copies with its fp8 forward (the copy gets its own state).

Note: cuBLASLt wants the contraction dimension a multiple of 16; in ``grad_w`` that is the
number of rows of the input (tokens), which the layer does not choose: rows are padded with
zeros up to the next multiple (exact: they add nothing), on every device alike.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .cast import FORMATS, GRAD, INPUT, WEIGHT, cast, compiled_cast
from .config import MULTIPLE
from .scaled_mm import scaled_mm
from .state import LayerState

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _cast(t: torch.Tensor, role: int, state: tuple, opts: tuple, count: bool = True):
    counts, scale, has_history, pending = state
    margin, counting, _, _, compiled = opts
    count = count and counting
    fn = compiled_cast if compiled else cast
    role_counts = counts[role] if count else None
    if scale is None:
        return fn(t, FORMATS[role], margin, count, role_counts)
    return fn(t, FORMATS[role], margin, count, role_counts, scale[role], has_history[role],
              pending[role])


def _column_major(t8: torch.Tensor, rows: int = 0) -> torch.Tensor:
    """``t8`` (R, C) laid out column-major, with ``rows`` zero rows appended."""
    t = t8.t().contiguous()
    if rows:
        t = F.pad(t.view(torch.uint8), (0, rows)).view(t8.dtype)
    return t.t()


def _pad_columns(t8: torch.Tensor, columns: int) -> torch.Tensor:
    return F.pad(t8.view(torch.uint8), (0, columns)).view(t8.dtype) if columns else t8


class _Fp8Linear(torch.autograd.Function):
    """``x @ weight.T + bias`` with the three matmuls in fp8. ``state``: the layer's (counts,
    scale, has_history, pending) views; ``opts``: (margin, count, fast_accum, native,
    compiled), constants."""

    @staticmethod
    def forward(ctx, input, weight, bias, state: tuple, opts: tuple):
        fast_accum, native = opts[2], opts[3]
        x = input.reshape(-1, input.shape[-1]).contiguous()
        x8, inv_x = _cast(x, INPUT, state, opts)
        w8, inv_w = _cast(weight.contiguous(), WEIGHT, state, opts)
        out = scaled_mm(x8, w8.t(), inv_x, inv_w, out_dtype=input.dtype, bias=bias,
                        fast_accum=fast_accum, native=native)
        # The weight, not its fp8 copy: it is a parameter (no bytes of its own; under FSDP2 it
        # is gathered again for the backward), and its cast is repeated there, identically.
        ctx.save_for_backward(x8, inv_x, weight)
        ctx.input_shape = input.shape
        # The state is mutated by later calls: kept as attributes (save_for_backward would
        # refuse them as modified in place), read only by this backward.
        ctx.state, ctx.opts = state, opts
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        if input.dim() == 2:
            return out
        # Not a view of the 2-D result (F.linear's output is none either: FSDP2 and in-place
        # ops treat views apart).
        return torch.ops.aten._unsafe_view(out, (*input.shape[:-1], out.shape[-1]))

    @staticmethod
    def backward(ctx, grad_output):
        x8, inv_x, weight = ctx.saved_tensors
        native = ctx.opts[3]
        grad = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()
        g8, inv_g = _cast(grad, GRAD, ctx.state, ctx.opts)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            w8, inv_w = _cast(weight.contiguous(), WEIGHT, ctx.state, ctx.opts, count=False)
            grad_x = scaled_mm(g8, _column_major(w8), inv_g, inv_w, out_dtype=grad.dtype,
                               native=native).reshape(ctx.input_shape)
        if ctx.needs_input_grad[1]:
            pad = -g8.shape[0] % MULTIPLE
            grad_w = scaled_mm(_pad_columns(g8.t().contiguous(), pad), _column_major(x8, pad),
                               inv_g, inv_x, out_dtype=ctx.weight_dtype, native=native)
        if ctx.needs_input_grad[2]:
            grad_b = grad.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None


class Fp8Forward:
    """The forward of one fp8 ``nn.Linear`` (``linear.forward = Fp8Forward(linear, ...)``).
    Inputs it cannot take in fp8 (empty, or not floating) go through ``F.linear``."""

    def __init__(self, linear: torch.nn.Linear, state: LayerState, native: bool,
                 compiled: bool):
        self.linear = linear
        self.state = state
        self.native = native
        self.compiled = compiled

    @property
    def name(self) -> str:
        return self.state.name

    def _views(self) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor],
                              Optional[torch.Tensor]]:
        s = self.state
        return s.counts, s.scale, s.has_history, s.pending

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        linear = self.linear
        weight, bias = linear.weight, linear.bias
        if input.numel() == 0 or input.dim() == 0 or input.shape[-1] != linear.in_features \
                or input.dtype not in _FLOATS or weight.dtype not in _FLOATS:
            return F.linear(input, weight, bias)   # torch's result, or torch's error
        state = self.state
        config = state.config
        state.group.dirty = True   # the delayed recipe folds this step at optimizer.step()
        opts = (config.margin, config.counts, config.fast_accum, self.native, self.compiled)
        return _Fp8Linear.apply(input, weight, bias, self._views(), opts)
