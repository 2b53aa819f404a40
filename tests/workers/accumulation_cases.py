"""Two-rank cases of data-parallel training loops (tests/test_parallel_accumulation.py, issue
50); not tests themselves: tests/workers/case_worker.py runs each in a gloo group of its own.

Each loop is written as data-parallel scripts write it, once per kind of run: ``fp32``,
``torch.amp`` (autocast in bf16 and GradScaler: the reference for amp), or an amp opt level on a
step path. Ranks build their models from their own seeds (``100 + rank``) and read their own
data; a case returns the weights it ended with (the masters at O2 and O5) and the half model.
"""
from __future__ import annotations

import contextlib
import functools
import io

import torch
import torch.distributed as dist
from torch.distributed.algorithms import Join
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from amp_habits import PATHS, warm_up  # noqa: F401 (case_worker runs warm_up)
from apex_lite import amp
from apex_lite.parallel import DistributedDataParallel as ApexDDP

AMP_LEVELS = ("O0", "O1", "O2", "O5")


class Run:
    """One kind of run (``kind``: "fp32", "torch.amp" or an amp opt level, on step ``path``)
    of one model, with the calls a loop makes."""

    def __init__(self, rank, kind, path=None, wrapper="torch", lr=0.05, seed=None,
                 checkpoint=None):
        self.kind = kind
        torch.manual_seed(100 + rank if seed is None else seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        self.scaler = None
        if kind in AMP_LEVELS:
            amp.default_handle().__init__()
            model, optimizer = amp.initialize(
                model, optimizer, opt_level=kind, verbosity=0,
                fused_step=PATHS[path] if kind in ("O2", "O5") else None)
        elif kind == "torch.amp":
            self.scaler = torch.amp.GradScaler("cpu")
        if checkpoint is not None:          # apex's order: initialize, then load
            model.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            amp.load_state_dict(checkpoint["amp"])
        self.model, self.optimizer = model, optimizer
        self.ddp = ApexDDP(model) if wrapper == "apex" else TorchDDP(model)

    def loss(self, x, y, divide=1):
        autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if self.kind == "torch.amp"
                    else contextlib.nullcontext())
        with autocast:
            out = self.ddp(x)
        return torch.nn.functional.mse_loss(out.float(), y) / divide

    def backward(self, loss, delay_unscale=False):
        if self.kind in AMP_LEVELS:
            with amp.scale_loss(loss, self.optimizer, delay_unscale=delay_unscale) as scaled:
                scaled.backward()
        elif self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def step(self):
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()

    def weights(self):
        masters = (amp.master_params(self.optimizer) if self.kind in AMP_LEVELS
                   else self.model.parameters())
        return {"masters": [m.detach().clone() for m in masters],
                "half": [p.detach().clone() for p in self.model.parameters()]}


def _batch(rank, i, n=8):
    g = torch.Generator().manual_seed(1000 * rank + i)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


# ---- gradient accumulation: torch DDP's no_sync, apex DDP's disable_allreduce -------------------

def accumulate(rank, kind, path=None, wrapper="torch", micro=2, delay_unscale=False, steps=3):
    """``micro`` micro-batches a step, each in its own backward (under amp its own scale_loss),
    all but the last without the all-reduce; with ``delay_unscale``, apex's flag on all but the
    last."""
    run = Run(rank, kind, path, wrapper)
    for step in range(steps):
        run.optimizer.zero_grad()
        for k in range(micro):
            last = k == micro - 1
            if wrapper == "torch":
                context = contextlib.nullcontext() if last else run.ddp.no_sync()
            else:
                (run.ddp.enable_allreduce if last else run.ddp.disable_allreduce)()
                context = contextlib.nullcontext()
            with context:
                loss = run.loss(*_batch(rank, step * micro + k), divide=micro)
                run.backward(loss, delay_unscale=delay_unscale and not last)
        run.step()
    return run.weights()


# ---- Join with uneven inputs ---------------------------------------------------------------------

def join(rank, kind, path=None):
    """Rank 0 has 3 batches, rank 1 has 2: the Join context shadows the collectives of the rank
    that ran out (torch's Join tutorial); DDP then gives every rank the last joiner's model."""
    run = Run(rank, kind, path)
    with Join([run.ddp]):
        for i in range(3 if rank == 0 else 2):
            run.optimizer.zero_grad()
            run.backward(run.loss(*_batch(rank, i)))
            run.step()
    return run.weights()


# ---- a forward on rank 0 alone before training ---------------------------------------------------

def rank0_forward(rank, kind, path=None, steps=2):
    """"Validate on rank 0 before training": a no_grad forward through the DDP model on rank 0
    only, a barrier, then training."""
    run = Run(rank, kind, path)
    if rank == 0:
        with torch.no_grad():
            run.ddp(_batch(rank, 99)[0])
    dist.barrier()
    for i in range(steps):
        run.optimizer.zero_grad()
        run.backward(run.loss(*_batch(rank, i)))
        run.step()
    return run.weights()


# ---- one rank's overflow -------------------------------------------------------------------------

def overflow(rank, kind, path=None, steps=3, inject_step=1):
    """Rank 1 alone overflows in its backward (an inf in one gradient, before DDP's all-reduce
    spreads it), at step ``inject_step``: every rank skips that step (O5's static scale too)."""
    run = Run(rank, kind, path)
    skipped = []
    for i in range(steps):
        run.optimizer.zero_grad()
        before = [m.detach().clone() for m in amp.master_params(run.optimizer)]
        hook = None
        if i == inject_step and rank == 1:
            hook = run.model[0].weight.register_hook(
                lambda g: g.flatten().index_fill(0, torch.tensor([3]), float("inf")).view_as(g))
        with amp.scale_loss(run.loss(*_batch(rank, i)), run.optimizer) as scaled:
            scaled.backward()
        if hook is not None:
            hook.remove()
        run.step()
        skipped.append(all(torch.equal(b, m) for b, m in
                           zip(before, amp.master_params(run.optimizer))))
    return dict(run.weights(), skipped=skipped)


# ---- a checkpoint taken on rank 0 and resumed by every rank --------------------------------------

def resume(rank, kind, path=None, before=2, after=2):
    """Train ``before`` steps, save the model's, the optimizer's and amp's state on rank 0, then
    build everything again (rank 1 from its own seed), load rank 0's checkpoint on every rank,
    wrap in DDP, and train ``after`` steps; beside it, ``before + after`` uninterrupted steps."""
    def train(run, steps):
        for i in steps:
            run.optimizer.zero_grad()
            run.backward(run.loss(*_batch(rank, i)))
            run.step()

    whole = Run(rank, kind, path)
    train(whole, range(before + after))
    uninterrupted = whole.weights()
    first = Run(rank, kind, path)
    train(first, range(before))
    buffer = io.BytesIO()
    if rank == 0:
        torch.save({"model": first.model.state_dict(), "optimizer": first.optimizer.state_dict(),
                    "amp": amp.state_dict()}, buffer)
    saved = [buffer.getvalue()]
    dist.broadcast_object_list(saved, 0)
    checkpoint = torch.load(io.BytesIO(saved[0]), weights_only=False)
    del first
    resumed = Run(rank, kind, path, seed=500 + rank, checkpoint=checkpoint)
    train(resumed, range(before, before + after))
    return {"uninterrupted": uninterrupted, "resumed": resumed.weights()}


def _cases():
    runs = [("O1", None), ("O2", "fused"), ("O2", "unfused"), ("O5", "fused"), ("O5", "unfused")]
    cases = {}

    def add(name, fn, kind, path=None, **kwargs):
        cases[f"{name}-{kind}" + (f"-{path}" if path else "")] = functools.partial(
            fn, kind=kind, path=path, **kwargs)
    # The cases that hang today first: they wait out their deadline together.
    for kind, path in [("O0", None)] + runs:
        add("join", join, kind, path)
    for kind, path in runs:
        add("rank0_forward", rank0_forward, kind, path)
    for kind in ("fp32", "torch.amp"):
        add("join", join, kind)
        add("rank0_forward", rank0_forward, kind)
        add("no_sync", accumulate, kind)
        add("plain", accumulate, kind, micro=1)
    for kind, path in runs:
        for delay in (False, True):
            flag = "-delay_unscale" if delay else ""
            add("no_sync" + flag, accumulate, kind, path, delay_unscale=delay)
            add("disable_allreduce" + flag, accumulate, kind, path, wrapper="apex",
                delay_unscale=delay)
    for kind, path in runs[3:]:
        add("plain", accumulate, kind, path, micro=1)
        add("overflow", overflow, kind, path)
    for kind, path in runs[1:4]:
        add("resume", resume, kind, path)
    return cases


CASES = _cases()
