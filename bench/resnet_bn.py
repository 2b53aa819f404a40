"""O2 on a CNN with BatchNorm (issue 53): step time and peak memory of a ResNet-18-shaped net in
fp32, under torch.autocast, and at apex_lite's O1, O2, O3 and O5, and O2 as amp ran it before
issue 53 ("O2-casts": each kept BatchNorm's input cast to fp32 and its output back to half), in
the same run.

The net: torchvision's ResNet-18 layout (7x7 stem, max pool, four stages of two conv-BN-ReLU
basic blocks, 64-512 channels), 100 classes, on 64x64 images in NCHW, batch 32, cross-entropy,
SGD with momentum 0.9. A step is forward, loss, backward (scaled where the mode scales),
optimizer step, zero_grad. Every mode starts from the same fp32 weights and sees the same
batches.

How it measures (CPU): each mode trains in a process of its own, one process at a time; a round
runs every mode once, the order rotating from round to round, and each figure is the median over
the rounds (the time of a process is the median of its timed steps). Per process:
- ms/step, wall clock;
- RSS MiB: the growth of the process's peak resident set (VmHWM) from before the model was built
  to the end of the timed steps; this counts what the C allocator keeps of freed temporaries;
- live MiB: the tensors alive at the step's peak: those alive before a step (weights, masters,
  optimizer state) plus the peak of bytes allocated and not yet freed during one more step,
  from torch's profiler (profile_memory), whatever the allocator keeps;
- saved MiB: the bytes autograd saves for backward in one forward (distinct storages).
On a GPU (``--device cuda``) the modes run in this process, one after another in each round,
the peak being torch.cuda.max_memory_allocated over the mode's steps (no RSS column), as in
bench/o2_step.py.

The issue's targets: O2's peak at most 0.95x fp32's and 1.10x autocast's, and O2's step at most
1.10x autocast's time on hardware with half units (a CPU with AVX-512 BF16 or AMX, or a GPU).
On a CPU without them (AVX2 only) half convolutions take tens of times fp32's: the times say
nothing there and the verdict leaves them out; the memory holds on every CPU.

``--numerics STEPS`` trains fp32, O2 and O2-casts for STEPS steps each (own processes) on 8
batches the net can learn, and compares the losses: O2's distance from fp32 against O2-casts'.

    python bench/resnet_bn.py                         # the issue's sizes: minutes per round
    python bench/resnet_bn.py --rounds 2 --steps 1    # AVX2-only CPUs: a half step takes ~1 min
    python bench/resnet_bn.py --numerics 300 --width 16 --image 32 --batch 16
    python bench/resnet_bn.py --device cuda --quick --json PATH    # tools/gpu_check.sh
    python bench/resnet_bn.py --smoke                 # seconds: keeps this file working
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

MODES = ("fp32", "autocast", "O1", "O2", "O2-casts", "O3", "O5")
CLASSES = 100
MIB = 2 ** 20


# ---- the net and the data ----------------------------------------------------------------------

class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


def resnet18(width: int = 64) -> nn.Module:
    """ResNet-18's layout with ``width`` channels in the first stage (64 is ResNet-18's)."""
    torch.manual_seed(0)
    layers: List[nn.Module] = [nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width),
                               nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    cin = width
    for stage in range(4):
        cout = width * 2 ** stage
        layers += [BasicBlock(cin, cout, 1 if stage == 0 else 2), BasicBlock(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, CLASSES)]
    return nn.Sequential(*layers)


def batches(args, device: torch.device, count: int) -> list:
    """``count`` batches from a fixed seed; labels are a fixed function of the image (the sign
    pattern of a few pixel sums), so that the loss can fall."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        x = torch.randn(args.batch, 3, args.image, args.image, generator=g)
        y = (x[:, :, ::8, ::8].flatten(1)[:, :7] > 0).long() @ (2 ** torch.arange(7)) % CLASSES
        out.append((x.to(device), y.to(device)))
    return out


# ---- one mode, in this process -----------------------------------------------------------------

def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(l for l in f if l.startswith(field + ":")).split()[1]) * 1024


def _half(device: torch.device) -> torch.dtype:
    return torch.float16 if device.type == "cuda" else torch.bfloat16


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class Trainer:
    """The model, optimizer and step of one mode."""

    def __init__(self, mode: str, args, device: torch.device):
        from apex_lite import amp
        self.amp, self.mode, self.device = amp, mode, device
        self.half = _half(device)
        model = resnet18(args.width).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9,
                                    weight_decay=5e-5)
        self.scaler = None
        if mode == "autocast" and self.half == torch.float16:
            self.scaler = torch.amp.GradScaler(device.type)
        if mode.startswith("O"):
            from apex_lite.amp import casting
            table = dict(casting._HALF_INPUT_FORWARDS)
            if mode == "O2-casts":   # amp before issue 53: every kept BatchNorm's input to fp32
                casting._HALF_INPUT_FORWARDS.clear()
            try:
                model, optimizer = amp.initialize(model, optimizer, opt_level=mode[:2],
                                                  verbosity=0)
            finally:   # the choice is made here, once per kept module
                casting._HALF_INPUT_FORWARDS.update(table)
        self.model, self.optimizer = model, optimizer

    def step(self, x, y) -> torch.Tensor:
        if self.mode == "autocast":
            with torch.autocast(self.device.type, dtype=self.half):
                loss = F.cross_entropy(self.model(x).float(), y)
        else:
            loss = F.cross_entropy(self.model(x).float(), y)
        if self.mode.startswith("O"):
            with self.amp.scale_loss(loss, self.optimizer) as scaled:
                scaled.backward()
        elif self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def resident_bytes(self) -> int:
        """Weights, buffers, masters, gradients and optimizer state alive between steps."""
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        for group in self.optimizer.param_groups:
            tensors += [p for p in group["params"]] + [p.grad for p in group["params"]]
        for state in self.optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return _storage_bytes(tensors)

    def profiled_step(self, x, y) -> Dict[str, float]:
        """One more step under torch's memory profiler and autograd's saved-tensor hooks."""
        from torch._C._profiler import _EventType
        from torch.profiler import ProfilerActivity, profile
        saved: list = []
        resident = self.resident_bytes()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with torch.autograd.graph.saved_tensors_hooks(
                    lambda t: saved.append(t) or t, lambda t: t):
                self.step(x, y)
        allocations = []
        stack = list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            event = stack.pop()
            if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
                allocations.append((event.start_time_ns, event.extra_fields.alloc_size))
            stack.extend(event.children)
        live = peak = 0
        for _, size in sorted(allocations):
            live += size
            peak = max(peak, live)
        return {"live_mib": (resident + peak) / MIB, "saved_mib": _storage_bytes(saved) / MIB,
                "resident_mib": resident / MIB}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_mode(mode: str, args) -> dict:
    """Train ``mode`` for ``args.warmup + args.steps`` steps in this process; its figures."""
    device = torch.device(args.device)
    data = batches(args, device, 4)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _status_bytes("VmHWM")
    trainer = Trainer(mode, args, device)
    times = []
    for i in range(args.warmup + args.steps):
        x, y = data[i % len(data)]
        _sync(device)
        start = time.perf_counter()
        trainer.step(x, y)
        _sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    out = {"mode": mode, "ms": 1e3 * statistics.median(times)}
    if cuda:
        out["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / MIB
    else:
        out["rss_mib"] = (_status_bytes("VmHWM") - base) / MIB
        out.update(trainer.profiled_step(*data[0]))
    if mode.startswith("O"):
        trainer.amp.initialize([], enabled=False)
    return out


def run_losses(mode: str, args) -> dict:
    """``args.numerics`` steps of ``mode`` over 8 batches; the loss of each step."""
    device = torch.device(args.device)
    data = batches(args, device, 8)
    trainer = Trainer(mode, args, device)
    losses = [trainer.step(*data[i % len(data)]) for i in range(args.numerics)]
    return {"mode": mode, "losses": [float(l) for l in losses]}


# ---- the parent: processes, rounds, medians, verdict -------------------------------------------

def cpu_line() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        model = next((l.split(":", 1)[1].strip() for l in text.splitlines()
                      if l.startswith("model name")), "?")
        flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in text]
    except OSError:
        model, flags = "?", []
    return f"{model}; flags {' '.join(flags) or '-'}; {torch.get_num_threads()} threads"


def has_half_units(device: torch.device) -> bool:
    if device.type == "cuda":
        return True
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return False
    return " avx512_bf16" in text or " amx_bf16" in text


def child(job: str, mode: str, args) -> Optional[dict]:
    """``job`` ("mode" or "losses") of ``mode`` in a fresh process."""
    command = [sys.executable, __file__, f"--{job}-job", mode, "--device", args.device,
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--width",
               str(args.width), "--image", str(args.image), "--batch", str(args.batch), "--lr",
               str(args.lr), "--numerics", str(args.numerics)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"{mode}: failed\n{done.stderr[-3000:]}")
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or not b else a / b


def measure(args, modes: List[str]) -> dict:
    cuda = torch.device(args.device).type == "cuda"
    runs: Dict[str, list] = {m: [] for m in modes}
    for round_index in range(args.rounds):
        shift = round_index % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            if cuda:
                got = run_mode(mode, args)
                gc.collect()
                torch.cuda.empty_cache()
            else:
                got = child("mode", mode, args)
            if got:
                runs[mode].append(got)
                print(f"  round {round_index + 1}: {mode:9s} " + " ".join(
                    f"{k} {v:.1f}" for k, v in got.items() if k != "mode"), flush=True)
    keys = ("ms", "peak_mib") if cuda else ("ms", "rss_mib", "live_mib", "saved_mib",
                                            "resident_mib")
    results = {m: {k: statistics.median(r[k] for r in rs) for k in keys} | {"rounds": len(rs)}
               for m, rs in runs.items() if rs}
    for m, r in results.items():
        for other in ("fp32", "autocast"):
            if other in results:
                r[f"ms_x_{other}"] = _ratio(r["ms"], results[other]["ms"])
                for k in keys[1:3] if not cuda else ("peak_mib",):
                    r[f"{k}_x_{other}"] = _ratio(r[k], results[other][k])
    verdict = {}
    if {"O2", "fp32", "autocast"} <= set(results):
        o2 = results["O2"]
        memory_keys = ("peak_mib",) if cuda else ("live_mib", "rss_mib")
        verdict = {f"O2 {k} <= 0.95x fp32 and <= 1.10x autocast":
                   o2[f"{k}_x_fp32"] <= 0.95 and o2[f"{k}_x_autocast"] <= 1.10
                   for k in memory_keys}
        verdict["O2 ms <= 1.10x autocast"] = (o2["ms_x_autocast"] <= 1.10
                                             if has_half_units(torch.device(args.device))
                                             else "not judged: no bf16 units on this CPU")
    return {"results": results, "verdict": verdict}


def numerics(args) -> dict:
    losses = {}
    for mode in ("fp32", "O2", "O2-casts"):
        got = child("losses", mode, args)
        if got:
            losses[mode] = got["losses"]
    window = max(1, min(50, args.numerics // 5))

    def tail(mode):
        return statistics.fmean(losses[mode][-window:])

    def distance(a, b):
        return max(abs(x - y) for x, y in zip(losses[a], losses[b]))

    out = {"steps": args.numerics, "window": window, "losses": losses}
    if len(losses) == 3:
        out.update({f"final_{m}": tail(m) for m in losses})
        out.update({"max_abs_O2_vs_fp32": distance("O2", "fp32"),
                    "max_abs_O2casts_vs_fp32": distance("O2-casts", "fp32"),
                    "max_abs_O2_vs_O2casts": distance("O2", "O2-casts"),
                    "final_gap_O2": abs(tail("O2") - tail("fp32")),
                    "final_gap_O2casts": abs(tail("O2-casts") - tail("fp32"))})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--modes", help="comma-separated, default: " + ",".join(MODES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per process")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--image", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--numerics", type=int, default=0,
                        help="compare the losses of this many steps instead of timing")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 10 steps (GPU check)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 1 round")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--mode-job", help=argparse.SUPPRESS)
    parser.add_argument("--losses-job", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.width, args.image, args.batch, args.rounds, args.steps, args.warmup = 8, 32, 4, 1, 1, 1
        args.numerics = min(args.numerics, 3)
    elif args.quick:
        args.rounds, args.steps, args.warmup = 2, 10, 5
    if args.mode_job:
        print(json.dumps(run_mode(args.mode_job, args)))
        return 0
    if args.losses_job:
        print(json.dumps(run_losses(args.losses_job, args)))
        return 0
    device = torch.device(args.device)
    header = {"date": datetime.date.today().isoformat(), "cpu": cpu_line(),
              "torch": torch.__version__, "device": (torch.cuda.get_device_name()
                                                     if device.type == "cuda" else "cpu"),
              "half_units": has_half_units(device),
              "sizes": {k: getattr(args, k) for k in ("width", "image", "batch")}}
    print(f"bench/resnet_bn.py, {header['date']}: torch {header['torch']}, {header['cpu']}, "
          f"device {header['device']}; ResNet-18 layout width {args.width}, {args.image}x"
          f"{args.image}, batch {args.batch}")
    if args.numerics:
        record = dict(header, numerics=numerics(args))
        n = record["numerics"]
        if "final_O2" in n:
            print(f"{n['steps']} steps, mean loss of the last {n['window']}: fp32 "
                  f"{n['final_fp32']:.4f}, O2 {n['final_O2']:.4f}, O2-casts "
                  f"{n['final_O2-casts']:.4f}; largest step-wise gap to fp32: O2 "
                  f"{n['max_abs_O2_vs_fp32']:.4f}, O2-casts {n['max_abs_O2casts_vs_fp32']:.4f}"
                  f"; O2 to O2-casts {n['max_abs_O2_vs_O2casts']:.4f}")
    else:
        modes = args.modes.split(",") if args.modes else list(MODES)
        print(f"{args.rounds} rounds, {args.warmup} warm-up + {args.steps} timed steps per "
              f"{'mode' if device.type == 'cuda' else 'process'}")
        record = dict(header, **measure(args, modes))
        cuda = device.type == "cuda"
        cols = ["ms", "peak_mib"] if cuda else ["ms", "rss_mib", "live_mib", "saved_mib"]
        print("\n" + f"{'mode':9s}" + "".join(f"{c:>11s}" for c in cols)
              + "".join(f"  {c + ' x fp32':>13s}{c + ' x ac':>13s}" for c in cols[:3 - cuda]))
        for mode, r in record["results"].items():
            print(f"{mode:9s}" + "".join(f"{r[c]:11.1f}" for c in cols) + "".join(
                f"  {r[c + '_x_fp32'] or 0:13.2f}{r[c + '_x_autocast'] or 0:13.2f}"
                for c in cols[:3 - cuda] if c + "_x_fp32" in r))
        for claim, ok in record["verdict"].items():
            print(f"{claim}: {ok}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
