"""Fused optimizer step benchmark: ratios to the floor, all measured interleaved in one run.

Workloads: 25M fp32 parameters in 200 tensors, and 4000 tensors of 2500 elements. Variants:
  sgd foreach, sgd fused       torch.optim.SGD(momentum=0.9, foreach=True / fused=True).step()
  sgd ours                     apex_lite's SGDUpdate (momentum 0.9), the update FusedSGD and
                               amp's O2 step make: fp32 grads read from the params' .grad
  adamw foreach, adamw fused   torch.optim.AdamW(foreach=True / fused=True).step()
  adamw ours                   apex_lite's AdamUpdate (adam_w_mode), the update FusedAdam and
                               amp's O2 step make: fp32 grads read from the params' .grad
  O2 adamw torch               torch's closest to amp's O2 step: bf16 grads copied into fp32
                               master grads, unscaled and checked
                               (_amp_foreach_non_finite_check_and_unscale_), AdamW(fused=True)
                               step on the fp32 masters, masters copied into the bf16 model
  O2 adamw ours                AdamUpdate in amp's O2 form: bf16 grads read from the bf16 model
                               parameters' .grad, fp32 masters and state, bf16 model out
  O2 adamw ours, lists         the same fused_adam_ op called from Python with the six lists
                               built once: what passing 6 tensors per parameter costs per call
  O2 lamb ours                 fused_lamb_ likewise, lists passed (two stages: reads the state
                               twice; torch has no LAMB, so it is shown against the AdamW floor)
  mp lamb ours                 FusedMixedPrecisionLamb(reduced_precision_dtype=bf16).step() on
                               the bf16 parameters: the global gradient norm, the group's count,
                               then fused_lamb_mp_ on its own fp32 masters, bf16 parameters out
                               (the O2 layout, so shown against the AdamW O2 floor)
  adagrad foreach, fused       torch.optim.Adagrad(foreach=True / fused=True).step() (fused: CPU)
  adagrad ours                 apex_lite's AdagradUpdate, the update FusedAdagrad and amp's O2
                               step make: fp32 grads read from the params' .grad
  novograd ours                apex_lite's NovoGradUpdate (L2 per-layer norms) on fp32 params;
                               torch has no NovoGrad: against its floor only
  O2 novograd ours             NovoGradUpdate in amp's O2 form (bf16 grads and model, fp32
                               masters); NovoGrad's step reads the gradients twice (the norms,
                               then the update), so it cannot reach its one-pass floor
"ours" runs on apex_lite's backend for the device (native when the extension is built). The
update builds its lists once; on the native backend it hands them to C++ at its second step
(csrc/held_lists.cpp) and its later steps pass no list through Python.

The floor of a variant is one multithreaded pass over a flat tensor moving the bytes of its
ideal fused step: ``flat.mul_(1.0)`` over one fp32 tensor of half those bytes, which reads and
writes every byte once, in place, as the steps do with the parameters and the state. Bytes per
parameter: SGD with momentum 20 (grad 4 read, param 8 and buffer 8 read and written), AdamW 28
(grad 4, param 8, exp_avg and exp_avg_sq 16), AdamW O2 28 (bf16 grad 2 read, fp32 master 8,
state 16, bf16 model 2 written). The steps read a little more than they write (AdamW fp32 reads
16 bytes per parameter and writes 12), and O2 writes its model parameters to other lines than it
reads (a copy into a separate buffer, ``dst.copy_(src)``, runs at about 2/3 of the in-place
rate here, so it is no floor). Adagrad 20 (grad 4, param 8, sum 8), NovoGrad 20 (grad 4, param 8,
exp_avg 8; its per-parameter norm is one value), NovoGrad O2 20 (bf16 grad 2, master 8, exp_avg
8, bf16 model 2).

Every repetition runs each variant once, in a shuffled order; the table shows medians and the first
repetition (warm-up, state allocation) is dropped. GB/s is the ideal step's bytes over the time.

    python bench/optimizers.py [--device cuda] [--reps 7] [--threads N] [--only 1,2]
    python bench/optimizers.py --device cuda --quick --json optimizers.json   # gpu_check.sh
    python bench/optimizers.py --smoke          # tiny sizes, seconds: keeps this file working
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
from typing import Callable, Dict, List, Tuple

import torch

from apex_lite.multi_tensor import _backend
from apex_lite.optimizers import (AdagradHyper, AdagradUpdate, AdamHyper, AdamUpdate,
                                  FusedMixedPrecisionLamb, NovoGradHyper, NovoGradUpdate,
                                  SGDHyper, SGDUpdate)
from kernels import split_sizes, timed

# (title, total parameters, tensors) per workload; the smoke sizes keep the shapes' character.
WORKLOADS = {1: ("200 tensors, 25M fp32 params", 25_000_000, 200),
             2: ("4000 tensors of 2500 elements", 4000 * 2500, 4000)}
SMOKE_WORKLOADS = {1: ("200 tensors, 20K fp32 params (smoke)", 20_000, 200),
                   2: ("400 tensors of 25 elements (smoke)", 400 * 25, 400)}
BYTES_PER_PARAM = {"sgd": 20, "adamw": 28, "O2 adamw": 28}
FLOOR_OF = {"sgd foreach": "sgd", "sgd fused": "sgd", "sgd ours": "sgd",
            "adamw foreach": "adamw", "adamw fused": "adamw", "adamw ours": "adamw",
            "O2 adamw torch": "O2 adamw", "O2 adamw ours": "O2 adamw",
            "O2 adamw ours, lists": "O2 adamw", "O2 lamb ours": "O2 adamw"}
FLOOR_OF["mp lamb ours"] = "O2 adamw"     # issue 27
LR, MOMENTUM, WEIGHT_DECAY, BETAS, EPS = 1e-3, 0.9, 1e-2, (0.9, 0.999), 1e-8

# ---- Adagrad and NovoGrad rows ----
BYTES_PER_PARAM.update({"adagrad": 20, "novograd": 20, "O2 novograd": 20})
FLOOR_OF.update({"adagrad foreach": "adagrad", "adagrad fused": "adagrad",
                 "adagrad ours": "adagrad", "novograd ours": "novograd",
                 "O2 novograd ours": "O2 novograd"})
INV_SCALE = 2.0 ** -16


def describe_cpu() -> str:
    """The CPU's model and the vector flags the kernels care about, from /proc/cpuinfo."""
    model, flags = platform.processor() or "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model in ("", "unknown CPU", platform.machine()):
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    present = " ".join(f for f in wanted if f in flags) or "(none of the AVX ones)"
    try:
        from apex_lite import _build_info
        build = f"apex_lite._C built for {_build_info.CPU_ARCH}"
    except ImportError:
        build = "apex_lite._C build arch unknown"
    return (f"{model}; flags: {present}; torch CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}; {os.cpu_count()} logical CPUs; {build}")


def _floors(total: int, device) -> Dict[str, Callable[[], None]]:
    """{"floor <kind>": flat.mul_(1.0) over half the kind's bytes}, slices of one fp32 tensor."""
    flat = torch.ones(max(BYTES_PER_PARAM.values()) * total // 8, device=device)

    def floor(n):
        view = flat[:n]
        return lambda: view.mul_(1.0)

    return {f"floor {kind}": floor(per_param * total // 8)
            for kind, per_param in BYTES_PER_PARAM.items()}


def make_workload(total: int, count: int, device, ops) -> Dict[str, Callable[[], None]]:
    """{variant: a zero-argument step} for fp32 parameters split into `count` tensors."""
    sizes = split_sizes(total, count)
    found_inf = torch.zeros(1, device=device)
    one = torch.ones(1, device=device)
    inv_scale = torch.full((1,), INV_SCALE, device=device)

    # fp32 parameters with fp32 gradients, shared by the torch optimizers and ours; each
    # optimizer keeps its own state.
    params = [torch.nn.Parameter(torch.randn(n, device=device)) for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    variants: Dict[str, Callable[[], None]] = {}
    for name, make in (("sgd", lambda **kw: torch.optim.SGD(params, lr=LR, momentum=MOMENTUM,
                                                               **kw)),
                       ("adamw", lambda **kw: torch.optim.AdamW(params, lr=LR, betas=BETAS,
                                                                eps=EPS,
                                                                weight_decay=WEIGHT_DECAY,
                                                                **kw))):
        for flavour in ("foreach", "fused"):
            variants[f"{name} {flavour}"] = make(**{flavour: True}).step

    sgd_hyper = SGDHyper(LR, MOMENTUM, dampening=0.0, weight_decay=0.0, nesterov=False,
                         wd_after_momentum=False)
    sgd_state: dict = {}
    sgd_update = SGDUpdate(params)
    variants["sgd ours"] = lambda: sgd_update(sgd_state, one, found_inf, sgd_hyper)
    hyper = AdamHyper(LR, BETAS[0], BETAS[1], EPS, WEIGHT_DECAY, adam_w_mode=True,
                      bias_correction=True)
    adamw_state: dict = {}
    adamw_update = AdamUpdate(params)
    variants["adamw ours"] = lambda: adamw_update(adamw_state, one, found_inf, hyper)

    # O2: bf16 model parameters and gradients (of a loss scaled by 2**16), fp32 masters. Ours
    # (both forms) share their moments (values only drift), torch's optimizer has its own.
    masters = [torch.nn.Parameter(torch.randn(n, device=device)) for n in sizes]
    half_params = [m.detach().bfloat16() for m in masters]
    half_grads = [(torch.randn(n, device=device) * 2.0 ** 10).bfloat16() for n in sizes]
    for h, g in zip(half_params, half_grads):
        h.grad = g
    master_grads = [torch.empty(n, device=device) for n in sizes]
    for m, g in zip(masters, master_grads):
        m.grad = g
    torch_o2 = torch.optim.AdamW(masters, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                 fused=True)
    plain_masters = [m.detach() for m in masters]

    def o2_torch():
        torch._foreach_copy_(master_grads, half_grads)
        torch._amp_foreach_non_finite_check_and_unscale_(master_grads, found_inf, inv_scale)
        torch_o2.step()
        torch._foreach_copy_(half_params, plain_masters)

    variants["O2 adamw torch"] = o2_torch
    o2_state: dict = {}
    o2_update = AdamUpdate(plain_masters, grad_sources=half_params, model_params=half_params)
    variants["O2 adamw ours"] = lambda: o2_update(o2_state, inv_scale, found_inf, hyper)
    o2_update(o2_state, inv_scale, found_inf, hyper)    # creates the state the lists form reads
    exp_avgs = [o2_state[m]["exp_avg"] for m in plain_masters]
    exp_avg_sqs = [o2_state[m]["exp_avg_sq"] for m in plain_masters]
    steps = [o2_state[m]["step"] for m in plain_masters]
    variants["O2 adamw ours, lists"] = lambda: ops.fused_adam_(
        plain_masters, half_grads, exp_avgs, exp_avg_sqs, half_params, steps, inv_scale,
        found_inf, *hyper)
    grad_norm = torch.ones(1, device=device)
    variants["O2 lamb ours"] = lambda: ops.fused_lamb_(
        plain_masters, half_grads, exp_avgs, exp_avg_sqs, half_params, steps, inv_scale,
        found_inf, grad_norm, LR, BETAS[0], BETAS[1], 1e-6, WEIGHT_DECAY, True, True, True, 1.0,
        False)

    # ---- issue 27: FusedMixedPrecisionLamb, the whole optimizer step on the bf16 parameters
    # (their gradients the O2 ones), its masters made from them at its first step ----
    mp_lamb = FusedMixedPrecisionLamb(half_params, lr=LR, betas=BETAS, eps=1e-6,
                                      weight_decay=WEIGHT_DECAY,
                                      reduced_precision_dtype=torch.bfloat16)
    variants["mp lamb ours"] = mp_lamb.step
    # ---- end issue 27 ----

    variants.update(_adagrad_novograd_variants(params, plain_masters, half_params, device))
    variants.update(_floors(total, device))
    return variants


def _adagrad_novograd_variants(params, masters, half_params, device
                               ) -> Dict[str, Callable[[], None]]:
    """The Adagrad and NovoGrad rows over make_workload's tensors (each with its own state)."""
    found_inf = torch.zeros(1, device=device)
    one = torch.ones(1, device=device)
    inv_scale = torch.full((1,), INV_SCALE, device=device)
    variants: Dict[str, Callable[[], None]] = {}
    for flavour in ("foreach", "fused"):
        if flavour == "fused" and device.type != "cpu":
            variants["adagrad fused"] = lambda: None   # torch's fused Adagrad is CPU only
            continue
        variants[f"adagrad {flavour}"] = torch.optim.Adagrad(
            params, lr=LR, weight_decay=WEIGHT_DECAY, **{flavour: True}).step
    adagrad_update, adagrad_state = AdagradUpdate(params), {}
    adagrad_hyper = AdagradHyper(LR, 1e-10, WEIGHT_DECAY, adagrad_w_mode=False)
    variants["adagrad ours"] = lambda: adagrad_update(adagrad_state, one, found_inf,
                                                      adagrad_hyper)
    novograd_hyper = NovoGradHyper(LR, 0.95, 0.98, EPS, WEIGHT_DECAY, bias_correction=True,
                                   grad_averaging=True, reg_inside_moment=False, norm_type=2,
                                   init_zero=False)
    novograd_update, novograd_state = NovoGradUpdate(params), {}
    variants["novograd ours"] = lambda: novograd_update(novograd_state, one, found_inf,
                                                        novograd_hyper)
    o2_update = NovoGradUpdate(masters, grad_sources=half_params, model_params=half_params)
    o2_state: dict = {}
    variants["O2 novograd ours"] = lambda: o2_update(o2_state, inv_scale, found_inf,
                                                     novograd_hyper)
    return variants


def measure(variants: Dict[str, Callable[[], None]], reps: int, device) -> Dict[str, float]:
    """Median seconds per variant, every repetition running each variant once, in an order
    shuffled per repetition (seeded): a variant's time depends on what ran just before it (on
    the 2-core CPU host the one after torch's O2 step ran up to 1.6x slower than the same step
    elsewhere in the order), so no variant keeps one neighbour."""
    samples: Dict[str, List[float]] = {name: [] for name in variants}
    order = list(variants)
    shuffle = random.Random(0).shuffle
    for rep in range(reps + 1):   # the first repetition warms up and is dropped
        for name in order:
            fn = variants[name]
            elapsed = timed(lambda _: fn(), None, device)
            if rep:
                samples[name].append(elapsed)
        shuffle(order)
    return {name: statistics.median(times) for name, times in samples.items()}


def report(title: str, total: int, medians: Dict[str, float]) -> List[Tuple[str, float]]:
    """Prints the workload's rows; returns (variant, ratio to its floor) pairs."""
    ratios = []
    for name, kind in FLOOR_OF.items():
        median = medians[name]
        ratio = median / medians[f"floor {kind}"]
        gbps = BYTES_PER_PARAM[kind] * total / median / 1e9
        print(f"{title:<40} {name:<20} {median * 1e3:>10.4f} {ratio:>8.2f} {gbps:>7.1f}")
        ratios.append((name, ratio))
    for kind in BYTES_PER_PARAM:
        median = medians[f"floor {kind}"]
        gbps = BYTES_PER_PARAM[kind] * total / median / 1e9
        print(f"{title:<40} {'floor ' + kind:<20} {median * 1e3:>10.4f} {1.0:>8.2f} {gbps:>7.1f}")
    return ratios


def _verdict(value: float, target: float) -> str:
    return "met" if value <= target else "MISSED"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, help="torch threads on CPU (default: torch's)")
    parser.add_argument("--only", default="1,2", help="comma-separated workload numbers")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 2 repetitions")
    parser.add_argument("--quick", action="store_true",
                        help="3 repetitions of the full sizes (tools/gpu_check.sh)")
    parser.add_argument("--json", help="also write the medians and ratios here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.smoke:
        args.reps = 2
    elif args.quick:
        args.reps = 3

    ops = _backend.ops_for(device)
    name, why = _backend.backend(device)
    print(f"torch {torch.__version__}, device {device}, {torch.get_num_threads()} threads, "
          f"median of {args.reps}; ours: {name} backend ({why})")
    if device.type == "cpu":
        print(f"CPU: {describe_cpu()}")
    if name != "native" and not args.smoke:
        print("'ours' needs the native extension (build it with --cpp_ext); stopping")
        return 1

    workloads = SMOKE_WORKLOADS if args.smoke else WORKLOADS
    print(f"{'workload':<40} {'variant':<20} {'median ms':>10} {'x floor':>8} {'GB/s':>7}")
    results = {}
    for index in (int(i) for i in args.only.split(",")):
        title, total, count = workloads[index]
        variants = make_workload(total, count, device, ops)
        medians = measure(variants, args.reps, device)
        results[index] = (dict(report(title, total, medians)), medians)
        del variants

    if 1 in results:
        ratios, medians = results[1]
        adamw = medians["adamw ours"] / medians["adamw fused"]
        print(f"target: O2 adamw ours <= 1.3x its floor ({workloads[1][0]}): "
              f"{ratios['O2 adamw ours']:.2f} {_verdict(ratios['O2 adamw ours'], 1.3)}")
        print(f"target: adamw ours no slower than torch AdamW(fused=True) on fp32 params: "
              f"{adamw:.2f} {_verdict(adamw, 1.0)}")
    if 2 in results:
        ratios, _ = results[2]
        print(f"target: O2 adamw ours <= 1.6x its floor ({workloads[2][0]}): "
              f"{ratios['O2 adamw ours']:.2f} {_verdict(ratios['O2 adamw ours'], 1.6)}")
    _report_adagrad_novograd(results, workloads, device.type == "cpu")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "torch": torch.__version__, "reps": args.reps,
                       "backend": f"{name} ({why})",
                       "workloads": {workloads[i][0]: {"x_floor": dict(ratios),
                                                       "ms": {k: v * 1e3
                                                              for k, v in medians.items()}}
                                     for i, (ratios, medians) in results.items()}}, f, indent=1)
    return 0


def _report_adagrad_novograd(results, workloads, cpu: bool) -> None:
    """Adagrad against torch's foreach (and fused, on the CPU) Adagrad; NovoGrad against its
    floor (ratios, no targets)."""
    for index, (ratios, medians) in sorted(results.items()):
        title = workloads[index][0]
        line = (f"adagrad ours / torch Adagrad(foreach=True) ({title}): "
                f"{medians['adagrad ours'] / medians['adagrad foreach']:.2f}")
        if cpu:
            line += (f"; / Adagrad(fused=True): "
                     f"{medians['adagrad ours'] / medians['adagrad fused']:.2f}")
        print(line)
        print(f"novograd ours x its floor ({title}): {ratios['novograd ours']:.2f}; "
              f"O2 novograd ours: {ratios['O2 novograd ours']:.2f}")


if __name__ == "__main__":
    sys.exit(main())
