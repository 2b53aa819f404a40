"""The internals of apex's amp that apex-era scripts write, and what the writes do here (issue
51): a loss scaler's ``_loss_scale`` and ``_scale_seq_len`` (DeepLearningExamples' GNMT and
BERT), its ``_overflow_buf`` and ``update_scale()`` (BERT's --allreduce_post_accumulation), and
``optimizer._amp_stash``'s parameter lists and lazy initialisation (BERT's skip and resume).
Each on the fused and the unfused O2 step; the suite runs once per kernel backend.
tests/test_apex_era_scripts.py runs the scripts' own code through them.
"""
import math

import pytest
import torch

from amp_helpers import Net, batch, inject_inf, snapshot
from apex_lite import amp

STEP_PATHS = {"fused": dict(fused_step=True), "unfused": dict(fused_step=False)}


def _setup(level="O2", path="fused", optimizer=torch.optim.AdamW, **kwargs):
    model = Net()
    opt = optimizer(model.parameters(), lr=1e-2)
    options = STEP_PATHS[path] if level in ("O2", "O5") else {}
    return amp.initialize(model, opt, opt_level=level, verbosity=0, **options, **kwargs)


def _scaler():
    return amp._amp_state.loss_scalers[0]


def _scaler_state():
    state = amp.state_dict()
    return state["loss_scaler0"], state["apex_lite"]["loss_scalers"][0]


def _backward(model, opt, step, *, delay_overflow_check=False, bad=False):
    """One backward as apex scripts run it; returns the scaled loss the block yielded."""
    x, y = batch(step)
    loss = torch.nn.functional.mse_loss(model(x).float(), y)
    hook = inject_inf(model.fc1.weight) if bad else None
    with amp.scale_loss(loss, opt, delay_overflow_check=delay_overflow_check) as scaled:
        scaled.backward()
    if hook is not None:
        hook.remove()
    return loss.detach(), scaled.detach()


def _same(a, b):
    """The same tensors, in the same order (``==`` on lists of tensors compares values)."""
    return [id(t) for t in a] == [id(t) for t in b]


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _changed(before, model):
    return [not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters())]


# ---- _loss_scale and _scale_seq_len --------------------------------------------------------

@pytest.mark.parametrize("path", list(STEP_PATHS))
@pytest.mark.parametrize("loss_scale", ["dynamic", 128.0])
def test_a_loss_scale_set_before_training_is_the_scale_of_the_first_step(path, loss_scale):
    """GNMT's AMPOptimizer and BERT's prepare_model_and_optimizer set ``_loss_scale`` right
    after initialize: the initial scale, as in apex (a static scale becomes that static scale)."""
    model, opt = _setup(path=path, loss_scale=loss_scale)
    scaler = _scaler()
    scaler._loss_scale = 8192
    assert scaler._loss_scale == scaler.loss_scale() == amp.loss_scalers()[0].loss_scale == 8192
    loss, scaled = _backward(model, opt, 0)
    assert float(scaled) == float(loss.float() * 8192.0)
    opt.step()
    assert amp.loss_scalers()[0].loss_scale == 8192.0 and amp.loss_scalers()[0].steps == 1
    assert scaler.dynamic is (loss_scale == "dynamic")


@pytest.mark.parametrize("path", list(STEP_PATHS))
def test_scale_seq_len_is_the_number_of_clean_steps_before_the_scale_doubles(path):
    model, opt = _setup(path=path)
    scaler = _scaler()
    scaler._loss_scale = 1024.0
    scaler._scale_seq_len = 3          # GNMT's dls_upscale_interval
    assert scaler._scale_seq_len == 3 and amp.loss_scalers()[0].scale_window == 3
    scales = []
    for step in range(7):
        opt.zero_grad()
        _, scaled = _backward(model, opt, step, bad=step == 4)
        opt.step()
        scales.append(amp.loss_scalers()[0].loss_scale)
    # Clean steps 0-2 double it at the third; step 4 overflows and halves it; 5, 6 are clean.
    assert scales == [1024.0, 1024.0, 2048.0, 2048.0, 1024.0, 1024.0, 1024.0]


@pytest.mark.parametrize("path", list(STEP_PATHS))
def test_a_scale_above_max_loss_scale_is_used_until_the_first_growth_caps_it(path):
    """BERT's default --init_loss_scale is 2**32, above max_loss_scale (2**24): apex used it,
    halved it on overflows and capped it at the first growth."""
    model, opt = _setup(path=path)
    scaler = _scaler()
    scaler._loss_scale = 2.0 ** 32
    scaler._scale_seq_len = 2
    loss, scaled = _backward(model, opt, 0)
    assert float(scaled) == float(loss.float() * 2.0 ** 32)
    opt.step()
    opt.zero_grad()
    _backward(model, opt, 1)
    opt.step()
    assert amp.loss_scalers()[0].loss_scale == 2.0 ** 24


@pytest.mark.parametrize("name, value, error, message", [
    ("_loss_scale", 0.0, ValueError, "not a positive finite number"),
    ("_loss_scale", math.inf, ValueError, "not a positive finite number"),
    ("_loss_scale", 1e-40, ValueError, "its inverse"),
    ("_loss_scale", "8192", TypeError, "a loss scale is a number"),
    ("_scale_seq_len", 0, ValueError, "a positive int"),
    ("_scale_seq_len", True, ValueError, "a positive int"),
    ("_overflow_buf", 0, TypeError, "1-element integer, bool or float tensor"),
    ("_overflow_buf", torch.zeros(2, dtype=torch.int), TypeError, "1-element"),
    ("dynamic", False, AttributeError, r"amp.initialize\(loss_scale="),
    ("_unskipped", 0, AttributeError, "amp.load_state_dict"),
    ("_has_overflow", False, AttributeError, "update_scale"),
    ("_max_loss_scale", 2.0 ** 30, AttributeError, r"max_loss_scale=\.\.\."),
    ("update_scale", None, AttributeError, "does not take a replacement"),
])
def test_writes_that_cannot_be_honoured_are_refused_and_change_nothing(name, value, error,
                                                                        message):
    _setup()
    scaler = _scaler()
    before = _scaler_state()
    with pytest.raises(error, match=message):
        setattr(scaler, name, value)
    assert _scaler_state() == before and amp.loss_scalers()[0].scale_window == 2000


def test_other_attributes_stay_on_the_scaler_as_on_apexs():
    """apex's LossScaler was a plain object; BERT's ``scaler._overfloat_buf = ...`` (a typo of
    ``_overflow_buf``) is one such write. Every read of loss_scalers[i] is the same object."""
    _setup()
    _scaler()._overfloat_buf = "kept"
    assert _scaler() is amp._amp_state.loss_scalers[0]
    assert _scaler()._overfloat_buf == "kept"
    del _scaler()._overfloat_buf
    with pytest.raises(AttributeError, match="has no attribute '_overfloat_buf'"):
        _scaler()._overfloat_buf


# ---- _overflow_buf and update_scale() --------------------------------------------------------

def test_update_scale_without_a_pending_decision_is_refused():
    model, opt = _setup()
    _backward(model, opt, 0)   # amp decided when scale_loss exited
    with pytest.raises(RuntimeError, match=r"no skip decision is pending .* "
                                           r"delay_overflow_check=True"):
        _scaler().update_scale()
    assert amp.loss_scalers()[0].steps == 1


@pytest.mark.parametrize("path", list(STEP_PATHS))
def test_update_scale_decides_the_delayed_step(path):
    """BERT's --allreduce_post_accumulation: scale_loss(..., delay_overflow_check=True), then
    update_scale() with its own buffer, then step() only when it says so."""
    model, opt = _setup(path=path)
    scaler = _scaler()
    own = torch.zeros(1, dtype=torch.int32)
    scaler._overflow_buf = own
    assert scaler._overflow_buf is own

    # A clean step: not skipped, one decision, the step applies.
    _backward(model, opt, 0, delay_overflow_check=True)
    before = _params(model)
    assert scaler.update_scale() is False
    assert amp.loss_scalers()[0].steps == 1 and scaler._unskipped == 1
    opt.step()
    assert all(_changed(before, model))

    # The caller's kernels found inf (its buffer set): skipped, the scale halved, the buffer
    # read and zeroed; a step() all the same would skip.
    opt.zero_grad()
    _backward(model, opt, 1, delay_overflow_check=True)
    own.fill_(1)
    assert scaler.update_scale() is True
    assert int(own) == 0 and scaler._has_overflow and scaler.loss_scale() == 32768.0
    before = snapshot(model, opt)
    opt.step()
    assert not any(_changed(before["params"], model))

    # amp's own check counts too: an inf gradient, the buffer clear.
    opt.zero_grad()
    _backward(model, opt, 2, delay_overflow_check=True, bad=True)
    assert scaler.update_scale() is True and scaler.loss_scale() == 16384.0
    # BERT then drops the gradients (the masters' through the stash) and goes on.
    for param in opt._amp_stash.all_fp32_from_fp16_params:
        param.grad = None
    for param in model.parameters():
        param.grad = None
    _backward(model, opt, 3, delay_overflow_check=True)
    before = _params(model)
    assert scaler.update_scale() is False
    opt.step()
    assert all(_changed(before, model))
    assert amp.loss_scalers()[0].steps == 4 and amp.loss_scalers()[0].skipped_steps == 2


@pytest.mark.parametrize("path", list(STEP_PATHS))
def test_update_scale_makes_every_pending_decision_of_an_accumulation(path):
    """Two backwards with delay_overflow_check=True before one update_scale(): each is one
    decision (as amp makes them without delay_overflow_check); one overflow skips the step."""
    model, opt = _setup(path=path)
    scaler = _scaler()
    _backward(model, opt, 0, delay_overflow_check=True, bad=True)
    _backward(model, opt, 1, delay_overflow_check=True)
    assert amp.loss_scalers()[0].steps == 0
    assert scaler.update_scale() is True
    counters = amp.loss_scalers()[0]
    assert counters.steps == 2 and counters.skipped_steps == 1 and scaler._unskipped == 1
    before = _params(model)
    opt.step()
    assert not any(_changed(before, model))


@pytest.mark.parametrize("path", list(STEP_PATHS))
@pytest.mark.parametrize("bad_backward", [None, 0, 1])
def test_one_accumulated_step_backs_the_scale_off_once(path, bad_backward):
    """BERT's flow: two backwards, then its own unscale of the accumulated gradients into its
    buffer, which an inf of either backward reaches too: the step skips and the scale halves
    once, whether the overflow was amp's to see (an inf gradient) or only the caller's."""
    model, opt = _setup(path=path)
    scaler = _scaler()
    own = torch.zeros(1, dtype=torch.int32)
    scaler._overflow_buf = own
    for step in range(2):
        _backward(model, opt, step, delay_overflow_check=True, bad=step == bad_backward)
    own.fill_(1)
    assert scaler.update_scale() is True
    assert scaler.loss_scale() == 32768.0 and amp.loss_scalers()[0].skipped_steps >= 1
    before = _params(model)
    opt.step()
    assert not any(_changed(before, model))


def test_the_default_overflow_buf_is_an_int_flag_that_update_scale_reads():
    model, opt = _setup()
    scaler = _scaler()
    buffer = scaler._overflow_buf
    assert buffer.dtype == torch.int32 and buffer.shape == (1,) and int(buffer) == 0
    _backward(model, opt, 0, delay_overflow_check=True)
    buffer.fill_(1)
    assert scaler.update_scale() is True and int(buffer) == 0


# ---- optimizer._amp_stash ----------------------------------------------------------------------

def _two_groups(level, path="fused", **kwargs):
    model = Net()
    model.extra = torch.nn.Linear(2, 2)   # in no optimizer yet
    opt = torch.optim.AdamW([{"params": model.fc1.parameters()},
                             {"params": list(model.bn.parameters()) +
                              list(model.fc2.parameters()), "lr": 1e-3}], lr=1e-2)
    options = STEP_PATHS[path] if level == "O2" else {}
    return amp.initialize(model, opt, opt_level=level, verbosity=0, **options, **kwargs)


@pytest.mark.parametrize("path", list(STEP_PATHS))
def test_the_stash_lists_the_masters_and_their_model_parameters_as_apex(path):
    model, opt = _two_groups("O2", path)
    stash = opt._amp_stash
    half = [model.fc1.weight, model.fc1.bias, model.fc2.weight, model.fc2.bias]
    assert all(p.dtype == torch.bfloat16 for p in half)
    assert _same(stash.all_fp16_params, half)
    masters = stash.all_fp32_from_fp16_params
    groups = opt.param_groups
    assert _same(masters, [groups[0]["params"][0], groups[0]["params"][1],
                           groups[1]["params"][2], groups[1]["params"][3]])
    assert all(m.dtype == torch.float32 for m in masters)
    assert all(torch.equal(m.bfloat16(), p.detach()) for m, p in zip(masters, half))
    assert _same(stash.all_fp32_from_fp32_params, [model.bn.weight, model.bn.bias])   # fp32
    assert [len(g) for g in stash.fp16_groups] == [2, 2]
    assert [len(g) for g in stash.fp32_from_fp32_groups] == [0, 2]
    assert _same(stash.fp32_from_fp16_groups[1], masters[2:])
    assert stash.lazy_init_called is True and stash.already_patched is False

    # What is read is the optimizer as it is now.
    opt.add_param_group({"params": list(model.extra.parameters())})
    assert _same(stash.all_fp16_params[4:], [model.extra.weight, model.extra.bias])
    assert _same(stash.all_fp32_from_fp16_params[4:], opt.param_groups[2]["params"])
    assert len(stash.fp16_groups) == 3


def test_the_stash_without_master_weights_lists_half_and_fp32_parameters():
    model, opt = _two_groups("O3", keep_batchnorm_fp32=True)
    stash = opt._amp_stash
    assert _same(stash.all_fp16_params, [model.fc1.weight, model.fc1.bias, model.fc2.weight,
                                         model.fc2.bias])
    assert _same(stash.all_fp32_params, [model.bn.weight, model.bn.bias])
    with pytest.raises(AttributeError, match=r"has no attribute 'all_fp32_from_fp16_params'; "
                                             r"at this opt level it has \['all_fp16_params'"):
        stash.all_fp32_from_fp16_params
    model, opt = _two_groups("O1")
    assert opt._amp_stash.all_fp16_params == []
    assert _same(opt._amp_stash.all_fp32_params, [p for n, p in model.named_parameters()
                                                  if not n.startswith("extra")])


@pytest.mark.parametrize("path", list(STEP_PATHS))
def test_apexs_lazy_initialisation_has_nothing_left_to_do(path):
    """BERT's resume: ``_lazy_init_maybe_master_weights()``, ``lazy_init_called = True``, then
    the optimizer's state and the masters loaded: the masters stay the ones amp made."""
    model, opt = _two_groups("O2", path)
    opt.zero_grad()
    _backward(model, opt, 0)
    opt.step()
    before = snapshot(model, opt)
    groups = [list(g["params"]) for g in opt.param_groups]
    opt._lazy_init_maybe_master_weights()
    opt._amp_lazy_init()
    opt._amp_stash.lazy_init_called = True
    assert [list(g["params"]) for g in opt.param_groups] == groups
    after = snapshot(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before["masters"], after["masters"]))
    with pytest.raises(AttributeError, match="makes the master weights at amp.initialize"):
        opt._amp_stash.lazy_init_called = False
    with pytest.raises(AttributeError, match="never patches step"):
        opt._amp_stash.already_patched = True
    with pytest.raises(AttributeError, match="add_param_group"):
        opt._amp_stash.all_fp16_params = []
    opt._amp_stash.dls_update_manager = "kept"   # apex's stash was a plain object
    assert opt._amp_stash.dls_update_manager == "kept"
