"""Sharded training on PyTorch FSDP2: apex_lite O2 against FSDP2's own mixed precision.

examples/fsdp.py's model, a stack of pre-norm MLP blocks (a few hundred MB of fp32 parameters
by default), each block a ``fully_shard`` unit and the root a unit, AdamW, 2 ranks on gloo
(CPU). Each variant runs in
its own pair of processes (peak memory is a process's):

  fp32            FSDP2 without a policy: fp32 compute, torch.optim.AdamW
  torch mp        FSDP2 with MixedPrecisionPolicy(param_dtype=half, reduce_dtype=float32),
                  torch.amp.GradScaler, torch.optim.AdamW: PyTorch's own mixed precision
  apex_lite O2    the same policy, amp.initialize(opt_level="O2") with torch.optim.AdamW:
                  amp's default step on the fp32 shards (the masters): the fused step where
                  the native kernels serve the CPU, else the unfused one (the path column)

Reported per variant, the larger of the two ranks' numbers: the median ms of a training step
(forward, backward, step) over the timed steps; the growth of the rank's peak resident memory
from before the model was built (setup included); and the peak counted from the end of setup
(the steps' own). Ratios are to "torch mp", measured in this run. Target (issue 17): apex_lite O2
holds no more memory per rank than "torch mp" and is no more than 5% slower.

The ranks run with glibc's mmap threshold fixed at 128 KiB (MALLOC_MMAP_THRESHOLD_), so that
every freed tensor goes back to the OS and the resident peak counts live tensors. With glibc's
default (a threshold that rises to 32 MiB after the first large free), freed 1-32 MiB shards
stay resident in the heap or not depending on the order of allocations: the peaks of two
variants holding the same tensors differed by 7%. ``--default-malloc`` keeps glibc's default.

Numbers from a machine shared with other jobs are rough: rerun on a quiet machine before
quoting them.

    python bench/fsdp.py                      # width 1024, 8 blocks: 67M parameters, 268 MB
    python bench/fsdp.py --width 2048 --blocks 4
    python bench/fsdp.py --smoke              # seconds: keeps this file working
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

# bench/ is on the path when this file runs as a script: o2_step.py's resident-memory probes.
from o2_step import _peak_rss_bytes, _reset_peak, _status_bytes

VARIANTS = ["fp32", "torch mp", "apex_lite O2"]
BASELINE = "torch mp"


def _example():
    """examples/fsdp.py as a module: the benchmark times its ``Net`` and tears down as it does."""
    path = Path(__file__).resolve().parent.parent / "examples" / "fsdp.py"
    spec = importlib.util.spec_from_file_location("fsdp_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def run_rank(name: str, args) -> dict:
    """One rank of variant ``name`` in this process: train and measure, then tear down as
    examples/fsdp.py does."""
    import torch.distributed as dist
    import torch.distributed.nn  # noqa: F401  (before init_process_group)
    from apex_lite import amp

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    example = _example()
    result = _measure(name, args, example.Net)
    dist.barrier()
    amp.initialize([], enabled=False)   # amp's default handle lets go of the model
    example.release_device_meshes()
    dist.destroy_process_group()
    return result


def _measure(name: str, args, net) -> dict:
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from apex_lite import amp

    rank = dist.get_rank()
    base_rss = _peak_rss_bytes()
    torch.manual_seed(0)
    model = net(args.width, args.blocks)
    half = torch.bfloat16
    policy = MixedPrecisionPolicy() if name == "fp32" else \
        MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = None
    if name == "apex_lite O2":
        model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    elif name == "torch mp":
        scaler = torch.amp.GradScaler("cpu")
    params = sum(p.numel() for p in model.parameters())
    step_peak_counted = _reset_peak()
    generator = torch.Generator().manual_seed(100 + rank)
    times = []
    for i in range(args.warmup + args.steps):
        x = torch.randn(args.batch, args.width, generator=generator)
        y = torch.randn(args.batch, 1, generator=generator)
        dist.barrier()   # both ranks start the step together: the time is the step's
        start = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        optimizer.zero_grad(set_to_none=True)
        if name == "apex_lite O2":
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
        elif scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        elapsed = time.perf_counter() - start
        if i >= args.warmup:
            times.append(elapsed)
    if name == "apex_lite O2":
        amp.loss_scalers()   # the host catches up: its cost is not hidden past the end
        path = optimizer._apex_lite_amp.path.describe()
    else:
        path = "torch"
    return {"variant": name, "rank": rank, "params": params,
            "ms": 1e3 * statistics.median(times),
            "peak_mib": (_peak_rss_bytes() - base_rss) / 2 ** 20,
            "steps_peak_mib": (_status_bytes("VmHWM") - base_rss) / 2 ** 20
            if step_peak_counted else None, "path": path}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_variant(name: str, args) -> list:
    """Both ranks of ``name``, each its own process; their results."""
    port = _free_port()
    procs = []
    for rank in range(args.ranks):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(args.ranks), LOCAL_RANK=str(rank),
                   OMP_NUM_THREADS=str(args.threads))
        if not args.default_malloc:
            env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
        child = [sys.executable, __file__, "--variant", name, "--width", str(args.width),
                 "--blocks", str(args.blocks), "--batch", str(args.batch), "--steps",
                 str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads)]
        procs.append(subprocess.Popen(child, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        stdout, stderr = p.communicate()
        if p.returncode != 0:
            for q in procs:
                if q.poll() is None:
                    q.kill()
            raise RuntimeError(f"{name}: a rank failed\n{stderr[-3000:]}")
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64, help="rows per rank")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="per rank")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--default-malloc", action="store_true",
                        help="keep glibc's dynamic mmap threshold (see above)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to test the script")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--variant", help=argparse.SUPPRESS)   # a rank's job
    args = parser.parse_args()
    if args.smoke:
        args.width, args.blocks, args.batch, args.steps, args.warmup = 32, 2, 8, 2, 1
    if args.variant:
        print(json.dumps(run_rank(args.variant, args)))
        return

    params = args.blocks * (8 * args.width ** 2 + 7 * args.width) + args.width + 1
    print(f"bench/fsdp.py: {params:,} parameters ({4 * params / 2 ** 20:.0f} MiB in fp32) in "
          f"{args.blocks} blocks of width {args.width}, {args.ranks} ranks (gloo, "
          f"{args.threads} thread(s) each), batch {args.batch} per rank, AdamW, median of "
          f"{args.steps} steps; each variant in its own processes"
          f"{'' if args.default_malloc else ', MALLOC_MMAP_THRESHOLD_=131072'}")
    print(f"torch {torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()}")
    results = {}
    for name in args.variants.split(","):
        ranks = run_variant(name, args)
        results[name] = {
            "ms": max(r["ms"] for r in ranks), "peak_mib": max(r["peak_mib"] for r in ranks),
            "steps_peak_mib": None if any(r["steps_peak_mib"] is None for r in ranks)
            else max(r["steps_peak_mib"] for r in ranks), "path": ranks[0]["path"],
            "ranks": ranks}
    print("\nper rank (the larger of the ranks): peak = growth of the peak resident memory "
          "over the rank's start (setup included); steps peak = the same counted from the end "
          "of setup")
    print(f"\n{'variant':14s} {'ms/step':>9s} {'x torch mp':>10s} {'peak MiB':>9s} "
          f"{'x torch mp':>10s} {'steps peak':>10s} {'x torch mp':>10s}  path")
    base = results.get(BASELINE, {})

    def ratio(value, reference):
        return f"{value / reference:.2f}" if value is not None and reference else "-"

    for name, r in results.items():
        steps_peak = r["steps_peak_mib"]
        print(f"{name:14s} {r['ms']:9.1f} {ratio(r['ms'], base.get('ms')):>10s} "
              f"{r['peak_mib']:9.1f} {ratio(r['peak_mib'], base.get('peak_mib')):>10s} "
              f"{'-' if steps_peak is None else f'{steps_peak:.1f}':>10s} "
              f"{ratio(steps_peak, base.get('steps_peak_mib')):>10s}  {r['path']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"width": args.width, "blocks": args.blocks, "batch": args.batch,
                       "ranks": args.ranks, "default_malloc": args.default_malloc,
                       "torch": torch.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
