"""What O2 costs in the optimizer phase: time and memory of backward + step, against fp32.

The model is parameter-heavy with a trivial forward (the loss is 1e-3 times the sum of all
weights), so a step is the gradient write and the optimizer update: what O2's master weights,
loss scaling and fused step change. Each variant runs in its own process (peak memory is a
process's), in turn:

  fp32 AdamW(fused)    torch.optim.AdamW(fused=True) on fp32 parameters: the baseline
  O2 AdamW             amp O2 with torch.optim.AdamW: amp's fused step (fused_step=True, the
                       default): the native kernels, or without them (APEX_LITE_DISABLE_EXT=1,
                       a pure install) torch's fused kernels over fp32 gradient chunks
  O2 AdamW unfused     the same with fused_step=False: fp32 master gradients, torch's step
  O2 FusedAdam         amp O2 with apex_lite.optimizers.FusedAdam (fused_step=True)
  fp32 SGD(fused)      torch.optim.SGD(fused=True), no momentum, on fp32 parameters
  O2 SGD               amp O2 with torch.optim.SGD: the fused step (fused_step=True)
  O2 SGD unfused       fused_step=False

Reported per variant: the median ms of backward + step over the timed steps, the growth of the
process's peak resident memory from before the model was built to the end, and both as ratios
to the fp32 baseline of the same optimizer family, measured in this run. The variants' processes
run ``--rounds`` times, each round in a shuffled order (seeded), and each figure is the median
over the rounds: on a shared host the memory bandwidth moves by tens of percent from one
process to the next, and one process per variant gave the same step 1.0x or 1.5x fp32's
depending on when it ran. Targets (issue 9): O2
with either AdamW no slower than 1.1x fp32 fused AdamW and no more than 1.0x its peak memory;
with SGD without momentum, O2 memory <= fp32's. Without native kernels (issue 29): O2 AdamW
at most 1.5x fp32 fused AdamW's time and 1.05x its peak.

    python bench/o2_step.py                     # 8M parameters in 200 tensors, ~3 min
    python bench/o2_step.py --tensors 4000      # the many-small-tensors case
    python bench/o2_step.py --smoke             # seconds: keeps this file working

On a GPU (``--device cuda``) the variants run one after the other in this process (the peak is
torch.cuda.max_memory_allocated over the variant's own allocations, reset between variants),
with two more: GradScaler AdamW(fused) (fp32 parameters, the forward under torch.autocast,
torch.amp.GradScaler handing its scale to AdamW(fused=True): PyTorch's own mixed precision), and
the O2 variants again with the Python backend forced ("pure": the pure install's route, torch's
fused kernels over fp32 gradient chunks). 100M parameters by default there.

    python bench/o2_step.py --device cuda [--quick] [--json PATH]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time

import torch

from apex_lite.multi_tensor import _backend

VARIANTS = ["fp32 AdamW(fused)", "O2 AdamW", "O2 AdamW unfused", "O2 FusedAdam",
            "fp32 SGD(fused)", "O2 SGD", "O2 SGD unfused"]
CUDA_VARIANTS = ["fp32 AdamW(fused)", "GradScaler AdamW(fused)", "O2 AdamW", "O2 AdamW pure",
                 "O2 FusedAdam", "O2 FusedAdam pure", "O2 AdamW unfused", "fp32 SGD(fused)",
                 "O2 SGD", "O2 SGD pure"]
BASELINE = {"AdamW": "fp32 AdamW(fused)", "FusedAdam": "fp32 AdamW(fused)",
            "SGD": "fp32 SGD(fused)"}


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux: KiB


def _status_bytes(field: str) -> int:
    """VmRSS / VmHWM (the peak since the last reset) of this process, from /proc (Linux)."""
    with open("/proc/self/status") as f:
        line = next(l for l in f if l.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _reset_peak() -> bool:
    """Start a new peak resident-memory count (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cpu_line() -> str:
    """The CPU, its half-precision flags, torch and threads (bench/o2_route_floor.py too)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        model = next((l.split(":", 1)[1].strip() for l in text.splitlines()
                      if l.startswith("model name")), "?")
        flags = [flag for flag in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
                 if f" {flag}" in text]
    except OSError:
        model, flags = "?", []
    return (f"{model}; flags {' '.join(flags) or '-'}; torch {torch.__version__}, capability "
            f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")


class _Memory:
    """The peak memory of one variant: the process's resident set on the CPU (the variant runs in
    a process of its own), torch's allocator on a GPU (variants share the process: what is
    allocated before the variant is left out)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = _peak_rss_bytes()

    def steps_start(self) -> bool:
        """Start counting the steps' own peak; False where that cannot be done."""
        if self.cuda:
            self.steps_base = self.base
            return True
        return _reset_peak()

    def peak_mib(self) -> float:
        if self.cuda:
            return (torch.cuda.max_memory_allocated() - self.base) / 2 ** 20
        return (_peak_rss_bytes() - self.base) / 2 ** 20

    def steps_peak_mib(self) -> float:
        if self.cuda:
            return self.peak_mib()   # setup's transients are below the steps' peak there
        return (_status_bytes("VmHWM") - self.base) / 2 ** 20


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_variant(name: str, args) -> dict:
    """Build the model and optimizer of ``name``, time its steps; in this process."""
    from apex_lite import amp
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    memory = _Memory(device)
    size = args.params // args.tensors
    generator = torch.Generator().manual_seed(0)
    params = torch.nn.ParameterList(
        torch.nn.Parameter((0.01 * torch.randn(size, generator=generator)).to(device))
        for _ in range(args.tensors))
    model = torch.nn.Module()
    model.params = params
    scaler = None
    if name.startswith("GradScaler"):
        scaler = torch.amp.GradScaler(device.type)
    if "AdamW" in name or "FusedAdam" in name:
        if name.startswith(("fp32", "GradScaler")):
            opt = torch.optim.AdamW(params.parameters(), lr=1e-4, fused=True)
        elif "FusedAdam" in name:
            from apex_lite.optimizers import FusedAdam
            opt = FusedAdam(params.parameters(), lr=1e-4)
        else:
            opt = torch.optim.AdamW(params.parameters(), lr=1e-4)
    else:
        opt = torch.optim.SGD(params.parameters(), lr=1e-4,
                              **({"fused": True} if name.startswith("fp32") else {}))
    o2 = name.startswith("O2")
    if o2:
        model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0,
                                    fused_step=not name.endswith("unfused"))
    tensors = tuple(model.params)
    # The peak of the steps alone: initialisation transients (O2 casting the model) left out.
    step_peak_counted = memory.steps_start()

    def forward():
        if scaler is not None:
            with torch.autocast(device.type):
                return torch.stack([t.sum() for t in tensors]).float().sum() * 1e-3
        return torch.stack([t.sum() for t in tensors]).float().sum() * 1e-3

    times = []
    for i in range(args.warmup + args.steps):
        opt.zero_grad(set_to_none=True)
        loss = forward()
        _sync(device)
        start = time.perf_counter()
        if o2:
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
        elif scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        _sync(device)
        elapsed = time.perf_counter() - start
        if i >= args.warmup:
            times.append(elapsed)
    if o2:
        amp.loss_scalers()   # the host catches up: its cost is not hidden past the end
        amp.initialize([], enabled=False)
    path = opt._apex_lite_amp.path.describe() if o2 else "torch"
    steps_peak = memory.steps_peak_mib() if step_peak_counted else None
    return {"variant": name, "ms": 1e3 * statistics.median(times), "peak_mib": memory.peak_mib(),
            "steps_peak_mib": steps_peak, "path": path}


def run_in_process(name: str, args) -> dict:
    """``run_variant`` in this process (the GPU's way); "pure" variants with the Python backend
    forced, as a pure install has it."""
    pure = name.endswith(" pure")
    if pure:
        os.environ["APEX_LITE_DISABLE_EXT"] = "1"
    _backend.reset()
    try:
        result = run_variant(name[:-len(" pure")] if pure else name, args)
    finally:
        os.environ.pop("APEX_LITE_DISABLE_EXT", None)
        _backend.reset()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    result["variant"] = name
    return result


def _median_run(runs: list) -> dict:
    """One variant's figures over its processes: the median of each."""
    out = dict(runs[0])
    for key in ("ms", "peak_mib", "steps_peak_mib"):
        values = [r[key] for r in runs if r[key] is not None]
        out[key] = statistics.median(values) if values else None
    out["runs"] = len(runs)
    out["ms_each"] = [round(r["ms"], 3) for r in runs]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (variants in-process)")
    parser.add_argument("--params", type=int, help="default 8M on the CPU, 100M on a GPU")
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3,
                        help="processes per variant, in shuffled rounds; medians are shown")
    parser.add_argument("--variants", help="comma-separated; default: all of the device's")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to test the script")
    parser.add_argument("--quick", action="store_true",
                        help="1 round of 10 steps (tools/gpu_check.sh)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--in-process", action="store_true",
                        help="the variants in this process, as on a GPU (on the CPU: to test)")
    parser.add_argument("--variant", help=argparse.SUPPRESS)   # the child process's job
    args = parser.parse_args()
    cuda = torch.device(args.device).type == "cuda"
    in_process = cuda or args.in_process
    if args.params is None:
        args.params = 100_000_000 if cuda else 8_000_000
    if args.variants is None:
        args.variants = ",".join(CUDA_VARIANTS if in_process else VARIANTS)
    if args.smoke:
        args.params, args.tensors, args.steps, args.warmup, args.rounds = 20_000, 20, 3, 1, 1
    elif args.quick:
        args.steps, args.warmup, args.rounds = 10, 3, 1
    if args.variant:
        print(json.dumps(run_variant(args.variant, args)))
        return

    print(f"bench/o2_step.py: {args.params:,} parameters in {args.tensors} tensors, backward + "
          f"step, median of {args.steps} steps, each variant in its own process, median of "
          f"{args.rounds} rounds")
    print(f"cpu: {cpu_line()}")
    if cuda:
        print(f"device: {torch.cuda.get_device_name()}, variants in this process")
    backend, why = _backend.backend(torch.device(args.device))
    print(f"multi_tensor backend: {backend} ({why})")
    names = list(dict.fromkeys(args.variants.split(",")))
    runs: dict = {name: [] for name in names}
    order, shuffle = list(names), random.Random(0).shuffle
    for _ in range(args.rounds):
        for name in order:
            if in_process:
                runs[name].append(run_in_process(name, args))
                continue
            child = [sys.executable, __file__, "--variant", name, "--params", str(args.params),
                     "--tensors", str(args.tensors), "--steps", str(args.steps), "--warmup",
                     str(args.warmup), "--threads", str(args.threads)]
            out = subprocess.run(child, capture_output=True, text=True)
            if out.returncode != 0:
                print(f"{name}: failed\n{out.stderr[-2000:]}")
                continue
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
        shuffle(order)
    results = {name: _median_run(r) for name, r in runs.items() if r}
    print("\npeak: growth of the process's peak resident memory over its start (setup included);"
          "\nsteps peak: the same peak counted from the end of setup (the training steps' peak)")
    print(f"\n{'variant':24s} {'ms/step':>9s} {'x fp32':>7s} {'peak MiB':>9s} {'x fp32':>7s} "
          f"{'steps peak':>10s} {'x fp32':>7s}  path")

    def ratio(value, base):
        return f"{value / base:.2f}" if value is not None and base else "-"

    for name, r in results.items():
        family = next(key for key in BASELINE if key in name)
        base = results.get(BASELINE[family], {})
        steps_peak = r["steps_peak_mib"]
        print(f"{name:24s} {r['ms']:9.2f} {ratio(r['ms'], base.get('ms')):>7s} "
              f"{r['peak_mib']:9.1f} {ratio(r['peak_mib'], base.get('peak_mib')):>7s} "
              f"{'-' if steps_peak is None else f'{steps_peak:.1f}':>10s} "
              f"{ratio(steps_peak, base.get('steps_peak_mib')):>7s}  {r['path']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                       "cpu": cpu_line(), "device": args.device,
                       "device_name": torch.cuda.get_device_name() if cuda else "cpu",
                       "backend": f"{backend} ({why})",
                       "params": args.params, "tensors": args.tensors, "rounds": args.rounds,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
