"""ROCm apex's L0 amp tests (tests/L0/run_amp), their O4 and O5 cases, ported to CPU.

Written from what ROCm's tests check, not copied, with these changes for apex_lite:
- apex's global ``_amp_state`` was written to (``loss_scalers[0]._loss_scale = 4.0``,
  ``allow_incoming_model_not_fp32``); apex_lite's is read-only, so the loss scale is
  ``initialize``'s ``loss_scale=4.0``, and models are fp32 (apex_lite refuses a model whose
  parameters are not: ROCm's bf16 ``weight1`` of test_add_param_group is fp32 here).
- ``_amp_state.handle._deactivate()`` between runs: a reference and a restored model trained side
  by side each get their own ``AmpHandle`` (one handle serves one ``initialize``).
- test_basic_casts and test_promotion ran ops under apex's ``amp.init(patch_type=bfloat16)``,
  which patched torch; apex_lite's ``amp.init`` turns on ``torch.autocast`` instead (its own
  tests are in test_amp_rocm_levels.py): here the ops run inside an O4 model's forward, under the
  same autocast, and only the cases where torch's
  CPU autocast lists agree with apex's are kept (CPU autocast runs softmax, group_norm, pow and
  sum in their input's dtype where apex ran them in fp32, and casts binary_cross_entropy where
  apex refused it).
- Sizes are small (CPU), the data seeded.
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amp_helpers import inject_inf
from apex_lite import amp

ROCM_LEVELS = ["O4", "O5"]


# ---- test_checkpointing ----------------------------------------------------------------------

class MyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, 1, 1)
        self.bn1 = nn.BatchNorm2d(6)
        self.param = nn.Parameter(torch.randn(1))

    def forward(self, x):
        return self.bn1(F.relu(self.conv1(x * self.param)))


def _train_step(handle, model, optimizer, data, loss_ids):
    optimizer.zero_grad()
    output = model(data)
    for loss_id in loss_ids:
        with handle.scale_loss(output.mean(), optimizer, loss_id=loss_id) as scaled_loss:
            scaled_loss.backward(retain_graph=True)
    optimizer.step()
    return output


def _assert_fp32_state(state_dict):
    for key, value in state_dict.items():
        if "num_batches_tracked" not in key:
            assert value.dtype == torch.float32, key


@pytest.mark.parametrize("level", ROCM_LEVELS)
@pytest.mark.parametrize("amp_before_load", [True, False])
@pytest.mark.parametrize("num_losses", [1, 2])
def test_restoring(level, amp_before_load, num_losses):
    """Train 10 steps, checkpoint after 5 into a fresh model and optimizer (initialized before or
    after loading), and train both on: the same outputs and the same state, exactly."""
    torch.manual_seed(2809)
    handle = amp.AmpHandle()
    model = MyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = handle.initialize(model, optimizer, opt_level=level,
                                         num_losses=num_losses * 2, verbosity=0)
    restore_handle = amp.AmpHandle()

    def initialize_restored(model, optimizer):
        return restore_handle.initialize(model, optimizer, opt_level=level,
                                         num_losses=num_losses * 2, verbosity=0)

    for epoch in range(10):
        x = torch.randn(2, 3, 4, 4)
        output = _train_step(handle, model, optimizer, x, range(num_losses))
        if epoch == 4:
            checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                          "amp": handle.state_dict()}
            _assert_fp32_state(checkpoint["model"])
            restore_model = MyModel()
            restore_optimizer = torch.optim.SGD(restore_model.parameters(), lr=1e-3)
            if amp_before_load:
                restore_model, restore_optimizer = initialize_restored(restore_model,
                                                                       restore_optimizer)
            restore_model.load_state_dict(checkpoint["model"])
            restore_optimizer.load_state_dict(checkpoint["optimizer"])
            if not amp_before_load:
                restore_model, restore_optimizer = initialize_restored(restore_model,
                                                                       restore_optimizer)
            # (ROCm's test could not load the amp state in the same script; apex_lite can.)
            restore_handle.load_state_dict(checkpoint["amp"])
        elif epoch > 4:
            restore_output = _train_step(restore_handle, restore_model, restore_optimizer, x,
                                         range(num_losses, num_losses * 2))
            assert torch.equal(output.float(), restore_output.float())
            expected, got = model.state_dict(), restore_model.state_dict()
            assert expected.keys() == got.keys()
            for key in expected:
                assert torch.equal(expected[key], got[key]), key


@pytest.mark.parametrize("level", ROCM_LEVELS)
def test_loss_scale_decrease(level):
    """ROCm's test skips levels whose scale is static (O4 and O5 by default): there each loss
    scaler stays at 1.0 while its skips are counted. With loss_scale="dynamic" each scaler
    halves once per overflow of its own backward (inf written into a gradient: bf16 does not
    overflow where ROCm's inputs * 2**17 overflowed fp16)."""
    for loss_scale in (None, "dynamic"):
        handle = amp.AmpHandle()
        model = MyModel()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        model, optimizer = handle.initialize(model, optimizer, opt_level=level, num_losses=3,
                                             loss_scale=loss_scale, verbosity=0)
        dynamic = handle._run.properties.dynamic
        assert dynamic == (loss_scale == "dynamic")
        initial = [s.loss_scale for s in handle.loss_scalers()]
        assert initial == ([65536.0] * 3 if dynamic else [1.0] * 3)
        decreases = [0, 1, 2]
        x = torch.randn(2, 3, 4, 4)
        for loss_id, count in enumerate(decreases):
            for _ in range(count):
                optimizer.zero_grad()
                hook = inject_inf(model.conv1.weight)
                with handle.scale_loss(model(x).mean(), optimizer, loss_id=loss_id) as scaled:
                    scaled.backward()
                hook.remove()
                optimizer.step()
        scalers = handle.loss_scalers()
        assert [s.skipped_steps for s in scalers] == decreases
        for scaler, count, init in zip(scalers, decreases, initial):
            assert scaler.loss_scale == (init / 2 ** count if dynamic else 1.0)
        state = handle.state_dict()
        for i, (count, init) in enumerate(zip(decreases, initial)):
            assert state[f"loss_scaler{i}"] == {
                "loss_scale": init / 2 ** count if dynamic else 1.0, "unskipped": 0}


@pytest.mark.parametrize("level", ROCM_LEVELS)
def test_state_dict(level):
    """No half tensor in the model's state_dict(), and the model still trains (Adam, as ROCm's
    test, without its capturable=True, which torch refuses on CPU)."""
    torch.manual_seed(0)
    model = MyModel()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, verbosity=0)
    for key, value in model.state_dict().items():
        assert value.dtype not in (torch.float16, torch.bfloat16), key
    data, target = torch.randn(10, 3, 4, 4), torch.randn(10, 6, 4, 4)
    last_loss = None
    for _ in range(11):
        optimizer.zero_grad()
        loss = F.mse_loss(model(data), target)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        if last_loss is not None:
            assert loss.item() < last_loss
        last_loss = loss.item()


# ---- test_add_param_group ----------------------------------------------------------------------

class TwoWeights(nn.Module):
    def __init__(self, unique):
        super().__init__()
        self.weight0 = nn.Parameter(unique + torch.arange(2, dtype=torch.float32))
        self.weight1 = nn.Parameter(1.0 + unique + torch.arange(2, dtype=torch.float32))

    def forward(self, x):
        return ((x * self.weight0.float()) * self.weight1.float()).sum()


def _zero_grad(models, optimizer, how):
    if how == "none":
        for model in models:
            for param in model.parameters():
                param.grad = None
    elif how == "model":
        for model in models:
            model.zero_grad()
    else:
        optimizer.zero_grad()


@pytest.mark.parametrize("level", ROCM_LEVELS)
@pytest.mark.parametrize("zero_before_add, try_accumulation",
                         list(itertools.product([True, False], [True, False])))
def test_add_param_group(level, zero_before_add, try_accumulation):
    x = torch.ones(2)

    def losses(models, backward):
        loss = sum(model(x) for model in models)
        backward(loss, retain_graph=try_accumulation)
        if try_accumulation:
            backward(loss)

    # The reference: plain fp32 torch.
    model0, model1 = TwoWeights(1), TwoWeights(2)
    optimizer = torch.optim.SGD([{"params": model0.parameters(), "lr": 0.25}], momentum=0.125)
    optimizer.zero_grad()
    model0(x).backward()
    optimizer.step()
    if zero_before_add:
        optimizer.zero_grad()
    optimizer.add_param_group({"params": model1.parameters(), "lr": 0.5})
    if not zero_before_add:
        optimizer.zero_grad()
    for step in range(2):
        if step:
            optimizer.zero_grad()
        losses([model0, model1], lambda loss, **kw: loss.backward(**kw))
        optimizer.step()
    reference = [p.detach().clone() for m in (model0, model1) for p in m.parameters()]

    for how in ("none", "model", "optimizer"):
        handle = amp.AmpHandle()
        model0, model1 = TwoWeights(1), TwoWeights(2)
        optimizer = torch.optim.SGD([{"params": model0.parameters(), "lr": 0.25}],
                                    momentum=0.125)
        [model0, model1], optimizer = handle.initialize(
            [model0, model1], optimizer, opt_level=level, verbosity=0, cast_model_type=False,
            loss_scale=4.0)

        def backward(loss, **kwargs):
            with handle.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward(**kwargs)

        _zero_grad([model0, model1], optimizer, how)
        backward(model0(x))
        optimizer.step()
        if zero_before_add:
            _zero_grad([model0, model1], optimizer, how)
        optimizer.add_param_group({"params": model1.parameters(), "lr": 0.5})
        if not zero_before_add:
            _zero_grad([model0, model1], optimizer, how)
        for step in range(2):
            if step:
                _zero_grad([model0, model1], optimizer, how)
            losses([model0, model1], backward)
            optimizer.step()
        final = [p.detach() for m in (model0, model1) for p in m.parameters()]
        for ref, got in zip(reference, final):
            torch.testing.assert_close(got.float(), ref, msg=how)


# ---- test_cache ---------------------------------------------------------------------------------

class Whitelist(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.arange(8 * 8, dtype=torch.float32).view(8, 8))

    @staticmethod
    def ops(input, weight):
        return input.mm(weight).mm(weight).sum()

    def forward(self, input):
        return self.ops(input, self.weight)


class Blacklist(Whitelist):
    def __init__(self):
        nn.Module.__init__(self)
        self.weight = nn.Parameter(torch.arange(2 * 8, dtype=torch.float32).view(2, 8))

    @staticmethod
    def ops(input, weight):
        return (input + torch.pow(weight, 2) + torch.pow(weight, 2)).sum()


class Promote(Blacklist):
    @staticmethod
    def ops(input, weight):
        return ((input * weight) * weight).sum()


@pytest.mark.parametrize("module", [Whitelist, Blacklist, Promote])
def test_cache_train_eval_train_at_o4(module):
    """A weight's gradient after training, eval under no_grad, and training again: the weight's
    dtype, and the fp32 reference (O4's fp32-weight cases; bf16 weights are refused)."""
    x = torch.ones(2, 8)
    model = module()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O4", verbosity=0,
                                      loss_scale=4.0)

    def training_step():
        model.weight.grad = None
        with amp.scale_loss(model(x).sum(), optimizer) as scaled_loss:
            scaled_loss.backward()
        assert model.weight.grad.dtype == model.weight.dtype == torch.float32
        weight = model.weight.detach().clone().requires_grad_()
        model.ops(x.clone(), weight).backward()
        torch.testing.assert_close(model.weight.grad, weight.grad, rtol=1e-5, atol=1e-8)
        with torch.no_grad():
            model.weight -= 1.0

    training_step()
    with torch.no_grad():
        model(x).sum()
    training_step()


# ---- test_basic_casts and test_promotion, bfloat16 classes --------------------------------------

ALWAYS_BF16 = {torch.float32: torch.bfloat16, torch.bfloat16: torch.bfloat16}
ALWAYS_FLOAT = {torch.float32: torch.float32, torch.bfloat16: torch.float32}
MATCH_INPUT = {torch.float32: torch.float32, torch.bfloat16: torch.bfloat16}


class Recorder(nn.Module):
    """Runs ``fn`` in its forward and keeps the result (O4 hands outputs back in fp32)."""

    def __init__(self, fn):
        super().__init__()
        self.fn, self.out = fn, None

    def forward(self, x):
        self.out = self.fn(x)
        return self.out


def _under_o4(fn, x):
    """``fn(x)`` inside an O4 model's forward (O4 casts no input)."""
    model = amp.initialize(Recorder(fn), opt_level="O4", verbosity=0)
    model(x)
    return model.out


@pytest.mark.parametrize("name", ["linear", "conv2d", "mse_loss", "relu", "batch_norm",
                                  "matmul", "matmul_op"])
def test_basic_casts_bfloat16(name):
    b, h, c, k = 4, 8, 4, 3
    linear, conv, bn = nn.Linear(h, h), nn.Conv2d(c, c, k), nn.BatchNorm2d(c)
    target = torch.randn(b, h)
    other = torch.randn(h, h)
    cases = {
        "linear": (linear, ALWAYS_BF16, (b, h)),
        "conv2d": (conv, ALWAYS_BF16, (b, c, h, h)),
        "mse_loss": (lambda x: F.mse_loss(x, target), ALWAYS_FLOAT, (b, h)),
        "relu": (F.relu, MATCH_INPUT, (b, h)),
        "batch_norm": (bn, MATCH_INPUT, (b, c, h, h)),
        "matmul": (lambda x: x.matmul(other), ALWAYS_BF16, (h, h)),
        "matmul_op": (lambda x: other @ x, ALWAYS_BF16, (h, h)),
    }
    fn, expected, shape = cases[name]
    for dtype, out_dtype in expected.items():
        x = torch.randn(shape, dtype=dtype).requires_grad_()
        y = _under_o4(fn, x)
        assert y.dtype == out_dtype, (name, dtype)
        y.float().sum().backward()
        assert x.grad.dtype == dtype


@pytest.mark.parametrize("op", [torch.mul, torch.atan2])
def test_promotion_bfloat16_binary_ops_match_the_widest(op):
    for xtype, ytype in itertools.product([torch.bfloat16, torch.float32], repeat=2):
        x = torch.randn(4, 8, dtype=xtype).requires_grad_()
        y = torch.randn(4, 8, dtype=ytype)
        out = _under_o4(lambda t: op(t, y), x)
        wide = torch.float32 if torch.float32 in (xtype, ytype) else torch.bfloat16
        assert out.dtype == wide
        out.float().sum().backward()
        assert x.grad.dtype == xtype


def test_promotion_bfloat16_cat_and_inplace():
    ys = [torch.randn(8, dtype=torch.bfloat16) for _ in range(5)]
    assert _under_o4(lambda x: torch.cat(ys + [x]), torch.randn(8)).dtype == torch.float32
    assert _under_o4(lambda x: torch.cat(ys + [x]),
                     torch.randn(8, dtype=torch.bfloat16)).dtype == torch.bfloat16
    for xtype, ytype in itertools.product([torch.bfloat16, torch.float32], repeat=2):
        x = torch.randn(4, 8, dtype=xtype).requires_grad_()
        y = torch.randn(4, 8, dtype=ytype)
        out = _under_o4(lambda t: t.clone().add_(y), x)
        assert out.dtype == xtype                  # in place: matches self
        out.float().sum().backward()
        assert x.grad.dtype == xtype
