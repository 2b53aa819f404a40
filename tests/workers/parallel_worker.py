"""One rank of the apex_lite.parallel tests (tests/test_parallel_*.py); not a test itself.

``--suite ddp|syncbn|amp`` runs every scenario of that suite in this process (one launch per test
module keeps the distributed tests fast) and saves what each produced to ``--out/rank<r>.pt``:
local gradients beside the reduced ones, outputs and gradients of SyncBatchNorm on this rank's
slice of a batch that every rank generates whole, parameters after amp steps. The tests compute
the expectations (from every rank's file, or from single-process references).
"""
import argparse
import gc
import os

import torch
import torch.distributed as dist
# Before init_process_group (tests/workers/ddp_skip_worker.py says why).
import torch.distributed.nn  # noqa: F401

from apex_lite import amp
from apex_lite.amp import casting
from apex_lite.parallel import (DistributedDataParallel as DDP, Reducer, SyncBatchNorm,
                                convert_syncbn_model, create_syncbn_process_group,
                                flat_dist_call)
from apex_lite.parallel.LARC import LARC


def clone_grads(module):
    return [None if p.grad is None else p.grad.detach().clone() for p in module.parameters()]


class Mixed(torch.nn.Module):
    """An fp32 layer and a bf16 layer: two dtypes, two buckets."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(5, 4)
        self.b = torch.nn.Linear(4, 3).to(torch.bfloat16)

    def forward(self, x):
        return self.b(self.a(x).to(torch.bfloat16)).float()


def make_net(kind):
    torch.manual_seed(0)
    if kind == "mixed":
        return Mixed()
    net = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    return net.to(torch.bfloat16) if kind == "bf16" else net


DDP_CONFIGS = {
    "default": ("fp32", {}),
    "predivide": ("fp32", {"gradient_predivide_factor": 4.0}),
    "sum_predivide": ("fp32", {"gradient_average": False, "gradient_predivide_factor": 2.0}),
    "delay": ("fp32", {"delay_allreduce": True, "gradient_predivide_factor": 2.0}),
    "tiny_buckets": ("fp32", {"message_size": 1}),
    "triggers": ("fp32", {"allreduce_trigger_params": "first weight"}),
    "retain": ("fp32", {"retain_allreduce_buffers": True, "message_size": 12}),
    "bf16": ("bf16", {}),
    "bf16_fp32": ("bf16", {"allreduce_always_fp32": True, "gradient_predivide_factor": 2.0}),
    "mixed": ("mixed", {"message_size": 8}),
}


def ddp_suite(rank):
    out = {}
    # Construction: parameters (not buffers) come from rank 0.
    torch.manual_seed(100 + rank)
    net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    net[1].running_mean.fill_(float(rank))
    before = [p.detach().clone() for p in net.parameters()]
    ddp = DDP(net)
    out["broadcast"] = {"before": before, "after": [p.detach().clone() for p in net.parameters()],
                        "running_mean": net[1].running_mean.clone(),
                        "keys": list(ddp.state_dict()), "module_is_net": ddp.module is net}
    del ddp, net

    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(10 + rank))
    for name, (kind, kwargs) in DDP_CONFIGS.items():
        net = make_net(kind)
        dtype = next(net.parameters()).dtype if kind != "mixed" else torch.float32
        net(x.to(dtype)).float().pow(2).sum().backward()
        local = clone_grads(net)
        net.zero_grad()
        kwargs = dict(kwargs)
        if kwargs.get("allreduce_trigger_params") == "first weight":
            kwargs["allreduce_trigger_params"] = [next(net.parameters())]
        ddp = DDP(net, **kwargs)
        ddp(x.to(dtype)).float().pow(2).sum().backward()
        result = {"local": local, "reduced": clone_grads(net)}
        if kwargs.get("retain_allreduce_buffers"):
            buffers = {b.data_ptr() for b in ddp.allreduce_buffers}
            result["views"] = [p.grad._base is not None and
                               p.grad._base.data_ptr() in buffers for p in net.parameters()]
        out[name] = result
        del ddp, net

    # fp16: a gradient of 40000 on each rank overflows an fp16 sum (80000), not a predivided one.
    for name, kwargs in (("fp16_plain", {}), ("fp16_predivide", {"gradient_predivide_factor": 2.0}),
                         ("fp16_fp32", {"allreduce_always_fp32": True})):
        w = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
        holder = torch.nn.Module()
        holder.w = w
        ddp = DDP(holder, **kwargs)
        (w * torch.full((4,), 40000.0, dtype=torch.float16)).sum().backward()
        out[name] = w.grad.clone()
        del ddp, holder, w

    # disable_allreduce / enable_allreduce.
    net = make_net("fp32")
    ddp = DDP(net)
    ddp.disable_allreduce()
    ddp(x).pow(2).sum().backward()
    disabled = clone_grads(net)
    net.zero_grad()
    ddp.enable_allreduce()
    ddp(x).pow(2).sum().backward()
    out["disable"] = {"disabled": disabled, "enabled": clone_grads(net)}
    del ddp, net

    # A layer no rank uses keeps no gradient; one that rank 1 skips: zeros from it.
    net = torch.nn.ModuleDict({"a": torch.nn.Linear(5, 2), "b": torch.nn.Linear(5, 2),
                               "never": torch.nn.Linear(5, 2)})
    ddp = DDP(net)
    loss = net["a"](x).sum() + (net["b"](x).sum() if rank == 0 else 0)
    loss.backward()
    out["unused"] = {name: None if p.grad is None else p.grad.clone()
                     for name, p in net.named_parameters()}
    del ddp, net, loss

    # apex's ddp_race_condition_test (4096 elements instead of 4096**2): triggers, several
    # streams, one-element buckets; the gradient sums it expects, every iteration.
    class Race(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Parameter(torch.full((4096,), 1.0))
            self.b = torch.nn.Parameter(torch.full((4096,), 2.0))

        def forward(self, input):
            return (input * self.a) * self.b

    race = Race()
    ddp = DDP(race, message_size=1, allreduce_trigger_params=[race.b], num_allreduce_streams=3)
    sums = []
    for i in range(4):
        x_race = torch.full((4096,), float(i + rank))
        ddp.zero_grad()
        ddp(x_race).sum().backward()
        sums.append((race.a.grad.sum().item(), race.b.grad.sum().item()))
    out["race"] = sums
    del ddp, race

    # Reducer and flat_dist_call: averages and broadcasts.
    torch.manual_seed(200 + rank)
    net = torch.nn.Linear(3, 2)
    reducer = Reducer(net)
    weights = [p.detach().clone() for p in net.parameters()]
    for p in net.parameters():
        p.grad = torch.full_like(p, float(rank + 1))
    reducer.reduce()
    tensors = [torch.full((3,), float(rank)), torch.full((2,), 2.0 * rank, dtype=torch.float64)]
    Reducer(tensors).reduce()
    broadcast = [torch.full((2,), float(rank + 5))]
    flat_dist_call(broadcast, dist.broadcast, (0,))
    averaged = [torch.full((2,), float(rank + 1), dtype=torch.bfloat16)]
    flat_dist_call(averaged, dist.all_reduce)
    out["reducer"] = {"weights": weights, "grads": clone_grads(net), "tensors": tensors,
                      "broadcast": broadcast, "averaged": averaged}
    return out


# ---- SyncBatchNorm ------------------------------------------------------------------------------
def full_batch(shape, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def syncbn_case(rank, sizes, shape_rest, channel_last, dtype, momentum=1.0, fuse_relu=False,
                process_group=None, with_ddp=False, kept=False):
    """This rank's slice (sizes[rank] samples) of a full batch every rank generates; returns
    what the SyncBatchNorm produced on it. With ``kept``, the layer is wrapped as O2 keeps it
    fp32 in a model cast to ``dtype`` (issue 53: it takes the half input as it is), and the
    result counts the fp32 tensors of the input's size it saved for backward."""
    total = sum(sizes)
    start = sum(sizes[:rank])
    shape = (total, *shape_rest)
    inp = full_batch(shape, 18, dtype)
    grad = full_batch(shape, 19, dtype)
    z = full_batch(shape, 20, dtype) if fuse_relu else None
    channels = shape[-1] if channel_last or len(shape) == 2 else shape[1]
    sbn = SyncBatchNorm(channels, momentum=momentum, channel_last=channel_last,
                        fuse_relu=fuse_relu, process_group=process_group)
    with torch.no_grad():
        sbn.weight.copy_(full_batch((channels,), 21, torch.float32))
        sbn.bias.copy_(full_batch((channels,), 22, torch.float32))
    if dtype != torch.float32 and with_ddp:
        sbn.to(dtype)   # apex's two_gpu_unit_test --fp16: the layer itself in half
    if kept:
        casting.wrap_kept(sbn, dtype)
    layer = DDP(sbn) if with_ddp else sbn
    mine = inp[start:start + sizes[rank]].clone().requires_grad_()
    my_z = None if z is None else z[start:start + sizes[rank]].clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        output = layer(mine) if z is None else layer(mine, my_z)
    output.backward(grad[start:start + sizes[rank]])
    result = {"out": output.detach(), "grad_in": mine.grad, "running_mean": sbn.running_mean,
              "running_var": sbn.running_var, "grad_w": sbn.weight.grad,
              "grad_b": sbn.bias.grad, "grad_z": None if my_z is None else my_z.grad,
              "fp32_saved": sum(t.dtype == torch.float32 and t.numel() == mine.numel() > 0
                                for t in saved)}
    if with_ddp:
        torch.optim.SGD(sbn.parameters(), lr=1.0).step()
        result["weight_after"] = sbn.weight.detach().clone()
        result["bias_after"] = sbn.bias.detach().clone()
    return result


SYNCBN_CASES = {
    # name: (sizes per rank, shape after N, channel_last, dtype, extra keywords)
    "unit_fp32": ((4, 4), (10, 4, 4), False, torch.float32, {"with_ddp": True}),
    "unit_bf16": ((4, 4), (10, 4, 4), False, torch.bfloat16, {"with_ddp": True}),
    "unit_fp16": ((4, 4), (10, 4, 4), False, torch.float16, {"with_ddp": True}),
    "uneven_nchw": ((5, 2), (6, 3, 3), False, torch.float32, {"momentum": 0.1}),
    "uneven_nhwc": ((5, 2), (3, 3, 6), True, torch.float32, {"momentum": None}),
    "uneven_2d": ((7, 3), (6,), False, torch.float32, {}),
    "uneven_3d_bf16": ((5, 2), (6, 5), False, torch.bfloat16, {}),
    "uneven_relu_z": ((3, 5), (4, 2, 3), False, torch.float32, {"fuse_relu": True}),
    "empty_rank": ((6, 0), (3, 2), False, torch.float32, {}),
    # Half input, fp32 weight, bias and statistics: the layer as O2 keeps it (issue 53).
    "half_bf16_nchw": ((5, 3), (6, 3, 3), False, torch.bfloat16, {"momentum": 0.1}),
    "half_fp16_nhwc_relu_z": ((5, 3), (3, 3, 6), True, torch.float16,
                              {"momentum": None, "fuse_relu": True}),
    "half_fp16_2d": ((7, 3), (6,), False, torch.float16, {}),
    "kept_bf16_O2": ((5, 3), (6, 3, 3), False, torch.bfloat16, {"kept": True}),
    "kept_fp16_O2_relu_z": ((3, 5), (4, 2, 3), False, torch.float16,
                            {"kept": True, "fuse_relu": True}),
}


def torch_ddp_case(rank):
    """apex's two_gpu_test_different_batch_size under torch's DDP: Conv2d + SyncBatchNorm, 16
    samples (scaled by 50) on rank 0 and 8 on rank 1, the gradient weighted by the global
    batch."""
    torch.manual_seed(2809)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 6, 3, 1, 1), SyncBatchNorm(6))
    start = [p.detach().clone() for p in model.parameters()]
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    data = full_batch((24, 3, 8, 8), 50, torch.float32)
    data[:16] *= 50.0
    grad = torch.randint(0, 10, (24, 6, 8, 8), generator=torch.Generator().manual_seed(51)) / 10.0
    mine = slice(0, 16) if rank == 0 else slice(16, 24)
    x = data[mine].clone().requires_grad_()
    output = ddp(x)
    output.backward(grad[mine] * 2 / 24)
    result = {"start": start, "out": output.detach(), "conv_grad": model[0].weight.grad.clone(),
              "bn_grad": model[1].weight.grad.clone(), "running_mean": model[1].running_mean,
              "running_var": model[1].running_var}
    del ddp
    return result


def syncbn_suite(rank):
    out = {"torch_ddp": torch_ddp_case(rank)}
    for name, (sizes, rest, channel_last, dtype, kwargs) in SYNCBN_CASES.items():
        out[name] = syncbn_case(rank, sizes, rest, channel_last, dtype, **kwargs)
    # Groups of one rank: statistics stay local. Groups of both: as the default group.
    own = create_syncbn_process_group(1)
    both = create_syncbn_process_group(2)
    out["group_of_one"] = syncbn_case(rank, (4, 2), (3, 2), False, torch.float32,
                                      process_group=own)
    out["group_of_two"] = syncbn_case(rank, (4, 2), (3, 2), False, torch.float32,
                                      process_group=both)
    out["group_size_0"] = create_syncbn_process_group(0) is None
    # Eval: the running statistics, nothing communicated (only rank 0 runs it).
    sbn = SyncBatchNorm(3, channel_last=True)
    sbn(full_batch((4, 3), 30 + rank, torch.float32))
    sbn.eval()
    if rank == 0:
        x = full_batch((2, 2, 3), 40, torch.float32)
        out["eval"] = {"out": sbn(x), "running_mean": sbn.running_mean.clone(),
                       "running_var": sbn.running_var.clone(), "x": x}
    dist.barrier()
    return out


# ---- under amp --------------------------------------------------------------------------------
def amp_case(rank, opt_level, seed, with_bn=False, larc=False, steps=3):
    torch.manual_seed(seed)
    if with_bn:
        model = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3), torch.nn.BatchNorm2d(4),
                                    torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(16, 3))
        model = convert_syncbn_model(model)
        make_x = lambda g: torch.randn(3, 2, 4, 4, generator=g)   # noqa: E731
    else:
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 4))
        make_x = lambda g: torch.randn(6, 8, generator=g)   # noqa: E731
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    if larc:
        optimizer = LARC(optimizer)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    model = DDP(model)
    data = torch.Generator().manual_seed(300 + rank)
    for _ in range(steps):
        loss = model(make_x(data)).float().pow(2).mean()
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
    result = {"params": [p.detach().clone() for p in model.parameters()],
              "masters": [p.detach().clone() for p in amp.master_params(optimizer)],
              "buffers": [b.clone() for b in model.buffers()],
              "dtypes": [str(p.dtype) for p in model.parameters()]}
    if with_bn:
        result["bn_weight_dtype"] = str(model.module[1].weight.dtype)
        result["bn_type"] = type(model.module[1]).__name__
    return result


def amp_suite(rank):
    return {
        "O1_seeded_apart": amp_case(rank, "O1", 100 + rank),
        "O2_same_seed": amp_case(rank, "O2", 0),
        "O2_seeded_apart": amp_case(rank, "O2", 100 + rank),
        "O2_syncbn_larc": amp_case(rank, "O2", 0, with_bn=True, larc=True),
        "O1_syncbn": amp_case(rank, "O1", 100 + rank, with_bn=True),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--suite", choices=["ddp", "syncbn", "amp"], required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {"ddp": ddp_suite, "syncbn": syncbn_suite, "amp": amp_suite}[args.suite](rank)
    torch.save(result, os.path.join(args.out, f"rank{rank}.pt"))
    dist.barrier()   # no rank tears the gloo group down while a peer still uses it
    del result
    amp.initialize([], enabled=False)
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
