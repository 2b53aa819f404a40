"""One rank of the FSDP2 tests (tests/test_fsdp.py), and the model, data and training loop that
the test's single-process references share with it; not a test itself.

    python fsdp_worker.py --job main --out DIR      # 2 ranks: every training case, the refusals,
                                                    # report, clipping, a DCP checkpoint at step
                                                    # 3 on each O2 step path
    python fsdp_worker.py --job resume --out DIR    # 2 new ranks: load them, train on
    python fsdp_worker.py --job reshard --out DIR   # 1 rank: load them (DCP reshards 2 -> 1)

Each rank writes what it saw to DIR/<job>_rank<r>.pt, then tears down as examples/fsdp.py does
and exits with an error when a gloo thread outlives destroy_process_group. Ranks are started by
the test with MASTER_ADDR/PORT, RANK and WORLD_SIZE (gloo on CPU).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import traceback
from typing import Dict, List, NamedTuple, Optional

import torch
import torch.nn.functional as F

D_IN, WIDTH, HIDDEN, D_OUT = 16, 32, 64, 4
GLOBAL_BATCH = 16
STEPS = 20
INJECT_STEP = 5          # rank 1 (or the reference) writes inf into a gradient at this step
CHECKPOINT_STEPS, CHECKPOINT_AT = 6, 3


class Block(torch.nn.Module):
    def __init__(self, norm: Optional[str] = None):
        super().__init__()
        self.fc1 = torch.nn.Linear(WIDTH, HIDDEN)
        self.norm = torch.nn.BatchNorm1d(HIDDEN) if norm == "batchnorm" else None
        self.fc2 = torch.nn.Linear(HIDDEN, WIDTH)

    def forward(self, x):
        h = self.fc1(x)
        if self.norm is not None:
            h = self.norm(h)
        return x + self.fc2(torch.relu(h))


class Net(torch.nn.Module):
    def __init__(self, norm: Optional[str] = None):
        super().__init__()
        self.stem = torch.nn.Linear(D_IN, WIDTH)
        self.blocks = torch.nn.ModuleList([Block(norm), Block(norm)])
        self.head = torch.nn.Linear(WIDTH, D_OUT)

    def forward(self, x):
        h = torch.relu(self.stem(x))
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class Case(NamedTuple):
    """One training run: the opt level, how the model is sharded, amp's extra arguments, the
    optimizer, clipping (None, or (how, max_norm, norm_type)), and gradient accumulation
    (``micro`` backwards per step, all but the last with ``delay_unscale`` when asked, and with
    FSDP2's gradient reduction off (``set_requires_gradient_sync(False)``) when ``no_sync``)."""
    name: str
    level: str
    layout: str
    kwargs: dict = {}
    optimizer: str = "sgd"
    clip: Optional[tuple] = None
    steps: int = STEPS
    inject: bool = True
    micro: int = 1
    delay_unscale: bool = False
    no_sync: bool = False


# O2 has two step paths, and amp's default (fused_step=None) takes the fused one only where the
# native kernels serve the device: every O2 case runs on both, named explicitly, so that both
# backends test both paths.
STEP_PATHS = {"fused": True, "unfused": False}


def on_both_paths(*cases: Case) -> List[Case]:
    """Each O2 case once per step path, named ``<name>_fused`` and ``<name>_unfused``."""
    return [case._replace(name=f"{case.name}_{path}",
                          kwargs={**case.kwargs, "fused_step": fused_step})
            for case in cases for path, fused_step in STEP_PATHS.items()]


CASES = [
    Case("O0", "O0", "nested"),
    Case("O1", "O1", "unsharded_after_forward"),
    Case("O3", "O3", "nested"),
    Case("O1_clip_inf", "O1", "nested", clip=("amp", 0.05, math.inf)),
    Case("O1_accumulate_delay_unscale", "O1", "unsharded_after_forward", micro=2,
         delay_unscale=True),
    # ROCm apex's levels: O1 and O2 in bf16 with a static loss scale of 1.0 (issue 43).
    Case("O4", "O4", "nested"),
    *on_both_paths(Case("O5", "O5", "nested"),
                   Case("O5_adamw_clip", "O5", "nested", optimizer="adamw",
                        clip=("amp", 0.5, 2.0))),
    *on_both_paths(
        Case("O2", "O2", "nested"),
        Case("O2_partial", "O2", "partial"),
        Case("O2_no_root", "O2", "no_root"),
        Case("O2_adamw_clip", "O2", "nested", optimizer="adamw", clip=("amp", 0.5, 2.0)),
        Case("O2_master_params_clip", "O2", "unsharded_after_forward",
             clip=("master_params", 0.5, 2.0)),
        # mmengine's clip: the param groups' parameters that have a gradient (issue 32).
        Case("O2_param_groups_clip", "O2", "nested", clip=("param_groups", 0.5, 2.0)),
        # torch.amp's: the model's parameters, here the sharded masters themselves (issue 30).
        Case("O2_model_clip", "O2", "nested", clip=("model", 0.5, 2.0)),
        Case("O2_accumulate", "O2", "nested", micro=2),
        Case("O2_accumulate_no_sync", "O2", "nested", micro=2, delay_unscale=True,
             no_sync=True)),
]
CASE = {case.name: case for case in CASES}
# The cases whose amp.report() the ranks record: O2 with SGD, on each step path.
REPORTED = ("O2_fused", "O2_unfused")
CHECKPOINT_CASES = on_both_paths(Case("checkpoint", "O2", "nested", optimizer="adamw",
                                      steps=CHECKPOINT_STEPS, inject=False))


def build(case: Case, norm: Optional[str] = None) -> torch.nn.Module:
    """The fp32 model of a case, the same on every rank and in the reference."""
    torch.manual_seed(0)
    model = Net(norm)
    if case.layout == "no_root":
        model.stem.requires_grad_(False)   # left outside every unit, so not trained
    return model


def make_optimizer(case: Case, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if case.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def policy_for(level: str, half=torch.bfloat16):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    if level in ("O2", "O5"):   # the levels with fp32 master weights compute in half on FSDP2
        return MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard(model: Net, layout: str, policy=None) -> None:
    """fully_shard as the layout says: "nested" (a unit inside each block's unit, then the
    root), "unsharded_after_forward" (blocks keep their parameters between forward and
    backward), "partial" (one block a unit, the rest in the root's), "no_root" (blocks and head
    are units; the frozen stem stays a plain module, and there is no root unit)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = policy or MixedPrecisionPolicy()
    if layout == "nested":
        for block in model.blocks:
            fully_shard(block.fc1, mp_policy=policy)
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    elif layout == "unsharded_after_forward":
        for block in model.blocks:
            fully_shard(block, mp_policy=policy, reshard_after_forward=False)
        fully_shard(model, mp_policy=policy)
    elif layout == "partial":
        fully_shard(model.blocks[1], mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    elif layout == "no_root":
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model.head, mp_policy=policy)
    else:
        raise ValueError(layout)


def batch(step: int, rank: int = 0, world: int = 1, micro: int = 0, micros: int = 1):
    """This rank's share (all of it for world 1) of micro-batch ``micro`` of ``micros`` of the
    global batch of ``step``."""
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, D_IN, generator=generator)
    teacher = torch.randn(D_IN, D_OUT, generator=torch.Generator().manual_seed(7))
    y = torch.tanh(x @ teacher)
    rows = GLOBAL_BATCH // micros
    x, y = x[micro * rows:(micro + 1) * rows], y[micro * rows:(micro + 1) * rows]
    rows //= world
    return x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (an all-gather for a DTensor: every rank calls it in the same order)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def inject_inf(model: torch.nn.Module) -> None:
    """inf into the first element of the first gradient (shard) that has one."""
    for p in model.parameters():
        if p.grad is not None and local(p.grad).numel():
            local(p.grad).view(-1)[0] = float("inf")
            return


def train(case: Case, model, optimizer, handle, *, rank: int = 0, world: int = 1,
          first_step: int = 0, last_step: Optional[int] = None, inject_rank: int = 1,
          on_step=None) -> Dict[str, list]:
    """Steps ``first_step`` .. ``last_step - 1`` of ``case``; returns per step the local loss,
    the loss scaler's decision (``skipped``: its last backward overflowed), whether the
    optimizer changed the weights (``applied``), the loss scale, and the clip norm."""
    record = {"loss": [], "skipped": [], "applied": [], "scale": [], "norm": [],
              "master_grads": None}
    last_step = case.steps if last_step is None else last_step
    for step in range(first_step, last_step):
        optimizer.zero_grad()
        for micro in range(case.micro):
            x, y = batch(step, rank, world, micro, case.micro)
            loss = F.mse_loss(model(x).float(), y) / case.micro
            delay = case.delay_unscale and micro < case.micro - 1
            if case.no_sync and world > 1:   # FSDP2 reduces the gradients at the last one
                model.set_requires_gradient_sync(micro == case.micro - 1)
            with handle.scale_loss(loss, optimizer, delay_unscale=delay) as scaled_loss:
                scaled_loss.backward()
                # Without gradient sync FSDP2 writes the gradient shards at the last backward.
                inject_micro = case.micro - 1 if case.no_sync else 0
                if case.inject and step == INJECT_STEP and micro == inject_micro \
                        and rank == (inject_rank if world > 1 else 0):
                    inject_inf(model)
        if case.clip is not None:
            how, max_norm, norm_type = case.clip
            if how == "amp":
                norm = handle.clip_grad_norm_(optimizer, max_norm, norm_type)
            else:
                if how == "master_params":   # apex's way: torch's clip over amp.master_params
                    params = list(handle.master_params(optimizer))
                elif how == "param_groups":   # mmengine's: the groups' params with a gradient
                    params = [p for group in optimizer.param_groups for p in group["params"]
                              if p.requires_grad and p.grad is not None]
                else:   # "model": FSDP2's shards are the masters; one process clips its masters
                    params = [p for p in model.parameters() if p.requires_grad]
                    if not all(hasattr(p, "full_tensor") for p in params):
                        params = list(handle.master_params(optimizer))
                if step == 1:
                    record["master_grads"] = [full(p.grad) for p in params]
                norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
            record["norm"].append(float(full(norm)))
        before = [local(p).clone() for group in optimizer.param_groups for p in group["params"]]
        optimizer.step()
        after = [local(p) for group in optimizer.param_groups for p in group["params"]]
        record["applied"].append(any(not torch.equal(a, b) for a, b in zip(before, after)))
        scaler = handle.loss_scalers()[0]
        record["loss"].append(loss.item() * case.micro)
        record["skipped"].append(scaler.last_step_skipped)
        record["scale"].append(scaler.loss_scale)
        if on_step is not None:
            on_step(step)
    return record


def masters_of(handle, optimizer) -> List[torch.Tensor]:
    return [full(p) for p in handle.master_params(optimizer)]


def initialize(case: Case, handle, model, optimizer, **extra):
    return handle.initialize(model, optimizer, opt_level=case.level, verbosity=0,
                             **{**case.kwargs, **extra})


# ---- the ranks' jobs --------------------------------------------------------------------------

def sharded_run(case: Case, handle, *, norm=None, **extra):
    model = build(case, norm)
    shard(model, case.layout, policy_for(case.level))
    optimizer = make_optimizer(case, model)
    model, optimizer = initialize(case, handle, model, optimizer, **extra)
    return model, optimizer


def error_of(fn) -> str:
    try:
        fn()
    except (ValueError, RuntimeError) as exc:
        return str(exc)
    return "no error"


def refusals(amp) -> Dict[str, str]:
    """The messages of what amp refuses on FSDP2 (each on fresh models)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from apex_lite.optimizers import FusedLAMB, FusedNovoGrad
    out = {}

    def initialize_then_shard(level):
        def run():
            handle = amp.AmpHandle()
            case = Case("order", level, "nested")
            model = build(case)
            optimizer = make_optimizer(case, model)
            model, optimizer = initialize(case, handle, model, optimizer)
            shard(model, "nested", policy_for(level))
            x, y = batch(0, dist_rank(), dist_world())
            loss = F.mse_loss(model(x).float(), y)
            with handle.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
        return run
    out["order_O1"] = error_of(initialize_then_shard("O1"))
    out["order_O2"] = error_of(initialize_then_shard("O2"))

    def optimizer_before_shard():
        case = Case("stale", "O2", "nested")
        model = build(case)
        optimizer = make_optimizer(case, model)
        shard(model, "nested", policy_for("O2"))
        initialize(case, amp.AmpHandle(), model, optimizer)
    out["optimizer_before_shard"] = error_of(optimizer_before_shard)

    def with_policy(level, policy, layout="nested", **kwargs):
        def run():
            case = Case("policy", level, layout, kwargs)
            model = build(case)
            shard(model, layout, policy)
            initialize(case, amp.AmpHandle(), model, make_optimizer(case, model))
        return run
    out["O2_no_policy"] = error_of(with_policy("O2", MixedPrecisionPolicy()))
    out["O1_half_policy"] = error_of(with_policy("O1", policy_for("O2")))
    out["O4_half_policy"] = error_of(with_policy("O4", policy_for("O2")))
    out["O5_no_policy"] = error_of(with_policy("O5", MixedPrecisionPolicy()))
    out["O5_fp16_policy"] = error_of(with_policy("O5", policy_for("O2", torch.float16)))
    out["O0_half_reduce"] = error_of(with_policy(
        "O0", MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)))
    out["O2_fp16_policy"] = error_of(with_policy("O2", policy_for("O2", torch.float16)))
    out["O3_fp32_policy"] = error_of(with_policy(
        "O3", MixedPrecisionPolicy(param_dtype=torch.float32)))

    def batchnorm_inside_half_unit():
        case = Case("bn", "O2", "nested")
        model = build(case, "batchnorm")
        shard(model, "nested", policy_for("O2"))
        initialize(case, amp.AmpHandle(), model, make_optimizer(case, model))
    out["batchnorm_in_half_unit"] = error_of(batchnorm_inside_half_unit)

    def lamb():
        case = Case("lamb", "O2", "nested")
        model = build(case)
        shard(model, "nested", policy_for("O2"))
        optimizer = FusedLAMB(model.parameters(), lr=1e-3)
        initialize(case, amp.AmpHandle(), model, optimizer)
    out["lamb"] = error_of(lamb)

    def lamb_without_amp():
        model = build(Case("lamb", "O0", "nested"))
        fully_shard(model)
        optimizer = FusedLAMB(model.parameters(), lr=1e-3)
        x, y = batch(0, dist_rank(), dist_world())
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    out["lamb_without_amp"] = error_of(lamb_without_amp)

    def novograd():
        case = Case("novograd", "O2", "nested")
        model = build(case)
        shard(model, "nested", policy_for("O2"))
        optimizer = FusedNovoGrad(model.parameters(), lr=1e-3)
        initialize(case, amp.AmpHandle(), model, optimizer)
    out["novograd"] = error_of(novograd)

    def novograd_without_amp():
        model = build(Case("novograd", "O0", "nested"))
        fully_shard(model)
        optimizer = FusedNovoGrad(model.parameters(), lr=1e-3)
        x, y = batch(0, dist_rank(), dist_world())
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    out["novograd_without_amp"] = error_of(novograd_without_amp)
    return out


def kept_batchnorm(amp, fused_step: bool) -> dict:
    """O2 with keep_batchnorm_fp32 (BatchNorm units of their own, no param_dtype) and a head
    kept by keep_fp32_modules: the dtypes each module computes in, and a few steps."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    handle = amp.AmpHandle()
    case = Case("bn", "O2", "nested", {"keep_fp32_modules": ["head"], "fused_step": fused_step},
                steps=3, inject=False)
    model = build(case, "batchnorm")
    policy = policy_for("O2")
    for block in model.blocks:
        fully_shard(block.norm, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
        fully_shard(block, mp_policy=policy)
    fully_shard(model.head)
    fully_shard(model, mp_policy=policy)
    optimizer = make_optimizer(case, model)
    model, optimizer = initialize(case, handle, model, optimizer)
    seen = {}

    def watch(name):
        def hook(module, args, output):
            seen[name] = {"output": output.dtype, "param": next(module.parameters()).dtype}
        return hook
    for name in ("blocks.0.norm", "blocks.0.fc1", "head"):
        model.get_submodule(name).register_forward_hook(watch(name))
    # What BatchNorm computes in: the dtypes F.batch_norm is called with, inside the forward.
    batch_norm = F.batch_norm

    def recording_batch_norm(x, *args, **kwargs):
        seen["batch_norm_input"] = x.dtype
        seen["batch_norm_running_mean"] = args[0].dtype
        return batch_norm(x, *args, **kwargs)
    F.batch_norm = recording_batch_norm
    try:
        record = train(case, model, optimizer, handle, rank=dist_rank(), world=dist_world())
    finally:
        F.batch_norm = batch_norm
    report = str(handle.report())
    return {"dtypes": seen, "record": record, "report": report}


def fused_adam_without_amp() -> float:
    """apex_lite's FusedAdam stepping FSDP2 shards on its own (no amp), against torch's AdamW on
    the same sharded model: the largest difference of the weights after 3 steps."""
    from apex_lite.optimizers import FusedAdam
    finals = []
    for make in (lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01),
                 lambda params: FusedAdam(params, lr=1e-2, weight_decay=0.01)):
        model = build(Case("fused_adam", "O0", "nested"))
        shard(model, "nested", None)
        optimizer = make(model.parameters())
        for step in range(3):
            x, y = batch(step, dist_rank(), dist_world())
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()
        finals.append([full(p) for p in model.parameters()])
    return max(float((a - b).abs().max()) for a, b in zip(*finals))


def dist_rank() -> int:
    import torch.distributed as dist
    return dist.get_rank()


def dist_world() -> int:
    import torch.distributed as dist
    return dist.get_world_size()


def checkpoint_state(model, optimizer, handle):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state, "amp": handle.state_dict()}


def full_state(state) -> dict:
    """Every tensor of a checkpoint state made whole (for comparison across world sizes)."""
    if isinstance(state, dict):
        return {k: full_state(v) for k, v in sorted(state.items(), key=lambda kv: str(kv[0]))}
    if isinstance(state, (list, tuple)):
        return [full_state(v) for v in state]
    if isinstance(state, torch.Tensor):
        return full(state)
    return state


def default_step_path(amp) -> str:
    """amp.report()'s line for the step path amp chooses by default (fused_step=None) at O2 on
    a sharded model: the fused step where the native kernels serve the CPU."""
    handle = amp.AmpHandle()
    sharded_run(Case("default", "O2", "nested"), handle)
    return next(line.strip() for line in str(handle.report()).splitlines()
                if "optimizer 0" in line)


def job_main(amp, out: str, rank: int) -> dict:
    results = {"cases": {}, "kept_batchnorm": {}, "checkpoint": {}}
    for case in CASES:
        handle = amp.AmpHandle()
        model, optimizer = sharded_run(case, handle)
        record = train(case, model, optimizer, handle, rank=rank, world=dist_world())
        record["masters"] = masters_of(handle, optimizer)
        record["fused"] = optimizer._apex_lite_amp.path.fused
        record["report"] = str(handle.report()) if case.name in REPORTED else ""
        results["cases"][case.name] = record
    results["refusals"] = refusals(amp)
    results["default_step_path"] = default_step_path(amp)
    for path, fused_step in STEP_PATHS.items():
        results["kept_batchnorm"][path] = kept_batchnorm(amp, fused_step)
    results["fused_adam_without_amp"] = fused_adam_without_amp()
    for case in CHECKPOINT_CASES:
        results["checkpoint"][case.name] = checkpoint_run(amp, case, out, rank)
    return results


def checkpoint_run(amp, case: Case, out: str, rank: int) -> dict:
    """A DCP checkpoint at step CHECKPOINT_AT, then on to the end without stopping."""
    import torch.distributed.checkpoint as dcp
    handle = amp.AmpHandle()
    model, optimizer = sharded_run(case, handle)
    results = {}

    def save(step):
        if step + 1 == CHECKPOINT_AT:
            state = checkpoint_state(model, optimizer, handle)
            dcp.save(state, checkpoint_id=os.path.join(out, case.name))
            results["saved"] = full_state(state)
    results["record"] = train(case, model, optimizer, handle, rank=rank, world=dist_world(),
                              on_step=save)
    results["final"] = masters_of(handle, optimizer)
    return results


def job_load(amp, out: str, rank: int, continue_training: bool) -> dict:
    """For each checkpoint case: build and shard its model in new processes, load the
    checkpoint through DCP (get_state_dict / set_state_dict) and amp.load_state_dict; train on
    when asked."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    results = {}
    for case in CHECKPOINT_CASES:
        handle = amp.AmpHandle()
        model, optimizer = sharded_run(case, handle)
        state = checkpoint_state(model, optimizer, handle)
        dcp.load(state, checkpoint_id=os.path.join(out, case.name))
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        handle.load_state_dict(state["amp"])
        result = results[case.name] = {
            "loaded": full_state(checkpoint_state(model, optimizer, handle))}
        if continue_training:
            result["record"] = train(case, model, optimizer, handle, rank=rank,
                                     world=dist_world(), first_step=CHECKPOINT_AT)
            result["final"] = masters_of(handle, optimizer)
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", choices=["main", "resume", "reshard"], required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import torch.distributed as dist
    # Before init_process_group, so that it binds the default group at import, not later (see
    # the teardown below).
    import torch.distributed.nn  # noqa: F401
    from apex_lite import amp

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        if args.job == "main":
            results = job_main(amp, args.out, rank)
        else:
            results = job_load(amp, args.out, rank, continue_training=args.job == "resume")
    except Exception:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)   # a rank that failed must not wait in a collective for its peer
    torch.save(results, os.path.join(args.out, f"{args.job}_rank{rank}.pt"))
    dist.barrier()   # no rank tears the gloo group down while a peer still uses it
    # The models lived in the jobs (each on its own AmpHandle) and are gone; torch's caches
    # let go of their meshes, and destroy_process_group then ends gloo's threads. A gloo thread
    # still running at exit can abort the process; the check fails loudly instead.
    example_module().release_device_meshes()
    dist.destroy_process_group()
    from ddp_skip_worker import gloo_threads   # beside this file, on sys.path[0]
    leftover = gloo_threads()
    if leftover:
        raise SystemExit(f"gloo threads {leftover} outlived destroy_process_group: something "
                         "still holds a device mesh or the process group, and this process "
                         "can abort at exit")


def example_module():
    """examples/fsdp.py as a module (its release_device_meshes is the teardown tested here)."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir,
                        "examples", "fsdp.py")
    spec = importlib.util.spec_from_file_location("fsdp_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    main()
