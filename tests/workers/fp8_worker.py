"""Fresh processes for the fp8 tests (tests/test_amp_fp8_runs.py); not a test itself.

    python fp8_worker.py train  OUT     # per recipe: 2N steps (the reference), N steps + save
    python fp8_worker.py resume OUT     # per recipe: a fresh model, the checkpoint loaded with
                                        # weights_only=True, N more steps
    python fp8_worker.py dist   OUT     # one rank of 2 (gloo): DDP (and a resume of rank 0's
                                        # checkpoint on both ranks), then FSDP2, fp8 at O2

Each writes what it saw to OUT/<job>[_rank<r>].pt. The training has an overflow (inf in a
gradient of an fp8 layer) before and after the checkpoint, and an input far above the amax
history once, so the skip rule, the history and the counts all cross the boundary.
"""
from __future__ import annotations

import gc
import importlib
import importlib.util
import os
import sys

import torch
import torch.nn.functional as F

N = 5
OVERFLOW_STEPS = (2, 7)
BIG_INPUT_STEP = 3
RECIPES = ("current", "delayed")


class Mlp(torch.nn.Module):
    """Two fp8 layers (fc1, fc2; min_features=16) and one left in half (head: 10 outputs)."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 64)
        self.fc2 = torch.nn.Linear(64, 32)
        self.head = torch.nn.Linear(32, 10)

    def forward(self, x):
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def batch(step, rank=0, n=24, big=True):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(n, 32, generator=g)
    if big and step == BIG_INPUT_STEP:
        x = x * 1000.0
    return x, torch.randint(0, 10, (n,), generator=g)


def config(amp, recipe):
    return amp.FP8(recipe=recipe, min_features=16, amax_history=4)


def build(amp, handle, recipe, seed):
    torch.manual_seed(seed)
    model = Mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = handle.initialize(model, opt, opt_level="O2", verbosity=0, scale_window=3,
                                   fp8=config(amp, recipe))
    return model, opt


def step(handle, model, opt, inner, step_index, rank=0):
    x, y = batch(step_index, rank)
    opt.zero_grad()
    # An overflow inside the backward of an fp8 layer: inf in the gradient fc2's output gets.
    hook = inner.fc2.register_forward_hook(overflow) if step_index in OVERFLOW_STEPS else None
    loss = F.cross_entropy(model(x).float(), y)
    if hook is not None:
        hook.remove()
    with handle.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    return loss.detach()


def overflow(module, args, output):
    output.register_hook(lambda g: torch.full_like(g, float("inf")))


def result(handle, model):
    state = handle.state_dict()
    return {"params": [p.detach().clone() for p in model.parameters()],
            "model_state": model.state_dict(),
            "loss_scaler0": state["loss_scaler0"],
            "fp8": state["apex_lite"]["fp8"],
            "report": handle.report().fp8}


def job_train(amp, out):
    results = {}
    for recipe in RECIPES:
        handle = amp.AmpHandle()
        model, opt = build(amp, handle, recipe, seed=0)
        for i in range(2 * N):
            step(handle, model, opt, model, i)
        results[recipe] = result(handle, model)
        handle = amp.AmpHandle()
        model, opt = build(amp, handle, recipe, seed=0)
        for i in range(N):
            step(handle, model, opt, model, i)
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "amp": handle.state_dict()}, os.path.join(out, f"checkpoint_{recipe}.pt"))
    torch.save(results, os.path.join(out, "train.pt"))


def job_resume(amp, out):
    results = {}
    for recipe in RECIPES:
        handle = amp.AmpHandle()
        model, opt = build(amp, handle, recipe, seed=99)   # everything must come from the file
        checkpoint = torch.load(os.path.join(out, f"checkpoint_{recipe}.pt"), weights_only=True)
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
        handle.load_state_dict(checkpoint["amp"])
        for i in range(N, 2 * N):
            step(handle, model, opt, model, i)
        results[recipe] = result(handle, model)
    torch.save(results, os.path.join(out, "resume.pt"))


def count_scaled_mm():
    """Wrap torch._scaled_mm with a counter (amp calls it through the attribute)."""
    calls = [0]
    original = torch._scaled_mm

    def counting(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)
    torch._scaled_mm = counting
    return calls


def train_distributed(amp, handle, model, opt, inner, rank, steps=range(6)):
    losses = []
    for i in steps:
        x, y = batch(i, rank, big=False)
        opt.zero_grad()
        loss = F.cross_entropy(model(x).float(), y)
        with handle.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
    state = handle.state_dict()["apex_lite"]["fp8"]
    return {"losses": losses, "fp8": state,
            "params": [p.detach().clone() for p in inner.parameters()]}


def job_dist(amp, out, rank):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    calls = count_scaled_mm()
    results = {}
    for recipe in RECIPES:
        handle = amp.AmpHandle()
        model, opt = build(amp, handle, recipe, seed=0)
        ddp = DDP(model)
        calls[0] = 0
        results[f"ddp_{recipe}"] = train_distributed(amp, handle, ddp, opt, model, rank)
        results[f"ddp_{recipe}"]["calls"] = calls[0]
        del ddp, model, opt, handle
    # Rank 0's checkpoint after 3 steps, loaded by both ranks into fresh models: the 6 steps.
    handle = amp.AmpHandle()
    model, opt = build(amp, handle, "delayed", seed=0)
    train_distributed(amp, handle, DDP(model), opt, model, rank, steps=range(3))
    path = os.path.join(out, "ddp_checkpoint.pt")
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "amp": handle.state_dict()}, path)
    dist.barrier()
    handle = amp.AmpHandle()
    model, opt = build(amp, handle, "delayed", seed=99)
    checkpoint = torch.load(path, weights_only=True)
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])
    handle.load_state_dict(checkpoint["amp"])
    results["ddp_delayed_resumed"] = train_distributed(amp, handle, DDP(model), opt, model,
                                                       rank, steps=range(3, 6))
    del model, opt, handle
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch.manual_seed(0)
    model = Mlp()
    for layer in (model.fc1, model.fc2):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    handle = amp.AmpHandle()
    model, opt = handle.initialize(model, opt, opt_level="O2", verbosity=0,
                                   fp8=config(amp, "delayed"))
    calls[0] = 0
    results["fsdp_delayed"] = train_distributed(amp, handle, model, opt, model, rank)
    results["fsdp_delayed"]["calls"] = calls[0]
    results["fsdp_delayed"]["params"] = [p.full_tensor().detach().clone()
                                         for p in model.parameters()]
    results["fsdp_delayed"]["report"] = str(handle.report())
    torch.save(results, os.path.join(out, f"dist_rank{rank}.pt"))
    dist.barrier()   # no rank tears the gloo group down while a peer still uses it
    del model, opt, handle
    gc.collect()
    # examples/fsdp.py lets go of torch's cached device meshes (see fsdp_worker.py).
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir,
                        "examples", "fsdp.py")
    spec = importlib.util.spec_from_file_location("fsdp_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.release_device_meshes()
    dist.destroy_process_group()


def main():
    job, out = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    if job == "dist":
        # Before init_process_group: it binds the default group at import (fsdp_worker.py).
        importlib.import_module("torch.distributed.nn")
        torch.distributed.init_process_group("gloo")
    from apex_lite import amp
    if job == "train":
        job_train(amp, out)
    elif job == "resume":
        job_resume(amp, out)
    else:
        rank = torch.distributed.get_rank()
        try:
            job_dist(amp, out, rank)
        except Exception:
            import traceback
            traceback.print_exc()
            sys.stdout.flush()
            os._exit(1)   # a rank that failed must not wait in a collective for its peer


if __name__ == "__main__":
    main()
