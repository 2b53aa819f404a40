"""One rank of the O2-masters-under-DDP test (tests/test_amp_model_writes.py); not a test itself.

Each rank builds its model from its own seed (``torch.manual_seed(100 + rank)``: ranks start
from different weights, as most scripts leave them), initializes amp at O2, then wraps the model
in torch's DistributedDataParallel (apex's documented order), and trains a few steps. Saves its
fp32 weights before initialize, and after each step its masters and half parameters, to --out.
"""
import argparse
import gc
import os

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  (see ddp_skip_worker.py)
from torch.nn.parallel import DistributedDataParallel as DDP

from apex_lite import amp
from ddp_skip_worker import gloo_threads


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--fused-step", choices=["true", "false"], default="true")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    initial = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0,
                                fused_step=args.fused_step == "true")
    model = DDP(model)
    data = torch.Generator().manual_seed(7 + rank)
    steps = []
    first_forward = None
    for _ in range(args.steps):
        x, y = torch.randn(8, 16, generator=data), torch.randn(8, 4, generator=data)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        with amp.scale_loss(loss, opt) as scaled_loss:
            scaled_loss.backward()
        if first_forward is None:   # the masters are broadcast at the first scale_loss
            first_forward = [m.detach().clone() for m in amp.master_params(opt)]
        opt.step()
        steps.append({"masters": [m.detach().clone() for m in amp.master_params(opt)],
                      "params": [p.detach().clone() for p in model.parameters()]})
    torch.save({"initial": initial, "first_forward": first_forward, "steps": steps, "path": opt._apex_lite_amp.path.describe(),
                "state_dict": {k: v.clone() for k, v in model.module.state_dict().items()}},
               os.path.join(args.out, f"rank{rank}.pt"))
    dist.barrier()
    del model, opt, loss, scaled_loss
    amp.initialize([], enabled=False)
    gc.collect()
    dist.destroy_process_group()
    if gloo_threads():
        raise SystemExit("gloo threads outlived destroy_process_group")


if __name__ == "__main__":
    main()
