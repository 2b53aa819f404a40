"""Every apex_lite op once or a few times, at small and odd sizes: what tools/gpu_check.sh runs under
compute-sanitizer (memcheck over all of it, racecheck over the reduction kernels), so that a
bad read, write or race in a CUDA kernel shows there in seconds.

Each op runs through the backend that serves the device (``apex_lite.multi_tensor._backend``,
which stages what the kernels do not take), on: sizes 0, 1, 3, 555, 65537 (one past the kernels'
chunk) and 7777; fp32, fp16 and bf16 tensors, with fp32 state and masters and half model
parameters; found_inf clear and set; contiguous tensors, channels_last ones (parameter, gradient
and state in one layout) and slices (every other element). The held lists (the optimizers' step
without lists) and the gradient watch run too. The values are checked only for being finite
where they must be: correctness is the tests' business, memory and races the sanitizer's.

    python tools/cuda_sanitizer_ops.py                         # every op, on cuda
    python tools/cuda_sanitizer_ops.py --only l2norm,lamb,novograd
    python tools/cuda_sanitizer_ops.py --device cpu --dtypes float32   # without a GPU

Prints one line per group and "ok" at the end; exits 1 on an error.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, Dict, List

import torch

SIZES = [0, 1, 3, 555, 65537, 7777]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]   # --dtypes narrows it
LAYOUTS = ["contiguous", "channels_last", "sliced"]


def _tensor(n: int, dtype, device, layout: str, seed: int, scale: float = 1.0) -> torch.Tensor:
    """n values (or a 4-D shape holding about n, for channels_last) laid out as asked."""
    g = torch.Generator().manual_seed(seed)
    if layout == "channels_last":
        shape = (2, 3, max(1, n // 30), 5) if n else (0, 3, 1, 5)
        return (scale * torch.randn(shape, generator=g)).to(dtype).to(device).contiguous(
            memory_format=torch.channels_last)
    values = (scale * torch.randn(n, generator=g)).to(dtype).to(device)
    if layout == "sliced":
        spread = torch.zeros(2 * n, dtype=dtype, device=device)
        spread[::2] = values
        return spread[::2]
    return values


def _lists(count: int, dtype, device, layout: str, seed: int, scale: float = 1.0):
    return [_tensor(SIZES[i % len(SIZES)], dtype, device, layout, seed + i, scale)
            for i in range(count)]


def _set_first(t: torch.Tensor, value: float) -> None:
    """The first element of ``t`` (any layout) set to ``value``; nothing for an empty tensor."""
    if t.numel():
        t[(0,) * t.dim()] = value


def _flags(device) -> List[torch.Tensor]:
    """found_inf clear, then set."""
    return [torch.zeros(1, device=device), torch.ones(1, device=device)]


def run_elementwise(ops, device) -> None:
    for dtype in DTYPES:
        for layout in LAYOUTS:
            for found_inf in _flags(device):
                xs = _lists(6, dtype, device, layout, 1)
                _set_first(xs[3], float("inf"))
                outs = [torch.empty_like(x, dtype=torch.float32) for x in xs]
                ops.scale_(xs, 0.5, found_inf)
                ops.scale_out(xs, outs, 2.0, found_inf)
                ys = _lists(6, dtype, device, layout, 2)
                ops.axpby_(xs, ys, 0.5, 2.0, found_inf)
                ops.axpby_out(xs, ys, outs, 1.5, -0.5, found_inf)


def run_l2norm(ops, device) -> None:
    for dtype in DTYPES:
        for layout in LAYOUTS:
            xs = _lists(6, dtype, device, layout, 3)
            for per_tensor in (False, True):
                total, _ = ops.l2norm(xs, per_tensor)
                assert bool(torch.isfinite(total).all()), "l2norm of finite values is not finite"
            ops.nonfinite_flags(xs)


def _step_lists(dtype, device, layout, with_model: bool, count: int = 6):
    """params (fp32 masters), grads (dtype), model params (dtype) and fp32 state tensors."""
    params = _lists(count, torch.float32, device, layout, 10)
    grads = _lists(count, dtype, device, layout, 20, scale=1024.0)
    models = [p.to(dtype) for p in params] if with_model and dtype != torch.float32 else []
    return params, grads, models


def _state(params, value: float = 0.0):
    return [torch.full_like(p, value) for p in params]


def _steps(params, device):
    return [torch.zeros((), device=device) for _ in params]


def _optimizer_cases(device):
    """(dtype, layout, found_inf, inv_scale) of each optimizer call."""
    inv = torch.full((1,), 1.0 / 1024, device=device)
    for dtype in DTYPES:
        for layout in LAYOUTS:
            for found_inf in _flags(device):
                yield dtype, layout, found_inf, inv


def run_sgd_adam(ops, device) -> None:
    for dtype, layout, found_inf, inv in _optimizer_cases(device):
        params, grads, models = _step_lists(dtype, device, layout, True)
        for momentum, nesterov, after in ((0.0, False, False), (0.9, True, False),
                                          (0.9, False, True)):
            ops.fused_sgd_(params, grads, _state(params) if momentum else [], models, inv,
                           found_inf, 0.1, momentum, 0.0, 1e-2, nesterov, after, True)
        for adam_w_mode, bias_correction in ((True, True), (False, False)):
            ops.fused_adam_(params, grads, _state(params), _state(params), models,
                            _steps(params, device), inv, found_inf, 1e-3, 0.9, 0.999, 1e-8,
                            1e-2, adam_w_mode, bias_correction)


def run_lamb(ops, device) -> None:
    for dtype, layout, found_inf, inv in _optimizer_cases(device):
        params, grads, models = _step_lists(dtype, device, layout, True)
        grad_norm = torch.full((1,), 3.0, device=device)
        for use_nvlamb in (False, True):
            ops.fused_lamb_(params, grads, _state(params), _state(params), models,
                            _steps(params, device), inv, found_inf, grad_norm, 1e-3, 0.9, 0.999,
                            1e-6, 1e-2, True, True, True, 1.0, use_nvlamb)
        ops.fused_lamb_mp_(params, grads, _state(params), _state(params), models,
                           torch.ones(1, device=device),
                           torch.full((), 1e-3, device=device), inv, found_inf, grad_norm, 0.9,
                           0.999, 1e-6, 1e-2, True, True, True, 1.0, False)


def run_novograd(ops, device) -> None:
    for dtype, layout, found_inf, inv in _optimizer_cases(device):
        params, grads, models = _step_lists(dtype, device, layout, True)
        _set_first(grads[1], float("nan"))   # the inf norm passes it over (fmaxf)
        for norm_type in (0, 2):
            ops.fused_novograd_(params, grads, _state(params),
                                [torch.zeros((), device=device) for _ in params], models,
                                _steps(params, device), inv, found_inf, 1e-2, 0.95, 0.98, 1e-8,
                                1e-2, True, True, norm_type == 0, norm_type, False)


def run_adagrad(ops, device) -> None:
    for dtype, layout, found_inf, inv in _optimizer_cases(device):
        params, grads, models = _step_lists(dtype, device, layout, True)
        for adagrad_w_mode in (False, True):
            ops.fused_adagrad_(params, grads, _state(params, 0.1), models,
                               _steps(params, device), inv, found_inf, 1e-2, 1e-10, 1e-2,
                               adagrad_w_mode)


def run_held_lists(ops, device) -> None:
    """The optimizers' held step (csrc/held_lists.cpp) and the gradient watch, as amp's O2 step
    and FusedAdam make them."""
    from apex_lite.optimizers import FusedAdam, FusedSGD
    for dtype in DTYPES:
        for layout in ("contiguous", "channels_last"):
            params = [torch.nn.Parameter(t) for t in _lists(6, dtype, device, layout, 30)]
            for make in (lambda ps: FusedAdam(ps, lr=1e-3), lambda ps: FusedSGD(ps, lr=0.1,
                                                                                momentum=0.9)):
                optimizer = make(params)
                for _ in range(3):
                    for p in params:
                        p.grad = torch.randn_like(p)
                    optimizer.step()
            watch = ops.watch_grads(params)
            watch.record()
            params[2].grad.add_(1.0)
            assert watch.changed() == 2, "the gradient watch missed an in-place change"


GROUPS: Dict[str, Callable] = {"elementwise": run_elementwise, "l2norm": run_l2norm,
                               "sgd_adam": run_sgd_adam, "lamb": run_lamb,
                               "novograd": run_novograd, "adagrad": run_adagrad,
                               "held": run_held_lists}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--only", help=f"comma-separated groups of {', '.join(GROUPS)}")
    parser.add_argument("--dtypes", default="float32,float16,bfloat16",
                        help="the stepped tensors' dtypes (the dry run on a CPU: float32)")
    args = parser.parse_args(argv)
    DTYPES[:] = [getattr(torch, name) for name in args.dtypes.split(",")]
    from apex_lite.multi_tensor import _backend
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: run with --device cpu to check the script itself")
        return 1
    ops = _backend.ops_for(device)
    backend, why = _backend.backend(device)
    print(f"cuda_sanitizer_ops: device {device}, backend {backend} ({why})")
    names = args.only.split(",") if args.only else list(GROUPS)
    unknown = [name for name in names if name not in GROUPS]
    if unknown:
        parser.error(f"unknown groups {unknown}; the groups are {', '.join(GROUPS)}")
    for name in names:
        start = time.perf_counter()
        GROUPS[name](ops, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        print(f"  {name:12s} {time.perf_counter() - start:6.2f} s")
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
