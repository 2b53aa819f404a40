"""Per-step cost of amp's bookkeeping (O1) beside torch.amp.GradScaler, in the same run.

The model holds many small parameter tensors (300 by default) and does almost no arithmetic:
its forward concatenates them into one vector (one op, one op back in backward), so what a step
costs beyond plain SGD is the loss-scaling bookkeeping: scaling the loss, unscaling and checking
300 gradients for inf/NaN, deciding whether to skip, updating the scale.

Three variants run in one process, interleaved in rounds whose order rotates:
  plain       loss.backward(); optimizer.step()                       (no scaling: the floor)
  GradScaler  torch.autocast forward; scaler.scale(loss).backward(); scaler.step(); update()
  amp O1      apex_lite amp.initialize(O1); with amp.scale_loss(...): backward; step()
Reported: the median step time of each, the bookkeeping cost (median minus plain's median) and
the ratio amp O1 / GradScaler of both. Target: O1 no slower than GradScaler.

    python bench/step_overhead.py                 # CPU, 2 threads, ~20 s
    python bench/step_overhead.py --device cuda
    python bench/step_overhead.py --smoke         # seconds: keeps this file working
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

from apex_lite import amp

LOG = logging.getLogger("apex_lite.bench.step_overhead")
HALF_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class ManySmallParams(nn.Module):
    """`count` small 1-D parameter tensors, used by a forward of three ops."""

    def __init__(self, count: int, rows: int):
        super().__init__()
        # Alternating sizes of small Linear layers' weights (rows x rows) and biases (rows),
        # kept 1-D so that the forward is one cat: no per-tensor reshape in the graph.
        sizes = [rows * rows if i % 2 == 0 else rows for i in range(count)]
        generator = torch.Generator().manual_seed(0)
        self.tensors = nn.ParameterList(
            nn.Parameter(0.1 * torch.randn(size, generator=generator)) for size in sizes)
        # A plain tuple for the forward: walking the ParameterList costs more than the
        # bookkeeping measured here. Module.to() keeps the Parameter objects, so it stays valid.
        self.flat_inputs = tuple(self.tensors)

    def forward(self, x):
        return torch.cat(self.flat_inputs) * x


def make_variant(name: str, args, device: torch.device):
    """A zero-argument function running one training step of variant `name`."""
    model = ManySmallParams(args.params, args.rows).to(device)
    x = torch.randn(sum(p.numel() for p in model.parameters()), device=device)
    # foreach: one fused update for all tensors (the CPU default is a Python loop over them,
    # which would drown the bookkeeping being measured).
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, foreach=True)
    half_dtype = HALF_DTYPES[args.half_dtype]

    if name == "plain":
        def step():
            loss = model(x).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    elif name == "GradScaler":
        scaler = torch.amp.GradScaler(device.type)

        def step():
            with torch.autocast(device.type, dtype=half_dtype):
                loss = model(x).square().mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
    elif name == "amp O1":
        model, optimizer = amp.initialize(model, optimizer, opt_level="O1",
                                          half_dtype=half_dtype, verbosity=0)

        def step():
            loss = model(x).square().mean()
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    else:
        raise ValueError(f"unknown variant {name!r}")
    return step


def measure(args) -> dict:
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    names = ["plain", "GradScaler", "amp O1"]
    steps = {name: make_variant(name, args, device) for name in names}

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for name in names:
        for _ in range(args.warmup):
            steps[name]()
    times = {name: [] for name in names}
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            step = steps[name]
            for _ in range(args.steps_per_round):
                sync()
                start = time.perf_counter()
                step()
                sync()
                times[name].append((time.perf_counter() - start) * 1e6)
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {"times_us": times, "median_us": medians}


def report(result: dict, args) -> list:
    med = result["median_us"]
    overhead = {name: med[name] - med["plain"] for name in ("GradScaler", "amp O1")}
    lines = [f"{args.params} parameter tensors, {args.device}, half dtype {args.half_dtype}, "
             f"{args.rounds} rounds x {args.steps_per_round} steps per variant",
             f"{'variant':<12}{'median us/step':>16}{'bookkeeping us':>16}"]
    for name in ("plain", "GradScaler", "amp O1"):
        extra = f"{overhead[name]:>16.1f}" if name in overhead else f"{'-':>16}"
        lines.append(f"{name:<12}{med[name]:>16.1f}{extra}")
    step_ratio = med["amp O1"] / med["GradScaler"]
    lines.append(f"step time       amp O1 / GradScaler = {step_ratio:.3f}")
    if overhead["GradScaler"] > 0:
        lines.append(f"bookkeeping     amp O1 / GradScaler = "
                     f"{overhead['amp O1'] / overhead['GradScaler']:.3f}")
    lines.append(f"target: amp O1 step no slower than GradScaler: "
                 f"{'met' if step_ratio <= 1.0 else 'MISSED'}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--half-dtype", choices=sorted(HALF_DTYPES),
                   help="default: fp16 on CUDA, bf16 on CPU")
    p.add_argument("--params", type=int, default=300, help="number of parameter tensors")
    p.add_argument("--rows", type=int, default=16,
                   help="matrices are rows x rows, vectors rows long")
    p.add_argument("--threads", type=int, default=2, help="torch threads on CPU")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--steps-per-round", type=int, default=50)
    p.add_argument("--smoke", action="store_true", help="a few steps, to check it runs")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.half_dtype is None:
        args.half_dtype = "fp16" if torch.device(args.device).type == "cuda" else "bf16"
    if args.smoke:
        args.warmup, args.rounds, args.steps_per_round = 2, 2, 3
    result = measure(args)
    lines = report(result, args)
    print("\n".join(lines))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"config": vars(args) | {"json": str(args.json)},
                                         **result, "summary": lines}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
