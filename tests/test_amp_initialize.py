"""amp.initialize: return shapes, dtypes per opt level, O2 masters, casts, refusals."""
import gc
import logging
import pickle
import weakref

import pytest
import torch

from amp_helpers import Net, batch, snapshot, assert_bitwise_equal
from apex_lite import amp


def _model_and_opt(cls=Net):
    model = cls()
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


# ---- return shapes ------------------------------------------------------------------------------

@pytest.mark.parametrize("enabled", [True, False])
def test_return_shapes_follow_apex(enabled):
    m1, o1 = _model_and_opt()
    out = amp.initialize(m1, o1, opt_level="O1", enabled=enabled, verbosity=0)
    assert out[0] is m1 and out[1] is o1
    m2, o2 = _model_and_opt()
    models, opts = amp.initialize([m2], [o2], opt_level="O1", enabled=enabled, verbosity=0)
    assert models == [m2] and opts == [o2]
    m3, o3 = _model_and_opt()
    model, opts = amp.initialize(m3, [o3], opt_level="O1", enabled=enabled, verbosity=0)
    assert model is m3 and opts == [o3]
    m4, o4 = _model_and_opt()
    models, opt = amp.initialize([m4], o4, opt_level="O1", enabled=enabled, verbosity=0)
    assert models == [m4] and opt is o4
    m5 = Net()
    assert amp.initialize(m5, opt_level="O1", enabled=enabled, verbosity=0) is m5
    m6 = Net()
    assert amp.initialize([m6], opt_level="O1", enabled=enabled, verbosity=0) == [m6]


def test_disabled_leaves_everything_untouched_and_scale_loss_yields_the_loss():
    model, opt = _model_and_opt()
    forward, step = model.forward, opt.step
    amp.initialize(model, opt, opt_level="O2", enabled=False)
    assert model.fc1.weight.dtype == torch.float32 and model.forward == forward
    assert opt.step == step and not hasattr(opt, "_apex_lite_amp")
    loss = model(batch(0)[0]).sum()
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled is loss
    assert amp.state_dict() == {}


# ---- dtypes per opt level -----------------------------------------------------------------------

DTYPES_PER_LEVEL = {    # fc1's weight, batchnorm, masters, fc1's output in the forward, output
    "O0": ("fp32", "fp32", "fp32", "fp32", "fp32"),
    "O1": ("fp32", "fp32", "fp32", "half", "fp32"),
    "O2": ("half", "fp32", "fp32", "half", "fp32"),
    "O3": ("half", "half", "half", "half", "fp32"),
}


# O0 never uses the half dtype: one case, not one per half dtype.
@pytest.mark.parametrize("level, half", [("O0", torch.bfloat16)] + [
    (level, half) for level in ("O1", "O2", "O3") for half in (torch.bfloat16, torch.float16)],
    ids=lambda v: str(v).replace("torch.", ""))
def test_dtypes_per_level(level, half):
    fc_dtype, bn_dtype, master_dtype, inner_dtype, out_dtype = DTYPES_PER_LEVEL[level]
    resolve = {"fp32": torch.float32, "half": half}
    model, opt = _model_and_opt(lambda: Net(4, 4, 2))
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=half, verbosity=0)
    seen = []
    model.fc1.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    x = torch.randn(8, 4)
    out = model(x)
    assert seen == [resolve[inner_dtype]]
    assert out.dtype == resolve[out_dtype]
    assert model.fc1.weight.dtype == resolve[fc_dtype]
    assert model.bn.weight.dtype == resolve[bn_dtype]
    assert model.bn.running_mean.dtype == resolve[bn_dtype]
    with amp.scale_loss(out.float().sum(), opt) as scaled:
        scaled.backward()
    masters = list(amp.master_params(opt))
    assert masters[0].dtype == resolve[master_dtype]
    assert all(m.grad is not None and m.grad.dtype == m.dtype for m in masters)
    if level == "O2":
        # Unscaled into the fp32 master gradient; the half gradient stays until it is cleared
        # (the sign that the next backward accumulates, as torch's .grad does).
        assert model.fc1.weight.grad is not None and model.fc1.weight.grad.dtype == half
        assert masters[0] is not model.fc1.weight
    else:
        assert masters[0] is model.fc1.weight
    opt.step()


def test_o2_masters_are_the_original_fp32_values_and_the_model_their_rounding():
    model, opt = _model_and_opt()
    original = [p.detach().clone() for p in model.parameters()]
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    masters = list(amp.master_params(opt))
    assert len(masters) == len(original)
    for o, m, p in zip(original, masters, model.parameters()):
        torch.testing.assert_close(m, o, rtol=0, atol=0)      # not the rounded half values
        torch.testing.assert_close(p, o.to(p.dtype), rtol=0, atol=0)


def test_o2_step_copies_masters_into_the_half_model():
    model, opt = _model_and_opt()
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    x, y = batch(0)
    with amp.scale_loss(torch.nn.functional.mse_loss(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()
    for m, p in zip(amp.master_params(opt), model.parameters()):
        torch.testing.assert_close(p, m.to(p.dtype), rtol=0, atol=0)


def test_o2_inputs_are_cast_and_cast_model_outputs_is_honoured():
    seen = {}

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 3)

        def forward(self, x, extra, index):
            seen["x"], seen["extra"], seen["index"] = x.dtype, extra["t"].dtype, index.dtype
            return {"out": self.fc(x), "index": index}

    model = amp.initialize(Probe(), opt_level="O2", cast_model_outputs=torch.bfloat16,
                           verbosity=0)
    out = model(torch.randn(2, 3), {"t": torch.randn(2)}, index=torch.arange(2))
    assert seen == {"x": torch.bfloat16, "extra": torch.bfloat16, "index": torch.int64}
    assert out["out"].dtype == torch.bfloat16 and out["index"].dtype == torch.int64


def test_o1_loss_outside_the_forward_is_computed_in_fp32():
    # The loss is taken on the model's output outside autocast's reach: O1 hands it fp32
    # outputs, so the loss matches the one torch.autocast computes inside its region.
    torch.manual_seed(0)
    fc = torch.nn.Linear(64, 512)
    x, y = torch.randn(16, 64), torch.randint(0, 512, (16,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = torch.nn.functional.cross_entropy(fc(x), y)
    model = amp.initialize(fc, opt_level="O1", verbosity=0)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    assert loss.dtype == torch.float32
    assert torch.equal(loss, expected)


def test_o1_outputs_in_half_on_request():
    model = amp.initialize(torch.nn.Linear(4, 4), opt_level="O1", verbosity=0,
                           cast_model_outputs=torch.bfloat16)
    assert model(torch.randn(2, 4)).dtype == torch.bfloat16


@pytest.mark.parametrize("rule", [torch.nn.LayerNorm, "norm", "*norm"])
def test_keep_fp32_modules_by_type_or_name(rule):
    class WithNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)
            self.norm = torch.nn.LayerNorm(4)
            self.head = torch.nn.Linear(4, 1)

        def forward(self, x):
            return self.head(self.norm(self.fc(x)))

    model = WithNorm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", keep_fp32_modules=[rule],
                                verbosity=0)
    assert model.norm.weight.dtype == torch.float32 and model.fc.weight.dtype == torch.bfloat16
    assert model(torch.randn(2, 4)).dtype == torch.float32
    # Kept params are their own masters; only the cast ones get fp32 copies.
    masters = list(amp.master_params(opt))
    assert any(m is model.norm.weight for m in masters)
    assert not any(m is model.fc.weight for m in masters)


@pytest.mark.parametrize("kwargs, message", [
    (dict(opt_level="O2", keep_fp32_modules=["nonexistent"]), "matches no module"),
    (dict(opt_level="O2", keep_fp32_modules=[42]), "takes nn.Module subclasses or module names"),
    (dict(opt_level="O1", keep_fp32_modules=[torch.nn.LayerNorm]), "does not cast the model"),
])
def test_bad_keep_fp32_modules(kwargs, message):
    model, opt = _model_and_opt()
    with pytest.raises((ValueError, TypeError), match=message):
        amp.initialize(model, opt, verbosity=0, **kwargs)
    assert model.fc1.weight.dtype == torch.float32


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_initialized_model_still_pickles(level):
    model = amp.initialize(Net(), opt_level=level, verbosity=0)
    clone = pickle.loads(pickle.dumps(model))
    x = torch.randn(4, 8)
    model.eval(), clone.eval()
    torch.testing.assert_close(clone(x), model(x), rtol=0, atol=0)



def test_a_model_pickled_when_its_hooks_lived_in_handle_still_loads(monkeypatch):
    """The hooks kept with a model moved to amp/model_hooks.py; a model pickled before names
    them apex_lite.amp.handle.<class>, which must still resolve to the same classes."""
    from apex_lite.amp import model_hooks
    kept = ("_ModelZeroGrad", "_MastersFollowModelLoads", "_Fp32StateDict")
    for name in kept + ("_DtypeGuard",):   # pickled under their old module, as before the move
        monkeypatch.setattr(getattr(model_hooks, name), "__module__", "apex_lite.amp.handle")
    model = amp.initialize(Net(), opt_level="O2", verbosity=0)
    data = pickle.dumps(model)
    # The forward pre-hook of those models (_BeforeForward does its work now): it unpickles,
    # and does nothing.
    guard = pickle.dumps(model_hooks._DtypeGuard(None, 0))
    monkeypatch.undo()
    for name in kept:
        assert b"apex_lite.amp.handle" in data and name.encode() in data
    assert b"apex_lite.amp.handle" in guard
    assert pickle.loads(guard)(Net(), ()) is None
    clone = pickle.loads(data)
    assert isinstance(clone.zero_grad, model_hooks._ModelZeroGrad)
    x = torch.randn(4, 8)
    model.eval(), clone.eval()
    torch.testing.assert_close(clone(x), model(x), rtol=0, atol=0)

# ---- O1 function casts --------------------------------------------------------------------------

def test_o1_runs_the_forward_under_autocast_without_touching_torch():
    matmul, linear = torch.matmul, torch.nn.functional.linear
    inner = []
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    model[0].register_forward_hook(lambda module, args, out: inner.append(out.dtype))
    model = amp.initialize(model, opt_level="O1", verbosity=0)
    assert model(torch.randn(2, 4)).dtype == torch.float32     # outputs leave in fp32
    assert inner == [torch.bfloat16]                           # the forward ran in half
    assert torch.matmul is matmul and torch.nn.functional.linear is linear
    assert torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.float32   # only the model


@pytest.mark.parametrize("decorator, inputs, expected", [
    (amp.half_function, (torch.float32, torch.float32), torch.bfloat16),
    (amp.float_function, (torch.bfloat16, torch.float32), torch.float32),
    (amp.promote_function, (torch.bfloat16, torch.float32), torch.float32),
    (amp.promote_function, (torch.bfloat16, torch.bfloat16), torch.bfloat16),
])
def test_function_decorators_under_autocast(decorator, inputs, expected):
    seen = []

    def add(a, b):
        seen.append((a.dtype, b.dtype))
        return a + b

    fn = decorator(add)
    a, b = (torch.ones(3, dtype=d) for d in inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fn(a, b).dtype == expected
    assert seen == [(expected, expected)]
    # Outside autocast the function runs as written.
    assert fn(a, b).dtype == torch.promote_types(*inputs)
    assert seen[-1] == inputs


def test_register_functions_and_disable_casts():
    import types
    args_seen = []

    def mix(a, b):   # what autocast alone would run in bf16 (a matmul)
        args_seen.append((a.dtype, b.dtype))
        return a @ b

    module = types.SimpleNamespace(mm=lambda a, b: a @ b, softmax=lambda t: torch.softmax(t, -1),
                                   mix=mix)
    amp.register_float_function(module, "softmax")
    amp.register_half_function(module, "mm")
    amp.register_promote_function(module, "mix")

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            soft = module.softmax(x.to(torch.bfloat16))
            prod = module.mm(x, self.w)
            with amp.disable_casts():
                plain = x @ self.w
            # promote: the widest of the arguments' dtypes, autocast off inside.
            wide, narrow = module.mix(x.to(torch.bfloat16), self.w), module.mix(
                x.to(torch.bfloat16), self.w.to(torch.bfloat16))
            seen.update(soft=soft.dtype, prod=prod.dtype, plain=plain.dtype, wide=wide.dtype,
                        narrow=narrow.dtype)
            return prod

    seen = {}
    model = amp.initialize(Model(), opt_level="O1", verbosity=0)
    model(torch.randn(2, 4))
    assert seen == {"soft": torch.float32, "prod": torch.bfloat16, "plain": torch.float32,
                    "wide": torch.float32, "narrow": torch.bfloat16}
    assert args_seen == [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)]
    with pytest.raises(ValueError, match="No function named 'nope'"):
        amp.register_half_function(module, "nope")


# ---- refusals: message names problem and fix, nothing changes ------------------------------------

def _state_of(model, opt):
    return (snapshot(model), model.forward, [p.dtype for p in model.parameters()],
            [list(g["params"]) for g in opt.param_groups], opt.step, hasattr(opt, "_apex_lite_amp"))


def _assert_unchanged(before, model, opt):
    assert_bitwise_equal(before[0], snapshot(model))
    assert model.forward == before[1]
    assert [p.dtype for p in model.parameters()] == before[2]
    assert [list(g["params"]) for g in opt.param_groups] == before[3]
    assert opt.step == before[4] and hasattr(opt, "_apex_lite_amp") == before[5]


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_refuses_a_model_that_is_not_fp32(level):
    model, opt = _model_and_opt()
    model.bfloat16()
    before = _state_of(model, opt)
    with pytest.raises(ValueError, match="'fc1.weight' of model 0 is torch.bfloat16") as err:
        amp.initialize(model, opt, opt_level=level, verbosity=0)
    assert "O2 casts the model to half and keeps fp32 master weights" in str(err.value)
    _assert_unchanged(before, model, opt)


def test_refuses_the_same_optimizer_twice():
    model, opt = _model_and_opt()
    amp.initialize(model, opt, opt_level="O1", verbosity=0)
    other = Net()
    with pytest.raises(RuntimeError, match="optimizer 0 .* was already passed to amp.initialize"):
        amp.initialize(other, opt, opt_level="O2", verbosity=0)
    assert other.fc1.weight.dtype == torch.float32
    assert amp.default_handle()._run.properties.opt_level == "O1"


@pytest.mark.parametrize("wrapper", ["ddp", "dp"])
def test_refuses_a_model_already_wrapped_for_parallelism(wrapper, tmp_path):
    import torch.distributed as dist
    inner = Net()
    if wrapper == "ddp":
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                                world_size=1)
        model = torch.nn.parallel.DistributedDataParallel(inner)
    else:
        model = torch.nn.DataParallel(inner)
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        before = _state_of(inner, opt)
        with pytest.raises(RuntimeError, match="must be applied AFTER amp.initialize"):
            amp.initialize(model, opt, opt_level="O2", verbosity=0)
        _assert_unchanged(before, inner, opt)
    finally:
        if wrapper == "ddp":
            # DDP first: destroying the group while its reducer lives makes the reducer join
            # gloo's threads later, holding the GIL, which can deadlock (see
            # tests/workers/ddp_skip_worker.py).
            del model
            dist.destroy_process_group()


def test_refuses_an_optimizer_with_parameters_outside_the_models():
    model, other = Net(), Net()
    opt = torch.optim.SGD(list(model.parameters()) + list(other.parameters()), lr=0.1)
    before = _state_of(model, opt)
    with pytest.raises(ValueError, match=r"not a parameter of the model\(s\) passed to "
                                         r"amp.initialize. Pass every model"):
        amp.initialize(model, opt, opt_level="O2", verbosity=0)
    _assert_unchanged(before, model, opt)
    # Passing both models is the fix.
    amp.initialize([model, other], opt, opt_level="O2", verbosity=0)


def test_refuses_a_model_initialised_twice():
    model = amp.initialize(Net(), opt_level="O1", verbosity=0)
    with pytest.raises(RuntimeError, match="already passed to amp.initialize"):
        amp.initialize(model, opt_level="O1", verbosity=0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_losses=0), "num_losses must be an int >= 1"),
    (dict(hysteresis=0), "hysteresis must be an int >= 1"),
    (dict(min_loss_scale=8.0, max_loss_scale=4.0), "is above max_loss_scale"),
    (dict(max_loss_scale=float("inf")), "max_loss_scale must be a positive finite"),
    (dict(verbosity=-1), "verbosity must be an int >= 0"),
])
def test_refuses_bad_scaler_arguments(kwargs, message):
    model, opt = _model_and_opt()
    before = _state_of(model, opt)
    with pytest.raises(ValueError, match=message):
        amp.initialize(model, opt, opt_level="O2", verbosity=kwargs.pop("verbosity", 0), **kwargs)
    _assert_unchanged(before, model, opt)


def test_reinitialising_starts_clean():
    model, opt = _model_and_opt()
    amp.initialize(model, opt, opt_level="O1", loss_scale=128.0, verbosity=0)
    model2, opt2 = _model_and_opt()
    amp.initialize(model2, opt2, opt_level="O2", num_losses=2, verbosity=0)
    state = amp.state_dict()
    assert state["loss_scaler0"] == {"loss_scale": 65536.0, "unskipped": 0}
    assert "loss_scaler1" in state
    with pytest.raises(RuntimeError, match="belongs to an earlier amp.initialize"):
        with amp.scale_loss(model(batch(0)[0]).sum(), opt):
            pass


@pytest.mark.parametrize("level, fused_step", [("O0", None), ("O1", None), ("O2", True),
                                               ("O2", False), ("O3", None)])
def test_a_run_lets_go_of_its_model_and_optimizer_when_it_ends(level, fused_step):
    """Nothing amp installs keeps a model or an optimizer alive past its run: the backward
    watches on the parameters hold their optimizer weakly (torch keeps those hooks where the
    garbage collector does not look). initialize(..., enabled=False) ends the default handle's
    run, as a distributed program does before destroy_process_group (examples/fsdp.py)."""
    def train():
        model, opt = _model_and_opt()
        model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0,
                                    fused_step=fused_step)
        with amp.scale_loss(model(batch(0)[0]).float().sum(), opt) as loss:
            loss.backward()
        opt.step()
        return weakref.ref(model), weakref.ref(opt)

    model, opt = train()
    amp.initialize([], enabled=False)
    gc.collect()
    assert model() is None and opt() is None


def test_initialize_logs_the_level_subject_to_verbosity(caplog):
    caplog.set_level("INFO", logger="apex_lite.amp")
    amp.initialize(Net(), opt_level="O2", verbosity=1)
    assert "Selected optimization level O2" in caplog.text
    caplog.clear()
    amp.initialize(Net(), opt_level="O2", verbosity=0)
    assert caplog.text == ""


# Each case overrides its level's default, so that the level alone would give other dtypes: at O1
# the forward runs under autocast (fc1 computes in half) and outputs leave in fp32; O2 keeps
# batchnorm fp32; O3 casts it; both hand fp32 outputs back. (half_dtype is bf16, so fp16
# outputs can only come from cast_model_outputs.)
@pytest.mark.parametrize("level, kwargs, inner_dtype, out_dtype, bn_dtype", [
    ("O1", dict(cast_model_outputs=torch.float16), "half", torch.float16, torch.float32),
    ("O1", dict(patch_torch_functions=False), torch.float32, torch.float32, torch.float32),
    ("O1", dict(patch_torch_functions=False, cast_model_outputs=torch.float16), torch.float32,
     torch.float16, torch.float32),
    ("O2", dict(keep_batchnorm_fp32="False"), "half", torch.float32, "half"),
    ("O3", dict(keep_batchnorm_fp32=True), "half", torch.float32, torch.float32),
    ("O3", dict(cast_model_outputs=torch.float16), "half", torch.float16, "half"),
])
def test_overrides_take_effect(level, kwargs, inner_dtype, out_dtype, bn_dtype):
    half = torch.bfloat16
    resolve = lambda d: half if d == "half" else d     # noqa: E731
    model, opt = _model_and_opt()
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, half_dtype=half,
                                **kwargs)
    seen = []
    model.fc1.register_forward_hook(
        lambda module, args, out: seen.append((out.dtype, torch.is_autocast_enabled("cpu"))))
    out = model(batch(0)[0])
    autocast = level == "O1" and kwargs.get("patch_torch_functions", True)
    assert seen == [(resolve(inner_dtype), autocast)]
    assert out.dtype == out_dtype and model.bn.weight.dtype == resolve(bn_dtype)
    with amp.scale_loss(out.float().mean(), opt) as scaled:
        scaled.backward()
    opt.step()


def test_a_parameter_shared_by_two_models_gets_one_master_from_its_fp32_value():
    shared = torch.nn.Linear(4, 4)
    first, second = torch.nn.Sequential(shared, torch.nn.Linear(4, 2)), \
        torch.nn.Sequential(shared, torch.nn.Linear(4, 3))
    original = shared.weight.detach().clone()
    opt = torch.optim.SGD(list(first.parameters()) + list(second[1].parameters()), lr=0.1)
    [first, second], opt = amp.initialize([first, second], opt, opt_level="O2", verbosity=0)
    masters = [m for m in amp.master_params(opt) if m.shape == original.shape]
    assert len(masters) == 1
    torch.testing.assert_close(masters[0], original, rtol=0, atol=0)


@pytest.mark.parametrize("level, half, fast_probe, warned", [
    ("O2", torch.bfloat16, None, True),
    ("O2", torch.bfloat16, "_is_avx512_bf16_supported", False),
    ("O2", torch.bfloat16, "_is_amx_tile_supported", False),
    ("O1", torch.float16, None, True),
    ("O1", torch.float16, "_is_amx_fp16_supported", False),
    ("O0", torch.bfloat16, None, False),
])
def test_slow_cpu_half_is_warned_about(monkeypatch, caplog, level, half, fast_probe, warned):
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported",
                  "_is_amx_fp16_supported"):
        monkeypatch.setattr(torch.cpu, probe, lambda probe=probe: probe == fast_probe)
    with caplog.at_level(logging.WARNING, logger="apex_lite.amp"):
        amp.initialize(torch.nn.Linear(4, 4), opt_level=level, half_dtype=half)
    messages = [r.getMessage() for r in caplog.records if "slow fallbacks" in r.getMessage()]
    assert bool(messages) == warned
    if warned:
        assert f"{level} will still save memory" in messages[0]
