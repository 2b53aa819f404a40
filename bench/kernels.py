"""Multi-tensor kernel benchmark: ratios to the floor, all measured interleaved in one run.

The floor is one multithreaded pass over one flat tensor holding the same bytes as the list:
- in-place unscale of fp32 grads: ``flat.mul_(s)`` on one fp32 tensor of the same total size
  (reads and writes every byte once, which is what a fused unscale must do);
- bf16 grads unscaled into fp32 master grads: ``flat_fp32.copy_(flat_bf16)``, one pass reading the
  bf16 bytes and writing the fp32 bytes (the multiply is free next to the memory traffic; torch
  has no single flat op that converts and multiplies in one pass).

Columns: floor; torch (``torch._amp_foreach_non_finite_check_and_unscale_``, for the bf16 case a
``torch._foreach_copy_`` into the masters first); torch foreach (``torch._foreach_mul_``, no
inf/NaN check: the fastest unchecked multi-tensor op torch has); native and python
(``apex_lite.multi_tensor.scale`` on each backend, argument validation included); native op (the
bare ``torch.ops.apex_lite`` call, to show what validation costs). Every repetition runs each
column once, in turn; the table shows medians. Scales alternate between 0.5 and 2.0 so values
neither drift nor turn subnormal. On a GPU the device-to-device copy bandwidth is measured first,
and "x copy" is each median over the time that copy takes for the bytes the workload must move.

    python bench/kernels.py [--device cuda] [--reps 7] [--only 1,2,3] [--columns floor,native]
    python bench/kernels.py --device cuda --quick --json kernels.json    # tools/gpu_check.sh
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from apex_lite import multi_tensor
from apex_lite.multi_tensor import _backend  # noqa: E402


def use_backend(name: str) -> None:
    """Makes ``apex_lite.multi_tensor`` use the ``name`` backend from now on."""
    if name == "python":
        os.environ["APEX_LITE_DISABLE_EXT"] = "1"
    else:
        os.environ.pop("APEX_LITE_DISABLE_EXT", None)
    _backend.reset()


def split_sizes(total: int, count: int):
    base = total // count
    return [base + (1 if i < total - base * count else 0) for i in range(count)]


def make_workload(index: int, device: torch.device):
    """(title, {column: callable(scale)}) for workload ``index``."""
    found_inf = torch.zeros(1, device=device)
    if index in (1, 2):
        total, count = (100_000_000, 200) if index == 1 else (4000 * 2500, 4000)
        title = (f"{count} fp32 grads, {total / 1e6:g}M elements, unscale in place")
        flat = torch.randn(total, device=device)
        grads = [torch.randn(n, device=device) for n in split_sizes(total, count)]

        def torch_op(s):
            inv = torch.full((1,), s, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv)

        def api(s):
            multi_tensor.scale(grads, grads, s, found_inf)

        def bare(s):
            torch.ops.apex_lite.scale_.default(grads, s, found_inf)

        columns = {"floor": lambda s: flat.mul_(s), "torch": torch_op,
                   "torch foreach": lambda s: torch._foreach_mul_(grads, s), "native": api,
                   "python": api, "native op": bare}
        moved = 8 * total   # fp32 read and written
    else:
        total, count = 50_000_000, 200
        title = f"{count} bf16 grads, {total / 1e6:g}M elements, unscaled into fp32 master grads"
        flat_in = torch.randn(total, device=device).bfloat16()
        flat_out = torch.empty(total, device=device)
        grads = [torch.randn(n, device=device).bfloat16() for n in split_sizes(total, count)]
        masters = [torch.empty(g.shape, device=device) for g in grads]

        def torch_op(s):
            inv = torch.full((1,), s, device=device)
            torch._foreach_copy_(masters, grads)
            torch._amp_foreach_non_finite_check_and_unscale_(masters, found_inf, inv)

        def api(s):
            multi_tensor.scale(grads, masters, s, found_inf)

        def bare(s):
            torch.ops.apex_lite.scale_out.default(grads, masters, s, found_inf)

        def foreach(s):
            torch._foreach_copy_(masters, grads)
            torch._foreach_mul_(masters, s)

        columns = {"floor": lambda s: flat_out.copy_(flat_in), "torch": torch_op,
                   "torch foreach": foreach, "native": api, "python": api, "native op": bare}
        moved = 6 * total   # bf16 read, fp32 written
    return title, columns, moved


def timed(fn, scale, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn(scale)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def copy_bandwidth(device: torch.device, reps: int) -> float:
    """Measured device-to-device copy bandwidth in GB/s (read + write), for the GPU target."""
    src = torch.empty(100_000_000, device=device)
    dst = torch.empty_like(src)
    times = [timed(lambda s: dst.copy_(src), 1.0, device) for _ in range(reps + 1)][1:]
    return 2 * src.numel() * 4 / statistics.median(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--only", default="1,2,3", help="comma-separated workload numbers")
    parser.add_argument("--columns", default="floor,torch,torch foreach,native,python,native op",
                        help="comma-separated columns to measure (floor is always measured)")
    parser.add_argument("--quick", action="store_true", help="5 repetitions (tools/gpu_check.sh)")
    parser.add_argument("--json", help="also write the medians and ratios here")
    args = parser.parse_args()
    if args.quick:
        args.reps = 5
    device = torch.device(args.device)

    use_backend("native")
    native, why = multi_tensor.backend(device)
    print(f"torch {torch.__version__}, device {device}, {torch.get_num_threads()} threads, "
          f"median of {args.reps}; native backend: {native} ({why})")
    if native != "native":
        print("the native columns need the extension (build it with --cpp_ext); stopping")
        sys.exit(1)
    bandwidth = copy_bandwidth(device, args.reps) if device.type == "cuda" else None
    if bandwidth:
        print(f"device-to-device copy: {bandwidth:.0f} GB/s")
    record = {"device": str(device), "device_name": _device_name(device),
              "torch": torch.__version__, "reps": args.reps, "copy_gbps": bandwidth,
              "workloads": {}}

    print(f"{'workload':<72} {'column':>13} {'median ms':>10} {'x floor':>8} {'x copy':>7}")
    for index in (int(i) for i in args.only.split(",")):
        title, columns, moved = make_workload(index, device)
        wanted = {"floor"} | set(args.columns.split(","))
        columns = {name: fn for name, fn in columns.items() if name in wanted}
        times = {name: [] for name in columns}
        for rep in range(args.reps + 1):  # the first repetition warms up and is dropped
            scale = 0.5 if rep % 2 == 0 else 2.0
            for name, fn in columns.items():
                use_backend("python" if name == "python" else "native")
                elapsed = timed(fn, scale, device)
                if rep:
                    times[name].append(elapsed)
        floor = statistics.median(times["floor"])
        copy_time = moved / (bandwidth * 1e9) if bandwidth else None
        rows = record["workloads"][title] = {}
        for name, samples in times.items():
            median = statistics.median(samples)
            x_copy = median / copy_time if copy_time else None
            rows[name] = {"ms": median * 1e3, "x_floor": median / floor, "x_copy": x_copy}
            print(f"{title:<72} {name:>13} {median * 1e3:>10.2f} {median / floor:>8.2f} "
                  f"{'-' if x_copy is None else f'{x_copy:.2f}':>7}")
        del columns
    use_backend("native")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


if __name__ == "__main__":
    main()
