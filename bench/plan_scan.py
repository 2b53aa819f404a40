"""The CPU plan scan (csrc/cpu/fused_optimizer_cpu.h, PlannedCall) in isolation: O2 AdamW over
4000 x 2500 through AdamUpdate (held lists), one process, one thread. Per round a real step, then
a skipped step (found_inf = 1: the checks, the scan and the gathering of the gradients, cold after
the step's pass), then a second skipped step (warm). Medians of this thread's CPU time
(time.thread_time), which a loaded host disturbs far less than wall time. Compare builds by
alternating processes: PYTHONPATH=<a copy of apex_lite with build X> python bench/plan_scan.py

    python bench/plan_scan.py [rounds=100] [label] [threads=1]
"""
import statistics, sys, time
import torch
from apex_lite.multi_tensor import _backend
from apex_lite.optimizers import AdamHyper, AdamUpdate

torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 100
n, count = 2500, 4000
masters = [torch.randn(n) for _ in range(count)]
half = [m.bfloat16() for m in masters]
for h in half:
    h.grad = (torch.randn(n) * 1024).bfloat16()
hyper = AdamHyper(1e-3, 0.9, 0.999, 1e-8, 1e-2, adam_w_mode=True, bias_correction=True)
update = AdamUpdate(masters, grad_sources=half, model_params=half)
state = {}
inv = torch.full((1,), 2.0 ** -16)
clear, found = torch.zeros(1), torch.ones(1)
for _ in range(5):
    update(state, inv, clear, hyper)
step, cold, warm = [], [], []
for _ in range(rounds):
    t0 = time.thread_time(); update(state, inv, clear, hyper); t1 = time.thread_time()
    update(state, inv, found, hyper); t2 = time.thread_time()
    update(state, inv, found, hyper); t3 = time.thread_time()
    step.append(t1 - t0); cold.append(t2 - t1); warm.append(t3 - t2)
med = lambda xs: statistics.median(xs) * 1e3
print(f"{sys.argv[2] if len(sys.argv) > 2 else ''} step {med(step):.3f} skipped-cold {med(cold):.3f} "
      f"skipped-warm {med(warm):.3f} ms ({_backend.backend('cpu')[0]})")
