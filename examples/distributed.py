"""Data-parallel mixed-precision training with apex_lite and DistributedDataParallel.

    torchrun --nproc_per_node=2 examples/distributed.py               # gloo on CPU
    torchrun --nproc_per_node=2 examples/distributed.py --device cuda # NCCL, one GPU per rank

amp.initialize comes first, then DDP wraps the (cast) model. apex_lite all-reduces its overflow
flag over the process group, so every rank skips or applies each step together and the loss
scales stay identical.
"""
import argparse
import logging
import os

import torch
import torch.distributed as dist
# Before init_process_group: on import it binds the default group into default arguments (DDP
# imports it), which would keep the group and gloo's threads alive to exit; see the end of main().
import torch.distributed.nn  # noqa: F401
from torch.nn.parallel import DistributedDataParallel as DDP

from apex_lite import amp


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--opt-level", default="O2")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=64, help="per rank")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--lr", type=float, default=0.05)
    return parser.parse_args()


def main():
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if "RANK" not in os.environ:
        raise SystemExit("run me under torchrun, e.g. "
                         "`torchrun --nproc_per_node=2 examples/distributed.py`")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    world = dist.get_world_size()

    torch.manual_seed(0)                      # the same initial weights on every rank
    model = torch.nn.Sequential(
        torch.nn.Linear(args.width, args.width), torch.nn.ReLU(),
        torch.nn.Linear(args.width, args.width), torch.nn.ReLU(),
        torch.nn.Linear(args.width, 1)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level)
    model = DDP(model, device_ids=[local_rank] if args.device == "cuda" else None)

    generator = torch.Generator().manual_seed(1000 + rank)   # each rank its own shard
    target = torch.randn(args.width, 1, generator=torch.Generator().manual_seed(7))
    for step in range(args.steps):
        x = torch.randn(args.batch, args.width, generator=generator)
        y = (x @ target).tanh()
        x, y = x.to(device), y.to(device)
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            scaler = amp.loss_scalers()[0]
            print(f"step {step:4d}  loss {loss.item():.5f}  loss scale {scaler.loss_scale}  "
                  f"skipped {scaler.skipped_steps}/{scaler.steps}  ({world} ranks)")
    dist.barrier()   # no rank tears the group down while a peer still uses it
    # DDP first, then the group: that joins gloo's threads now, with the GIL released. One still
    # running at exit can abort the process ("terminate called without an active exception").
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
