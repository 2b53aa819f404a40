"""PyTorch's "Automatic Mixed Precision" recipe network, trained with apex_lite.amp.

A Linear+ReLU MLP trained with MSE loss and SGD, first at default precision (fp32, no amp) and
then once per opt level. Each amp run is the fp32 loop with two changed lines:

    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")   # added
    with amp.scale_loss(loss, optimizer) as scaled_loss:                 # was: loss.backward()
        scaled_loss.backward()

The targets come from a fixed random teacher (a rank-8 linear map of the inputs), so the loss
falls at every level. Prints one table: per run the median ms/step, peak memory, the mean
training loss of the first and the last epoch, and the loss on held-out inputs; below it, what
the columns are and one line on what the figures mean on this machine's hardware.

    python examples/amp_recipe.py               # sizes from the hardware: under a minute on 2 cores
    python examples/amp_recipe.py --plot amp_recipe.png   # also a PNG (needs matplotlib)
    python examples/amp_recipe.py --full        # the recipe's sizes (for a GPU): batch 512,
                                                #   4096 wide, 3 layers, 50 batches x 3 epochs

On CPU the half type is bfloat16, on CUDA float16 (choose with --half-dtype). Mixed precision
pays off where the hardware has fast half arithmetic: tensor-core GPUs, CPUs with AVX512-BF16 or
AMX. On AVX2-only CPUs torch's bf16 and fp16 matmuls fall back to slow reference kernels, and
the amp runs are many times slower than default precision. So the default sizes follow the
hardware (`default_sizes`): where half units exist they are large enough that the levels differ
as in real training (the recipe's sizes on a tensor-core GPU; 3 x 2048, batch 128 on a CPU with
bf16 units); elsewhere they are small. --full and explicit size flags win over either.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import logging
import math
import statistics
import sys
import textwrap
import time
from typing import List, Optional

import torch

from apex_lite import amp

LOG = logging.getLogger("apex_lite.examples.amp_recipe")
FULL_SIZES = dict(batch_size=512, width=4096, layers=3, batches=50, epochs=3)
SMALL_SIZES = dict(batch_size=64, width=512, layers=3, batches=32, epochs=3)
# A CPU with bf16 units: big enough that matmuls set the step time, small enough that the
# five runs take well under a minute on 2 cores.
CPU_HALF_UNIT_SIZES = dict(batch_size=128, width=2048, layers=3, batches=24, epochs=3)
# The CPU flags that mean fast matmuls of each half type (torch's oneDNN kernels use them).
CPU_HALF_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("amx_fp16",)}
HALF_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
TEACHER_RANK = 8
HELD_OUT_ROWS = 512
PLOT_PANELS = ("step time", "training loss", "loss scale")


def make_model(width: int, num_layers: int, device) -> torch.nn.Module:
    """The recipe's network: (num_layers - 1) x [Linear, ReLU], then a Linear."""
    layers = []
    for _ in range(num_layers - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, width))
    return torch.nn.Sequential(*layers).to(device)


def make_data(args, device):
    """`args.batches` training pairs (input, target) and one held-out pair, shared by every run.

    The recipe's targets are pure noise, which no run can learn. Here a fixed random "teacher"
    makes them: a rank-8 linear map of the input, scaled so that targets have unit variance
    (an untrained network's loss is about 1.0). The held-out inputs are drawn apart from the
    training ones, so the held-out loss shows the map was learned, not the batches memorised.
    """
    generator = torch.Generator().manual_seed(0)
    down = torch.randn(args.width, TEACHER_RANK, generator=generator) / math.sqrt(args.width)
    up = torch.randn(TEACHER_RANK, args.width, generator=generator) / math.sqrt(TEACHER_RANK)

    def pair(rows):
        x = torch.randn(rows, args.width, generator=generator)
        return x.to(device), (x @ down @ up).to(device)

    return [pair(args.batch_size) for _ in range(args.batches)], pair(HELD_OUT_ROWS)


class PeakMemory:
    """Peak memory of one run: CUDA allocator peak, or the peak resident set on Linux CPUs.

    On CPU the process's peak resident set (VmHWM) is reset before each run, after handing
    memory freed by the previous run back to the system; elsewhere it is not measured.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.baseline = 0
        try:
            self._libc = ctypes.CDLL("libc.so.6")
            self.available = device.type == "cuda" or self._read_kib("VmHWM") is not None
        except OSError:
            self._libc = None
            self.available = device.type == "cuda"

    @staticmethod
    def _read_kib(field: str):
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith(field + ":"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def start(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
        elif self.available:
            self._libc.malloc_trim(0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")   # reset the peak resident set to the current one
            self.baseline = self._read_kib("VmRSS")

    def peak_mib(self) -> float:
        """Peak memory above what was held at `start` (data and the previous runs excluded)."""
        if not self.available:
            return float("nan")
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = self._read_kib("VmHWM")
        return (peak - self.baseline) / 2**20


def train(opt_level, data, args, device, memory: PeakMemory, log: bool = True) -> dict:
    """Train a fresh model; opt_level None is the recipe's default-precision loop.

    Returns the median step time, the peak memory, the mean training loss of each epoch, the
    loss after the last epoch on the held-out pair, and per step the loss and the loss scale.
    """
    batches, (held_out_x, held_out_target) = data
    memory.start()
    torch.manual_seed(1)   # the same initial weights for every run
    model = make_model(args.width, args.layers, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    loss_fn = torch.nn.MSELoss()
    if opt_level is not None:
        model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level,
                                          half_dtype=args.half_dtype, verbosity=args.verbosity)

    step_ms, step_losses, loss_scales, epoch_losses = [], [], [], []
    for epoch in range(args.epochs):
        losses = []
        for x, target in batches:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            loss = loss_fn(model(x), target)
            if opt_level is None:
                loss.backward()
            else:
                with amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            step_ms.append((time.perf_counter() - start) * 1e3)
            losses.append(loss.item())
            # The scale the next step uses (1.0 where nothing scales), read after the timed
            # step: on the fused O2 step reading it syncs with the device.
            loss_scales.append(amp.loss_scalers()[0].loss_scale if opt_level else 1.0)
        step_losses += losses
        epoch_losses.append(statistics.fmean(losses))
        if log:
            LOG.info("%s epoch %d/%d: mean training loss %.4f", opt_level or "default precision",
                     epoch + 1, args.epochs, epoch_losses[-1])
    with torch.no_grad():
        held_out = loss_fn(model(held_out_x), held_out_target).item()
    return {"ms_per_step": statistics.median(step_ms), "peak_mib": memory.peak_mib(),
            "epoch_losses": epoch_losses, "held_out_loss": held_out,
            "step_losses": step_losses, "loss_scales": loss_scales}


def cpu_flags() -> Optional[set]:
    """The CPU's feature flags from /proc/cpuinfo, or None where there is no such file."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line.split(":", 1)[1].split() for line in f
                             if line.startswith("flags")), []))
    except OSError:
        return None


def cuda_tensor_cores(device: torch.device, half_dtype: torch.dtype) -> bool:
    """Whether this GPU has tensor cores for the half type: fp16 from Volta (sm_70), bf16 from
    Ampere (sm_80)."""
    major, _ = torch.cuda.get_device_capability(device)
    return major >= (8 if half_dtype == torch.bfloat16 else 7)


def cpu_half_flags(half_dtype: torch.dtype) -> Optional[List[str]]:
    """The CPU flags that give fast `half_dtype` matmuls here ([] for none), or None where
    /proc/cpuinfo cannot be read."""
    flags = cpu_flags()
    if flags is None:
        return None
    return [flag for flag in CPU_HALF_FLAGS[half_dtype] if flag in flags]


def has_half_units(device: torch.device, half_dtype: torch.dtype) -> bool:
    """Whether this device runs `half_dtype` matmuls on fast half units."""
    if device.type == "cuda":
        return cuda_tensor_cores(device, half_dtype)
    return bool(cpu_half_flags(half_dtype))


def default_sizes(device: torch.device, half_units: bool) -> dict:
    """The sizes used where no size flag is given: large enough that the levels differ as in
    real training where half units exist, small where they do not (amp is slower there)."""
    if not half_units:
        return SMALL_SIZES
    return FULL_SIZES if device.type == "cuda" else CPU_HALF_UNIT_SIZES


def what_the_figures_mean(device: torch.device, half_dtype: torch.dtype) -> str:
    """One line, from this machine's hardware, on what the speed-ups mean here."""
    half = {torch.float16: "fp16", torch.bfloat16: "bf16"}[half_dtype]
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        major, minor = torch.cuda.get_device_capability(device)
        if cuda_tensor_cores(device, half_dtype):
            return (f"Here: {name} (sm_{major}{minor}) runs {half} matmuls on tensor cores, so "
                    f"O1-O3 should beat fp32 at the recipe's sizes (the default here); at small "
                    f"sizes kernel launches, not arithmetic, set the step time.")
        return (f"Here: {name} (sm_{major}{minor}) has no {half} tensor cores: expect memory "
                f"savings from O1-O3, not speed.")
    capability = torch.backends.cpu.get_cpu_capability()
    found = cpu_half_flags(half_dtype)
    if found is None:
        return (f"Here: a CPU with torch {capability} kernels (no /proc/cpuinfo, so whether it "
                f"has {half} units is unknown); without them O1-O3 run slower than fp32.")
    wanted = CPU_HALF_FLAGS[half_dtype]
    if found:
        return (f"Here: a CPU with torch {capability} kernels and {'/'.join(found)}: {half} "
                f"matmuls run on its {half} units, so O1-O3 can beat fp32 (on a quiet machine); "
                f"a tensor-core GPU gains more.")
    return (f"Here: a CPU with torch {capability} kernels but no {'/'.join(wanted)}: torch runs "
            f"{half} matmuls through slow fallbacks, so O1-O3 run slower than fp32 here; on a "
            f"GPU or a CPU with {half} units the same code is faster.")


def require_matplotlib(parser, path) -> None:
    """Stop before training when --plot was given and matplotlib cannot be imported."""
    if path is None:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        parser.error(f"--plot needs matplotlib, which cannot be imported here ({exc}). "
                     f"Install it with: pip install matplotlib (or pip install \".[plot]\" in "
                     f"apex_lite's checkout), or drop --plot.")


def plot(rows, path) -> List[str]:
    """Write a PNG with one panel each for step times, training loss and loss scale; returns
    the panels' titles, read back from the figure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (times, losses, scales) = plt.subplots(1, 3, figsize=(15, 4))
    names = [name for name, _ in rows]
    colours = [f"C{i}" for i in range(len(rows))]
    times.bar(names, [r["ms_per_step"] for _, r in rows], color=colours)
    times.set_title(f"{PLOT_PANELS[0]}: median ms/step")
    times.tick_params(axis="x", labelrotation=20)
    for (name, r), colour in zip(rows, colours):
        losses.plot(r["step_losses"], label=name, color=colour)
        scales.plot(r["loss_scales"], label=name, color=colour)
    losses.set_title(f"{PLOT_PANELS[1]} (MSE per batch)")
    losses.set_xlabel("step")
    losses.legend(fontsize="small")
    scales.set_title(f"{PLOT_PANELS[2]} (amp.loss_scalers()[0])")
    scales.set_yscale("log", base=2)
    scales.set_xlabel("step")
    scales.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    titles = [ax.get_title() for ax in fig.axes]
    plt.close(fig)
    return titles


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--full", action="store_true",
                   help="the recipe's sizes: batch 512, width 4096, 3 layers, 50 batches, "
                        "3 epochs (explicit size flags still win)")
    sizes = ("default from the hardware: {} without half units, {} on a CPU with them, the "
             "recipe's {} on a GPU with tensor cores")
    for flag, name, what in (("--batch-size", "batch_size", ""),
                             ("--width", "width", "input = hidden = output size; "),
                             ("--layers", "layers", "Linear layers; "),
                             ("--batches", "batches", "batches per epoch; "),
                             ("--epochs", "epochs", "")):
        p.add_argument(flag, type=int, help=what + sizes.format(
            SMALL_SIZES[name], CPU_HALF_UNIT_SIZES[name], FULL_SIZES[name]))
    p.add_argument("--lr", type=float, default=1.0,
                   help="SGD learning rate (default 1.0: MSELoss averages over every output, "
                        "which makes each gradient small)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    p.add_argument("--opt-levels", default="O0,O1,O2,O3",
                   help="comma-separated opt levels to run after default precision")
    p.add_argument("--half-dtype", choices=sorted(HALF_DTYPES),
                   help="default: fp16 on CUDA, bf16 on CPU")
    p.add_argument("--threads", type=int, help="torch threads on CPU (default: torch's)")
    p.add_argument("--verbosity", type=int, default=0, help="amp.initialize verbosity")
    p.add_argument("--plot", metavar="PATH",
                   help="also write a PNG: step times, loss curves, loss-scale histories "
                        "(needs matplotlib)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    args.half_dtype = HALF_DTYPES[args.half_dtype or ("fp16" if device.type == "cuda" else "bf16")]
    if args.full:
        sizes = FULL_SIZES
    elif device.type == "cuda" and not torch.cuda.is_available():
        sizes = SMALL_SIZES   # main() stops with the reason
    else:
        sizes = default_sizes(device, has_half_units(device, args.half_dtype))
    for name, value in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return p, args


def print_table(rows, args, device) -> None:
    base = rows[0][1]
    last = f"ep {args.epochs}"
    print(f"\n{'opt level':<18}{'ms/step':>9}{'speed-up':>10}{'peak MiB':>10}"
          f"{'train loss ep 1':>17}{'train loss ' + last:>17}{'held-out loss':>15}")
    for name, r in rows:
        print(f"{name:<18}{r['ms_per_step']:>9.2f}{base['ms_per_step'] / r['ms_per_step']:>9.2f}x"
              f"{r['peak_mib']:>10.1f}{r['epoch_losses'][0]:>17.4f}{r['epoch_losses'][-1]:>17.4f}"
              f"{r['held_out_loss']:>15.4f}")
    where = "CUDA allocator" if device.type == "cuda" else "resident set"
    weights_mib = args.layers * (args.width + 1) * args.width * 4 / 2**20
    # fp32 activations the backward keeps: about one batch x width tensor per Linear.
    activations_mib = args.layers * args.batch_size * args.width * 4 / 2**20
    small = "small" if activations_mib < weights_mib else "not small"
    notes = [
        f"ms/step: median over all {args.epochs * args.batches} steps; speed-up: default "
        f"precision's ms/step over the row's. peak MiB: the run's peak {where} above what was "
        f"held before it. The fp32 weights are {weights_mib:.1f} MiB; O2 keeps fp32 master "
        f"weights beside the half model, so it saves activation memory, not weight memory, "
        f"and activations (about {activations_mib:.1f} MiB in fp32) are {small} beside the weights "
        f"at these sizes.",
        f"Loss: MSE against the teacher's targets (about 1.0 untrained). train loss ep N: the "
        f"mean over epoch N's {args.batches} batches. held-out loss: after the last epoch, on "
        f"{HELD_OUT_ROWS} inputs never trained on.",
        what_the_figures_mean(device, args.half_dtype),
    ]
    print()
    for note in notes:
        print(textwrap.fill(note, width=100))


def main(argv=None) -> int:
    parser, args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda was given but this torch sees no GPU")
    require_matplotlib(parser, args.plot)
    if args.threads:
        torch.set_num_threads(args.threads)
    opt_levels = [level for level in args.opt_levels.split(",") if level]
    LOG.info("device %s, batch %d, width %d, %d layers, %d batches x %d epochs, SGD lr %g "
             "momentum %g", device, args.batch_size, args.width, args.layers, args.batches,
             args.epochs, args.lr, args.momentum)

    # A throw-away pass on a tiny model first: the kernels and libraries each configuration
    # loads on first use would otherwise count as the first run's memory.
    tiny = argparse.Namespace(**{**vars(args), "batch_size": 8, "width": 8, "batches": 1,
                                 "epochs": 1})
    tiny_data = make_data(tiny, device)
    for level in [None] + opt_levels:
        train(level, tiny_data, tiny, device, PeakMemory(device), log=False)

    data = make_data(args, device)
    memory = PeakMemory(device)
    rows = [("default precision", train(None, data, args, device, memory))]
    for level in opt_levels:
        rows.append((level, train(level, data, args, device, memory)))
    print_table(rows, args, device)
    if args.plot:
        LOG.info("wrote %s (panels: %s)", args.plot, "; ".join(plot(rows, args.plot)))
    if not all(math.isfinite(r["held_out_loss"]) for _, r in rows):
        LOG.error("a run ended with a non-finite loss")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
