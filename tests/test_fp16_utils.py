"""apex_lite.fp16_utils (apex.fp16_utils): FP16_Optimizer's steps against an fp32-master
reference, its loss scaling, skips, state_dict and refusals; the model helpers; the stand-alone
loss scalers; apex's signatures; apex's tests/L0/run_fp16util ported to the CPU."""
import copy
import inspect
import io
import types

import pytest
import torch
import torch.nn as nn

import apex_lite.fp16_utils as fp16_utils
from apex_lite import amp
from apex_lite.fp16_utils import (BN_convert_float, DynamicLossScaler, FP16_Optimizer, FP16Model,
                                  LossScaler, clip_grad_norm, convert_module, convert_network,
                                  master_params_to_model_params, model_grads_to_master_grads,
                                  network_to_half, prep_param_lists, to_python_float, tofp16)

HALF = [torch.float16, torch.bfloat16]


class Model(nn.Module):
    """A half trunk and an fp32 head (FP16_Optimizer's two kinds of parameters), one frozen
    parameter."""

    def __init__(self, dtype):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 5)).to(dtype)
        self.head = nn.Linear(5, 1)
        self.frozen = nn.Parameter(torch.ones(3, dtype=dtype), requires_grad=False)

    def forward(self, x):
        return self.head(self.trunk(x.to(self.frozen.dtype)).float())


def data(step, n=16):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(n, 6, generator=g)
    return x, x.sum(1, keepdim=True) * 0.3


def loss_of(model, step, scale_input=1.0):
    x, y = data(step)
    return nn.functional.mse_loss(model(x * scale_input), y)


def wrapped(dtype, make=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), **kwargs):
    torch.manual_seed(0)
    model = Model(dtype)
    return model, FP16_Optimizer(make(model.parameters()), verbose=False, **kwargs)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_steps_equal_an_fp32_master_reference(dtype):
    """Each step: the half gradients, unscaled in fp32, step fp32 masters with the torch optimizer;
    the half model gets the masters rounded. Bit for bit against the same done by hand."""
    model, optimizer = wrapped(dtype, static_loss_scale=128.0)
    ref_model = copy.deepcopy(model)
    ref_masters = [p.detach().float().clone().requires_grad_() for p in ref_model.parameters()
                   if p.requires_grad]
    ref_optimizer = torch.optim.SGD(ref_masters, lr=0.1, momentum=0.9)
    for step in range(4):
        optimizer.zero_grad()
        optimizer.backward(loss_of(model, step))
        optimizer.step()

        ref_model.zero_grad()
        (loss_of(ref_model, step).float() * 128.0).backward()
        live = [p for p in ref_model.parameters() if p.requires_grad]
        for p, m in zip(live, ref_masters):
            m.grad = p.grad.float() * (1 / 128.0)
        ref_optimizer.step()
        with torch.no_grad():
            for p, m in zip(live, ref_masters):
                p.copy_(m)
    masters = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    assert all(m.dtype == torch.float32 for m in masters)
    for got, want in zip(masters, ref_masters):
        assert torch.equal(got, want)
    for got, want in zip(model.parameters(), ref_model.parameters()):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert torch.equal(model.frozen, torch.ones(3, dtype=dtype))


def _inf_step(model, optimizer, step):
    optimizer.zero_grad()
    optimizer.backward(loss_of(model, step, scale_input=float("inf")))


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
def test_a_non_finite_step_is_never_applied(dynamic):
    """An overflow skips the step (the model, the masters and the optimizer state stay), with a
    static scale too (apex_lite's rule; apex applied it); a dynamic scale is divided by the
    factor, a static one stays. clip_master_grads says -1 meanwhile."""
    kwargs = {"dynamic_loss_scale": True} if dynamic else {"static_loss_scale": 64.0}
    model, optimizer = wrapped(torch.float16, **kwargs)
    optimizer.zero_grad()
    optimizer.backward(loss_of(model, 0))
    optimizer.step()   # momentum state exists
    before = copy.deepcopy((model.state_dict(), optimizer.optimizer.state_dict()))
    scale = optimizer.loss_scale
    _inf_step(model, optimizer, 1)
    assert optimizer.overflow and optimizer.clip_master_grads(1.0) == -1
    assert optimizer.inspect_master_grad_data() is None
    assert optimizer.step() is None
    after = (model.state_dict(), optimizer.optimizer.state_dict())
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert optimizer.loss_scale == (scale / 2 if dynamic else scale)
    optimizer.zero_grad()
    optimizer.backward(loss_of(model, 2))
    assert not optimizer.overflow and optimizer.clip_master_grads(1e9) > 0
    optimizer.step()
    assert not torch.equal(model.trunk[0].weight, before[0]["trunk.0.weight"])


def test_dynamic_scale_rule_and_its_arguments():
    """apex's rule with dynamic_loss_args: start init_scale (capped by max_loss_scale), times
    scale_factor after scale_window clean steps, divided by it on an overflow, floored at
    min_loss_scale."""
    model, optimizer = wrapped(torch.bfloat16, dynamic_loss_scale=True, dynamic_loss_args={
        "init_scale": 64.0, "scale_factor": 4.0, "scale_window": 2, "min_loss_scale": 8.0,
        "max_loss_scale": 1024.0})
    seen = []
    for step, bad in enumerate([0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0]):
        if bad:
            _inf_step(model, optimizer, step)
        else:
            optimizer.zero_grad()
            optimizer.backward(loss_of(model, step))
        optimizer.step()
        seen.append(optimizer.loss_scale)
    assert seen == [64, 256, 256, 1024, 1024, 1024, 256, 64, 16, 8, 8, 32]
    _, default = wrapped(torch.float16, dynamic_loss_scale=True)
    assert default.loss_scale == 2.0 ** 16 and default.loss_scaler._scale_seq_len == 2000


def test_several_backwards_add_up():
    """Two losses through backward (each updating the master gradients, or not) give the
    gradients of their sum, for the half and the fp32 parameters, also when the dynamic scale
    grows between them (apex unscaled the fp32 gradients once per call)."""
    def grads(calls, **kwargs):
        model, optimizer = wrapped(torch.float16, **kwargs)
        optimizer.zero_grad()
        calls(model, optimizer)
        return [p.grad.clone() for group in optimizer.param_groups for p in group["params"]
                if p.requires_grad]

    def together(model, optimizer):
        optimizer.backward(loss_of(model, 0) + loss_of(model, 1))

    def each(model, optimizer):
        optimizer.backward(loss_of(model, 0))
        optimizer.backward(loss_of(model, 1))

    def delayed(model, optimizer):
        optimizer.backward(loss_of(model, 0), update_master_grads=False)
        optimizer.backward(loss_of(model, 1), update_master_grads=False)
        optimizer.update_master_grads()

    growing = {"dynamic_loss_scale": True,
               "dynamic_loss_args": {"init_scale": 256.0, "scale_window": 1}}
    for kwargs in ({"static_loss_scale": 256.0}, growing):
        want = grads(together, **kwargs)
        for calls in (each, delayed):
            for got, expected in zip(grads(calls, **kwargs), want):
                torch.testing.assert_close(got, expected, rtol=2e-3, atol=1e-6)


def test_a_master_whose_parameter_got_no_gradient_gets_none():
    """A half parameter without a gradient this step (its module unused) leaves its master
    without one, so the optimizer skips it, as it would the parameter itself (apex kept the
    master's stale gradient and stepped it again)."""
    model, optimizer = wrapped(torch.float16, make=lambda p: torch.optim.SGD(p, lr=0.1))
    optimizer.backward(loss_of(model, 0))
    optimizer.step()
    model.zero_grad()   # the model's own zero_grad: gradients to None
    kept = optimizer.fp32_from_fp16_groups[0][0].clone()
    optimizer.backward(nn.functional.mse_loss(model.head(torch.randn(4, 5)), torch.zeros(4, 1)))
    assert all(m.grad is None for m in optimizer.fp32_from_fp16_groups[0])
    optimizer.step()
    assert torch.equal(optimizer.fp32_from_fp16_groups[0][0], kept)


def test_state_dict_round_trip_resumes_exactly(tmp_path):
    """apex's keys; torch.save and torch.load (weights_only, its default) into a fresh optimizer
    resume the run bit for bit, masters and loss scale included."""
    def run(model, optimizer, steps):
        for step in steps:
            if step == 3:
                _inf_step(model, optimizer, step)
            else:
                optimizer.zero_grad()
                optimizer.backward(loss_of(model, step))
            optimizer.step()

    kwargs = {"dynamic_loss_scale": True, "dynamic_loss_args": {"scale_window": 3}}
    model, optimizer = wrapped(torch.float16, **kwargs)
    run(model, optimizer, range(5))
    state = optimizer.state_dict()
    assert sorted(state) == sorted(["loss_scaler", "dynamic_loss_scale", "overflow",
                                    "first_closure_call_this_step", "optimizer_state_dict",
                                    "fp32_from_fp16"])
    path = tmp_path / "checkpoint.pt"
    torch.save({"model": model.state_dict(), "optimizer": state}, path)
    run(model, optimizer, range(5, 9))

    resumed_model, resumed = wrapped(torch.float16, **kwargs)
    checkpoint = torch.load(path)
    resumed_model.load_state_dict(checkpoint["model"])
    resumed.load_state_dict(checkpoint["optimizer"])
    assert resumed.loss_scale == checkpoint["optimizer"]["loss_scaler"].loss_scale()
    run(resumed_model, resumed, range(5, 9))
    assert resumed.loss_scale == optimizer.loss_scale
    for a, b in zip(resumed.state_dict()["fp32_from_fp16"][0], optimizer.fp32_from_fp16_groups[0]):
        assert torch.equal(a, b)
    for a, b in zip(resumed_model.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_load_state_dict_refuses_what_does_not_fit():
    model, optimizer = wrapped(torch.float16)
    _, other = wrapped(torch.bfloat16, make=lambda p: torch.optim.SGD(list(p)[:2], lr=0.1))
    before = copy.deepcopy(optimizer.state_dict())
    for state, message in (({"overflow": False}, "lacks"),
                           (other.state_dict(), "holds masters of shapes"),
                           (dict(before, loss_scaler=3), "must be the loss scaler")):
        with pytest.raises(ValueError, match=message):
            optimizer.load_state_dict(state)
    torch.testing.assert_close(optimizer.state_dict()["fp32_from_fp16"], before["fp32_from_fp16"])
    # A scaler saved by apex (its amp LossScaler's attributes) loads.
    saved = types.SimpleNamespace(_loss_scale=512.0, dynamic=True, _unskipped=7,
                                  _scale_seq_len=100, _min_loss_scale=None,
                                  _max_loss_scale=2.0 ** 24, _has_overflow=False)
    optimizer.load_state_dict(dict(before, loss_scaler=saved))
    assert optimizer.loss_scale == 512.0 and optimizer.loss_scaler._unskipped == 7


def test_misuse_is_refused():
    model, optimizer = wrapped(torch.float16)
    with pytest.raises(RuntimeError, match="call optimizer.backward\\(loss\\) instead of "
                                           "loss.backward\\(\\)"):
        optimizer.step()
    optimizer.backward(loss_of(model, 0), update_master_grads=False)
    with pytest.raises(RuntimeError, match="call optimizer.update_master_grads\\(\\) first"):
        optimizer.step()
    optimizer.update_master_grads()
    optimizer.step()
    with pytest.raises(RuntimeError, match="no gradients came through FP16_Optimizer"):
        optimizer.step()   # the same gradients twice
    with pytest.raises(RuntimeError, match="serialized using state_dict"):
        copy.deepcopy(optimizer)

    double = nn.Linear(2, 2).double()
    sgd = torch.optim.SGD(double.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="must be float32, float16 or bfloat16 tensors. "
                                        "Received torch.float64"):
        FP16_Optimizer(sgd)
    assert sgd.param_groups[0]["params"][0] is double.weight   # nothing changed
    with pytest.raises(TypeError, match="unknown keys \\['delayed_shift'\\]"):
        FP16_Optimizer(torch.optim.SGD(Model(torch.float16).parameters(), lr=0.1),
                       dynamic_loss_scale=True, dynamic_loss_args={"delayed_shift": 2})
    with pytest.raises(ValueError, match="cannot be used as a loss scale"):
        FP16_Optimizer(torch.optim.SGD(Model(torch.float16).parameters(), lr=0.1),
                       static_loss_scale=0.0)
    with pytest.raises(TypeError, match="already an FP16_Optimizer"):
        FP16_Optimizer(optimizer)
    linear = nn.Linear(2, 2)
    _, amp_optimizer = amp.initialize(linear, torch.optim.SGD(linear.parameters(), lr=0.1),
                                      opt_level="O1", verbosity=0)
    with pytest.raises(ValueError, match="use amp \\(opt_level O2\\) or FP16_Optimizer"):
        FP16_Optimizer(amp_optimizer)


def test_wrapping_moves_state_and_keeps_what_it_does_not_own():
    """Half parameters are replaced by fp32 masters in param_groups, their state moved and cast,
    frozen ones too (issue 49: a master that follows requires_grad, where apex left them); fp32
    parameters stay; param_groups, state and loss_scale are the optimizer's."""
    model = Model(torch.bfloat16)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(data(0)[0]).sum().backward()
    sgd.step()
    momentum = sgd.state[model.trunk[0].weight]["momentum_buffer"].clone()
    optimizer = FP16_Optimizer(sgd, static_loss_scale=8.0, verbose=False)
    params = optimizer.param_groups[0]["params"]
    assert params[-2] is model.head.weight
    frozen_master = params[0]
    assert frozen_master.dtype == torch.float32 and not frozen_master.requires_grad
    assert torch.equal(frozen_master, model.frozen.float())
    master = params[1]
    assert master.dtype == torch.float32 and master.requires_grad and master.is_leaf
    assert torch.equal(master, model.trunk[0].weight.float())
    assert optimizer.state[master]["momentum_buffer"].dtype == torch.float32
    assert torch.equal(optimizer.state[master]["momentum_buffer"], momentum.float())
    assert optimizer.fp16_groups[0] == [model.frozen] + list(model.trunk.parameters())
    assert optimizer.fp32_from_fp32_groups[0] == list(model.head.parameters())
    optimizer.loss_scale = 32.0
    assert optimizer.loss_scaler.loss_scale() == 32.0
    optimizer.param_groups[0]["lr"] = 0.5
    assert sgd.param_groups[0]["lr"] == 0.5


@pytest.mark.parametrize("set_to_none", [False, True])
def test_zero_grad(set_to_none):
    model, optimizer = wrapped(torch.float16)
    optimizer.backward(loss_of(model, 0))
    optimizer.zero_grad(set_grads_to_None=set_to_none)
    for p in list(model.parameters()) + optimizer.fp32_from_fp16_groups[0]:
        if p.requires_grad:
            assert p.grad is None if set_to_none else torch.equal(p.grad, torch.zeros_like(p))


def test_step_with_a_closure():
    """The closure's gradients step the masters once; an overflowing one is skipped; LBFGS, which
    re-evaluates inside its step, sees the half model follow the masters."""
    model, optimizer = wrapped(torch.float16, dynamic_loss_scale=True)

    def closure(step=0, bad=False):
        optimizer.zero_grad()
        loss = loss_of(model, step, scale_input=float("inf") if bad else 1.0)
        optimizer.backward(loss)
        return loss

    trunk_master = 1   # after the frozen parameter's master
    first = optimizer.fp32_from_fp16_groups[0][trunk_master].clone()
    loss = optimizer.step(closure)
    assert torch.isfinite(loss) and \
        not torch.equal(optimizer.fp32_from_fp16_groups[0][trunk_master], first)
    kept = model.trunk[0].weight.clone()
    optimizer.step(lambda: closure(1, bad=True))
    assert torch.equal(model.trunk[0].weight, kept) and optimizer.first_closure_call_this_step

    model, optimizer = wrapped(torch.float16, make=lambda p: torch.optim.LBFGS(p, lr=0.5,
                                                                              max_iter=4))
    losses = [optimizer.step(closure).item() for _ in range(3)]
    assert losses[-1] < losses[0]
    assert torch.equal(model.trunk[0].weight,
                       optimizer.fp32_from_fp16_groups[0][trunk_master].half())


# ---- the model helpers --------------------------------------------------------------------------

def test_prep_param_lists_and_copies():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).half()
    model[1].bias.requires_grad_(False)
    model_params, masters = prep_param_lists(model)
    assert model_params == [model[0].weight, model[0].bias, model[1].weight]
    assert [m.dtype for m in masters] == [torch.float32] * 3
    assert all(m.requires_grad and m.is_leaf for m in masters)
    model(torch.randn(5, 3).half()).sum().backward()
    model[0].bias.grad = None
    model_grads_to_master_grads(model_params, masters)
    assert masters[1].grad is None
    assert torch.equal(masters[0].grad, model[0].weight.grad.float())
    with torch.no_grad():
        for m in masters:
            m.add_(1.0)
    master_params_to_model_params(model_params, masters)
    assert torch.equal(model[0].weight, masters[0].half())

    flat_params, [flat] = prep_param_lists(model, flat_master=True)
    assert flat.shape == (4 * 3 + 4 + 2 * 4,) and flat.dtype == torch.float32
    assert torch.equal(flat.grad, torch.zeros_like(flat))
    model_grads_to_master_grads(flat_params, [flat], flat_master=True)
    assert torch.equal(flat.grad[:12], model[0].weight.grad.float().flatten())
    assert torch.equal(flat.grad[12:16], torch.zeros(4))   # no gradient: zeros
    with torch.no_grad():
        flat.fill_(0.5)
    master_params_to_model_params(flat_params, [flat], flat_master=True)
    assert torch.equal(model[1].weight, torch.full((2, 4), 0.5, dtype=torch.half))

    model[1].float()
    with pytest.raises(TypeError, match="one dtype; they have torch.float16, torch.float32"):
        prep_param_lists(model, flat_master=True)


def test_conversions():
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.BatchNorm1d(4, affine=False),
                        nn.GRU(4, 4))
    net[0].weight.grad = torch.ones(4, 3)
    weight = net[0].weight
    assert convert_network(net, torch.bfloat16) is net
    assert net[0].weight is weight and weight.dtype == torch.bfloat16
    assert weight.grad.dtype == torch.bfloat16
    assert net[1].weight.dtype == torch.float32 and net[1].running_mean.dtype == torch.float32
    assert net[2].running_mean.dtype == torch.bfloat16   # not affine: converted, as apex
    assert net[3].weight_ih_l0.dtype == torch.bfloat16
    assert net[1].num_batches_tracked.dtype == torch.int64

    lone = nn.Linear(2, 2)
    convert_module(lone, torch.float16)
    assert lone.weight.dtype == torch.float16
    half = network_to_half(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
    assert isinstance(half[0], tofp16) and half[1][0].weight.dtype == torch.float16
    assert half[1][1].weight.dtype == torch.float32
    assert half(torch.randn(5, 3)).dtype == torch.float16
    assert BN_convert_float(nn.BatchNorm2d(3).half()).weight.dtype == torch.float32
    assert to_python_float(torch.tensor([2.5])) == 2.5 and to_python_float([7]) == 7
    assert clip_grad_norm is torch.nn.utils.clip_grad_norm_
    ids = torch.tensor([[1, 2]])
    embedding = FP16Model(nn.Embedding(4, 3))
    assert embedding(ids).dtype == torch.float16   # integer inputs are not cast


# ---- apex's tests/L0/run_fp16util/test_fp16util.py, on the CPU ---------------------------------

class DummyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(10, 10, 2)
        self.bn = nn.BatchNorm2d(10, affine=True)

    def forward(self, x):
        return self.conv(self.bn(x))


class DummyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 10, 2)
        self.bn1 = nn.BatchNorm2d(10, affine=False)
        self.db1 = DummyBlock()
        self.db2 = DummyBlock()

    def forward(self, x):
        return self.db2(self.db1(self.bn1(self.conv1(x))))


class DummyNetWrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(3, affine=True)
        self.dn = DummyNet()

    def forward(self, x):
        return self.dn(self.bn(x))


def test_apex_fp16_model_params_buffers_and_output():
    in_tensor = torch.randn((4, 3, 8, 12))
    fp16_model = FP16Model(DummyNetWrapper())
    exempted = [fp16_model.network.bn, fp16_model.network.dn.db1.bn,
                fp16_model.network.dn.db2.bn]
    for m in fp16_model.modules():
        expected = torch.float if m in exempted else torch.half
        for p in m.parameters(recurse=False):
            assert p.dtype == expected
        for b in m.buffers(recurse=False):
            assert b.dtype in (expected, torch.int64)
    assert fp16_model(in_tensor).dtype == torch.half


# ---- the stand-alone loss scalers ---------------------------------------------------------------

def test_loss_scalers():
    static = LossScaler(8)
    assert static.loss_scale == 8 and static.cur_scale == 8
    w = nn.Parameter(torch.ones(3))
    static.backward((w * 2).sum())
    assert torch.equal(w.grad, torch.full((3,), 16.0))
    assert not static.has_overflow([w])
    w.grad[1] = float("nan")
    assert static.has_overflow([w])   # apex's static scaler said False
    static.update_scale(True)
    assert static.loss_scale == 8

    dynamic = DynamicLossScaler(init_scale=16, scale_factor=2., scale_window=3)
    sparse = nn.Parameter(torch.ones(4))
    sparse.grad = torch.sparse_coo_tensor([[1]], [float("inf")], (4,), check_invariants=True)
    assert dynamic.has_overflow([sparse]) and not dynamic.has_overflow([nn.Parameter(
        torch.ones(2))])
    assert DynamicLossScaler._has_inf_or_nan(torch.tensor([1.0, float("-inf")]))
    assert not dynamic._has_inf_or_nan(torch.ones(2, dtype=torch.bfloat16))
    seen = []
    for overflow in [False, False, True, False, False, False, True, True, True, True, True]:
        dynamic.update_scale(overflow)
        seen.append(dynamic.loss_scale)
    # apex's rule: grow when (iteration - last overflow) is a multiple of the window; an
    # overflow divides, floored at 1.
    assert seen == [16, 16, 8, 8, 8, 16, 8, 4, 2, 1, 1]
    assert dynamic.scale_gradient(None, (torch.ones(1),), None)[0].item() == 1.0


# ---- apex's names and signatures ----------------------------------------------------------------

APEX_SIGNATURES = {   # apex/fp16_utils at e13873de
    FP16_Optimizer.__init__: "(self, init_optimizer, static_loss_scale=1.0, "
                             "dynamic_loss_scale=False, dynamic_loss_args=None, verbose=True)",
    FP16_Optimizer.backward: "(self, loss, update_master_grads=True, retain_graph=False)",
    FP16_Optimizer.update_master_grads: "(self)",
    FP16_Optimizer.clip_master_grads: "(self, max_norm, norm_type=2)",
    FP16_Optimizer.step: "(self, closure=None)",
    FP16_Optimizer.zero_grad: "(self, set_grads_to_None=False)",
    FP16_Optimizer.state_dict: "(self)",
    FP16_Optimizer.load_state_dict: "(self, state_dict)",
    FP16_Optimizer.inspect_master_grad_data: "(self)",
    FP16_Optimizer.maybe_print: "(self, msg)",
    FP16Model.__init__: "(self, network)",
    FP16Model.forward: "(self, *inputs)",
    tofp16.__init__: "(self)",
    network_to_half: "(network)",
    BN_convert_float: "(module)",
    convert_module: "(module, dtype)",
    convert_network: "(network, dtype)",
    prep_param_lists: "(model, flat_master=False)",
    model_grads_to_master_grads: "(model_params, master_params, flat_master=False)",
    master_params_to_model_params: "(model_params, master_params, flat_master=False)",
    to_python_float: "(t)",
    LossScaler.__init__: "(self, scale=1)",
    LossScaler.has_overflow: "(self, params)",
    LossScaler.update_scale: "(self, overflow)",
    LossScaler.scale_gradient: "(self, module, grad_in, grad_out)",
    LossScaler.backward: "(self, loss, retain_graph=False)",
    DynamicLossScaler.__init__: "(self, init_scale=4294967296, scale_factor=2.0, "
                                "scale_window=1000)",
    DynamicLossScaler.has_overflow: "(self, params)",
    DynamicLossScaler.update_scale: "(self, overflow)",
    DynamicLossScaler.backward: "(self, loss, retain_graph=False)",
}


@pytest.mark.parametrize("fn", list(APEX_SIGNATURES), ids=lambda f: f.__qualname__)
def test_apex_signatures(fn):
    assert str(inspect.signature(fn)) == APEX_SIGNATURES[fn]


def test_apex_properties_and_names():
    for name in ("loss_scale", "state", "param_groups"):
        assert isinstance(getattr(FP16_Optimizer, name), property)
    assert isinstance(LossScaler.loss_scale, property)
    assert isinstance(DynamicLossScaler.loss_scale, property)
    star = {}
    exec("from apex_lite.fp16_utils import *", star)
    assert sorted(k for k in star if not k.startswith("__")) == sorted([
        "BN_convert_float", "network_to_half", "prep_param_lists", "model_grads_to_master_grads",
        "master_params_to_model_params", "tofp16", "to_python_float", "clip_grad_norm",
        "convert_module", "convert_network", "FP16Model", "FP16_Optimizer", "LossScaler",
        "DynamicLossScaler", "fp16util", "fp16_optimizer", "loss_scaler"])
    assert fp16_utils.fp16util.clip_grad_norm is clip_grad_norm


def test_an_optimizer_state_dict_pickles_with_the_default_torch_load():
    _, optimizer = wrapped(torch.float16, dynamic_loss_scale=True)
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)   # weights_only: the scaler class is allow-listed
    assert loaded["loss_scaler"].loss_scale() == 2.0 ** 16 and loaded["dynamic_loss_scale"]
