"""apex_lite.optimizers.FusedMixedPrecisionLamb (apex's): the signature, lr and step as device
tensors, the fp32 masters of reduced_precision_dtype parameters and their state_dict round trip,
against a float64 LAMB and against FusedLAMB (the same update: bit for bit), under
torch.amp.GradScaler and under apex_lite's amp (O1, O2), apex's amp_C ops
(multi_tensor_l2norm_mp, multi_tensor_lamb_mp) in apex's argument order, and the import
through the apex alias. Runs on the backend the environment selects (both, in two runs)."""
from __future__ import annotations

import inspect
import io
import os
import subprocess
import sys

import pytest
import torch

from apex_lite import amp
from apex_lite.apex_compat import multi_tensor as amp_C
from apex_lite.optimizers import FusedLAMB, FusedMixedPrecisionLamb
from test_fused_optimizers import (CHUNK, F64_TOL, RefLAMB, assert_bitwise, backward_with_grads,
                                   copies, grads_for, make_params)

SHAPES = [(33, 17), (555,), (1,), (CHUNK + 1,), (0,)]
HALF = [torch.float16, torch.bfloat16]
LAMB_KW = dict(lr=1e-2, weight_decay=0.01, max_grad_norm=1.0)


def _step_with(opt, params, grads, scaler=None):
    opt.zero_grad()
    backward_with_grads(params, grads, scaler)
    if scaler is None:
        opt.step()
    else:
        scaler.step(opt)
        scaler.update()


def _state_tensors(opt, params):
    return [{k: v.clone() for k, v in opt.state.get(p, {}).items()} for p in params]


# ---- construction -------------------------------------------------------------------------------

def test_signature_is_apexs():
    params = list(inspect.signature(FusedMixedPrecisionLamb.__init__).parameters.values())[1:]
    assert [(p.name, p.default) for p in params] == [
        ("params", inspect.Parameter.empty), ("lr", 1e-3), ("step", 0),
        ("bias_correction", True), ("betas", (0.9, 0.999)), ("eps", 1e-6),
        ("weight_decay", 0.01), ("amsgrad", False), ("adam_w_mode", True),
        ("grad_averaging", True), ("max_grad_norm", 1.0), ("use_nvlamb", False),
        ("reduced_precision_dtype", None)]


def test_lr_and_step_are_tensors_of_each_group():
    a, b = make_params(SHAPES[:2])
    opt = FusedMixedPrecisionLamb([{"params": [a]}, {"params": [b], "lr": 0.5}], lr=0.25, step=7)
    for group, lr in zip(opt.param_groups, (0.25, 0.5)):
        assert group["lr"].dtype == torch.float32 and group["lr"].shape == ()
        assert float(group["lr"]) == lr
        assert group["step"].dtype == torch.int32 and group["step"].tolist() == [7]
        assert group["lr"].device == group["params"][0].device
    assert opt.param_groups[0]["step"] is not opt.param_groups[1]["step"]
    opt.add_param_group({"params": make_params([(3,)], seed=4)})
    assert opt.param_groups[2]["lr"] is not opt.param_groups[0]["lr"]
    assert opt.param_groups[2]["step"] is not opt.param_groups[0]["step"]


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(amsgrad=True), RuntimeError, r"AMSGrad"),
    (dict(reduced_precision_dtype=torch.float64), ValueError, r"reduced_precision_dtype"),
    (dict(lr=-1.0), ValueError, r"Invalid learning rate"),
    (dict(lr=torch.ones(2)), TypeError, r"1-element"),
    (dict(step=-1), ValueError, r"step must be a non-negative integer"),
    (dict(max_grad_norm=-1.0), ValueError, r"max_grad_norm"),
    (dict(betas=(0.9, 1.0)), ValueError, r"beta parameter at index 1"),
])
def test_refused_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        FusedMixedPrecisionLamb(make_params(SHAPES[:1]), **kwargs)


# ---- the update ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32] + HALF)
def test_against_float64_lamb(dtype):
    """Parameters of reduced_precision_dtype: their fp32 masters follow a float64 LAMB started
    from the same fp32 values, and the parameters are the masters rounded once."""
    params32 = make_params(SHAPES)
    params = copies(params32, dtype)
    reduced = dtype if dtype != torch.float32 else None
    opt = FusedMixedPrecisionLamb(params, reduced_precision_dtype=reduced, **LAMB_KW)
    # The masters start from the half values: so does the reference.
    ref = RefLAMB([dict(params=copies(params, torch.float32), betas=(0.9, 0.999), eps=1e-6,
                        weight_decay=0.01, adam_w_mode=True, bias_correction=True,
                        max_grad_norm=1.0, lr=1e-2)])
    shapes = [p.shape for p in params]
    for step in range(6):
        grads = [g.to(dtype).float() for g in grads_for(step, shapes)]
        _step_with(opt, params, grads)
        ref.step([grads])
    assert opt.param_groups[0]["step"].tolist() == [6]
    for p, r in zip(params, ref.params()):
        state = opt.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
        if reduced is None:
            assert "master_param" not in state
            torch.testing.assert_close(p.detach().double(), r, **F64_TOL)
            continue
        master = state["master_param"]
        assert master.dtype == torch.float32
        torch.testing.assert_close(master.double(), r, **F64_TOL)
        assert torch.equal(p.detach(), master.to(dtype))     # rounded once, from the master


@pytest.mark.parametrize("dtype", HALF)
def test_same_bits_as_fused_lamb_on_fp32_copies(dtype):
    """The masters are what FusedLAMB makes of fp32 copies of the parameters, bit for bit (the
    same op arithmetic; every parameter steps every time, so the group's count is each
    parameter's)."""
    half = copies(make_params(SHAPES), dtype)
    fp32 = copies(half, torch.float32)
    kw = dict(LAMB_KW, use_nvlamb=True, max_grad_norm=0.5)
    ours = FusedMixedPrecisionLamb(half, reduced_precision_dtype=dtype, **kw)
    theirs = FusedLAMB(fp32, **kw)
    shapes = [p.shape for p in half]
    for step in range(5):
        grads = [g.to(dtype).float() for g in grads_for(step, shapes)]
        _step_with(ours, half, grads)
        _step_with(theirs, fp32, grads)
    assert_bitwise([ours.state[p]["master_param"] for p in half], [p.detach() for p in fp32])
    assert_bitwise(half, [p.detach().to(dtype) for p in fp32])
    for p, q in zip(half, fp32):
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ours.state[p][name], theirs.state[q][name])


def test_mixed_dtypes_in_a_group_and_params_without_grads():
    """fp16 parameters get masters, fp32 and bf16 ones are stepped in place (rounded once); a
    parameter without a gradient is left alone; the group's count still advances (apex's)."""
    a, b, c, d = copies(make_params(SHAPES[:4]))
    b, c = b.detach().half().requires_grad_(), c.detach().bfloat16().requires_grad_()
    params = [a, b, c, d]
    opt = FusedMixedPrecisionLamb(params, reduced_precision_dtype=torch.float16, **LAMB_KW)
    # FusedLAMB, with an fp32 copy where ours keeps a master: the same bits.
    ref = [a.detach().clone(), b.detach().float(), c.detach().clone(), d.detach().clone()]
    ref = [r.requires_grad_() for r in ref]
    ref_opt = FusedLAMB(ref, **LAMB_KW)
    shapes = [p.shape for p in params]
    d_before = d.detach().clone()
    for step in range(3):
        grads = grads_for(step, shapes)
        grads = [g.to(p.dtype).float() for g, p in zip(grads, params)]
        opt.zero_grad()
        backward_with_grads(params[:3], grads[:3])
        opt.step()
        ref_opt.zero_grad()
        backward_with_grads(ref[:3], grads[:3])
        ref_opt.step()
    assert_bitwise([a, opt.state[b]["master_param"], c], [r.detach() for r in ref[:3]])
    assert set(opt.state[b]) == {"exp_avg", "exp_avg_sq", "master_param"}
    assert set(opt.state[a]) == set(opt.state[c]) == {"exp_avg", "exp_avg_sq"}
    assert d not in opt.state and torch.equal(d.detach(), d_before)
    assert torch.equal(b.detach(), opt.state[b]["master_param"].half())
    assert opt.param_groups[0]["step"].tolist() == [3]


def test_lr_tensor_is_read_at_every_step_and_schedulers_write_it():
    params = make_params(SHAPES[:2])
    opt = FusedMixedPrecisionLamb(params, lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(3):
        _step_with(opt, params, grads_for(step, [p.shape for p in params]))
        sched.step()
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(0.1 * 0.5 ** 3)
    # With lr 0 the parameters stay as they are.
    with torch.no_grad():
        opt.param_groups[0]["lr"].fill_(0.0)
    before = [p.detach().clone() for p in params]
    _step_with(opt, params, grads_for(9, [p.shape for p in params]))
    assert_bitwise(params, before)


def test_a_refused_step_changes_nothing():
    params = make_params(SHAPES[:2])
    opt = FusedMixedPrecisionLamb(params)
    params[0].grad = torch.zeros_like(params[0])
    params[1].grad = torch.zeros(params[1].shape).to_sparse()
    with pytest.raises(RuntimeError, match=r"dense gradient"):
        opt.step()
    assert opt.param_groups[0]["step"].tolist() == [0]


# ---- state_dict ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", HALF)
def test_state_dict_round_trip_keeps_the_masters(dtype):
    half = copies(make_params(SHAPES), dtype)
    opt = FusedMixedPrecisionLamb(half, reduced_precision_dtype=dtype, **LAMB_KW)
    shapes = [p.shape for p in half]
    for step in range(3):
        _step_with(opt, half, grads_for(step, shapes))
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    saved_step = opt.param_groups[0]["step"].clone()
    # The run goes on; a copy resumes from the checkpoint.
    resumed = copies(half)
    buffer.seek(0)
    other = FusedMixedPrecisionLamb(resumed, lr=0.5, reduced_precision_dtype=dtype)
    other.load_state_dict(torch.load(buffer))
    for p, q in zip(half, resumed):
        for name, value in opt.state[p].items():
            assert other.state[q][name].dtype == torch.float32, name
            assert torch.equal(other.state[q][name], value), name
    group = other.param_groups[0]
    assert float(group["lr"]) == pytest.approx(1e-2) and group["lr"].dtype == torch.float32
    assert torch.equal(group["step"], saved_step) and group["step"].dtype == torch.int32
    for step in range(3, 6):
        _step_with(opt, half, grads_for(step, shapes))
        _step_with(other, resumed, grads_for(step, shapes))
    assert_bitwise(resumed, half)
    for p, q in zip(half, resumed):
        assert torch.equal(other.state[q]["master_param"], opt.state[p]["master_param"])


def test_a_state_dict_taken_earlier_keeps_its_count():
    params = make_params(SHAPES[:2])
    opt = FusedMixedPrecisionLamb(params)
    _step_with(opt, params, grads_for(0, [p.shape for p in params]))
    saved = opt.state_dict()
    _step_with(opt, params, grads_for(1, [p.shape for p in params]))
    assert saved["param_groups"][0]["step"].tolist() == [1]
    assert opt.param_groups[0]["step"].tolist() == [2]


def test_apex_layout_state_without_masters_makes_them_from_the_params():
    """apex's checkpoints hold no masters: they are made again from the parameters."""
    half = copies(make_params(SHAPES[:3]), torch.float16)
    opt = FusedMixedPrecisionLamb(half, reduced_precision_dtype=torch.float16)
    _step_with(opt, half, grads_for(0, [p.shape for p in half]))
    sd = opt.state_dict()
    for entry in sd["state"].values():
        del entry["master_param"]
    sd["param_groups"][0]["step"] = torch.tensor([1], dtype=torch.int32)
    other_params = copies(half)
    other = FusedMixedPrecisionLamb(other_params, reduced_precision_dtype=torch.float16)
    other.load_state_dict(sd)
    _step_with(other, other_params, grads_for(1, [p.shape for p in half]))
    assert other.param_groups[0]["step"].tolist() == [2]
    assert all(other.state[p]["master_param"].dtype == torch.float32 for p in other_params)


# ---- torch.amp.GradScaler -----------------------------------------------------------------------

@pytest.mark.parametrize("position", ["first", "middle", "last"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grad_scaler(dtype, value, position):
    """GradScaler hands its scale and found_inf over: with a power-of-two scale the run equals
    the unscaled one bit for bit; an inf/NaN anywhere in a gradient skips the step: parameters,
    masters, moments and the group's count unchanged, the scale halved."""
    reduced = dtype if dtype != torch.float32 else None
    params = copies(make_params(SHAPES), dtype)
    scaled, plain = copies(params), copies(params)
    scaled_opt = FusedMixedPrecisionLamb(scaled, reduced_precision_dtype=reduced, **LAMB_KW)
    plain_opt = FusedMixedPrecisionLamb(plain, reduced_precision_dtype=reduced, **LAMB_KW)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    shapes = [p.shape for p in params]
    for step in range(5):
        grads = [g.to(dtype).float() for g in grads_for(step, shapes, scale=0.1)]
        scaled_opt.zero_grad()
        backward_with_grads(scaled, grads, scaler)
        if step in (0, 3):
            target = scaled[3].grad.view(-1)
            index = {"first": 0, "middle": target.numel() // 2, "last": target.numel() - 1}
            with torch.no_grad():
                target[index[position]] = value
            before = ([p.detach().clone() for p in scaled], _state_tensors(scaled_opt, scaled),
                      scaled_opt.param_groups[0]["step"].clone(), scaler.get_scale())
        scaler.step(scaled_opt)
        scaler.update()
        if step in (0, 3):
            assert_bitwise(scaled, before[0])
            if step == 3:
                now = _state_tensors(scaled_opt, scaled)
                for a, b in zip(now, before[1]):
                    assert a.keys() == b.keys()
                    assert all(torch.equal(a[k], b[k]) for k in a)
            assert torch.equal(scaled_opt.param_groups[0]["step"], before[2])
            assert scaler.get_scale() == before[3] / 2
            continue
        _step_with(plain_opt, plain, grads)
        assert_bitwise(scaled, plain)
    assert scaled_opt.param_groups[0]["step"].tolist() == [3]
    assert not hasattr(scaled_opt, "grad_scale") and not hasattr(scaled_opt, "found_inf")


# ---- apex_lite's amp ----------------------------------------------------------------------------

def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _amp_train(make_opt, opt_level, steps=5, **kwargs):
    model = _net()
    opt = make_opt(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level=opt_level, verbosity=0, **kwargs)
    for i in range(steps):
        g = torch.Generator().manual_seed(100 + i)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        opt.zero_grad()
        with amp.scale_loss(torch.nn.functional.mse_loss(model(x).float(), y), opt) as scaled:
            scaled.backward()
        opt.step()
    return model, opt


@pytest.fixture
def fresh_amp():
    amp.default_handle().__init__()
    yield
    amp.default_handle().__init__()


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_under_amp_it_is_fused_lamb_over_amps_parameters(fresh_amp, opt_level):
    """Under amp the optimizer takes the unfused step over what amp gives it (O2: amp's fp32
    masters, so it keeps no masters of its own even with reduced_precision_dtype): the same
    training as FusedLAMB on the unfused step, bit for bit."""
    kw = dict(lr=1e-2, max_grad_norm=0.5)
    model, opt = _amp_train(lambda ps: FusedMixedPrecisionLamb(
        ps, reduced_precision_dtype=torch.float16, **kw), opt_level)
    report = str(amp.report())
    assert "optimizer 0 (FusedMixedPrecisionLamb): unfused step" in report
    assert all("master_param" not in s for s in opt.state.values())
    amp.default_handle().__init__()
    ref_model, ref_opt = _amp_train(lambda ps: FusedLAMB(ps, **kw), opt_level, fused_step=False)
    assert_bitwise(list(model.parameters()), list(ref_model.parameters()))
    assert opt.param_groups[0]["step"].tolist() == [5]


def test_amp_fused_step_true_is_refused_naming_why(fresh_amp):
    with pytest.raises(ValueError, match=r"fused_step=True.*FusedMixedPrecisionLamb.*not an "
                                         r"optimizer the fused ops compute"):
        _amp_train(lambda ps: FusedMixedPrecisionLamb(ps), "O2", steps=1, fused_step=True)


# ---- amp_C --------------------------------------------------------------------------------------

def _apex_step(params, masters, state, group, grad_scale=None, found_inf=None):
    """apex's FusedMixedPrecisionLamb.step, as its source makes the amp_C calls (apex's argument
    order), for one group of reduced-precision parameters with masters."""
    device = params[0].device
    noop = torch.zeros(1, dtype=torch.int, device=device)
    found_inf = torch.zeros(1, device=device) if found_inf is None else found_inf
    noop.copy_(found_inf)
    scale = torch.ones(1, device=device) if grad_scale is None else grad_scale
    inv_scale = scale.double().reciprocal().float()
    max_grad_norm = 0.5 * scale
    grads = [p.grad for p in params]
    grad_norm = amp_C.multi_tensor_applier(amp_C.multi_tensor_l2norm_mp, noop, [grads], False)[0]
    group["step"] += (noop != 1).to(torch.int)
    lists = [grads, masters, state["exp_avg"], state["exp_avg_sq"], params]
    amp_C.multi_tensor_applier(amp_C.multi_tensor_lamb_mp, noop, lists, group["lr"], 0.9, 0.999,
                               1e-6, group["step"], 1, 0.01, 1, 1, grad_norm, max_grad_norm,
                               False, found_inf, inv_scale)


def test_amp_c_ops_in_apexs_order_step_as_the_optimizer():
    half = copies(make_params(SHAPES), torch.float16)
    theirs = copies(half)
    opt = FusedMixedPrecisionLamb(half, lr=1e-2, max_grad_norm=0.5,
                                  reduced_precision_dtype=torch.float16)
    masters = [p.detach().float() for p in theirs]
    state = {"exp_avg": [torch.zeros_like(m) for m in masters],
             "exp_avg_sq": [torch.zeros_like(m) for m in masters]}
    group = {"lr": torch.tensor(1e-2), "step": torch.tensor([0], dtype=torch.int)}
    shapes = [p.shape for p in half]
    for step in range(4):
        grads = grads_for(step, shapes)
        _step_with(opt, half, grads)
        for p, g in zip(theirs, grads):
            p.grad = g.half()
        _apex_step(theirs, masters, state, group)
    assert group["step"].tolist() == [4]
    assert_bitwise(theirs, half)
    assert_bitwise(masters, [opt.state[p]["master_param"] for p in half])
    # A set noop flag (apex's found_inf copy) skips the step.
    before = [p.detach().clone() for p in theirs]
    for p, g in zip(theirs, grads_for(9, shapes)):
        p.grad = g.half()
    _apex_step(theirs, masters, state, group, found_inf=torch.ones(1))
    assert_bitwise(theirs, before)
    assert group["step"].tolist() == [4]


def test_amp_c_lamb_mp_four_lists_and_half_state():
    params = copies(make_params(SHAPES[:3]))
    ref = copies(params)
    grads = [g for g in grads_for(0, [p.shape for p in params])]
    m = [torch.zeros_like(p, dtype=torch.float16) for p in params]
    v = [torch.zeros_like(p, dtype=torch.float16) for p in params]
    norm, _ = amp_C.multi_tensor_l2norm_mp(0, torch.zeros(1, dtype=torch.int), [grads])
    amp_C.multi_tensor_lamb_mp(0, torch.zeros(1, dtype=torch.int),
                               [grads, [p.detach() for p in params], m, v], 1e-2, 0.9, 0.999,
                               1e-6, 1, True, 0.0, True, 1, norm, 1.0, False, 0.0, 1.0)
    opt = FusedLAMB(ref, lr=1e-2, weight_decay=0.0, max_grad_norm=1.0)
    for p, g in zip(ref, grads):
        p.grad = g
    opt.step()
    assert_bitwise(params, ref)
    for h, p in zip(m, ref):
        assert torch.equal(h, opt.state[p]["exp_avg"].half())


@pytest.mark.parametrize("noop,found_inf", [(1, 0.0), (0, 1.0), (0, float("nan"))])
def test_amp_c_lamb_mp_skips_on_the_noop_flag_or_found_inf(noop, found_inf):
    params = copies(make_params(SHAPES[:3]))
    before = [p.detach().clone() for p in params]
    grads = grads_for(0, [p.shape for p in params])
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    flag = torch.tensor([noop], dtype=torch.int)
    amp_C.multi_tensor_lamb_mp(0, flag, [grads, params, m, v], torch.tensor(1e-2), 0.9, 0.999,
                               1e-6, torch.tensor([1], dtype=torch.int), 1, 0.01, 1, 1,
                               torch.ones(1), torch.ones(1), False, torch.tensor([found_inf]),
                               torch.ones(1))
    assert_bitwise(params, before)
    assert not any(t.any() for t in m + v)
    assert flag.tolist() == [noop]     # not written


def test_amp_c_names():
    assert {"multi_tensor_l2norm_mp", "multi_tensor_lamb_mp"} <= set(amp_C.AMP_C_OPS)
    with pytest.raises(ValueError, match=r"mode=2"):
        amp_C.multi_tensor_lamb_mp(0, torch.zeros(1, dtype=torch.int),
                                   [[torch.ones(1)], [torch.ones(1)], [torch.ones(1)],
                                    [torch.ones(1)]], 1e-2, 0.9, 0.999, 1e-6, 1, True, 0.0,
                                   True, 2, torch.ones(1), 1.0, False, 0.0, 1.0)


# ---- the apex alias, in a subprocess ------------------------------------------------------------

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(__import__("importlib").util.find_spec("apex") is not None,
                    reason="a package named apex is installed here")
@pytest.mark.parametrize("how", ["alias", "compat"])
def test_import_through_apex(how):
    code = ("from apex.optimizers import FusedMixedPrecisionLamb, FusedLAMB\n"
            "import apex_lite.optimizers as o\n"
            "assert FusedMixedPrecisionLamb is o.FusedMixedPrecisionLamb\n"
            "import amp_C\n"
            "assert amp_C.multi_tensor_lamb_mp and amp_C.multi_tensor_l2norm_mp\n")
    env = dict(os.environ)
    path = [REPO]
    if how == "alias":
        code = "import apex_lite; apex_lite.install_apex_alias()\n" + code
    else:
        path.insert(0, os.path.join(REPO, "compat", "apex"))
    env["PYTHONPATH"] = os.pathsep.join(path + [p for p in [env.get("PYTHONPATH")] if p])
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=180, cwd=os.path.dirname(REPO))
    assert result.returncode == 0, result.stderr
