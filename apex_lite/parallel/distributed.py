"""apex's ``DistributedDataParallel`` and ``Reducer`` (``apex.parallel.distributed``), on torch's
collectives: CPU with gloo, CUDA with nccl, any floating dtype.

``DistributedDataParallel(module, ...)`` broadcasts the module's parameters (not its buffers)
from rank 0 when it is built and, in every backward, all-reduces the gradients of the
parameters that take them: ``grad = allreduce(grad / f) * f / world`` with ``f =
gradient_predivide_factor`` (``gradient_average=False``: ``allreduce(grad / f)``). The
reduction is in grad_allreduce.py. ``Reducer`` reduces when asked (``reduce()``), averaging.
The flat helpers apex exported from this module (``flat_dist_call``, ``flatten``, ...) live in
flat.py and are importable from here too.
"""
from __future__ import annotations

import math
import weakref
from typing import Optional

import torch
import torch.distributed as dist
from torch.nn.modules import Module

from .flat import (apply_flat_dist_call, extract_tensors, flat_dist_call, flatten,  # noqa: F401
                   split_by_type, split_half_float_double, unflatten)
from ..amp.ddp import apex_ddp_forward, broadcast_masters
from .grad_allreduce import BucketPlan, Reduction

__all__ = ["DistributedDataParallel", "Reducer", "flat_dist_call"]


def _require_process_group(what: str) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{what} needs torch.distributed initialised first: call "
                           f"torch.distributed.init_process_group(backend) ('gloo' for CPU, "
                           f"'nccl' for CUDA) in every process before building it")


def _broadcast_parameters(module: Module) -> None:
    """Every rank's parameters become rank 0's (through ``detach()``, so that the write shows
    in their version counters as any in-place write would)."""
    with torch.no_grad():
        flat_dist_call([p.detach() for p in module.parameters()], dist.broadcast, (0,))


class Reducer(object):
    """apex's manual all-reduce: ``reduce()`` averages gradients over the ranks when called
    (for example every few iterations), where ``DistributedDataParallel`` does it in every
    backward.

    Args:
        module_or_grads_list: a module, whose parameters are broadcast from rank 0 now and whose
            parameters' ``.grad`` ``reduce()`` averages; or tensors (nested iterables of them,
            typically gradients), which ``reduce()`` averages in place (their parameters are
            then yours to keep equal across ranks).

    Raises:
        RuntimeError: torch.distributed is not initialised.
    """

    def __init__(self, module_or_grads_list):
        _require_process_group("apex_lite.parallel.Reducer")
        if isinstance(module_or_grads_list, Module):
            self.module = module_or_grads_list
            _broadcast_parameters(self.module)
        else:
            self.module = None
            self.grads = []
            extract_tensors(module_or_grads_list, self.grads)

    def reduce(self) -> None:
        """Average the gradients (or the tensors given) over all ranks, in place."""
        if self.module is not None:
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        else:
            grads = self.grads
        with torch.no_grad():
            flat_dist_call(grads, dist.all_reduce)


class _GradReady:
    """The post-accumulate-grad hook on each parameter. It holds its DDP weakly: torch keeps a
    parameter's hooks in its autograd metadata, out of the garbage collector's sight, so a
    strong reference (DDP -> module -> parameter -> hook -> DDP) would never be freed."""

    __slots__ = ("ddp",)

    def __init__(self, ddp: "DistributedDataParallel"):
        self.ddp = weakref.ref(ddp)

    def __call__(self, param: torch.Tensor) -> None:
        ddp = self.ddp()
        if ddp is not None:
            ddp._grad_ready(param)


class DistributedDataParallel(Module):
    """apex's data-parallel wrapper: ``model = DistributedDataParallel(model)`` after
    ``amp.initialize``, one process per device; ``.module`` is the wrapped model, and
    ``state_dict()`` keys start with ``module.``.

    At construction the parameters of ``module`` (not its buffers) are broadcast from rank 0;
    under amp at O2 rank 0's fp32 master weights follow them (``apex_lite.amp.ddp.
    broadcast_masters``), so ranks seeded differently train one model. In each backward that reaches the module,
    the gradients of its parameters are all-reduced in buckets, each launched as soon as it and
    the buckets before it are complete, so that communication overlaps the rest of the
    backward; the backward returns with every gradient reduced: ``grad = allreduce(grad / f) * f
    / world``, ``f = gradient_predivide_factor``. Every rank must run the same backwards (the
    collectives pair up by order); a parameter without a gradient on a rank adds zeros there and
    keeps no gradient. A second backward before ``step()`` reduces the accumulated gradients
    again (as apex): accumulate under ``disable_allreduce()`` and enable it for the last
    backward.

    Args:
        module: the model, its parameters on this process's device.
        message_size: elements per bucket (default 1e7); smaller buckets start communicating
            earlier in the backward. Buckets hold one dtype each.
        delay_allreduce: reduce everything at the end of the backward, in one go per bucket
            (no overlap).
        shared_param: removed in apex; anything but None raises ValueError.
        allreduce_trigger_params: parameters after which a bucket closes (walking the
            parameters in reverse), instead of ``message_size``.
        retain_allreduce_buffers: keep the flat reduced buffers (``self.allreduce_buffers``,
            one per bucket) and make the gradients views into them.
        allreduce_always_fp32: reduce half gradients in fp32 (converted back after), so that
            the sum over ranks neither overflows nor rounds to 11 or 8 bits.
        num_allreduce_streams, allreduce_communicators: apex's CUDA streams and extra NCCL
            communicators per bucket. torch's process group runs its collectives on its own
            stream (nccl) or threads (gloo) already, so these are checked as apex did and have
            no other effect.
        gradient_average: divide the sum by the world size (default True); False leaves
            ``sum(grad / f)``.
        gradient_predivide_factor: ``f`` above: divide before the sum and multiply after, which
            keeps a half sum over many ranks within range.
        gradient_average_split_factor: accepted and ignored, as apex ignored it.
        prof: label the launches and waits in torch's profiler (apex pushed NVTX ranges).

    Raises:
        ValueError: ``shared_param`` given; ``delay_allreduce`` with several streams or with
            ``allreduce_trigger_params``; communicators that do not match
            ``num_allreduce_streams``; ``message_size`` below 0 or a ``gradient_predivide_factor``
            that is not a positive finite number; nccl with parameters off CUDA.
        RuntimeError: torch.distributed is not initialised.
    """

    def __init__(self,
                 module,
                 message_size=10000000,
                 delay_allreduce=False,
                 shared_param=None,
                 allreduce_trigger_params=None,
                 retain_allreduce_buffers=False,
                 allreduce_always_fp32=False,
                 num_allreduce_streams=1,
                 allreduce_communicators=None,
                 gradient_average=True,
                 gradient_predivide_factor=1.0,
                 gradient_average_split_factor=None,
                 prof=False):
        super().__init__()
        self.allreduce_different_streams = num_allreduce_streams > 1
        _check_arguments(module, message_size, delay_allreduce, shared_param,
                         allreduce_trigger_params, num_allreduce_streams,
                         allreduce_communicators, gradient_predivide_factor,
                         self.allreduce_different_streams)
        _require_process_group("apex_lite.parallel.DistributedDataParallel")
        if dist.get_backend() == "nccl":
            off = next((name for name, p in module.named_parameters() if not p.is_cuda), None)
            if off is not None:
                raise ValueError(f"the nccl backend reduces CUDA tensors only, and parameter "
                                 f"{off!r} is not on CUDA: move the model to this process's "
                                 f"GPU (model.cuda()) before wrapping it, or use gloo for CPU")
        self.prof = prof
        self.num_allreduce_streams = num_allreduce_streams
        self.allreduce_communicators = allreduce_communicators
        self.world_size = float(dist.get_world_size())
        self.retain_allreduce_buffers = retain_allreduce_buffers
        self.allreduce_always_fp32 = allreduce_always_fp32
        self.gradient_average = gradient_average
        self.gradient_predivide_factor = gradient_predivide_factor
        self.custom_allreduce_triggers = allreduce_trigger_params is not None
        self.allreduce_trigger_params = (
            {id(p) for p in allreduce_trigger_params} if self.custom_allreduce_triggers
            else None)
        self.delay_allreduce = delay_allreduce
        self.message_size = message_size
        self.module = module
        self._disable_allreduce = False
        self.allreduce_buffers = []
        self._plan: Optional[BucketPlan] = None
        self._hooks = []
        self._reduction: Optional[Reduction] = None

        _broadcast_parameters(module)
        # O2: the masters are what the optimizer steps; they must follow the broadcast (rank
        # 0's fp32 values, not the upcast of its half ones), or the ranks part at the first step.
        broadcast_masters(module, None, 0)
        self._refresh()

    # ---- apex's switches ----------------------------------------------------------------------
    def enable_allreduce(self) -> None:
        """Reduce gradients in the following backwards (the default)."""
        self._disable_allreduce = False

    def disable_allreduce(self) -> None:
        """Leave gradients local in the following backwards (gradient accumulation)."""
        self._disable_allreduce = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped module's ``zero_grad(set_to_none)`` (under amp, the one that also clears
        O2's master gradients)."""
        self.module.zero_grad(set_to_none=set_to_none)

    # ---- the forward and the hooks ------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        """``module(*inputs, **kwargs)``; first re-plans the buckets when the parameters that
        take gradients changed (added, replaced, ``requires_grad`` switched, cast or moved)."""
        self._reduction = None   # a backward that raised left its reduction unfinished
        if not self._disable_allreduce:
            self._refresh()
        # amp's forward hook on the module sees this wrapper (amp/ddp.py: gradient
        # accumulation under disable_allreduce(), decisions without a collective).
        with apex_ddp_forward(self):
            return self.module(*inputs, **kwargs)

    def reduces_next_backward(self) -> bool:
        """Whether the backward of the forward now running all-reduces the gradients (not under
        ``disable_allreduce()``)."""
        return not self._disable_allreduce

    def _refresh(self) -> None:
        params = [p for p in self.module.parameters() if p.requires_grad]
        if self._plan is not None and len(params) == len(self._plan.params) and \
                all(a is b and a.dtype == dtype and a.device == device
                    for a, (b, dtype, device) in zip(params, self._plan.placed)):
            return
        for handle in self._hooks:
            handle.remove()
        self._plan = BucketPlan(params, self.message_size, self.allreduce_trigger_params)
        hook = _GradReady(self)
        self._hooks = [p.register_post_accumulate_grad_hook(hook) for p in params]

    def _grad_ready(self, param: torch.Tensor) -> None:
        if self._disable_allreduce:
            return
        if self._reduction is None:
            self._reduction = Reduction(self, self._plan)
            # Runs when the whole backward is done (torch's DDP and FSDP end theirs this way).
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if not self.delay_allreduce:
            self._reduction.grad_ready(param)

    def _end_of_backward(self) -> None:
        reduction, self._reduction = self._reduction, None
        if reduction is None:
            return
        retained = reduction.finish()
        if retained is not None:
            self.allreduce_buffers = retained

    # ---- copies -------------------------------------------------------------------------------
    def __getstate__(self):
        # Hooks live on the parameters, not in a copy: the copy hangs its own at its forward.
        state = dict(self.__dict__)
        state.update(_plan=None, _hooks=[], _reduction=None)
        return state


def _check_arguments(module, message_size, delay_allreduce, shared_param,
                     allreduce_trigger_params, num_allreduce_streams, allreduce_communicators,
                     gradient_predivide_factor, different_streams) -> None:
    """apex's ValueErrors, and the others a misuse deserves, before anything is done."""
    if not isinstance(module, Module):
        raise TypeError(f"DistributedDataParallel wraps a torch.nn.Module, got "
                        f"{type(module).__name__}")
    if allreduce_communicators:
        if len(allreduce_communicators) != 2 or \
                len(allreduce_communicators[0]) != num_allreduce_streams or \
                len(allreduce_communicators[0]) != len(allreduce_communicators[1]) or \
                not different_streams:
            raise ValueError("allreduce_communicators must be (process groups, streams), one "
                             "of each per stream, with num_allreduce_streams > 1 matching them")
    if different_streams and delay_allreduce:
        raise ValueError("self.allreduce_different_streams may only be used if "
                         "delay_allreduce=False.")
    if shared_param is not None:
        raise ValueError("shared_param is no longer supported as an option.  It was "
                         "misleadingly named from the start.  It turns out overlapping "
                         "communication with computation should work fine with shared "
                         "parameters.  If you still wish to delay communication to the end of "
                         "the backward pass, use delay_allreduce=True|False instead.")
    if allreduce_trigger_params is not None and delay_allreduce:
        raise ValueError("Setting allreduce_trigger_params is only valid if "
                         "delay_allreduce=False.")
    if isinstance(message_size, bool) or not isinstance(message_size, (int, float)) or \
            message_size < 0:
        raise ValueError(f"message_size is the number of elements per bucket, a number >= 0; "
                         f"got {message_size!r}")
    if isinstance(gradient_predivide_factor, bool) or \
            not isinstance(gradient_predivide_factor, (int, float)) or \
            not math.isfinite(gradient_predivide_factor) or gradient_predivide_factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be a positive finite number (the "
                         f"gradients are divided by it before the all-reduce), got "
                         f"{gradient_predivide_factor!r}")
