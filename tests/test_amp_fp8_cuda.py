"""fp8 under amp on a CUDA GPU (cuBLASLt's scaled matmuls, the compiled casts): the same fp8
operands as the CPU reference, results within fp32-accumulation order of it, training close
to bf16, and the refusal on a GPU without fp8 matmuls. Skipped without such a GPU (run by
tools/gpu_check.sh, ``-k cuda``)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from apex_lite import amp
from test_amp_fp8 import Mlp, _train, batch, ref_linear, small

FP8_GPU = torch.cuda.is_available() and not torch.version.hip \
    and torch.cuda.get_device_capability() >= (8, 9)
requires_fp8_cuda = pytest.mark.skipif(not FP8_GPU, reason="needs a CUDA GPU with fp8 matmuls "
                                                          "(sm_89 or newer)")


@requires_fp8_cuda
@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [24, 64])   # 24: grad_weight's contraction padded to 32
def test_cuda_layer_matches_the_reference(half, rows):
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48).cuda()
    layer = amp.initialize(layer, opt_level="O2", half_dtype=half, fp8=small(), verbosity=0)
    x = torch.randn(rows, 64, device="cuda").to(half).requires_grad_()
    out = layer(x)
    expected = ref_linear(x.detach().cpu(), layer.weight.detach().cpu(),
                          layer.bias.detach().cpu(), half).float()
    # cuBLASLt sums in another order (and the forward with fast accumulation): half rounding
    torch.testing.assert_close(out.cpu(), expected, rtol=2e-2, atol=2e-2)
    out.float().pow(2).sum().backward()
    assert torch.isfinite(layer.weight.grad).all() and torch.isfinite(x.grad).all()
    reference = torch.nn.Linear(64, 48).cuda().to(half)
    with torch.no_grad():
        reference.weight.copy_(layer.weight)
        reference.bias.copy_(layer.bias)
    x2 = x.detach().clone().requires_grad_()
    reference(x2).float().pow(2).sum().backward()
    relative = (layer.weight.grad.float() - reference.weight.grad.float()).norm() \
        / reference.weight.grad.float().norm()
    assert relative < 0.15                    # E5M2 gradients: a few percent


@requires_fp8_cuda
def test_cuda_training_stays_close_to_bf16():
    baseline, _ = _train(None, None, device="cuda")
    losses, handle = _train(small(), None, device="cuda")
    late, late_baseline = sum(losses[-8:]) / 8, sum(baseline[-8:]) / 8
    assert abs(late - late_baseline) < 0.05 * late_baseline
    assert set(handle.report().fp8) == {"fc1", "fc2"}


@requires_fp8_cuda
def test_cuda_counts_and_state_stay_on_the_device():
    model = Mlp().cuda()
    opt = torch.optim.AdamW(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0,
                                fp8=small(recipe="delayed"))
    x, y = batch(0)
    loss = F.cross_entropy(model(x.cuda()).float(), y.cuda())
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    group = amp.default_handle()._run.fp8.groups[0]
    for tensor in (group.counts, group.history, group.scale, group.pending, group.steps):
        assert tensor.is_cuda
    assert int(group.steps) == 1


@pytest.mark.skipif(not torch.cuda.is_available() or FP8_GPU,
                    reason="needs a CUDA GPU without fp8 matmuls (before sm_89)")
def test_cuda_gpu_without_fp8_matmuls_is_refused():
    with pytest.raises(ValueError, match="compute capability 8.9 or newer"):
        amp.initialize(Mlp().cuda(), opt_level="O2", fp8=True, verbosity=0)


@requires_fp8_cuda
@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_cuda_fp8_forward_backward_and_fold_never_sync(recipe):
    """Amaxes, scales, counts and the fold stay on the device (torch's sync debug mode
    raises on any host synchronisation)."""
    model = Mlp().cuda()
    opt = torch.optim.AdamW(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0,
                                fp8=small(recipe=recipe))
    x, y = batch(0)
    x, y = x.cuda(), y.cuda()
    F.cross_entropy(model(x).float(), y).backward()    # compiles the casts (may sync)
    model.zero_grad()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        F.cross_entropy(model(x).float(), y).backward()
        group = amp.default_handle()._run.fp8.groups[0]
        if group.delayed:
            group.fold()
    finally:
        torch.cuda.set_sync_debug_mode("default")
