"""Two-rank cases of O2's two copies (tests/test_parallel_two_copies.py, issue 49 item 6); not
tests themselves: tests/workers/case_worker.py runs each in a gloo group of its own.

Every rank builds its model from its own seed (``100 + rank``: ranks start apart, as most
scripts leave them) and reads its own data. A case returns what the test compares across the
ranks: masters and half parameters as tensors.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.optim import PostLocalSGDOptimizer
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from amp_habits import PATHS, warm_up  # noqa: F401 (case_worker runs warm_up)
from apex_lite import amp
from apex_lite.parallel import DistributedDataParallel as ApexDDP
from apex_lite.parallel import Reducer

RUNS = [("O2", "fused"), ("O2", "unfused"), ("O5", "fused"), ("O5", "unfused")]
WRITTEN = 0.3      # what a write before DDP's broadcast puts in the first layer's weight


def _setup(rank, level, path, lr=0.1, seed=None):
    torch.manual_seed(100 + rank if seed is None else seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    amp.default_handle().__init__()
    return amp.initialize(model, optimizer, opt_level=level, verbosity=0,
                          fused_step=PATHS[path])


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def _step(model, optimizer, seed, stepper=None):
    x, y = _batch(seed)
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x).float(), y)
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    (stepper or optimizer).step()


def _copies(model, optimizer):
    return {"masters": [m.detach().clone() for m in amp.master_params(optimizer)],
            "half": [p.detach().clone() for p in model.parameters()]}


# ---- model averaging of the masters (torch's PostLocalSGDOptimizer) -----------------------------

def local_sgd(rank, level, path, checkpoint_on_rank_0=False, steps=3):
    """Each rank trains on its own data; PostLocalSGDOptimizer averages the optimizer's
    parameters (the masters) at steps 0 and 2. With ``checkpoint_on_rank_0``, rank 0 alone
    takes ``model.state_dict()`` after every step, as a script that saves on rank 0 does."""
    model, optimizer = _setup(rank, level, path)
    averaged = PostLocalSGDOptimizer(optimizer, PeriodicModelAverager(period=2, warmup_steps=0))
    for i in range(steps):
        _step(model, optimizer, 10 * rank + i, stepper=averaged)
        if checkpoint_on_rank_0 and rank == 0:
            model.state_dict()
    return _copies(model, optimizer)


# ---- a write to the half model before amp's master broadcast ------------------------------------

def write_then_ddp(rank, level, path, when):
    """lr 0: the weight written (the same on every rank, as a pretrained load is) must be what
    training ends with, rounded to the half dtype. ``when``: between amp.initialize and
    DDP(model), after DDP(model) before its first forward, or before apex_lite's DDP."""
    model, optimizer = _setup(rank, level, path, lr=0.0)

    def write():
        with torch.no_grad():
            model[0].weight.fill_(WRITTEN)
    if when != "after DDP":
        write()
    wrapped = ApexDDP(model) if when == "before apex DDP" else TorchDDP(model)
    if when == "after DDP":
        write()
    for i in range(2):
        _step(wrapped, optimizer, 10 * rank + i)
    return dict(_copies(model, optimizer), saved=model.state_dict()["0.weight"].clone())


# ---- sync-init by hand, then training on the same data on every rank ----------------------------

def _broadcast(model):
    for p in model.parameters():
        dist.broadcast(p, 0)                      # no version bump: C++ writes in place


def _copy(model):
    with torch.no_grad():
        for p in model.parameters():
            rank0 = p.detach().clone()
            dist.broadcast(rank0, 0)
            p.copy_(rank0)


def _reducer(model):
    Reducer(model)                                # apex's Reducer broadcasts rank 0's weights


def _average(model):
    with torch.no_grad():                         # local SGD's averaging, by hand
        for p in model.parameters():
            dist.all_reduce(p)
            p.div_(dist.get_world_size())


SYNCS = {"dist.broadcast": _broadcast, "p.copy_": _copy, "Reducer": _reducer,
         "average": _average}


def sync_init(rank, level, path, how):
    """Ranks whose half models differ make them equal with ``how``; one step at lr 0 (what the
    masters became), then two steps at lr 0.1 on the same batch on every rank. The ranks start
    from their own seeds, except for "average": local SGD starts from one model (one seed),
    trains two steps on each rank's own data, then averages (the half models then differ in
    some elements, and the masters in the low bits of all)."""
    if how == "average":
        model, optimizer = _setup(rank, level, path, seed=100)
        for i in range(2):
            _step(model, optimizer, 10 * rank + i)
        for group in optimizer.param_groups:
            group["lr"] = 0.0
    else:
        model, optimizer = _setup(rank, level, path, lr=0.0)
    rank0_half = [p.detach().clone() for p in model.parameters()]
    for tensor in rank0_half:
        dist.broadcast(tensor, 0)
    SYNCS[how](model)
    _step(model, optimizer, 1000)
    synced = _copies(model, optimizer)
    for group in optimizer.param_groups:
        group["lr"] = 0.1
    for i in range(2):
        _step(model, optimizer, 1001 + i)
    return {"rank0_half": rank0_half, "synced": synced, "trained": _copies(model, optimizer)}


CASES = {}
for _level, _path in RUNS:
    _run = f"{_level}-{_path}"
    CASES[f"local_sgd-{_run}"] = functools.partial(local_sgd, level=_level, path=_path)
    CASES[f"local_sgd_checkpoint_on_rank_0-{_run}"] = functools.partial(
        local_sgd, level=_level, path=_path, checkpoint_on_rank_0=True)
    for _when in ("before DDP", "after DDP", "before apex DDP"):
        CASES[f"write_{_when.replace(' ', '_')}-{_run}"] = functools.partial(
            write_then_ddp, level=_level, path=_path, when=_when)
    for _how in SYNCS:
        CASES[f"sync_by_{_how}-{_run}"] = functools.partial(sync_init, level=_level,
                                                           path=_path, how=_how)
