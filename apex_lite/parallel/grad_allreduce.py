"""DistributedDataParallel's gradient all-reduce: which gradients travel together (``BucketPlan``)
and one backward's reduction of them (``Reduction``).

The plan is made from the module's parameters alone (every rank builds the same one): walking
the parameters in reverse (a backward produces the last layers' gradients first), each
(device, dtype) fills its own bucket until it holds ``message_size`` elements, or, with
``allreduce_trigger_params``, until one of those parameters is added. Buckets are numbered in
the order they closed.

A backward launches the buckets strictly in that order (collectives match by order across
ranks): bucket ``i`` as soon as its gradients and those of buckets ``0..i-1`` have arrived,
asynchronously, so that its communication overlaps the rest of the backward; the end of the
backward (an autograd-engine callback) launches what is left, waits for all of them and writes
the results back. A parameter without a gradient in this backward adds zeros to its bucket and
keeps no gradient. Per bucket: ``flat = grads / f`` (``f = gradient_predivide_factor``, skipped
at 1.0), in fp32 with ``allreduce_always_fp32``; sum over the ranks; ``* f / world`` with
``gradient_average`` (apex's multiplications, in its order).
"""
from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Set

import torch
import torch.distributed as dist

__all__ = ["BucketPlan", "Reduction"]


class BucketPlan:
    """The buckets of ``params`` (those that take gradients), identical on every rank."""

    def __init__(self, params: List[torch.Tensor], message_size: int,
                 trigger_ids: Optional[Set[int]] = None):
        self.params = tuple(params)
        # What the plan was made for: a parameter cast or moved in place needs another plan.
        self.placed = tuple((p, p.dtype, p.device) for p in self.params)
        self.buckets: List[List[torch.Tensor]] = []
        open_buckets: Dict[tuple, List] = {}
        for p in reversed(self.params):
            key = (p.device, p.dtype)
            bucket = open_buckets.setdefault(key, [[], 0])
            bucket[0].append(p)
            bucket[1] += p.numel()
            full = id(p) in trigger_ids if trigger_ids is not None else bucket[1] >= message_size
            if full:
                self.buckets.append(open_buckets.pop(key)[0])
        self.buckets.extend(bucket for bucket, _ in open_buckets.values())
        self.index: Dict[int, int] = {id(p): i for i, bucket in enumerate(self.buckets)
                                      for p in bucket}


class Reduction:
    """One backward's all-reduce of ``plan``'s buckets, for ``ddp`` (whose settings it reads:
    ``gradient_predivide_factor``, ``gradient_average``, ``allreduce_always_fp32``,
    ``retain_allreduce_buffers``, ``world_size``, ``prof``)."""

    def __init__(self, ddp, plan: BucketPlan):
        self.ddp = ddp
        self.plan = plan
        self.arrived: List[Set[int]] = [set() for _ in plan.buckets]
        self.next = 0
        self.launched: List[tuple] = []   # (bucket index, flat buffer, async work)

    def grad_ready(self, param: torch.Tensor) -> None:
        """``param``'s gradient of this backward is in ``.grad``: launch every bucket now
        complete whose predecessors are launched."""
        index = self.plan.index.get(id(param))
        if index is None:
            return
        self.arrived[index].add(id(param))
        while self.next < len(self.plan.buckets) and \
                len(self.arrived[self.next]) == len(self.plan.buckets[self.next]):
            self._launch(self.next)
            self.next += 1

    def finish(self) -> Optional[List[torch.Tensor]]:
        """At the end of the backward: launch the rest, wait, and write the averaged gradients
        back (with ``retain_allreduce_buffers``, as views of the returned buffers)."""
        while self.next < len(self.plan.buckets):
            self._launch(self.next)
            self.next += 1
        ddp = self.ddp
        retained = []
        for index, flat, work in self.launched:
            with _profiled(ddp.prof, "apex_lite.parallel: allreduce wait"):
                work.wait()
            if ddp.gradient_average:
                flat.mul_(ddp.gradient_predivide_factor / ddp.world_size)
            bucket = self.plan.buckets[index]
            if ddp.retain_allreduce_buffers:
                flat = flat.to(bucket[0].dtype)
                retained.append(flat)
            for p, view in zip(bucket, _views(flat, bucket)):
                if p.grad is None:
                    continue
                if ddp.retain_allreduce_buffers:
                    p.grad = view
                else:
                    p.grad.copy_(view)
        self.launched = []
        return retained if ddp.retain_allreduce_buffers else None

    def _launch(self, index: int) -> None:
        ddp = self.ddp
        bucket = self.plan.buckets[index]
        dtype = torch.float32 if ddp.allreduce_always_fp32 else bucket[0].dtype
        with _profiled(ddp.prof, "apex_lite.parallel: allreduce launch"):
            flat = torch.empty(sum(p.numel() for p in bucket), dtype=dtype,
                               device=bucket[0].device)
            for p, view in zip(bucket, _views(flat, bucket)):
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad)
            if ddp.gradient_predivide_factor != 1.0:
                flat.mul_(1.0 / ddp.gradient_predivide_factor)
            work = dist.all_reduce(flat, async_op=True)
        self.launched.append((index, flat, work))


def _views(flat: torch.Tensor, bucket: List[torch.Tensor]) -> List[torch.Tensor]:
    views, offset = [], 0
    for p in bucket:
        views.append(flat[offset:offset + p.numel()].view(p.shape))
        offset += p.numel()
    return views



def _profiled(prof: bool, name: str):
    """``record_function(name)`` when ``prof`` (apex pushed NVTX ranges), else nothing."""
    return torch.autograd.profiler.record_function(name) if prof else contextlib.nullcontext()
