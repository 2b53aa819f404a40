"""Run by test_amp_checkpoint.py in fresh processes: train, checkpoint, resume.

    python amp_resume_worker.py train  OUTDIR SPEC...   # N+M uninterrupted steps; N steps + save
    python amp_resume_worker.py resume OUTDIR SPEC...   # fresh objects, load, M more steps

SPEC is an opt level, optionally with the half dtype: "O2" or "O2:fp16". The run has an
overflow before and after the checkpoint and a scale window of 3, so the scaler's counters
matter across the boundary.
"""
import os
import sys

import torch

from amp_helpers import Net, batch, inject_inf  # beside this script: sys.path[0]
from apex_lite import amp

N, M = 5, 4
OVERFLOW_STEPS = (2, 7)
HALVES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def build(spec, seed):
    level, _, half = spec.partition(":")
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=HALVES.get(half),
                                scale_window=3, verbosity=0)
    return model, opt, sched


def run_steps(model, opt, sched, steps):
    for step in steps:
        hook = inject_inf(model.fc1.weight) if step in OVERFLOW_STEPS else None
        x, y = batch(step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        sched.step()
        if hook:
            hook.remove()


def result(model):
    state = amp.state_dict()
    return {"params": [p.detach().clone() for p in model.parameters()],
            "buffers": [b.detach().clone() for b in model.buffers()],
            "loss_scaler0": state["loss_scaler0"],
            "counters": state["apex_lite"]["loss_scalers"][0]}


def main():
    mode, outdir, specs = sys.argv[1], sys.argv[2], sys.argv[3:]
    torch.set_num_threads(1)
    for spec in specs:
        name = spec.replace(":", "_")
        if mode == "train":
            model, opt, sched = build(spec, seed=0)
            run_steps(model, opt, sched, range(N + M))
            torch.save(result(model), os.path.join(outdir, f"{name}_full.pt"))
            model, opt, sched = build(spec, seed=0)
            run_steps(model, opt, sched, range(N))
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(), "amp": amp.state_dict()},
                       os.path.join(outdir, f"{name}_checkpoint.pt"))
        else:
            model, opt, sched = build(spec, seed=99)     # different init: all must be loaded
            checkpoint = torch.load(os.path.join(outdir, f"{name}_checkpoint.pt"))
            model.load_state_dict(checkpoint["model"])
            opt.load_state_dict(checkpoint["optimizer"])
            sched.load_state_dict(checkpoint["scheduler"])
            amp.load_state_dict(checkpoint["amp"])
            run_steps(model, opt, sched, range(N, N + M))
            torch.save(result(model), os.path.join(outdir, f"{name}_resumed.pt"))


if __name__ == "__main__":
    main()
