"""What libraries that drive apex themselves read: ``optimizer._amp_stash``, ``amp._amp_state``,
and the amp state inside each amp optimizer's own ``state_dict()`` (for frameworks that
checkpoint only the model and the optimizer)."""
import io

import pytest
import torch

from amp_helpers import Net, assert_bitwise_equal, batch, inject_inf, snapshot, train_step
from apex_lite import amp
from apex_lite.amp.optimizer import AMP_STATE_KEY


def _setup(level="O2", seed=0, num_losses=1, optimizer=torch.optim.Adam, **kwargs):
    torch.manual_seed(seed)
    model = Net()
    opt = optimizer(model.parameters(), lr=1e-2)
    return amp.initialize(model, opt, opt_level=level, num_losses=num_losses, verbosity=0,
                          **kwargs)


def _scaler_state():
    state = amp.state_dict()
    return state["loss_scaler0"], state["apex_lite"]["loss_scalers"][0]


# ---- optimizer._amp_stash ----------------------------------------------------------------------

def test_amp_stash_marks_exactly_the_optimizers_initialize_returned():
    model = Net()
    opt_a = torch.optim.SGD(model.fc1.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(list(model.bn.parameters()) + list(model.fc2.parameters()), lr=0.1)
    bystander = torch.optim.SGD(Net().parameters(), lr=0.1)
    _, (a, b) = amp.initialize(model, [opt_a, opt_b], opt_level="O1", verbosity=0)
    assert hasattr(a, "_amp_stash") and hasattr(b, "_amp_stash")
    assert not hasattr(bystander, "_amp_stash")
    disabled = torch.optim.SGD(Net().parameters(), lr=0.1)
    amp.AmpHandle().initialize(Net(), disabled, enabled=False)
    assert not hasattr(disabled, "_amp_stash")   # apex's enabled=False touched nothing either
    with pytest.raises(RuntimeError, match=r"optimizer 0 \(SGD\) was already passed to "
                                           r"amp.initialize"):
        amp.initialize(Net(), a, opt_level="O1")


class LazyApexEngine:
    """An engine written like mmengine's ApexOptimWrapper: amp.initialize inside the training
    step, guarded by hasattr(optimizer, '_amp_stash'), the amp state loaded once it exists."""

    def __init__(self, optimizer, opt_level):
        self.optimizer = optimizer
        self.opt_level = opt_level
        self.initialize_calls = 0
        self.pending_amp_state = None

    def optim_context(self, model):
        if not hasattr(self.optimizer, "_amp_stash"):
            self.initialize_calls += 1
            model, self.optimizer = amp.initialize(model, self.optimizer,
                                                   opt_level=self.opt_level, verbosity=0)
            if self.pending_amp_state is not None:
                amp.load_state_dict(self.pending_amp_state)
                self.pending_amp_state = None

    def state_dict(self):
        state = self.optimizer.state_dict()
        if hasattr(self.optimizer, "_amp_stash"):
            state["apex_amp"] = amp.state_dict()
        return state

    def load_state_dict(self, state):
        state = dict(state)
        if "apex_amp" in state:
            if hasattr(self.optimizer, "_amp_stash"):
                amp.load_state_dict(state.pop("apex_amp"))
            else:
                self.pending_amp_state = state.pop("apex_amp")
        self.optimizer.load_state_dict(state)

    def step(self, model, step):
        self.optim_context(model)
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        with amp.scale_loss(loss, self.optimizer) as scaled:
            scaled.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.item()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_lazy_engine_initializes_once_and_resumes(level):
    torch.manual_seed(0)
    model = Net()
    engine = LazyApexEngine(torch.optim.Adam(model.parameters(), lr=1e-2), level)
    losses = [engine.step(model, step) for step in range(6)]
    assert engine.initialize_calls == 1 and losses[-1] < losses[0]
    saved = engine.state_dict()
    assert "apex_amp" in saved

    # Resume through the same test: the optimizer is plain until the first step.
    torch.manual_seed(1)
    resumed_model = Net()
    resumed_model.load_state_dict(model.state_dict())
    resumed = LazyApexEngine(torch.optim.Adam(resumed_model.parameters(), lr=1e-2), level)
    resumed.load_state_dict(saved)
    resumed.step(resumed_model, 6)
    assert resumed.initialize_calls == 1 and resumed.pending_amp_state is None
    assert amp.state_dict()["loss_scaler0"]["unskipped"] == 7


# ---- amp._amp_state ----------------------------------------------------------------------------

def test_amp_state_before_initialize(fresh_amp_handle):
    state = amp._amp_state
    assert state.handle is fresh_amp_handle   # the default handle, resolved at each read
    assert state.loss_scalers == () and state.verbosity == 1
    with pytest.raises(AttributeError, match="set by amp.initialize, which has not been called"):
        state.opt_properties


def test_amp_state_reads_the_run_with_apex_names():
    model, opt = _setup("O2", num_losses=2, min_loss_scale=4.0)
    state = amp._amp_state
    assert state.verbosity == 0 and state.handle is amp.default_handle()
    assert len(state.loss_scalers) == 2
    assert [s.loss_scale() for s in state.loss_scalers] == [65536.0, 65536.0]
    properties = state.opt_properties
    assert properties.opt_level == "O2" and properties.master_weights is True
    assert properties.enabled is True and properties.loss_scale == "dynamic"
    assert properties.options["cast_model_type"] == torch.bfloat16   # catalyst reads this
    scaler = state.loss_scalers[0]
    assert scaler.dynamic and scaler._min_loss_scale == 4.0 and scaler._max_loss_scale == 2 ** 24

    hook = inject_inf(model.fc1.weight)
    train_step(model, opt, 0, amp)
    hook.remove()
    assert scaler.loss_scale() == 32768.0 == amp.loss_scalers()[0].loss_scale
    assert scaler._has_overflow and scaler._unskipped == 0
    train_step(model, opt, 1, amp)
    assert not scaler._has_overflow and scaler._unskipped == 1 and scaler._loss_scale == 32768.0
    assert state.loss_scalers[1].loss_scale() == 65536.0   # loss 1 never stepped


def test_amp_state_follows_reinitialisation_and_disabling():
    _setup("O1")
    assert amp._amp_state.opt_properties.opt_level == "O1"
    _setup("O2")
    assert amp._amp_state.opt_properties.opt_level == "O2"
    amp.initialize(Net(), enabled=False)
    assert amp._amp_state.loss_scalers == ()
    assert amp._amp_state.opt_properties.enabled is False


@pytest.mark.parametrize("write", [
    lambda s: setattr(s, "verbosity", 0),
    lambda s: setattr(s, "loss_scalers", []),
    lambda s: setattr(s, "opt_properties", None),
    lambda s: delattr(s, "handle"),
    lambda s: setattr(s.opt_properties, "master_weights", False),
])
def test_writing_amp_state_raises_naming_the_public_api(write):
    _setup("O2")
    before = _scaler_state()
    with pytest.raises(AttributeError, match=r"read-only view in apex_lite: .* Use "
                                             r"amp.initialize\(...\)"):
        write(amp._amp_state)
    assert _scaler_state() == before


def test_unknown_amp_state_names_list_what_is_mapped():
    _setup("O1")
    with pytest.raises(AttributeError, match=r"has no attribute 'hard_override'; it maps "
                                             r"\['handle', 'loss_scalers', 'opt_properties', "
                                             r"'verbosity'\]"):
        amp._amp_state.hard_override
    with pytest.raises(AttributeError, match=r"has no attribute 'scale_factor'; it maps "
                                             r"\['_has_overflow', '_loss_scale'"):
        amp._amp_state.loss_scalers[0].scale_factor


# ---- the amp state in the optimizer's state_dict() ---------------------------------------------

def _train(model, opt, steps, overflow_at=()):
    for step in steps:
        hook = inject_inf(model.fc1.weight) if step in overflow_at else None
        train_step(model, opt, step, amp)
        if hook:
            hook.remove()


def _through_a_file(checkpoint):
    """torch.save then torch.load(weights_only=True), as frameworks load checkpoints."""
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


RUNS = {"O1": dict(level="O1"), "O2 fused": dict(level="O2"),
        "O2 unfused": dict(level="O2", fused_step=False),
        "O2 SGD": dict(level="O2", optimizer=torch.optim.SGD)}


@pytest.mark.parametrize("run", RUNS)
def test_a_checkpoint_of_model_and_optimizer_resumes_the_loss_scale_exactly(run):
    """A framework that saves only the model and the optimizer (transformers' Trainer) resumes
    the loss scale and its counters, and the run goes on bit for bit."""
    kwargs = dict(RUNS[run], scale_window=3)
    model, opt = _setup(**kwargs)
    _train(model, opt, range(4), overflow_at={2})
    checkpoint = _through_a_file({"model": model.state_dict(),
                                  "optimizer": opt.state_dict()})
    assert set(checkpoint["optimizer"]) == {"state", "param_groups", AMP_STATE_KEY}
    _train(model, opt, range(4, 7))
    expected, expected_scaler = snapshot(model, opt), _scaler_state()
    # After the overflow the scale halved; it grew back 3 clean steps later (step 5).
    assert expected_scaler[0] == {"loss_scale": 65536.0, "unskipped": 1}

    resumed_model, resumed_opt = _setup(seed=1, **kwargs)
    resumed_model.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    assert _scaler_state()[0] == {"loss_scale": 32768.0, "unskipped": 1}
    assert _scaler_state()[1]["steps"] == 4 and _scaler_state()[1]["skipped_steps"] == 1
    _train(resumed_model, resumed_opt, range(4, 7))
    assert _scaler_state() == expected_scaler
    assert_bitwise_equal(expected, snapshot(resumed_model, resumed_opt))


def test_a_plain_torch_optimizer_loads_it():
    model, opt = _setup("O2")
    _train(model, opt, range(3))
    saved = _through_a_file(opt.state_dict())
    plain_model = Net()
    plain_model.load_state_dict(model.state_dict())
    plain = torch.optim.Adam(plain_model.parameters(), lr=1e-2)
    plain.load_state_dict(saved)
    assert set(plain.state_dict()) == {"state", "param_groups"}
    for ours, theirs in zip(opt.state.values(), plain.state.values()):
        assert all(torch.equal(ours[k], theirs[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    x, _ = batch(9)
    plain.zero_grad()
    plain_model(x).sum().backward()
    plain.step()   # and it steps


def test_an_explicit_amp_load_state_dict_after_it_wins():
    model, opt = _setup("O2")
    _train(model, opt, range(2))
    amp_state = amp.state_dict()                    # scale 65536, unskipped 2
    _train(model, opt, range(2, 3), overflow_at={2})
    optimizer_state = opt.state_dict()              # scale 32768, unskipped 0
    opt.load_state_dict(optimizer_state)
    amp.load_state_dict(amp_state)
    assert _scaler_state()[0] == {"loss_scale": 65536.0, "unskipped": 2}
    amp.load_state_dict(amp_state)
    opt.load_state_dict(optimizer_state)            # and the other way round, the optimizer's
    assert _scaler_state()[0] == {"loss_scale": 32768.0, "unskipped": 0}


# An amp part that does not fit the run (damaged, another number of losses) is left out with one
# WARNING while torch's part loads: test_amp_resume_levels.py (issue 31).


def test_when_torch_refuses_the_optimizer_state_the_scalers_stay():
    model, opt = _setup("O2")
    _train(model, opt, range(3), overflow_at={1})
    saved = opt.state_dict()
    torch.manual_seed(0)
    other = Net()
    two_groups = torch.optim.Adam([{"params": other.fc1.parameters()},
                                   {"params": list(other.bn.parameters()) +
                                    list(other.fc2.parameters())}], lr=1e-2)
    other, two_groups = amp.initialize(other, two_groups, opt_level="O2", verbosity=0)
    before = _scaler_state()
    assert saved[AMP_STATE_KEY]["loss_scaler0"] != before[0]
    with pytest.raises(ValueError, match="different number of parameter groups"):
        two_groups.load_state_dict(saved)
    assert _scaler_state() == before
    # A later load of a state without amp state does not apply the refused one's.
    own = two_groups.state_dict()
    own.pop(AMP_STATE_KEY)
    two_groups.load_state_dict(own)
    assert _scaler_state() == before
