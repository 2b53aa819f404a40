"""Sharded mixed-precision training with apex_lite on PyTorch FSDP2 (``fully_shard``).

    torchrun --nproc_per_node=2 examples/fsdp.py                  # gloo on CPU, O2 in bf16
    torchrun --nproc_per_node=2 examples/fsdp.py --device cuda    # NCCL, one GPU per rank, fp16
    torchrun --nproc_per_node=2 examples/fsdp.py --checkpoint ckpt  # save with DCP; run it
                                                                    # again to resume

The order is FSDP2's: build the model, fully_shard each block and then the root, build the
optimizer over the sharded parameters, then amp.initialize. At O2 the half compute is FSDP2's
own mixed precision, so each fully_shard call gets MixedPrecisionPolicy(param_dtype=half,
reduce_dtype=torch.float32), and the sharded fp32 parameters are amp's master weights: nothing
is copied. amp unscales and checks each rank's gradient shards, and all-reduces the overflow
flag over the mesh, so every rank skips or steps together. Checkpoints go through
torch.distributed.checkpoint (get_state_dict / set_state_dict) with amp.state_dict() beside
them; a checkpoint saved by N ranks loads into any number of ranks.
"""
import argparse
import gc
import logging
import os

import torch
import torch.distributed as dist
# Before init_process_group: torch.distributed.nn binds the default group when it is imported.
import torch.distributed.nn  # noqa: F401
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from apex_lite import amp


class Block(torch.nn.Module):
    """A pre-norm MLP block with a residual connection."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.fc1 = torch.nn.Linear(width, 4 * width)
        self.fc2 = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class Net(torch.nn.Module):
    def __init__(self, width: int, blocks: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(width) for _ in range(blocks)])
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--opt-level", default="O2", choices=["O0", "O1", "O2", "O3", "O4", "O5"])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=64, help="per rank")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--checkpoint", default=None,
                        help="a directory: resume from it when it holds a checkpoint, and save "
                             "into it at the end")
    return parser.parse_args()


def checkpoint_state(model, optimizer):
    """What a checkpoint holds: DCP's sharded model and optimizer states, and amp's."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state, "amp": amp.state_dict(),
            "step": 0}


def release_device_meshes():
    """Let go of the device meshes FSDP2 and DTensor keep, so that destroy_process_group ends
    gloo's threads (call it once the sharded model and optimizer are gone, before
    destroy_process_group). In torch 2.13 a DeviceMesh holds its process groups, and DTensor
    memoises its sharding and redistribution plans, which hold meshes, in four caches of its
    own; while one of them holds a mesh the group outlives destroy_process_group, and a gloo
    thread still running when the interpreter exits can abort the process ("terminate called
    without an active exception"). PyTorch's own DTensor tests clear these caches before
    destroying their groups. A cache that another torch release lacks is skipped."""
    from torch.distributed.tensor import _collective_utils, _redistribute, debug
    for clear in (getattr(debug, "_clear_sharding_prop_cache", None),
                  getattr(_redistribute, "clear_redistribute_planner_cache", None),
                  getattr(getattr(_redistribute, "_gen_transform_infos", None),
                          "cache_clear", None),
                  getattr(getattr(getattr(_collective_utils, "MeshTopoInfo", None),
                                  "build_from_mesh", None), "cache_clear", None)):
        if clear is not None:
            clear()
    # FSDP2's units and the meshes are reference cycles: free them now, not at a later pass.
    gc.collect()


def main():
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if "RANK" not in os.environ:
        raise SystemExit("run me under torchrun, e.g. "
                         "`torchrun --nproc_per_node=2 examples/fsdp.py`")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    train(args, device, rank)
    dist.barrier()   # no rank tears the group down while a peer still uses it
    # train()'s model and optimizer are gone; amp's default handle lets go of them, then torch
    # of its meshes, and destroy_process_group then ends gloo's threads (release_device_meshes).
    amp.initialize([], enabled=False)
    release_device_meshes()
    dist.destroy_process_group()


def train(args, device: torch.device, rank: int) -> None:
    """Build, shard, initialize, resume when asked, train, save when asked."""
    world = dist.get_world_size()

    torch.manual_seed(0)                      # the same initial weights on every rank
    model = Net(args.width, args.blocks).to(device)
    # amp's half dtype: fp16 on CUDA, bf16 on CPU (bf16 everywhere at ROCm apex's O4 and O5). At
    # O2 and O5 FSDP2 computes in it (the policy); at O0, O1 and O4 the units compute in fp32;
    # at O3 amp casts the shards themselves to half.
    half = torch.float16 if args.device == "cuda" and args.opt_level != "O5" else torch.bfloat16
    policy = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32) \
        if args.opt_level in ("O2", "O5") else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level)

    first_step = 0
    resume = args.checkpoint is not None and os.path.exists(
        os.path.join(args.checkpoint, ".metadata"))
    if resume:
        state = checkpoint_state(model, optimizer)
        dcp.load(state, checkpoint_id=args.checkpoint)
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        amp.load_state_dict(state["amp"])
        first_step = state["step"]
    if rank == 0 and resume:
        print(f"resumed from {args.checkpoint} at step {first_step}")

    target = torch.randn(args.width, 1, generator=torch.Generator().manual_seed(7))
    for step in range(first_step, first_step + args.steps):
        generator = torch.Generator().manual_seed(1000 * step + rank)   # each rank its share
        x = torch.randn(args.batch, args.width, generator=generator)
        y = (x @ target).tanh()
        x, y = x.to(device), y.to(device)
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        amp.clip_grad_norm_(optimizer, 1.0)   # the norm of the whole gradients, over all ranks
        optimizer.step()
        if rank == 0 and step == first_step:
            print(amp.report())   # this rank's shards, and the unit being all-gathered
        if rank == 0 and (step % 10 == 0 or step == first_step + args.steps - 1):
            scaler = amp.loss_scalers()[0]
            print(f"step {step:4d}  loss {loss.item():.5f}  loss scale {scaler.loss_scale}  "
                  f"skipped {scaler.skipped_steps}/{scaler.steps}  ({world} ranks)")

    if args.checkpoint is not None:
        state = checkpoint_state(model, optimizer)
        state["step"] = first_step + args.steps
        dcp.save(state, checkpoint_id=args.checkpoint)
        if rank == 0:
            print(f"saved {args.checkpoint} at step {state['step']}")


if __name__ == "__main__":
    main()
