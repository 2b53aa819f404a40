"""One rank of the two-process skip test (tests/test_distributed.py); not a test itself.

Trains a DDP-wrapped O2 model for a few steps on gloo. At the step named by --inject-step, rank
--inject-rank alone writes inf into one of its gradients: in its backward, before DDP's
all-reduce (a tensor hook), as an overflow happens; or with --no-ddp (each rank trains its own
model, no gradient is reduced) after the backward, so that only its overflow check sees it and
only the all-reduce of amp's flag (over --own-group or the default group) tells the others.
With --two-optimizers, the first and the last layer have an optimizer each, both given to the
one scale_loss (the inf goes into the first layer's gradient: apex's rule skips both, on every
rank). Saves the parameters, the loss scale and the skip history (per optimizer, whether its
masters changed) to --out.
"""
import argparse
import gc
import os

import torch
import torch.distributed as dist
# Before init_process_group: on import it binds the default group into default arguments (DDP
# imports it), which would keep the group and gloo's threads alive to exit; see the end of main().
import torch.distributed.nn  # noqa: F401
from torch.nn.parallel import DistributedDataParallel as DDP

from apex_lite import amp


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--inject-step", type=int, default=2)
    parser.add_argument("--inject-rank", type=int, default=1)
    parser.add_argument("--two-optimizers", action="store_true")
    parser.add_argument("--fused-step", choices=["default", "true", "false"], default="default")
    parser.add_argument("--own-group", action="store_true",
                        help="pass initialize(process_group=) a group of this rank alone")
    parser.add_argument("--no-ddp", action="store_true",
                        help="no DDP: gradients stay each rank's own")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # Every rank creates every group (new_group is collective); each passes its own.
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())] if args.own_group \
        else None
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    if args.two_optimizers:
        optimizers = [torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9),
                      torch.optim.SGD(model[2].parameters(), lr=0.1, momentum=0.9)]
    else:
        optimizers = [torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)]
    fused_step = {"default": None, "true": True, "false": False}[args.fused_step]
    model, optimizers = amp.initialize(model, optimizers, opt_level="O2", verbosity=0,
                                       fused_step=fused_step,
                                       process_group=groups[rank] if groups else None)
    if not args.no_ddp:
        model = DDP(model)

    data = torch.Generator().manual_seed(100 + rank)
    skipped, scales, stepped = [], [], []
    for step in range(args.steps):
        x = torch.randn(8, 16, generator=data)
        loss = model(x).float().pow(2).mean()
        for opt in optimizers:
            opt.zero_grad()
        before = [[p.detach().clone() for p in opt._apex_lite_amp.masters()]
                  for opt in optimizers]
        inject = step == args.inject_step and rank == args.inject_rank
        hook = None
        if inject and not args.no_ddp:   # in the backward, before DDP's all-reduce
            hook = next(model.parameters()).register_hook(
                lambda g: g.flatten().index_fill(0, torch.tensor([3]), float("inf")).view_as(g))
        with amp.scale_loss(loss, optimizers) as scaled_loss:
            scaled_loss.backward()
            if inject and args.no_ddp:
                next(model.parameters()).grad.view(-1)[3] = float("inf")
        if hook is not None:
            hook.remove()
        for opt in optimizers:
            opt.step()
        stepped.append([any(not torch.equal(b, p) for b, p in
                            zip(bs, opt._apex_lite_amp.masters()))
                        for bs, opt in zip(before, optimizers)])
        scaler = amp.loss_scalers()[0]
        skipped.append(scaler.last_step_skipped)
        scales.append(scaler.loss_scale)
    torch.save({"rank": rank, "skipped": skipped, "scales": scales, "stepped": stepped,
                "params": [p.detach().clone() for p in model.parameters()],
                "masters": [p.detach().clone() for opt in optimizers
                            for p in amp.master_params(opt)]},
               os.path.join(args.out, f"rank{rank}.pt"))
    dist.barrier()   # no rank tears the gloo group down while a peer still uses it
    # DDP first, then the group: that joins gloo's threads here, with the GIL released (the other
    # order joins them in ~Reducer holding it, and can hang). A gloo thread still running at exit
    # can free a tensor during finalization and abort ("terminate called without an active
    # exception"); the check below fails loudly instead if that would be possible.
    # The amp run holds an explicit group (and the optimizer, the loss scaler and the loss the
    # run): let them all go too.
    del model, optimizers, opt, groups, scaler, loss, scaled_loss
    amp.initialize([], enabled=False)
    gc.collect()
    dist.destroy_process_group()
    leftover = gloo_threads()
    if leftover:
        raise SystemExit(f"gloo threads {leftover} outlived destroy_process_group: something "
                         "still holds the process group, and this process can abort at exit")


def gloo_threads():
    """Names of this process's native threads that belong to gloo (Linux; [] elsewhere)."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return []
    names = []
    for tid in os.listdir(tasks):
        try:
            with open(os.path.join(tasks, tid, "comm")) as f:
                names.append(f.read().strip())
        except FileNotFoundError:   # the thread ended while we looked
            pass
    return [name for name in names if "gloo" in name]


if __name__ == "__main__":
    main()
