"""Issue 25: a half model's ``state_dict()`` is the truth wherever a framework takes it.

- Tied weights (an output layer sharing the embedding's weight, as GPT-2, T5 and BERT's MLM head
  do): every name gives the same values, at O2 the fp32 master's; a state holding any non-empty
  subset of the names sets the master exactly. A tied language model saved (both names, either
  alone), reloaded into a fresh run and continued matches the uninterrupted run bit for bit.
- Copies (``copy.deepcopy`` as timm's ``ModelEmaV3`` and ignite's ``EMAHandler`` make,
  ``AveragedModel``, ``torch.save(model)`` then ``torch.load``) give their own weights, never the
  original's masters, and nothing done to a copy changes the original.

O2 on both step paths, O3 (one path), on whichever backend the suite runs with.
"""
from __future__ import annotations

import copy
import io

import pytest
import torch
from torch.optim.swa_utils import AveragedModel

from amp_helpers import assert_bitwise_equal, snapshot
from apex_lite import amp

VOCAB, DIM = 24, 16

# (opt level, fused_step): the fused step exists at O2 only.
RUNS = [pytest.param("O2", True, id="O2-fused"), pytest.param("O2", False, id="O2-unfused"),
        pytest.param("O3", None, id="O3")]


class TiedLM(torch.nn.Module):
    """Embedding -> Linear -> tanh -> an output layer whose weight is the embedding's."""

    def __init__(self, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.mix = torch.nn.Linear(DIM, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


def _tokens(step):
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, VOCAB, (8, 6), generator=g)
    return tokens, tokens.roll(-1, dims=1)


def _setup(level, fused_step, seed=0, model=None):
    model = TiedLM(seed) if model is None else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, fused_step=fused_step, verbosity=0)
    assert opt._apex_lite_amp.path.fused == bool(fused_step)
    return model, opt


def _train(model, opt, steps):
    for step in steps:
        tokens, targets = _tokens(step)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(tokens).float().reshape(-1, VOCAB),
                                                 targets.reshape(-1))
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()


def _master(opt, param):
    """The fp32 tensor ``opt`` updates for the model parameter ``param`` (``param`` itself when
    it has no master)."""
    amp_opt = opt._apex_lite_amp
    return next((m for m in amp_opt.masters() if amp_opt.run.pairs.model_of(m) is param), param)


def _own_weights(model):
    """What a copy's ``state_dict()`` must give: its own parameters, upcast (exact)."""
    return {name: p.detach().float() for name, p in model.named_parameters(remove_duplicate=False)}


def _assert_state_is(state, expected):
    for name, value in expected.items():
        assert state[name].dtype == torch.float32, name
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)


# ---- tied weights ---------------------------------------------------------------------------

@pytest.mark.parametrize("level, fused_step", RUNS)
def test_every_name_of_a_tied_parameter_gives_the_master(level, fused_step):
    model, opt = _setup(level, fused_step)
    _train(model, opt, range(3))
    truth = _master(opt, model.embed.weight).detach()
    if level == "O3":
        truth = truth.float()
    state = model.state_dict()
    _assert_state_is(state, {"embed.weight": truth, "head.weight": truth})
    assert state["embed.weight"] is state["head.weight"]   # one shared tensor, as torch gives
    # The same through a parent module (the hook sees a prefix).
    parent = torch.nn.ModuleDict({"lm": model})
    _assert_state_is(parent.state_dict(), {"lm.embed.weight": truth, "lm.head.weight": truth})


SUBSETS = {"both": ("embed.weight", "head.weight"), "embed": ("embed.weight",),
           "head": ("head.weight",)}


@pytest.mark.parametrize("subset", SUBSETS)
@pytest.mark.parametrize("fused_step", [True, False], ids=["fused", "unfused"])
def test_loading_any_subset_of_tied_names_sets_the_master_exactly(subset, fused_step):
    model, opt = _setup("O2", fused_step)
    _train(model, opt, range(2))
    g = torch.Generator().manual_seed(7)
    value = torch.randn(VOCAB, DIM, generator=g)   # fp32 values that bf16 cannot hold
    assert not torch.equal(value.bfloat16().float(), value)
    state = {name: value for name in SUBSETS[subset]}
    state["mix.weight"], state["mix.bias"] = model.mix.weight.float(), model.mix.bias.float()
    model.load_state_dict(state, strict=False)
    master = _master(opt, model.embed.weight)
    torch.testing.assert_close(master, value, rtol=0, atol=0)
    torch.testing.assert_close(model.embed.weight, value.bfloat16(), rtol=0, atol=0)
    _assert_state_is(model.state_dict(), {"embed.weight": value, "head.weight": value})


def test_a_state_with_differing_tied_values_takes_the_first_name():
    """A checkpoint that an earlier apex_lite wrote (the master under the first name, the half
    value upcast under the second): the first name in ``named_parameters`` order wins, whatever
    the dict's order, so such a checkpoint resumes exactly."""
    model, opt = _setup("O2", False)
    value = torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(3))
    other = torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(4))
    for later in (value.bfloat16().float(), other):   # an earlier apex_lite's; any other value
        model.load_state_dict({"embed.weight": value, "head.weight": later}, strict=False)
        torch.testing.assert_close(_master(opt, model.embed.weight), value, rtol=0, atol=0)
        torch.testing.assert_close(model.embed.weight, value.bfloat16(), rtol=0, atol=0)
    model.load_state_dict({"head.weight": other, "embed.weight": value}, strict=False)
    torch.testing.assert_close(_master(opt, model.embed.weight), value, rtol=0, atol=0)
    torch.testing.assert_close(model.embed.weight, value.bfloat16(), rtol=0, atol=0)


@pytest.mark.parametrize("load", ["after_initialize", "before_initialize"])
@pytest.mark.parametrize("subset", SUBSETS)
@pytest.mark.parametrize("level, fused_step", RUNS)
def test_a_tied_model_resumes_bit_for_bit(level, fused_step, subset, load):
    """Saved as transformers' Trainer saves (the model's and the optimizer's state_dict()),
    with both tied names or either one alone (safetensors keeps a shared tensor once), loaded
    into a fresh run (before or after initialize) and continued."""
    model, opt = _setup(level, fused_step)
    _train(model, opt, range(3))
    checkpoint = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
    _train(model, opt, range(3, 6))
    expected = snapshot(model, opt)

    dropped = set(SUBSETS["both"]) - set(SUBSETS[subset])
    model_state = {k: v for k, v in checkpoint["model"].items() if k not in dropped}
    if load == "before_initialize":
        fresh = TiedLM(seed=1)
        fresh.load_state_dict(model_state, strict=not dropped)
        fresh, fresh_opt = _setup(level, fused_step, model=fresh)
    else:
        fresh, fresh_opt = _setup(level, fused_step, seed=1)
        fresh.load_state_dict(model_state, strict=not dropped)
    fresh_opt.load_state_dict(checkpoint["optimizer"])
    _train(fresh, fresh_opt, range(3, 6))
    assert_bitwise_equal(expected, snapshot(fresh, fresh_opt))


# ---- copies ---------------------------------------------------------------------------------

def _ema_update(ema, model, decay=0.9):
    """timm's ModelEmaV3 and ignite's EMAHandler: lerp the copy's parameters toward
    ``model.parameters()`` (the half parameters under O2)."""
    with torch.no_grad():
        torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 1.0 - decay)


def _assert_original_untouched(model, opt, before_state, before_snap):
    _assert_state_is(model.state_dict(), before_state)
    assert_bitwise_equal(before_snap, snapshot(model, opt))


@pytest.mark.parametrize("level, fused_step", RUNS)
def test_a_deepcopy_ema_checkpoints_its_own_weights(level, fused_step):
    model, opt = _setup(level, fused_step)
    ema = copy.deepcopy(model)
    for step in range(3):
        _train(model, opt, [step])
        _ema_update(ema, model)
    own = _own_weights(ema)
    assert not torch.equal(own["embed.weight"], model.state_dict()["embed.weight"])
    state = ema.state_dict()
    _assert_state_is(state, own)
    assert state["embed.weight"] is state["head.weight"]
    # The copy still runs forward with its level's casts.
    tokens, _ = _tokens(0)
    out = ema(tokens)
    assert out.dtype == torch.float32 and ema.mix.weight.dtype == torch.bfloat16
    # Nothing done to the copy changes the original: a load into the copy, its forward.
    before_state = {k: v.clone() for k, v in model.state_dict().items()}
    before_snap = snapshot(model, opt)
    ema.load_state_dict({k: torch.randn_like(v) for k, v in ema.state_dict().items()})
    _assert_original_untouched(model, opt, before_state, before_snap)
    _assert_state_is(ema.state_dict(), _own_weights(ema))


@pytest.mark.parametrize("level, fused_step", RUNS)
def test_an_averaged_model_checkpoints_its_averaged_weights(level, fused_step):
    model, opt = _setup(level, fused_step)
    swa = AveragedModel(model)
    for step in range(4):
        _train(model, opt, [step])
        swa.update_parameters(model)
    own = _own_weights(swa.module)
    assert not torch.equal(own["mix.weight"], model.state_dict()["mix.weight"])
    _assert_state_is(swa.module.state_dict(), own)
    _assert_state_is(swa.state_dict(), {f"module.{k}": v for k, v in own.items()})
    before_state = {k: v.clone() for k, v in model.state_dict().items()}
    before_snap = snapshot(model, opt)
    swa.update_parameters(model)
    _assert_original_untouched(model, opt, before_state, before_snap)


@pytest.mark.parametrize("level, fused_step", RUNS)
def test_a_whole_model_saved_and_loaded_is_its_own_copy(level, fused_step):
    model, opt = _setup(level, fused_step)
    _train(model, opt, range(3))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    clone = torch.load(buffer, weights_only=False)
    # It carries the fp32 values saved with it, which round to its parameters: exact.
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    _assert_state_is(clone.state_dict(), saved)
    tokens, _ = _tokens(1)
    torch.testing.assert_close(clone(tokens), model(tokens), rtol=0, atol=0)
    # The original trains on; the copy keeps what was saved.
    _train(model, opt, [3])
    _assert_state_is(clone.state_dict(), saved)
    # A load into the copy: fp32 values that round as the carried ones do are what it gives.
    before_state = {k: v.clone() for k, v in model.state_dict().items()}
    before_snap = snapshot(model, opt)
    # Halfway between each value and its rounding: another fp32 value with the same rounding.
    nudged = {k: (v + v.bfloat16().float()) / 2 for k, v in saved.items()}
    assert all(torch.equal(nudged[k].bfloat16(), saved[k].bfloat16()) for k in saved)
    assert level == "O3" or not torch.equal(nudged["embed.weight"], saved["embed.weight"])
    clone.load_state_dict(nudged)
    expected = nudged if level == "O2" else saved
    _assert_state_is(clone.state_dict(), expected)
    # Its own weights once it moves on.
    _ema_update(clone, model)
    _assert_state_is(clone.state_dict(), _own_weights(clone))
    _assert_original_untouched(model, opt, before_state, before_snap)
