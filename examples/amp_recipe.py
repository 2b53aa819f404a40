"""PyTorch's "Automatic Mixed Precision" recipe network, trained with apex_lite.amp.

A Linear+ReLU MLP trained with MSE loss and SGD, first at default precision (fp32, no amp) and
then once per opt level. Each amp run is the fp32 loop with two changed lines:

    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")   # added
    with amp.scale_loss(loss, optimizer) as scaled_loss:                 # was: loss.backward()
        scaled_loss.backward()

Prints one table: opt level, median ms/step, peak memory, final loss.

    python examples/amp_recipe.py               # small sizes: about a minute on 2 CPU cores
    python examples/amp_recipe.py --full        # the recipe's sizes (for a GPU): batch 512,
                                                #   4096 wide, 3 layers, 50 batches x 3 epochs

On CPU the half type is bfloat16, on CUDA float16 (choose with --half-dtype). Mixed precision
pays off where the hardware has fast half arithmetic: tensor-core GPUs, CPUs with AVX512-BF16 or
AMX. On AVX2-only CPUs torch's bf16 and fp16 matmuls fall back to slow reference kernels, and
the amp runs are much slower than default precision; the defaults are small for that reason.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import logging
import math
import statistics
import sys
import time

import torch

from apex_lite import amp

LOG = logging.getLogger("apex_lite.examples.amp_recipe")
FULL_SIZES = dict(batch_size=512, width=4096, layers=3, batches=50, epochs=3)
HALF_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def make_model(width: int, num_layers: int, device) -> torch.nn.Module:
    """The recipe's network: (num_layers - 1) x [Linear, ReLU], then a Linear."""
    layers = []
    for _ in range(num_layers - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, width))
    return torch.nn.Sequential(*layers).to(device)


def make_data(args, device):
    """`args.batches` (input, target) pairs shared by every run.

    The recipe's targets are pure noise, which no run can learn; here they come from a fixed
    random linear map of the inputs, so that the final loss shows whether training works.
    """
    generator = torch.Generator().manual_seed(0)
    teacher = torch.randn(args.width, args.width, generator=generator) / math.sqrt(args.width)
    data = []
    for _ in range(args.batches):
        x = torch.randn(args.batch_size, args.width, generator=generator)
        data.append((x.to(device), (x @ teacher).to(device)))
    return data


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


def train(opt_level, data, args, device, memory: PeakMemory, log: bool = True):
    """Train a fresh model; opt_level None is the recipe's default-precision loop."""
    memory.start()
    torch.manual_seed(1)   # the same initial weights for every run
    model = make_model(args.width, args.layers, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loss_fn = torch.nn.MSELoss()
    if opt_level is not None:
        model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level,
                                          half_dtype=args.half_dtype, verbosity=args.verbosity)

    step_ms, last_epoch_losses = [], []
    for epoch in range(args.epochs):
        for x, target in data:
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
            if epoch == args.epochs - 1:
                last_epoch_losses.append(loss.item())
        if log:
            LOG.info("%s epoch %d: loss %.4f", opt_level or "default precision", epoch,
                     loss.item())
    return {"ms_per_step": statistics.median(step_ms), "peak_mib": memory.peak_mib(),
            "final_loss": statistics.fmean(last_epoch_losses)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--full", action="store_true",
                   help="the recipe's sizes: batch 512, width 4096, 3 layers, 50 batches, "
                        "3 epochs (explicit size flags still win)")
    p.add_argument("--batch-size", type=int, help="default 64 (recipe: 512)")
    p.add_argument("--width", type=int, help="input = hidden = output size; default 512 "
                                             "(recipe: 4096)")
    p.add_argument("--layers", type=int, help="Linear layers; default 3 (recipe: 3)")
    p.add_argument("--batches", type=int, help="batches per epoch; default 8 (recipe: 50)")
    p.add_argument("--epochs", type=int, help="default 3 (recipe: 3)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--opt-levels", default="O0,O1,O2,O3",
                   help="comma-separated opt levels to run after default precision")
    p.add_argument("--half-dtype", choices=sorted(HALF_DTYPES),
                   help="default: fp16 on CUDA, bf16 on CPU")
    p.add_argument("--threads", type=int, help="torch threads on CPU (default: torch's)")
    p.add_argument("--verbosity", type=int, default=0, help="amp.initialize verbosity")
    args = p.parse_args(argv)
    small = dict(batch_size=64, width=512, layers=3, batches=8, epochs=3)
    for name, value in (FULL_SIZES if args.full else small).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.half_dtype = HALF_DTYPES[args.half_dtype] if args.half_dtype else None
    return p, args


def main(argv=None) -> int:
    parser, args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda was given but this torch sees no GPU")
    if args.threads:
        torch.set_num_threads(args.threads)
    opt_levels = [level for level in args.opt_levels.split(",") if level]
    LOG.info("device %s, batch %d, width %d, %d layers, %d batches x %d epochs",
             device, args.batch_size, args.width, args.layers, args.batches, args.epochs)

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

    base = rows[0][1]
    what = "CUDA allocator" if device.type == "cuda" else "resident set"
    print(f"\n{'opt level':<18}{'ms/step (median)':>18}{'speed-up':>10}"
          f"{'peak MiB (' + what + ')':>28}{'final loss':>12}")
    for name, r in rows:
        print(f"{name:<18}{r['ms_per_step']:>18.2f}{base['ms_per_step'] / r['ms_per_step']:>9.2f}x"
              f"{r['peak_mib']:>28.1f}{r['final_loss']:>12.4f}")
    if not all(math.isfinite(r["final_loss"]) for _, r in rows):
        LOG.error("a run ended with a non-finite loss")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
