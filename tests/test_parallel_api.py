"""apex_lite.parallel's public surface: apex's signatures and defaults (NVIDIA apex e13873de),
apex's import lines through the apex alias, and DistributedDataParallel's bookkeeping in a
one-rank gloo group in this process."""
import copy
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import gloo_ranks
from apex_lite import amp
from apex_lite import parallel
from apex_lite.parallel import LARC as larc_module
from apex_lite.parallel import distributed

TESTS = Path(__file__).resolve().parent

# apex's signatures, as its source at e13873de spells them (apex/parallel/*.py).
APEX_SIGNATURES = {
    parallel.DistributedDataParallel.__init__:
        "(self, module, message_size=10000000, delay_allreduce=False, shared_param=None, "
        "allreduce_trigger_params=None, retain_allreduce_buffers=False, "
        "allreduce_always_fp32=False, num_allreduce_streams=1, allreduce_communicators=None, "
        "gradient_average=True, gradient_predivide_factor=1.0, "
        "gradient_average_split_factor=None, prof=False)",
    parallel.SyncBatchNorm.__init__:
        "(self, num_features, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True, "
        "process_group=None, channel_last=False, fuse_relu=False)",
    parallel.SyncBatchNorm.forward: "(self, input, z=None)",
    parallel.convert_syncbn_model: "(module, process_group=None, channel_last=False)",
    parallel.create_syncbn_process_group: "(group_size)",
    larc_module.LARC.__init__: "(self, optimizer, trust_coefficient=0.02, clip=True, eps=1e-08)",
    parallel.Reducer.__init__: "(self, module_or_grads_list)",
    parallel.Reducer.reduce: "(self)",
    distributed.flat_dist_call: "(tensors, call, extra_args=None)",
    distributed.apply_flat_dist_call: "(bucket, call, extra_args=None)",
    distributed.extract_tensors: "(maybe_tensor, tensor_list)",
    parallel.DistributedDataParallel.enable_allreduce: "(self)",
    parallel.DistributedDataParallel.disable_allreduce: "(self)",
}


def _unannotated(fn) -> str:
    sig = inspect.signature(fn)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


@pytest.mark.parametrize("fn", list(APEX_SIGNATURES), ids=lambda fn: fn.__qualname__)
def test_signatures_are_apexs(fn):
    assert _unannotated(fn) == APEX_SIGNATURES[fn]


def test_names_where_apex_had_them():
    assert parallel.ReduceOp is torch.distributed.ReduceOp
    assert issubclass(parallel.SyncBatchNorm, torch.nn.modules.batchnorm._BatchNorm)
    from apex_lite.parallel.sync_batchnorm import SyncBatchNorm
    from apex_lite.parallel.sync_batchnorm_kernel import SyncBatchnormFunction
    assert SyncBatchNorm is parallel.SyncBatchNorm
    assert issubclass(SyncBatchnormFunction, torch.autograd.Function)


def _python(code):
    return subprocess.run([sys.executable, "-c", code], cwd=TESTS, capture_output=True,
                          text=True, timeout=180, env=dict(os.environ))


@pytest.mark.skipif(__import__("importlib").util.find_spec("apex") is not None,
                    reason="a package named apex is installed here")
def test_apex_import_lines_through_the_alias():
    """timm's import block, apex's examples/simple/distributed and imagenet imports (less
    fp16_utils, another module), apex's test_larc import and ``import apex; apex.parallel.X``."""
    code = """
import json
import apex_lite
apex_lite.install_apex_alias()
import apex
attribute_first = apex.parallel.SyncBatchNorm.__module__   # a submodule as an attribute
try:
    from apex import amp
    from apex.parallel import DistributedDataParallel as ApexDDP
    from apex.parallel import convert_syncbn_model
    has_apex = True
except ImportError:
    has_apex = False
import torch, argparse, os
from apex import amp
from apex.parallel import DistributedDataParallel
from apex.parallel import DistributedDataParallel as DDP
from apex.parallel import DistributedDataParallel, convert_syncbn_model
from apex.parallel.LARC import LARC
from apex.parallel import SyncBatchNorm, Reducer, ReduceOp, create_syncbn_process_group
import apex
import apex_lite.parallel
model = apex.parallel.convert_syncbn_model(torch.nn.Sequential(torch.nn.BatchNorm2d(3)))
print(json.dumps({"has_apex": has_apex, "same": DDP is apex_lite.parallel.DistributedDataParallel
                  and apex.parallel is apex_lite.parallel,
                  "larc": LARC.__module__, "converted": type(model[0]).__name__,
                  "attribute_first": attribute_first}))
"""
    result = _python(code)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"has_apex": True, "same": True,
                                         "larc": "apex_lite.parallel.LARC",
                                         "converted": "SyncBatchNorm",
                                         "attribute_first": "apex_lite.parallel.sync_batchnorm"}


# ---- DistributedDataParallel in a one-rank group -------------------------------------------------
@pytest.fixture
def one_rank():
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_ranks.free_port()}",
                            rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_amp_initialize_refuses_a_model_already_wrapped(one_rank):
    model = parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="Parallel wrappers must be applied AFTER"):
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2")


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.second(self.first(x).to(self.second.weight.dtype)).float().pow(2).sum()


def test_buckets_are_replanned_when_a_parameter_is_cast(one_rank):
    """A layer cast to bf16 after wrapping gets a bucket of its own at the next forward: the
    fp32 gradients are not rounded through bf16 (one rank, factor 1: the reduced gradients are
    the local ones)."""
    torch.manual_seed(0)
    net = TwoLayers()
    ddp = parallel.DistributedDataParallel(net)
    net.second.to(torch.bfloat16)
    x = torch.randn(3, 4)
    ddp.disable_allreduce()
    ddp(x).backward()
    local = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    ddp.enable_allreduce()
    ddp(x).backward()
    for before, p in zip(local, net.parameters()):
        assert p.grad.dtype == p.dtype and torch.equal(p.grad, before)


def test_a_copy_hooks_its_own_parameters(one_rank):
    net = torch.nn.Linear(3, 1)
    ddp = parallel.DistributedDataParallel(net, gradient_average=False,
                                           gradient_predivide_factor=2.0)
    twin = copy.deepcopy(ddp)
    assert twin.module is not net and twin._hooks == []
    twin(torch.ones(2, 3)).sum().backward()
    # One rank, sum predivided by 2: the copy reduced its own gradients once, after its forward.
    assert torch.equal(twin.module.bias.grad, torch.tensor([1.0]))
    assert net.bias.grad is None


def test_zero_grad_is_the_modules(one_rank):
    """amp replaces a model's zero_grad with one that also clears O2's master gradients: the
    wrapper's zero_grad is that one."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", fused_step=False,
                                      verbosity=0)
    ddp = parallel.DistributedDataParallel(model)
    with amp.scale_loss(ddp(torch.ones(4, 3)).float().sum(), optimizer) as scaled_loss:
        scaled_loss.backward()
    masters = list(amp.master_params(optimizer))
    assert all(m.grad is not None for m in masters)
    ddp.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert all(m.grad is None for m in masters)
