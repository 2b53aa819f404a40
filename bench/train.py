"""End-to-end training benchmark: fp32, torch.autocast + GradScaler, apex_lite O1 / O2 / O3.

Workloads: the PyTorch AMP recipe's MLP (Linear+ReLU, MSE, SGD), a conv net with BatchNorm
(cross-entropy, SGD with momentum) and a small transformer encoder (attention, LayerNorm, GELU,
AdamW). Every variant starts from the same fp32 weights and sees the same batches.

How it measures:
- Each (workload, variant) pair trains in its own worker process, so the peak memory reported
  for a variant is that variant's alone (CPU: the process's peak resident set, VmHWM on Linux,
  ru_maxrss elsewhere; CUDA: torch.cuda.max_memory_allocated). "train MiB" is that peak minus
  the memory held just before the model was built (interpreter, torch, the batches, and the
  kernels and libraries that a two-step priming run on tiny sizes loaded).
- The parent interleaves timing rounds: one worker runs at a time, each round runs every
  variant for the same number of steps, and the order rotates from round to round, so a load
  change on a shared machine falls on every variant alike.
- A step is forward, loss, backward (scaled where the variant scales), optimizer step and
  zero_grad; its time is wall clock, with a device synchronize on CUDA. Reported: the median
  over the timed steps after warm-up, and ratios against fp32 and autocast from the same run.
- "final loss" is the mean training loss over the last steps (the same batches for every
  variant), compared with fp32's.

Output: a table on stdout, a JSON file, and a PNG (step times, loss curves, loss-scale
histories) when matplotlib can be imported. Without matplotlib, `--plot PATH` stops before any
work with the command that installs it; without `--plot`, a warning says that no plot was
written and why.

    python bench/train.py                       # CPU sizes, a few minutes on 2 cores
    python bench/train.py --device cuda         # the recipe's full sizes (batch 512, 4096 wide)
    python bench/train.py --smoke               # tiny sizes, seconds: keeps this file working
"""
from __future__ import annotations

import argparse
import json
import logging
import gc
import math
import multiprocessing
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

LOG = logging.getLogger("apex_lite.bench.train")

VARIANTS = ("fp32", "autocast", "O1", "O2", "O3")
WORKLOADS = ("mlp", "cnn", "transformer")
HALF_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
INSTALL_MATPLOTLIB = 'pip install matplotlib (or pip install ".[plot]" in apex_lite\'s checkout)'

# Sizes per preset. "cpu" runs in a few minutes on 2 cores; "gpu" is the recipe at full size
# (batch 512, width 4096, 3 layers) and proportionally larger conv net and transformer.
PRESETS: Dict[str, Dict[str, dict]] = {
    # Sized for CPUs whose bf16 matmul is slow: on AVX2-only CPUs (no AVX512-BF16 / AMX)
    # torch's bf16 GEMM falls back to a reference kernel (~0.8 GFLOP/s on this machine's kind,
    # against tens of GFLOP/s in fp32), and bf16 convolutions run ~7x slower than fp32 ones.
    # The MLP's weights dominate its memory (batch 16, 1024 wide).
    "cpu": {
        "mlp": dict(batch=16, width=1024, layers=3, batches=8, lr=1e-2),
        "cnn": dict(batch=32, image=16, channels=(16, 32, 64), classes=10, batches=8, lr=0.05),
        "transformer": dict(batch=8, seq=32, vocab=128, d_model=64, heads=4, ff=128,
                            layers=2, batches=8, lr=1e-3),
        "steps": dict(warmup=3, rounds=5, per_round=4, final_window=4),
    },
    "gpu": {
        "mlp": dict(batch=512, width=4096, layers=3, batches=50, lr=1e-2),
        "cnn": dict(batch=256, image=32, channels=(64, 128, 256), classes=10, batches=16,
                    lr=0.05),
        "transformer": dict(batch=64, seq=256, vocab=8192, d_model=512, heads=8, ff=2048,
                            layers=4, batches=16, lr=1e-3),
        "steps": dict(warmup=10, rounds=10, per_round=10, final_window=10),
    },
    "smoke": {
        "mlp": dict(batch=16, width=64, layers=3, batches=2, lr=1e-2),
        "cnn": dict(batch=8, image=16, channels=(8, 16, 32), classes=10, batches=2, lr=0.05),
        "transformer": dict(batch=4, seq=16, vocab=64, d_model=32, heads=2, ff=64, layers=1,
                            batches=2, lr=1e-3),
        "steps": dict(warmup=1, rounds=2, per_round=2, final_window=2),
    },
}
# The gpu preset's sizes with a fifth of its timed steps: tools/gpu_check.sh's short run.
PRESETS["gpu-quick"] = dict(PRESETS["gpu"],
                            steps=dict(warmup=5, rounds=4, per_round=5, final_window=5))


# ----------------------------------------------------------------------------- workloads
# Each builder returns (batches, make_model, make_optimizer, loss_fn). Data and initial weights
# come from fixed seeds, so every variant's worker trains the same model on the same batches.

def build_mlp(size: dict, device: torch.device):
    width, layers = size["width"], size["layers"]
    gen = torch.Generator().manual_seed(0)
    # Targets come from a fixed random linear map, so that the loss can fall (the recipe's
    # targets are pure noise, which no variant can learn).
    teacher = torch.randn(width, width, generator=gen) / math.sqrt(width)
    batches = []
    for _ in range(size["batches"]):
        x = torch.randn(size["batch"], width, generator=gen)
        batches.append((x.to(device), (x @ teacher).to(device)))

    def make_model():
        torch.manual_seed(1)
        blocks: List[nn.Module] = []
        for _ in range(layers - 1):
            blocks += [nn.Linear(width, width), nn.ReLU()]
        blocks.append(nn.Linear(width, width))
        return nn.Sequential(*blocks).to(device)

    return batches, make_model, lambda params: torch.optim.SGD(params, lr=size["lr"]), \
        nn.MSELoss()


class ConvNet(nn.Module):
    """Conv-BatchNorm-ReLU blocks, each halving the image, then a linear classifier."""

    def __init__(self, channels: Tuple[int, ...], classes: int):
        super().__init__()
        blocks: List[nn.Module] = []
        in_ch = 3
        for out_ch in channels:
            blocks += [nn.Conv2d(in_ch, out_ch, 3, padding=1, bias=False),
                       nn.BatchNorm2d(out_ch), nn.ReLU(inplace=True), nn.MaxPool2d(2)]
            in_ch = out_ch
        self.features = nn.Sequential(*blocks)
        self.classifier = nn.Linear(in_ch, classes)

    def forward(self, x):
        return self.classifier(self.features(x).mean(dim=(2, 3)))


def build_cnn(size: dict, device: torch.device):
    gen = torch.Generator().manual_seed(0)
    image, classes = size["image"], size["classes"]
    # One fixed pattern per class plus noise: learnable, so the loss curve means something.
    templates = torch.randn(classes, 3, image, image, generator=gen)
    batches = []
    for _ in range(size["batches"]):
        labels = torch.randint(classes, (size["batch"],), generator=gen)
        x = templates[labels] + 2.0 * torch.randn(size["batch"], 3, image, image, generator=gen)
        batches.append((x.to(device), labels.to(device)))

    def make_model():
        torch.manual_seed(1)
        return ConvNet(tuple(size["channels"]), classes).to(device)

    return batches, make_model, \
        lambda params: torch.optim.SGD(params, lr=size["lr"], momentum=0.9), \
        nn.CrossEntropyLoss()


class Encoder(nn.Module):
    """Token and position embeddings, pre-norm transformer encoder layers (GELU), a head."""

    def __init__(self, vocab: int, seq: int, d_model: int, heads: int, ff: int, layers: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Parameter(0.02 * torch.randn(seq, d_model))
        layer = nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens):
        h = self.tokens(tokens) + self.positions
        return self.head(self.norm(self.encoder(h)))


class TokenLoss(nn.Module):
    """Cross-entropy over every position of a (batch, seq, vocab) logit tensor."""

    def forward(self, logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_transformer(size: dict, device: torch.device):
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(size["batches"]):
        tokens = torch.randint(size["vocab"], (size["batch"], size["seq"]), generator=gen)
        # Predict the previous token: needs attention to the neighbouring position.
        targets = torch.roll(tokens, shifts=1, dims=1)
        batches.append((tokens.to(device), targets.to(device)))

    def make_model():
        torch.manual_seed(1)
        return Encoder(size["vocab"], size["seq"], size["d_model"], size["heads"], size["ff"],
                       size["layers"]).to(device)

    return batches, make_model, lambda params: torch.optim.AdamW(params, lr=size["lr"]), \
        TokenLoss()


BUILDERS: Dict[str, Callable] = {"mlp": build_mlp, "cnn": build_cnn,
                                 "transformer": build_transformer}


# ------------------------------------------------------------------------------ variants

class Trainer:
    """One variant's training step on one model; `step` returns the (unscaled) loss."""

    def __init__(self, variant: str, model: nn.Module, make_optimizer, loss_fn,
                 device: torch.device, half_dtype: torch.dtype):
        self.variant = variant
        self.loss_fn = loss_fn
        self.device_type = device.type
        self.half_dtype = half_dtype
        self.scaler = None
        self.amp = None
        optimizer = make_optimizer(model.parameters())
        if variant in ("O1", "O2", "O3"):
            from apex_lite import amp
            model, optimizer = amp.initialize(model, optimizer, opt_level=variant,
                                              half_dtype=half_dtype, verbosity=0)
            self.amp = amp
        elif variant == "autocast":
            self.scaler = torch.amp.GradScaler(self.device_type)
        elif variant != "fp32":
            raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
        self.model, self.optimizer = model, optimizer

    def step(self, x, y) -> torch.Tensor:
        if self.variant == "fp32":
            loss = self.loss_fn(self.model(x), y)
            loss.backward()
            self.optimizer.step()
        elif self.variant == "autocast":
            with torch.autocast(self.device_type, dtype=self.half_dtype):
                loss = self.loss_fn(self.model(x), y)
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss = self.loss_fn(self.model(x), y)
            with self.amp.scale_loss(loss, self.optimizer) as scaled_loss:
                scaled_loss.backward()
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def loss_scale(self) -> float:
        """The loss scale the next step will use (1.0 where nothing scales)."""
        if self.scaler is not None:
            return float(self.scaler.get_scale())
        if self.amp is not None:
            # Read after the timed step: on the fused O2 step it syncs with the device.
            # (amp.state_dict() would also clone the O2 master weights, inflating O2's peak.)
            return float(self.amp.loss_scalers()[0].loss_scale)
        return 1.0


# -------------------------------------------------------------------------------- worker

def workload_size(preset: str, workload: str, mlp_overrides: dict) -> dict:
    """The preset's sizes for a workload, with the MLP overrides from the command line."""
    size = dict(PRESETS[preset][workload])
    if workload == "mlp":
        size.update({k: v for k, v in mlp_overrides.items() if v is not None})
    return size


def _status_kib(field: str) -> int:
    """A "VmXXX: N kB" line of /proc/self/status, or -1 where there is no such file."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


class HostMemory:
    """Resident memory of this process: now, and its peak since `reset`.

    Linux: VmRSS and VmHWM, the peak reset through /proc/self/clear_refs. ru_maxrss is not
    used there because a child inherits its parent's peak across fork and exec. Elsewhere
    ru_maxrss is the only peak there is, and the baseline is zero.
    """

    def __init__(self):
        self.linux = _status_kib("VmHWM") >= 0

    def reset(self) -> int:
        if self.linux:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")   # 5: reset the peak resident set to the current one
            except OSError:
                LOG.warning("cannot reset the peak resident set (/proc/self/clear_refs); "
                            "peak memory includes start-up")
            return _status_kib("VmRSS") * 1024
        return 0

    def peak(self) -> int:
        if self.linux:
            return _status_kib("VmHWM") * 1024
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def worker_main(conn, config: dict) -> None:
    """Train one variant on one workload, step chunks at the parent's command.

    Messages received: ("run", n) trains n steps and answers their times, losses and loss
    scales; ("finish", None) answers the memory figures and returns. Any error is answered
    as {"error": traceback} so the parent can show it.
    """
    try:
        _serve(conn, config)
    except BaseException:  # reported to the parent, which raises with it
        import traceback
        conn.send({"error": traceback.format_exc()})


def _serve(conn, config: dict) -> None:
    workload, variant = config["workload"], config["variant"]
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"[{workload}/{variant}] %(levelname)s %(message)s")
    device = torch.device(config["device"])
    half_dtype = HALF_DTYPES[config["half_dtype"]]
    if device.type == "cpu":
        torch.set_num_threads(config["threads"])
    build = BUILDERS[workload]

    # Prime: two steps of the same variant on the tiny sizes load the kernels and libraries
    # that the first step pulls in, so that they count in the baseline, not as training memory.
    batches, make_model, make_optimizer, loss_fn = build(PRESETS["smoke"][workload], device)
    primer = Trainer(variant, make_model(), make_optimizer, loss_fn, device, half_dtype)
    for x, y in batches[:2]:
        primer.step(x, y)
    del primer, batches, make_model, make_optimizer, loss_fn, x, y
    gc.collect()

    batches, make_model, make_optimizer, loss_fn = build(config["size"], device)
    _sync(device)
    host = HostMemory()
    if device.type == "cuda":
        baseline = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        baseline = host.reset()
    trainer = Trainer(variant, make_model(), make_optimizer, loss_fn, device, half_dtype)
    step_index = 0
    while True:
        command, count = conn.recv()
        if command == "run":
            times, losses, scales = [], [], []
            for _ in range(count):
                x, y = batches[step_index % len(batches)]
                _sync(device)
                start = time.perf_counter()
                loss = trainer.step(x, y)
                _sync(device)
                times.append((time.perf_counter() - start) * 1e3)
                losses.append(float(loss))
                scales.append(trainer.loss_scale())
                step_index += 1
            conn.send({"times_ms": times, "losses": losses, "scales": scales})
        elif command == "finish":
            peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
                    else host.peak())
            conn.send({"peak_bytes": peak, "baseline_bytes": baseline})
            return
        else:
            raise ValueError(f"unknown command {command!r}")


# -------------------------------------------------------------------------------- parent

def _process_context():
    """Workers fork from a server that has imported torch once (fast start); spawn elsewhere."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        # torch._dynamo is what the first optimizer constructor imports (seconds of start-up).
        context.set_forkserver_preload(["torch", "torch._dynamo"])
        return context
    return multiprocessing.get_context("spawn")


class Worker:
    """The parent's handle on one (workload, variant) worker process."""

    def __init__(self, context, config: dict):
        self.name = f"{config['workload']}/{config['variant']}"
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(target=worker_main, args=(child_conn, config),
                                       name=self.name, daemon=True)
        self.process.start()
        child_conn.close()

    def request(self, command: str, count: int = 0) -> dict:
        self.conn.send((command, count))
        try:
            reply = self.conn.recv()
        except EOFError:
            self.process.join()
            raise RuntimeError(f"worker {self.name} died (exit code {self.process.exitcode}) "
                               f"during {command!r}") from None
        if "error" in reply:
            raise RuntimeError(f"worker {self.name} failed during {command!r}:\n"
                               f"{reply['error']}")
        return reply

    def close(self) -> None:
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def measure_workload(workload: str, variants: List[str], args) -> Dict[str, dict]:
    steps = PRESETS[args.preset]["steps"]
    warmup = args.warmup if args.warmup is not None else steps["warmup"]
    rounds = args.rounds if args.rounds is not None else steps["rounds"]
    per_round = args.steps_per_round if args.steps_per_round is not None else steps["per_round"]
    context = _process_context()
    size = workload_size(args.preset, workload, mlp_overrides(args))
    workers = {v: Worker(context, dict(workload=workload, variant=v, size=size,
                                       device=args.device, half_dtype=args.half_dtype,
                                       threads=args.threads))
               for v in variants}
    results = {v: {"times_ms": [], "losses": [], "scales": []} for v in variants}
    try:
        for variant, worker in workers.items():
            reply = worker.request("run", warmup)
            results[variant]["losses"] += reply["losses"]
            results[variant]["scales"] += reply["scales"]
        for round_index in range(rounds):
            shift = round_index % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                reply = workers[variant].request("run", per_round)
                for key in ("times_ms", "losses", "scales"):
                    results[variant][key] += reply[key]
            LOG.info("%s: round %d/%d done", workload, round_index + 1, rounds)
        for variant, worker in workers.items():
            results[variant].update(worker.request("finish"))
    finally:
        for worker in workers.values():
            worker.close()
    window = steps["final_window"]
    for variant, r in results.items():
        r["median_ms"] = statistics.median(r["times_ms"])
        r["final_loss"] = statistics.fmean(r["losses"][-window:])
        r["train_bytes"] = r["peak_bytes"] - r["baseline_bytes"]
    return results


def matmul_check(device: torch.device, half_dtype: torch.dtype, threads: int,
                 n: int = 512) -> dict:
    """Median times of one (n/4 x n) @ (n x n) matmul in fp32 and in the half type: whether
    this device can make mixed precision faster at all."""
    if device.type == "cpu":
        torch.set_num_threads(threads)
    a, b = torch.randn(n // 4, n, device=device), torch.randn(n, n, device=device)
    result = {}
    for name, dtype in (("fp32", torch.float32), ("half", half_dtype)):
        x, y = a.to(dtype), b.to(dtype)
        times = []
        for _ in range(5):
            _sync(device)
            start = time.perf_counter()
            x @ y
            _sync(device)
            times.append((time.perf_counter() - start) * 1e3)
        result[f"{name}_ms"] = statistics.median(times)
    result["half_over_fp32"] = result["half_ms"] / result["fp32_ms"]
    return result


def mlp_overrides(args) -> dict:
    return {"batch": args.mlp_batch, "width": args.mlp_width, "layers": args.mlp_layers}


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else float("nan")


def summarise(all_results: Dict[str, Dict[str, dict]], loss_rtol: float) -> List[str]:
    mib = 1 / 2**20
    header = (f"{'workload':<12}{'variant':<10}{'ms/step':>9}{'speed vs fp32':>15}"
              f"{'vs autocast':>13}{'peak MiB':>10}{'train MiB':>11}{'mem vs fp32':>13}"
              f"{'final loss':>12}{'vs fp32':>9}")
    lines = [header, "-" * len(header)]
    for workload, results in all_results.items():
        fp32, auto = results.get("fp32"), results.get("autocast")
        for variant, r in results.items():
            speed_fp32 = _ratio(fp32["median_ms"], r["median_ms"]) if fp32 else float("nan")
            speed_auto = _ratio(auto["median_ms"], r["median_ms"]) if auto else float("nan")
            mem = _ratio(r["train_bytes"], fp32["train_bytes"]) if fp32 else float("nan")
            dloss = (_ratio(r["final_loss"] - fp32["final_loss"], abs(fp32["final_loss"]))
                     if fp32 else float("nan"))
            r.update(speedup_vs_fp32=speed_fp32, speedup_vs_autocast=speed_auto,
                     train_mem_vs_fp32=mem, final_loss_rel_diff_vs_fp32=dloss)
            lines.append(f"{workload:<12}{variant:<10}{r['median_ms']:>9.2f}{speed_fp32:>14.2f}x"
                         f"{speed_auto:>12.2f}x{r['peak_bytes'] * mib:>10.1f}"
                         f"{r['train_bytes'] * mib:>11.1f}{mem:>12.2f}x"
                         f"{r['final_loss']:>12.4f}{dloss:>+9.1%}")
    lines.append("")
    lines.append("speed: fp32 (or autocast) median ms/step / this variant's; mem: train MiB / "
                 "fp32's; final loss: mean of the last steps, relative to fp32")
    lines += check_targets(all_results, loss_rtol)
    return lines


def check_targets(all_results: Dict[str, Dict[str, dict]], loss_rtol: float) -> List[str]:
    """The issue's targets, each judged from this run's ratios."""
    lines = ["", "targets:"]

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    mlp = all_results.get("mlp", {})
    if "O1" in mlp and "autocast" in mlp:
        ratio = mlp["O1"]["median_ms"] / mlp["autocast"]["median_ms"]
        lines.append(f"  mlp  O1 step time / autocast+GradScaler = {ratio:.3f} "
                     f"(target <= 1.03): {verdict(ratio <= 1.03)}")
    if "O2" in mlp and "fp32" in mlp:
        s = mlp["O2"]["speedup_vs_fp32"]
        lines.append(f"  mlp  O2 speed-up vs fp32 = {s:.2f}x (target >= 2.3x): "
                     f"{verdict(s >= 2.3)}")
    if "O2" in mlp and "autocast" in mlp:
        s = mlp["O2"]["speedup_vs_autocast"]
        lines.append(f"  mlp  O2 speed-up vs autocast = {s:.2f}x (target > 1x): "
                     f"{verdict(s > 1.0)}")
    if "O3" in mlp and "fp32" in mlp:
        s = mlp["O3"]["speedup_vs_fp32"]
        lines.append(f"  mlp  O3 speed-up vs fp32 = {s:.2f}x (target >= 2.6x): "
                     f"{verdict(s >= 2.6)}")
    for workload, results in all_results.items():
        if all(v in results for v in ("fp32", "O1", "O2")):
            m = {v: results[v]["train_bytes"] / 2**20 for v in ("fp32", "O1", "O2")}
            ok = m["O2"] < m["O1"] < m["fp32"]
            lines.append(f"  {workload:<5} train memory O2 {m['O2']:.1f} < O1 {m['O1']:.1f} "
                         f"< fp32 {m['fp32']:.1f} MiB: {verdict(ok)}")
        for variant in ("O1", "O2"):
            if variant in results and "fp32" in results:
                d = results[variant]["final_loss_rel_diff_vs_fp32"]
                lines.append(f"  {workload:<5} {variant} final loss vs fp32 {d:+.2%} "
                             f"(tolerance {loss_rtol:.0%}): {verdict(abs(d) <= loss_rtol)}")
    return lines


def matplotlib_missing() -> Optional[str]:
    """Why matplotlib cannot be imported, or None when it can."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        return str(exc)
    return None


def plot(all_results: Dict[str, Dict[str, dict]], path: Path) -> List[str]:
    """Step times, loss curves and loss-scale histories, one row per workload; returns the
    panels' titles, read back from the figure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = len(all_results)
    fig, axes = plt.subplots(rows, 3, figsize=(15, 3.6 * rows), squeeze=False)
    for row, (workload, results) in enumerate(all_results.items()):
        names = list(results)
        medians = [results[v]["median_ms"] for v in names]
        ax = axes[row][0]
        ax.bar(names, medians, color=[f"C{i}" for i in range(len(names))])
        ax.set_title(f"{workload}: step time, median ms/step")
        ax.set_ylabel("ms")
        for i, v in enumerate(names):
            ax.plot([i] * len(results[v]["times_ms"]), results[v]["times_ms"], "k.", ms=2)
        ax = axes[row][1]
        for i, v in enumerate(names):
            ax.plot(results[v]["losses"], label=v, color=f"C{i}")
        ax.set_title(f"{workload}: training loss")
        ax.set_xlabel("step")
        ax.legend(fontsize="small")
        ax = axes[row][2]
        for i, v in enumerate(names):
            ax.plot(results[v]["scales"], label=v, color=f"C{i}")
        ax.set_yscale("log", base=2)
        ax.set_title(f"{workload}: loss scale")
        ax.set_xlabel("step")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    titles = [ax.get_title() for ax in fig.axes]
    plt.close(fig)
    return titles


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="sizes: cpu (default on CPU), gpu (default on CUDA: the recipe's full "
                        "sizes), gpu-quick (gpu's sizes, fewer steps), smoke (tiny)")
    p.add_argument("--smoke", action="store_true", help="same as --preset smoke")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma-separated subset of {','.join(WORKLOADS)}")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--half-dtype", choices=sorted(HALF_DTYPES),
                   help="half type for autocast and O1-O3 (default: fp16 on CUDA, bf16 on CPU)")
    p.add_argument("--threads", type=int, default=2, help="torch threads per worker on CPU")
    p.add_argument("--warmup", type=int, help="untimed steps per variant before timing")
    p.add_argument("--rounds", type=int, help="interleaved timing rounds")
    p.add_argument("--steps-per-round", type=int, help="timed steps per variant per round")
    p.add_argument("--mlp-batch", type=int, help="override the MLP's batch size")
    p.add_argument("--mlp-width", type=int, help="override the MLP's width")
    p.add_argument("--mlp-layers", type=int, help="override the MLP's number of layers")
    p.add_argument("--loss-rtol", type=float, default=0.05,
                   help="tolerance on O1/O2 final loss relative to fp32 (default 0.05)")
    p.add_argument("--json", type=Path, help="where to write the results (default: "
                   "bench/results/train_<device>[_smoke].json)")
    p.add_argument("--plot", type=Path,
                   help="where to write the PNG of step times, loss curves and loss scales "
                        "(needs matplotlib; default: beside the JSON when matplotlib is installed)")
    args = p.parse_args(argv)
    if args.smoke:
        args.preset = "smoke"
    device_type = torch.device(args.device).type
    if args.preset is None:
        args.preset = "gpu" if device_type == "cuda" else "cpu"
    if args.half_dtype is None:
        args.half_dtype = "fp16" if device_type == "cuda" else "bf16"
    return p, args


def main(argv=None) -> int:
    parser, args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    workloads = [w for w in args.workloads.split(",") if w]
    variants = [v for v in args.variants.split(",") if v]
    for name, chosen, valid in (("workload", workloads, WORKLOADS),
                                ("variant", variants, VARIANTS)):
        unknown = [c for c in chosen if c not in valid]
        if unknown or not chosen:
            parser.error(f"unknown {name}(s) {unknown}; choose from {', '.join(valid)}")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda given but torch.cuda.is_available() is False")
    no_matplotlib = matplotlib_missing()
    if args.plot and no_matplotlib:
        parser.error(f"--plot needs matplotlib, which cannot be imported here ({no_matplotlib}). "
                     f"Install it with: {INSTALL_MATPLOTLIB}, or drop --plot.")
    LOG.info("preset %s on %s, half dtype %s, %d thread(s); variants %s",
             args.preset, args.device, args.half_dtype, args.threads, ", ".join(variants))
    n = 64 if args.preset == "smoke" else 512
    check = matmul_check(torch.device(args.device), HALF_DTYPES[args.half_dtype], args.threads,
                         n)
    check_line = (f"matmul {n // 4}x{n}x{n} here: fp32 {check['fp32_ms']:.2f} ms, "
                  f"{args.half_dtype} "
                  f"{check['half_ms']:.2f} ms ({check['half_over_fp32']:.1f}x fp32's time)")
    LOG.info("%s", check_line)
    all_results = {}
    for workload in workloads:
        LOG.info("%s: starting %d workers", workload, len(variants))
        all_results[workload] = measure_workload(workload, variants, args)
    lines = summarise(all_results, args.loss_rtol) + ["", check_line]
    print("\n".join(lines))
    suffix = "_smoke" if args.preset == "smoke" else ""
    json_path = args.json or Path(__file__).resolve().parent / "results" / \
        f"train_{torch.device(args.device).type}{suffix}.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "config": {"device": args.device, "preset": args.preset, "half_dtype": args.half_dtype,
                   "threads": args.threads,
                   "sizes": {w: workload_size(args.preset, w, mlp_overrides(args))
                             for w in workloads},
                   "torch": torch.__version__, "python": platform.python_version(),
                   "machine": platform.machine(), "cpu_count": os.cpu_count()},
        "matmul_check": check,
        "results": all_results,
        "summary": lines,
    }
    json_path.write_text(json.dumps(record, indent=1))
    LOG.info("wrote %s", json_path)
    if no_matplotlib:
        LOG.warning("no plot written: matplotlib cannot be imported (%s); %s and pass --plot "
                    "PATH for step times, loss curves and loss scales", no_matplotlib,
                    INSTALL_MATPLOTLIB)
    else:
        plot_path = args.plot or json_path.with_suffix(".png")
        LOG.info("wrote %s (panels: %s)", plot_path, "; ".join(plot(all_results, plot_path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
