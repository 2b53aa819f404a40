"""apex_lite.parallel.SyncBatchNorm: apex's synced_batchnorm tests ported to CPU, on 2 gloo ranks
(tests/workers/parallel_worker.py --suite syncbn, run once for the module) and in this process;
convert_syncbn_model and create_syncbn_process_group.

Every rank generates the whole batch and normalises its slice; the references are
torch.nn.BatchNorm over the concatenated batch in fp64 (apex's tests used a DoubleTensor
reference the same way).
"""
import pytest
import torch
import torch.nn.functional as F

import parallel_ranks
from apex_lite import amp
from apex_lite.parallel import SyncBatchNorm, convert_syncbn_model, create_syncbn_process_group

TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3), torch.float64: dict(rtol=1e-9, atol=1e-9)}
dist_only = pytest.mark.skipif(not parallel_ranks.AVAILABLE, reason=parallel_ranks.REASON)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                reason="no CUDA device"))]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return parallel_ranks.run_suite("syncbn", tmp_path_factory.mktemp("syncbn"))


def full_batch(shape, seed, dtype):   # as tests/workers/parallel_worker.py makes them
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def reference(sizes, rest, channel_last, dtype, momentum=1.0, fuse_relu=False):
    """BatchNorm over the whole batch in fp64: output, input/z gradient, weight and bias
    gradients, running statistics."""
    shape = (sum(sizes), *rest)
    x = full_batch(shape, 18, dtype).double().requires_grad_()
    grad = full_batch(shape, 19, dtype).double()
    z = full_batch(shape, 20, dtype).double().requires_grad_() if fuse_relu else None
    layout = channel_last and len(shape) > 2
    channels = shape[-1] if layout or len(shape) == 2 else shape[1]
    bn = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d}[len(shape)](
        channels, momentum=momentum).double()
    with torch.no_grad():
        bn.weight.copy_(full_batch((channels,), 21, torch.float32))
        bn.bias.copy_(full_batch((channels,), 22, torch.float32))
    out = bn(x.movedim(-1, 1) if layout else x)
    out = out.movedim(1, -1) if layout else out
    if fuse_relu:
        out = torch.relu(out + z)
    out.backward(grad)
    return {"out": out.detach(), "grad_in": x.grad, "grad_z": None if z is None else z.grad,
            "grad_w": bn.weight.grad, "grad_b": bn.bias.grad,
            "running_mean": bn.running_mean, "running_var": bn.running_var}


def close(actual, expected, dtype):
    torch.testing.assert_close(actual.double(), expected.double(), **TOL[dtype])


CASES = {   # as SYNCBN_CASES in the worker: sizes, shape after N, channel_last, dtype, momentum, relu
    "uneven_nchw": ((5, 2), (6, 3, 3), False, torch.float32, 0.1, False),
    "uneven_nhwc": ((5, 2), (3, 3, 6), True, torch.float32, None, False),
    "uneven_2d": ((7, 3), (6,), False, torch.float32, 1.0, False),
    "uneven_3d_bf16": ((5, 2), (6, 5), False, torch.bfloat16, 1.0, False),
    "uneven_relu_z": ((3, 5), (4, 2, 3), False, torch.float32, 1.0, True),
    "empty_rank": ((6, 0), (3, 2), False, torch.float32, 1.0, False),
    # Half input with fp32 weight, bias and statistics, alone and kept by O2 (issue 53).
    "half_bf16_nchw": ((5, 3), (6, 3, 3), False, torch.bfloat16, 0.1, False),
    "half_fp16_nhwc_relu_z": ((5, 3), (3, 3, 6), True, torch.float16, None, True),
    "half_fp16_2d": ((7, 3), (6,), False, torch.float16, 1.0, False),
    "kept_bf16_O2": ((5, 3), (6, 3, 3), False, torch.bfloat16, 1.0, False),
    "kept_fp16_O2_relu_z": ((3, 5), (4, 2, 3), False, torch.float16, 1.0, True),
}


@dist_only
@pytest.mark.parametrize("name", list(CASES))
def test_statistics_and_gradients_are_the_concatenated_batchs(ranks, name):
    """Ranks with different batch sizes (one of them empty): outputs, input gradients and
    running statistics of BatchNorm over the concatenated batch; the ranks' weight and bias
    gradients sum to its. Half inputs to the fp32 layer (O2's kept SyncBatchNorm): statistics
    those of the half values in fp32, to fp32's tolerance."""
    sizes, rest, channel_last, dtype, momentum, relu = CASES[name]
    ref = reference(sizes, rest, channel_last, dtype, momentum=momentum, fuse_relu=relu)
    start = 0
    for rank, result in enumerate(ranks):
        mine = result[name]
        stop = start + sizes[rank]
        assert mine["out"].dtype == dtype and mine["grad_in"].dtype == dtype
        if dtype != torch.float32:   # statistics in fp32, and no fp32 copy of the input kept
            assert mine["running_mean"].dtype == mine["grad_w"].dtype == torch.float32
            assert mine["fp32_saved"] == 0
        close(mine["out"], ref["out"][start:stop], dtype)
        close(mine["grad_in"], ref["grad_in"][start:stop], dtype)
        if relu:
            close(mine["grad_z"], ref["grad_z"][start:stop], dtype)
        close(mine["running_mean"], ref["running_mean"], torch.float32)
        close(mine["running_var"], ref["running_var"], torch.float32)
        start = stop
    for key in ("grad_w", "grad_b"):
        close(ranks[0][name][key] + ranks[1][name][key], ref[key], dtype)


@dist_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_two_gpu_unit_test_under_apex_lite_ddp(ranks, dtype):
    """apex's two_gpu_unit_test.py (and --fp16): the layer in the input's dtype under DDP, one
    SGD step of lr 1; BatchNorm's gradients over the whole batch divided by the world size (the
    average DDP takes) give the same weights."""
    name = {torch.float32: "unit_fp32", torch.bfloat16: "unit_bf16",
            torch.float16: "unit_fp16"}[dtype]
    ref = reference((4, 4), (10, 4, 4), False, dtype)
    w0, b0 = full_batch((10,), 21, torch.float32), full_batch((10,), 22, torch.float32)
    for rank, result in enumerate(ranks):
        mine = result[name]
        close(mine["out"], ref["out"][4 * rank:4 * rank + 4], dtype)
        close(mine["grad_in"], ref["grad_in"][4 * rank:4 * rank + 4], dtype)
        close(mine["running_mean"], ref["running_mean"], dtype)
        close(mine["running_var"], ref["running_var"], dtype)
        close(mine["weight_after"], w0.to(dtype).double() - ref["grad_w"] / 2, dtype)
        close(mine["bias_after"], b0.to(dtype).double() - ref["grad_b"] / 2, dtype)
        assert torch.equal(mine["weight_after"], ranks[0][name]["weight_after"])


@dist_only
def test_different_batch_sizes_under_torch_ddp(ranks):
    """apex's two_gpu_test_different_batch_size.py with torch's DDP: the outputs, running
    statistics and weight gradients of Conv2d + BatchNorm2d over the concatenated batch."""
    torch.manual_seed(2809)
    reference_model = torch.nn.Sequential(torch.nn.Conv2d(3, 6, 3, 1, 1),
                                          torch.nn.BatchNorm2d(6)).double()
    with torch.no_grad():
        for p, start in zip(reference_model.parameters(), ranks[0]["torch_ddp"]["start"]):
            p.copy_(start)
    data = full_batch((24, 3, 8, 8), 50, torch.float32)
    data[:16] *= 50.0
    grad = torch.randint(0, 10, (24, 6, 8, 8), generator=torch.Generator().manual_seed(51)) / 10.0
    output = reference_model(data.double())
    output.backward(grad.double() / 24)
    got = torch.cat([ranks[0]["torch_ddp"]["out"], ranks[1]["torch_ddp"]["out"]])
    torch.testing.assert_close(got.double(), output.detach(), rtol=1e-5, atol=1e-4)
    for result in ranks:
        mine = result["torch_ddp"]
        close(mine["running_mean"], reference_model[1].running_mean, torch.float32)
        torch.testing.assert_close(mine["running_var"].double(), reference_model[1].running_var,
                                   rtol=1e-5, atol=1e-2)
        torch.testing.assert_close(mine["bn_grad"].double(), reference_model[1].weight.grad,
                                   rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(mine["conv_grad"].double(), reference_model[0].weight.grad,
                                   rtol=1e-5, atol=1e-4)


@dist_only
def test_process_groups(ranks):
    """create_syncbn_process_group(1): each rank normalises with its own statistics; (2): both
    ranks', as the default group; (0): None."""
    both = reference((4, 2), (3, 2), False, torch.float32)
    for rank, result in enumerate(ranks):
        start, size = ((0, 4), (4, 2))[rank]
        alone = torch.nn.BatchNorm1d(3).double()
        with torch.no_grad():
            alone.weight.copy_(full_batch((3,), 21, torch.float32))
            alone.bias.copy_(full_batch((3,), 22, torch.float32))
        x = full_batch((6, 3, 2), 18, torch.float32)[start:start + size].double()
        close(result["group_of_one"]["out"], alone(x), torch.float32)
        close(result["group_of_two"]["out"], both["out"][start:start + size], torch.float32)
        assert not torch.allclose(result["group_of_one"]["out"], result["group_of_two"]["out"])
        assert result["group_size_0"]


@dist_only
def test_eval_uses_the_running_statistics(ranks):
    ev = ranks[0]["eval"]
    expected = F.batch_norm(ev["x"].movedim(-1, 1), ev["running_mean"], ev["running_var"],
                            torch.ones(3), torch.zeros(3), False, 0.0, 1e-5).movedim(1, -1)
    close(ev["out"], expected, torch.float32)


# ---- in this process: apex's single-GPU tests on CPU ---------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("channel_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_single_process_unit_test(channel_last, dtype, device):
    """apex's python_single_gpu_unit_test.py / single_gpu_unit_test.py: output, gradients and
    running statistics against the formulas in fp64, and against BatchNorm2d."""
    torch.manual_seed(1)
    feature_size, space_size, batch_size, eps = 10, 16, 5, 1e-5
    inp = torch.randn(batch_size, feature_size, space_size, space_size).to(dtype)
    grad = torch.randn_like(inp)
    weight, bias = torch.randn(feature_size).to(dtype), torch.randn(feature_size).to(dtype)
    inp_r = inp.double().transpose(1, 0).reshape(feature_size, -1)
    m, b_v = inp_r.mean(1), inp_r.var(1, unbiased=False)
    shape = (-1, 1, 1)
    xmu = inp.double() - m.view(shape)
    out_r = weight.double().view(shape) * xmu * torch.rsqrt(b_v.view(shape) + eps) + \
        bias.double().view(shape)
    grad_r = grad.double()
    mean_dy = grad_r.transpose(1, 0).reshape(feature_size, -1).mean(1)
    mean_dy_xmu = (xmu * grad_r).transpose(1, 0).reshape(feature_size, -1).mean(1)
    grad_input_r = (grad_r - mean_dy.view(shape) - xmu / (b_v.view(shape) + eps)
                    * mean_dy_xmu.view(shape)) * torch.rsqrt(b_v.view(shape) + eps) \
        * weight.double().view(shape)
    grad_weight_r = (xmu * torch.rsqrt(b_v.view(shape) + eps) * grad_r).transpose(1, 0) \
        .reshape(feature_size, -1).sum(1)
    grad_bias_r = grad_r.transpose(1, 0).reshape(feature_size, -1).sum(1)

    sbn = SyncBatchNorm(feature_size, channel_last=channel_last).to(device, dtype)
    sbn.momentum = 1.0
    with torch.no_grad():
        sbn.weight.copy_(weight)
        sbn.bias.copy_(bias)
    layout = (lambda t: t.movedim(1, -1).contiguous()) if channel_last else (lambda t: t)
    x = layout(inp).to(device).requires_grad_()
    out = sbn(x)
    out.backward(layout(grad).to(device))
    back = (lambda t: t.movedim(-1, 1).cpu()) if channel_last else (lambda t: t.cpu())
    close(back(out), out_r, dtype)
    close(back(x.grad), grad_input_r, dtype)
    close(sbn.weight.grad.cpu(), grad_weight_r, dtype)
    close(sbn.bias.grad.cpu(), grad_bias_r, dtype)
    close(sbn.running_mean.cpu(), m, dtype)
    close(sbn.running_var.cpu(), inp_r.var(1, unbiased=True), dtype)


def test_batchnorm1d():
    """apex's test_batchnorm1d.py: a 2-D input, against BatchNorm1d with the same state."""
    model = SyncBatchNorm(4)
    model.weight.data.uniform_()
    model.bias.data.uniform_()
    data = torch.rand((8, 4))
    model_ref = torch.nn.BatchNorm1d(4)
    model_ref.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(data), model_ref(data))
    torch.testing.assert_close(model.running_mean, model_ref.running_mean)
    torch.testing.assert_close(model.running_var, model_ref.running_var)


@pytest.mark.parametrize("fuse_relu, with_z, train", [(False, False, True), (True, True, True),
                                                      (True, True, False), (False, True, False)])
@pytest.mark.parametrize("channel_last", [False, True])
def test_gradcheck(fuse_relu, with_z, train, channel_last):
    """The backward is the derivative of the forward (fp64 finite differences), through the
    batch statistics in training and the running ones in eval."""
    torch.manual_seed(0)
    sbn = SyncBatchNorm(3, fuse_relu=fuse_relu, channel_last=channel_last).double()
    with torch.no_grad():
        sbn.weight.uniform_(0.5, 1.5)
        sbn.bias.uniform_(-0.5, 0.5)
        sbn.running_mean.uniform_(-0.2, 0.2)
        sbn.running_var.uniform_(0.5, 1.5)
    sbn.train(train)
    shape = (4, 5, 3) if channel_last else (4, 3, 5)
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    z = torch.randn(*shape, dtype=torch.float64, requires_grad=True) if with_z else None
    assert torch.autograd.gradcheck(lambda x, z, w, b: sbn(x, z), (x, z, sbn.weight, sbn.bias))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_input_statistics_in_fp32(dtype, device):
    """A half input to an fp32 layer (O2's kept BatchNorm sees fp32, an unkept one half): the
    output is in the input's dtype, the statistics those of the fp32 values."""
    torch.manual_seed(0)
    x = (torch.randn(64, 3, 5) * 3 + 100).to(device, dtype)   # far from 0: half sums drift
    sbn = SyncBatchNorm(3).to(device)
    out = sbn(x)
    ref = torch.nn.BatchNorm1d(3).to(device)
    expected = ref(x.float())
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected.to(dtype), **TOL[dtype])
    torch.testing.assert_close(sbn.running_mean, ref.running_mean, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(sbn.running_var, ref.running_var, rtol=1e-5, atol=1e-5)


def test_momentum_none_is_a_cumulative_average():
    torch.manual_seed(0)
    sbn, ref = SyncBatchNorm(3, momentum=None), torch.nn.BatchNorm1d(3, momentum=None)
    for _ in range(3):
        x = torch.randn(6, 3)
        sbn(x), ref(x)
    torch.testing.assert_close(sbn.running_var, ref.running_var)
    assert int(sbn.num_batches_tracked) == 3


def test_misuse_is_named():
    with pytest.raises(ValueError, match="channel_last=True for"):
        SyncBatchNorm(4)(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        SyncBatchNorm(4)(torch.randn(1, 4))
    with pytest.raises(ValueError, match="z is added to the output"):
        SyncBatchNorm(4)(torch.randn(2, 4, 3), torch.randn(2, 4))


def test_empty_batch_leaves_running_statistics():
    sbn = SyncBatchNorm(3)
    out = sbn(torch.randn(0, 3, 2))
    assert out.shape == (0, 3, 2)
    assert torch.equal(sbn.running_mean, torch.zeros(3))
    assert torch.equal(sbn.running_var, torch.ones(3))


def test_convert_syncbn_model_keeps_everything():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3), torch.nn.BatchNorm2d(4, eps=1e-3,
                                                                                 momentum=0.3),
                                torch.nn.Sequential(torch.nn.Linear(4, 4),
                                                    torch.nn.BatchNorm1d(4, affine=False)),
                                torch.nn.SyncBatchNorm(4), torch.nn.InstanceNorm2d(4))
    model[1].running_mean.uniform_()
    model[1].weight.requires_grad_(False)
    model[3].eval()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    weight = model[1].weight
    converted = convert_syncbn_model(model, channel_last=True)
    assert converted is model
    for index in (1, 3):
        assert type(converted[index]) is SyncBatchNorm and converted[index].channel_last
    assert type(converted[2][1]) is SyncBatchNorm and not converted[2][1].affine
    assert type(converted[4]) is torch.nn.InstanceNorm2d
    bn = converted[1]
    assert (bn.eps, bn.momentum) == (1e-3, 0.3)
    assert bn.weight is weight and not bn.weight.requires_grad   # the optimizer's parameter
    assert bn.weight is optimizer.param_groups[0]["params"][2]
    assert not converted[3].training and converted[1].training
    assert list(converted.state_dict()) == list(state)
    for key, value in converted.state_dict().items():
        assert torch.equal(value, state[key]), key
    single = convert_syncbn_model(torch.nn.BatchNorm1d(3), process_group="g")
    assert type(single) is SyncBatchNorm and single.process_group == "g"


def test_create_syncbn_process_group_0_is_none():
    assert create_syncbn_process_group(0) is None


def test_kept_fp32_at_O2_as_batchnorm():
    """amp's O2 keeps _BatchNorm fp32 (keep_batchnorm_fp32): SyncBatchNorm is one."""
    model = convert_syncbn_model(torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3),
                                                     torch.nn.BatchNorm2d(4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    assert model[0].weight.dtype == torch.bfloat16
    assert model[1].weight.dtype == torch.float32 and model[1].running_var.dtype == torch.float32
    out = model(torch.randn(3, 2, 5, 5))
    with amp.scale_loss(out.float().pow(2).mean(), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    assert "model modules kept fp32: 1" in str(amp.report())

