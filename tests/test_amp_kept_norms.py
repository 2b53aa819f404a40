"""O2's kept norm layers on the half activations (issue 53): a BatchNorm kept fp32 at O2/O5 runs on
the half input with its fp32 weight, bias and running statistics where torch's kernel takes that
mix, saving no fp32 copy of its input, and gives what the fp32 round trip (input cast to fp32,
output cast back to half: what amp did before, and still does elsewhere) gives; everywhere else
the round trip stays. amp/casting.py's Note [kept norms run on the half activations] has the table.

Each layer is checked against an fp64 reference of the same half input: the mixed path's error
must be that of the round trip (the output and input gradient differ from it only where a value
lies next to a half rounding boundary; fp32 results, the weight and bias gradients and running
statistics, stay within a few fp32 roundings of it).
"""
from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn

from apex_lite import amp
from apex_lite.amp import casting
from apex_lite.parallel import SyncBatchNorm

HALF = [torch.bfloat16, torch.float16]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))]
C = 8

# name: (make the layer, the input's shape, device type -> the layouts it takes half input in)
ANY, CONTIGUOUS = casting.ANY_LAYOUT, casting.CONTIGUOUS
BN = {"cpu": CONTIGUOUS, "cuda": ANY}
BOTH = {"cpu": ANY, "cuda": ANY}
MIXED = {
    "bn2d": (lambda: nn.BatchNorm2d(C), (6, C, 5, 7), BN),
    "bn1d_on_nc": (lambda: nn.BatchNorm1d(C), (40, C), BN),
    "bn1d_on_ncl": (lambda: nn.BatchNorm1d(C), (6, C, 11), BN),
    "bn3d": (lambda: nn.BatchNorm3d(C), (3, C, 3, 4, 5), BN),
    "bn2d_momentum_none": (lambda: nn.BatchNorm2d(C, momentum=None), (6, C, 5, 7), BN),
    "bn2d_no_running_stats": (lambda: nn.BatchNorm2d(C, track_running_stats=False),
                              (6, C, 5, 7), BN),
    # Kept only by keep_fp32_modules (O2 casts BatchNorm without affine parameters): its fp32
    # running statistics make the mix.
    "bn2d_no_affine": (lambda: nn.BatchNorm2d(C, affine=False), (6, C, 5, 7), BN),
    "torch_syncbn": (lambda: nn.SyncBatchNorm(C), (6, C, 5, 7), BN),
    "apex_syncbn": (lambda: SyncBatchNorm(C), (6, C, 5, 7), BN),
    "apex_syncbn_nhwc_relu": (lambda: SyncBatchNorm(C, channel_last=True, fuse_relu=True),
                              (6, 5, 7, C), BN),
    "instance_norm": (lambda: nn.InstanceNorm2d(C, affine=True, track_running_stats=True),
                      (6, C, 5, 7), BOTH),
    "group_norm": (lambda: nn.GroupNorm(4, C), (6, C, 5, 7), {"cpu": ANY}),
}
# Layers that keep the round trip everywhere: torch has no mix for them, or not as exact a one
# (LayerNorm on the CPU rounds its weight and bias gradients through half), or they hold no fp32
# tensor at all (the kernel would run in pure half), or their forward is not torch's.


class ScaledBatchNorm(nn.BatchNorm2d):
    """A subclass with its own forward: amp cannot know what it does with a half input."""

    def forward(self, input):
        return super().forward(input) * 2.0


CASTS = {
    "layer_norm": (lambda: nn.LayerNorm([5, 7]), (6, C, 5, 7)),
    "bn2d_no_fp32_tensor": (lambda: nn.BatchNorm2d(C, affine=False, track_running_stats=False),
                            (6, C, 5, 7)),
    "instance_norm_plain": (lambda: nn.InstanceNorm2d(C), (6, C, 5, 7)),
    "bn_subclass_own_forward": (lambda: ScaledBatchNorm(C), (6, C, 5, 7)),
    "linear": (lambda: nn.Linear(7, 7), (6, C, 5, 7)),
}


def _layer(make, device, seed=0):
    """The layer with non-trivial weight, bias and running statistics."""
    torch.manual_seed(seed)
    layer = make().to(device)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.5)
        for name, b in layer.named_buffers():
            if b.is_floating_point():
                b.add_(torch.rand_like(b) if "var" in name else torch.randn_like(b))
    return layer


def _inputs(shape, dtype, device, channels_last, seed=1, offset=3.0):
    g = torch.Generator().manual_seed(seed)
    xs = [(torch.randn(shape, generator=g) * 2 + offset).to(device, dtype) for _ in range(2)]
    grads = [torch.randn(shape, generator=g).to(device, dtype) for _ in range(2)]
    if channels_last:
        fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
        xs = [x.contiguous(memory_format=fmt) for x in xs]
    return xs, grads


def _run(layer, xs, grads, train, saved=None):
    """Two forward and backward passes (the second sees the first's running statistics); what
    each returned, the input gradients, then the parameter gradients and floating buffers. With
    ``saved`` (a list), every tensor autograd saves for backward is appended to it."""
    layer.train(train)
    outs, grad_ins = [], []
    for x, g in zip(xs, grads):
        x = x.detach().clone().requires_grad_()
        if saved is None:
            out = layer(x)
        else:
            with torch.autograd.graph.saved_tensors_hooks(
                    lambda t: saved.append(t) or t, lambda t: t):
                out = layer(x)
        out.backward(g.to(out.dtype))
        outs.append(out.detach())
        grad_ins.append(x.grad)
    params = [p.grad.detach().clone() for p in layer.parameters()]
    buffers = [b.detach().clone() for b in layer.buffers() if b.is_floating_point()]
    return {"out": outs, "grad_in": grad_ins, "param_grads": params, "buffers": buffers}


def _three_ways(make, shape, dtype, device, channels_last, train, layouts=None):
    """The layer kept as amp keeps it now (``wrap_kept``, or a ``KeptForward`` taking half input
    in the given ``layouts``), the fp32 round trip, and fp64 on the same half values."""
    xs, grads = _inputs(shape, dtype, device, channels_last)
    kept, round_trip, exact = (_layer(make, device) for _ in range(3))
    if layouts is None:
        casting.wrap_kept(kept, dtype)
    else:
        kept.forward = casting.KeptForward(kept.forward, dtype, layouts)
    round_trip.forward = casting.KeptForward(round_trip.forward, dtype, {})
    exact.double()
    return (_run(kept, xs, grads, train), _run(round_trip, xs, grads, train),
            _run(exact, [x.double() for x in xs], [g.double() for g in grads], train))


def _max_err(results, ref):
    return [(a.double() - b).abs().max().item() for a, b in zip(results, ref)]


def _assert_as_exact(new, old, ref, dtype):
    """``new``'s errors against fp64 ``ref`` are those of ``old`` (the round trip): half
    results within one half rounding step more, fp32 results within a few fp32 roundings."""
    eps = torch.finfo(dtype).eps
    for key in ("out", "grad_in"):
        for a, b, r in zip(new[key], old[key], ref[key]):
            assert a.dtype == dtype
            scale = r.abs().max().item()
            err_new, err_old = _max_err([a], [r])[0], _max_err([b], [r])[0]
            assert err_new <= err_old + eps * scale, (key, err_new, err_old)
    for key in ("param_grads", "buffers"):
        assert len(new[key]) == len(ref[key])
        for a, b, r in zip(new[key], old[key], ref[key]):
            assert a.dtype == torch.float32, key
            scale = r.abs().max().item()
            err_new, err_old = _max_err([a], [r])[0], _max_err([b], [r])[0]
            assert err_new <= 4 * err_old + 1e-6 * scale, (key, err_new, err_old)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(MIXED))
def test_kept_norm_on_half_input_is_as_exact_as_the_fp32_round_trip(name, dtype, train, device):
    make, shape, _ = MIXED[name]
    new, old, ref = _three_ways(make, shape, dtype, device, False, train)
    _assert_as_exact(new, old, ref, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ["bn2d", "bn3d", "instance_norm", "group_norm", "torch_syncbn",
                                  "apex_syncbn"])
def test_channels_last_input(name, dtype, device):
    """Channels-last input: on the CPU BatchNorm takes the round trip (its mixed kernel is less
    exact there), the others and CUDA the half input."""
    make, shape, layouts = MIXED[name]
    new, old, ref = _three_ways(make, shape, dtype, device, True, True)
    _assert_as_exact(new, old, ref, dtype)
    fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    assert new["out"][0].is_contiguous(memory_format=fmt) == \
        old["out"][0].is_contiguous(memory_format=fmt)
    layer = _layer(make, device)
    casting.wrap_kept(layer, dtype)
    x = _inputs(shape, dtype, device, True)[0][0]
    assert bool(_fp32_saved(layer, x)) == (layouts[device] == CONTIGUOUS)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("layout", ["channels_last", "strided"])
def test_cpu_batchnorm_mix_off_contiguous_input_fails_the_check(layout, train):
    """Why the CPU's BatchNorm takes only contiguous half input, and that the check can fail:
    forced onto the mixed kernel, a channels-last or strided bf16 input gets a bias gradient
    summed in bf16."""
    make, shape, _ = MIXED["bn2d"]
    if layout == "channels_last":
        new, old, ref = _three_ways(make, shape, torch.bfloat16, "cpu", True, train,
                                    layouts={"cpu": ANY})
    else:
        xs, grads = _inputs((6, 5, C, 7), torch.bfloat16, "cpu", False)
        xs, grads = [x.transpose(1, 2) for x in xs], [g.transpose(1, 2) for g in grads]
        assert not xs[0].is_contiguous()
        kept, round_trip, exact = (_layer(make, "cpu") for _ in range(3))
        kept.forward = casting.KeptForward(kept.forward, torch.bfloat16, {"cpu": ANY})
        round_trip.forward = casting.KeptForward(round_trip.forward, torch.bfloat16, {})
        new, old = _run(kept, xs, grads, train), _run(round_trip, xs, grads, train)
        ref = _run(exact.double(), [x.double() for x in xs], [g.double() for g in grads], train)
    with pytest.raises(AssertionError):
        _assert_as_exact(new, old, ref, torch.bfloat16)
    kept = _layer(make, "cpu")
    casting.wrap_kept(kept, torch.bfloat16)
    assert _fp32_saved(kept, _inputs(shape, torch.bfloat16, "cpu", True)[0][0])


def _fp32_saved(layer, x, train=True):
    """The fp32 tensors of the input's size that ``layer`` saves for backward on ``x``."""
    saved = []
    _run(layer, [x], [torch.ones_like(x)], train, saved=saved)
    return [t for t in saved if t.dtype == torch.float32 and t.numel() == x.numel()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(MIXED))
def test_kept_norm_saves_no_fp32_copy_of_its_input(name, dtype, device):
    make, shape, devices = MIXED[name]
    layer = _layer(make, device)
    casting.wrap_kept(layer, dtype)
    assert layer.forward.half_input_layouts == devices
    x = torch.randn(shape).to(device, dtype)
    fp32 = _fp32_saved(layer, x)
    if device in devices:
        assert not fp32
    else:
        assert fp32   # GroupNorm on CUDA: the round trip


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(CASTS))
def test_other_kept_modules_keep_the_round_trip(name, dtype):
    make, shape = CASTS[name]
    layer = _layer(make, "cpu")
    casting.wrap_kept(layer, dtype)
    assert layer.forward.half_input_layouts == {}
    x = torch.randn(shape).to(dtype)
    assert _fp32_saved(layer, x), "the round trip saves the fp32 input (or a like-sized fp32)"
    out = layer(x)
    assert out.dtype == dtype
    reference = _layer(make, "cpu")
    torch.testing.assert_close(out, reference(x.float()).to(dtype), rtol=0, atol=0)


def test_fp32_input_and_other_devices_take_the_round_trip():
    """An fp32 input (a layer fed by something amp did not cast) runs the layer in fp32; a device
    outside the layer's list too; either way the output is half."""
    layer = _layer(lambda: nn.BatchNorm2d(C), "cpu")
    reference = _layer(lambda: nn.BatchNorm2d(C), "cpu")
    casting.wrap_kept(layer, torch.bfloat16)
    x = torch.randn(4, C, 3, 3)
    out = layer(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, reference(x).bfloat16(), rtol=0, atol=0)
    torch.testing.assert_close(layer.running_var, reference.running_var, rtol=0, atol=0)
    only_cuda = _layer(lambda: nn.BatchNorm2d(C), "cpu")
    only_cuda.forward = casting.KeptForward(only_cuda.forward, torch.bfloat16, {"cuda": ANY})
    assert _fp32_saved(only_cuda, x.bfloat16())
    # A half input in the other half dtype is not the run's: the round trip too.
    other = _layer(lambda: nn.BatchNorm2d(C), "cpu")
    casting.wrap_kept(other, torch.bfloat16)
    assert other(x.half()).dtype == torch.bfloat16 and _fp32_saved(other, x.half())


# ---- through amp.initialize ---------------------------------------------------------------------

def _cnn(seed=0, bn=nn.BatchNorm2d):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), bn(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1, stride=2), bn(16), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def _train(model, opt_level, steps, seed=5, **kwargs):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0,
                                      **kwargs)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 3, 12, 12, generator=g)
        y = torch.randint(0, 10, (8,), generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        losses.append(loss.item())
    return model, optimizer, losses


@pytest.mark.parametrize("level, kwargs", [("O2", {}), ("O5", {}),
                                           ("O3", {"keep_batchnorm_fp32": True}),
                                           ("O2", {"half_dtype": torch.float16})],
                         ids=["O2", "O5", "O3-keep-bn", "O2-fp16"])
def test_cnn_at_O2_saves_only_half_activations(level, kwargs):
    model, _, _ = _train(_cnn(), level, 1, **kwargs)
    half = next(model.parameters()).dtype
    bn = model[1]
    assert bn.weight.dtype == bn.running_mean.dtype == torch.float32
    assert bn.forward.half_input_layouts == BN
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = model(torch.randn(8, 3, 12, 12))
    out.float().sum().backward()
    big = [t for t in saved if t.numel() >= 8 * 16 * 6 * 6]
    assert big and all(t.dtype == half for t in big), sorted({str(t.dtype) for t in big})


def test_cnn_at_O2_trains_as_with_the_round_trip(monkeypatch):
    """The losses of 30 steps follow those of the round trip (amp before issue 53, forced here in
    the same run): the two differ only by where the kernels round; the kept BatchNorms' weights
    and running statistics stay fp32 and close."""
    steps = 30
    model, _, losses = _train(_cnn(), "O2", steps)
    with monkeypatch.context() as patch:
        patch.setattr(casting, "_HALF_INPUT_FORWARDS", {})
        before, _, before_losses = _train(_cnn(), "O2", steps)
    assert before[1].forward.half_input_layouts == {}
    assert model[1].forward.half_input_layouts == BN
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(before_losses),
                               rtol=0.03, atol=0.03)
    assert losses[-1] < losses[0]
    for index in (1, 4):
        for name in ("weight", "running_mean", "running_var"):
            mine, theirs = getattr(model[index], name), getattr(before[index], name)
            assert mine.dtype == torch.float32
            torch.testing.assert_close(mine, theirs, rtol=0.05, atol=0.05)


def test_checkpoint_of_the_kept_norms_does_not_change():
    """The model's state_dict (dtypes and keys) and a load across levels are as before."""
    model, optimizer, _ = _train(_cnn(), "O2", 2)
    state = model.state_dict()
    assert state["1.running_var"].dtype == state["1.weight"].dtype == torch.float32
    assert state["0.weight"].dtype == torch.float32   # O2's state_dict holds the masters
    fp32 = _cnn(seed=3)
    fp32.load_state_dict(state)
    for key, value in fp32.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0)
    buffer = io.BytesIO()
    torch.save({"model": state, "optimizer": optimizer.state_dict(), "amp": amp.state_dict()},
               buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    resumed, resumed_opt, _ = _train(_cnn(seed=4), "O2", 0)
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["optimizer"])
    torch.testing.assert_close(resumed[1].running_var, model[1].running_var, rtol=0, atol=0)
    assert resumed[1].forward.half_input_layouts == BN


def test_copies_of_the_model_run_their_own_norms():
    """deepcopy (an EMA) and pickle of an O2 model: the copy's kept BatchNorm is the copy's, on
    the half activations, and updates its own running statistics."""
    model, _, _ = _train(_cnn(), "O2", 1)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert clone[1].forward.forward.__self__ is clone[1]
        assert clone[1].forward.half_input_layouts == BN
        before = model[1].running_mean.clone()
        clone(torch.randn(4, 3, 12, 12))
        assert torch.equal(model[1].running_mean, before)
        assert not torch.equal(clone[1].running_mean, before)


def test_apex_syncbn_and_torch_syncbn_at_O2_take_half_input():
    from apex_lite.parallel import convert_syncbn_model
    for bn_model in (convert_syncbn_model(_cnn()),
                     nn.SyncBatchNorm.convert_sync_batchnorm(_cnn())):
        model, _, losses = _train(bn_model, "O2", 3)
        assert model[1].forward.half_input_layouts == BN
        assert model[1].weight.dtype == torch.float32
        x = torch.randn(4, 3, 12, 12)
        assert not _fp32_saved(model[1], model[0](x.bfloat16()))


def test_layer_norm_kept_by_the_user_keeps_the_round_trip():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.GroupNorm(2, 8), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0,
                                      keep_fp32_modules=[nn.LayerNorm, nn.GroupNorm])
    assert model[1].forward.half_input_layouts == {}
    assert model[2].forward.half_input_layouts == {"cpu": ANY}
    out = model(torch.randn(4, 8))
    assert out.dtype == torch.float32
