"""The floor of O2's step on torch's fused kernels (a pure install), and where its time goes.

bench/o2_step.py measures amp's O2 step against fp32 ``AdamW(fused=True)``, each variant in its
own processes. Here the same model (parameters in many tensors, a forward that only sums them,
bf16 at O2) runs two ways in one process, interleaved step by step:

  fp32      fp32 parameters, ``loss.backward()``, ``torch.optim.AdamW(fused=True).step()``
  route     the route amp's O2 step takes without native kernels, called directly, no amp:
            the half model's backward; the inf/NaN check of its gradients (the Python
            backend's ``nonfinite_flags``, what amp runs at the end of ``scale_loss``); the
            held AdamW step of ``multi_tensor/_torch_fused.py`` (step counts, then per chunk:
            the gradients converted to fp32, torch's fused AdamW, the masters rounded into the
            half model)

  amp       amp's O2 with torch.optim.AdamW, the default fused step, as on a pure install
            (this script sets APEX_LITE_DISABLE_EXT=1): ``with amp.scale_loss(...)``, ``step()``

and a fourth, ``parts``, which makes the route's step again with each pass timed on its own
(the conversion, the kernel and the rounding summed over the chunks), for the breakdown: its
total is shown beside the route's, which it must match within noise. The route has no loss
scaler, hooks or bookkeeping: whatever amp does, O2 on torch's kernels costs at least its time,
and amp's row shows what amp adds. Medians over the steps; interleaving puts the variants in
the same moments of a shared host (the same fp32 step's process medians moved between 10.5 and
15.4 ms within one run of o2_step.py). Memory is o2_step.py's business (one process each).

    python bench/o2_route_floor.py                  # 8M parameters in 200 tensors, ~30 s
    python bench/o2_route_floor.py --tensors 20
    python bench/o2_route_floor.py --smoke          # seconds: keeps this file working
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Dict, List

# amp's row is the pure install's O2 step: no native kernels, whatever is built here.
os.environ["APEX_LITE_DISABLE_EXT"] = "1"

import torch  # noqa: E402

from apex_lite import amp  # noqa: E402
from apex_lite.multi_tensor import _python, _torch_fused  # noqa: E402
from o2_step import cpu_line  # noqa: E402  (bench/ is on the path of a script run from it)

LR, BETAS, EPS, WEIGHT_DECAY = 1e-4, (0.9, 0.999), 1e-8, 0.01
PARTS = ("counts", "conversion", "kernel", "rounding")


def _forward(tensors) -> torch.Tensor:
    return torch.stack([t.sum() for t in tensors]).float().sum() * 1e-3


class Fp32:
    def __init__(self, masters: List[torch.Tensor]):
        self.params = [torch.nn.Parameter(m.clone()) for m in masters]
        self.opt = torch.optim.AdamW(self.params, lr=LR, betas=BETAS, eps=EPS,
                                     weight_decay=WEIGHT_DECAY, fused=True)

    def step(self, times: Dict[str, float]) -> None:
        self.opt.zero_grad(set_to_none=True)
        loss = _forward(self.params)
        start = time.perf_counter()
        loss.backward()
        middle = time.perf_counter()
        self.opt.step()
        end = time.perf_counter()
        times["backward"], times["step"], times["total"] = middle - start, end - middle, end - start


class Amp:
    def __init__(self, masters: List[torch.Tensor], half: torch.dtype):
        model = torch.nn.Module()
        model.params = torch.nn.ParameterList(torch.nn.Parameter(m.clone()) for m in masters)
        opt = torch.optim.AdamW(model.params.parameters(), lr=LR, betas=BETAS, eps=EPS,
                                weight_decay=WEIGHT_DECAY)
        self.model, self.opt = amp.initialize(model, opt, opt_level="O2", half_dtype=half,
                                              verbosity=0)
        self.params = tuple(self.model.params)
        self.path = self.opt._apex_lite_amp.path.describe()

    def step(self, times: Dict[str, float]) -> None:
        self.opt.zero_grad(set_to_none=True)
        loss = _forward(self.params)
        start = time.perf_counter()
        with amp.scale_loss(loss, self.opt) as scaled:
            scaled.backward()
        middle = time.perf_counter()
        self.opt.step()
        end = time.perf_counter()
        times["scale_loss"], times["step"], times["total"] = (middle - start, end - middle,
                                                               end - start)


class Route:
    """O2's masters, half model and AdamW state, as amp's O2 builds them; the step of
    ``_torch_fused``'s held lists (``timed=False``) or the same passes timed one by one."""

    def __init__(self, masters: List[torch.Tensor], half: torch.dtype):
        self.masters = [m.clone() for m in masters]
        self.model = [torch.nn.Parameter(m.to(half)) for m in self.masters]
        steps = [torch.zeros((), dtype=torch.float32) for _ in self.masters]
        self.state = [[torch.zeros_like(m) for m in self.masters],
                      [torch.zeros_like(m) for m in self.masters], steps]
        self.held = _torch_fused.hold_lists(self.masters, self.model,
                                            [p.detach() for p in self.model], self.state)
        self.layout = _torch_fused._Layout(self.masters, self.state[:2], steps,
                                           [p.detach() for p in self.model])
        self.kernel = _torch_fused._adam_kernel(LR, *BETAS, EPS, WEIGHT_DECAY, True)
        self.inv_scale = torch.ones(1)

    def step(self, times: Dict[str, float], timed: bool) -> None:
        for p in self.model:
            p.grad = None
        loss = _forward(self.model)
        start = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        grads = [p.grad for p in self.model]
        found_inf = _python.nonfinite_flags(grads).any().to(torch.float32).reshape(1)
        checked = time.perf_counter()
        with torch.no_grad():
            if timed:
                self._timed_step(grads, found_inf, times)
            else:
                self.held.fused_adam_(self.inv_scale, found_inf, LR, *BETAS, EPS,
                                      WEIGHT_DECAY, True, True)
        end = time.perf_counter()
        times["backward"], times["check"] = backward - start, checked - backward
        times["step"], times["total"] = end - checked, end - start

    def _timed_step(self, grads, found_inf, times: Dict[str, float]) -> None:
        """``_torch_fused._step`` over the layout, each pass timed (the chunks' conversion,
        kernel and rounding summed)."""
        clock = time.perf_counter
        for part in PARTS:
            times[part] = 0.0
        start = clock()
        grad_scale, flag = _torch_fused._scales(self.inv_scale, found_inf)
        _torch_fused._count_steps(self.state[2], flag)
        times["counts"] = clock() - start
        storage = self.layout.buffer.untyped_storage()
        storage.resize_(self.layout.nbytes)
        for chunk in self.layout.chunks:
            assert not chunk.staged   # contiguous tensors: every chunk is stepped in place
            a = clock()
            torch._foreach_copy_(chunk.outs, chunk.grads(grads))
            b = clock()
            self.kernel(chunk.params, chunk.outs, chunk.states, chunk.steps, grad_scale, flag)
            c = clock()
            torch._foreach_copy_(chunk.models, chunk.params)
            d = clock()
            times["conversion"] += b - a
            times["kernel"] += c - b
            times["rounding"] += d - c
        storage.resize_(0)


def measure(args) -> dict:
    torch.set_num_threads(args.threads)
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    size = args.params // args.tensors
    generator = torch.Generator().manual_seed(0)
    masters = [0.01 * torch.randn(size, generator=generator) for _ in range(args.tensors)]
    fp32, route, parts = Fp32(masters), Route(masters, half), Route(masters, half)
    amp_o2 = Amp(masters, half)
    del masters
    runs = {"fp32": (lambda t: fp32.step(t)), "route": (lambda t: route.step(t, False)),
            "amp": (lambda t: amp_o2.step(t)), "parts": (lambda t: parts.step(t, True))}
    samples: Dict[str, List[Dict[str, float]]] = {name: [] for name in runs}
    order = list(runs)
    for i in range(args.warmup + args.steps):
        for name in order:
            times: Dict[str, float] = {}
            runs[name](times)
            if i >= args.warmup:
                samples[name].append(times)
        order = order[1:] + order[:1]
    # The route and its timed twin make the same update from the same start.
    torch.testing.assert_close(route.masters, parts.masters, rtol=0, atol=0)
    amp.loss_scalers()   # the host catches up: nothing of amp's is left uncounted
    result = {name: {key: 1e3 * statistics.median(s[key] for s in rows) for key in rows[0]}
              for name, rows in samples.items()}
    result["amp"]["path"] = amp_o2.path
    return result


def report(result: dict) -> List[str]:
    fp32, route, parts, amp_o2 = result["fp32"], result["route"], result["parts"], result["amp"]
    ratio = route["total"] / fp32["total"]
    without_check = (route["total"] - route["check"]) / fp32["total"]
    return [
        f"fp32 AdamW(fused):  backward {fp32['backward']:.2f} + step {fp32['step']:.2f} = "
        f"{fp32['total']:.2f} ms",
        f"route, no amp:      backward {route['backward']:.2f} + check {route['check']:.2f} + "
        f"step {route['step']:.2f} = {route['total']:.2f} ms: {ratio:.2f}x fp32 "
        f"({without_check:.2f}x without the check)",
        f"its step, by pass:  counts {parts['counts']:.2f} + conversion {parts['conversion']:.2f}"
        f" + kernel {parts['kernel']:.2f} + rounding {parts['rounding']:.2f} (timed twin: step "
        f"{parts['step']:.2f}, total {parts['total']:.2f} ms)",
        f"amp O2:             scale_loss {amp_o2['scale_loss']:.2f} + step {amp_o2['step']:.2f} "
        f"= {amp_o2['total']:.2f} ms: {amp_o2['total'] / fp32['total']:.2f}x fp32, "
        f"{amp_o2['total'] / route['total']:.2f}x the route ({amp_o2['path']})",
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=8_000_000)
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to test the script")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.params, args.tensors, args.steps, args.warmup = 20_000, 20, 3, 1
    result = measure(args)
    print(f"bench/o2_route_floor.py: {args.params:,} parameters in {args.tensors} tensors, "
          f"{args.dtype} at O2, the variants interleaved in one process, medians of "
          f"{args.steps} steps")
    print(f"cpu: {cpu_line()}")
    for line in report(result):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                       "cpu": cpu_line(), "params": args.params, "tensors": args.tensors,
                       "dtype": args.dtype, "steps": args.steps, "ms": result}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
