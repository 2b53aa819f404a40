"""apex.normalization's norms against torch's own modules: forward + backward time, interleaved in
one process, medians, ratio to torch's in the same run.

Rows (each a workload: rows x features, dtype):
- ``FusedLayerNorm`` / ``FusedRMSNorm`` against ``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm``
  with parameters of the input's dtype (the layer norm is torch's op: the ratio is the wrapper's
  cost; the RMS norm is apex_lite's Function on torch's fused layer-norm backward, whose CPU
  rms_norm backward is composed of many ops);
- ``memory_efficient=True`` (the Function, keeping the output) against the same;
- ``MixedFusedLayerNorm`` / ``FusedLayerNorm`` with fp32 parameters and a bf16 input against
  torch's LayerNorm given the same (torch's CPU mixed-dtype kernel, which rounds the parameters'
  gradients to bf16; apex_lite's gradients are fp32).

    python bench/normalization.py [--reps 15] [--threads N] [--smoke]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List, Tuple

import torch

from apex_lite.normalization import (FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm,
                                     MixedFusedRMSNorm)
from o2_step import cpu_line  # noqa: E402  (bench/ is on the path of a script run from it)


def step_of(module: torch.nn.Module, x: torch.Tensor) -> Callable[[], None]:
    """One forward and backward of ``module`` on ``x`` (gradients set to None first)."""
    x = x.detach().requires_grad_()
    grad = None

    def step():
        nonlocal grad
        x.grad = None
        for p in module.parameters():
            p.grad = None
        out = module(x)
        if grad is None:
            grad = torch.randn_like(out)
        out.backward(grad)

    return step


def workloads(rows: int, features: int) -> List[Tuple[str, Dict[str, Callable[[], None]]]]:
    """(title, {column: step}) per workload; the column "torch" is the baseline."""
    result = []
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(rows, features, dtype=dtype)
        name = str(dtype).replace("torch.", "")
        result.append((f"LayerNorm {rows}x{features} {name}", {
            "torch": step_of(torch.nn.LayerNorm(features).to(dtype), x),
            "FusedLayerNorm": step_of(FusedLayerNorm(features).to(dtype), x),
            "memory_efficient": step_of(FusedLayerNorm(features, memory_efficient=True)
                                        .to(dtype), x)}))
        result.append((f"RMSNorm {rows}x{features} {name}", {
            "torch": step_of(torch.nn.RMSNorm(features, eps=1e-5).to(dtype), x),
            "FusedRMSNorm": step_of(FusedRMSNorm(features).to(dtype), x),
            "memory_efficient": step_of(FusedRMSNorm(features, memory_efficient=True)
                                        .to(dtype), x)}))
    x = torch.randn(rows, features, dtype=torch.bfloat16)
    result.append((f"LayerNorm {rows}x{features} bf16 in, fp32 params", {
        "torch": step_of(torch.nn.LayerNorm(features), x),
        "FusedLayerNorm": step_of(FusedLayerNorm(features), x),
        "MixedFusedLayerNorm": step_of(MixedFusedLayerNorm(features), x)}))
    result.append((f"RMSNorm {rows}x{features} bf16 in, fp32 params", {
        "torch": step_of(torch.nn.RMSNorm(features, eps=1e-5), x),
        "FusedRMSNorm": step_of(FusedRMSNorm(features), x),
        "MixedFusedRMSNorm": step_of(MixedFusedRMSNorm(features), x)}))
    return result


def measure(columns: Dict[str, Callable[[], None]], reps: int) -> Dict[str, float]:
    """Median ms per column; every repetition runs each column once, in turn."""
    for step in columns.values():
        step()   # warm up
    times: Dict[str, List[float]] = {name: [] for name in columns}
    for _ in range(reps):
        for name, step in columns.items():
            start = time.perf_counter()
            step()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 3 repetitions")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    reps = 3 if args.smoke else args.reps
    sizes = [(64, 96)] if args.smoke else [(8192, 1024), (64, 1024)]
    print(f"cpu: {cpu_line()}")
    print(f"forward + backward, median of {reps}, ms; ratio to torch's module in the same run")
    print(f"{'workload':<44} {'column':>20} {'ms':>9} {'x torch':>8}")
    for rows, features in sizes:
        for title, columns in workloads(rows, features):
            medians = measure(columns, reps)
            for name, ms in medians.items():
                print(f"{title:<44} {name:>20} {ms:9.3f} {ms / medians['torch']:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
