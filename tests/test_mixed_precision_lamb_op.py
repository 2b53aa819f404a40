"""The op of apex's FusedMixedPrecisionLamb, ``fused_lamb_mp_``, on every backend and device.

It is LAMB (``fused_lamb_``) with ``lr`` and one step tensor for the whole call read from
tensors: the step tensor holds the number of the step being taken, which the caller increments,
and the op never writes it. Checked against test_optimizer_kernels' float64 LAMB reference
(``ref_lamb``, written from the contract, independently of either backend) with the same
tolerances, over several steps with the state carried; the fixtures are test_multi_tensor's.
"""
from __future__ import annotations

import pytest
import torch

from apex_lite.multi_tensor import _backend, _python
from test_multi_tensor import CHUNK, assert_bits, backend, device, rand  # noqa: F401 (fixtures)
from test_optimizer_kernels import (HYPER, INV_SCALE, LAMB_OPTIONS, SHAPES, _lamb_close, _sizes,
                                    expected_step, f32, lamb_max_grad_norm, make_call,
                                    true_grad_norm)

F32 = torch.float32
COMBOS = ["fp32", "O2-bf16", "O2-fp16", "fp16-param", "mixed"]


def mp_call(sizes, combo, device, **kw):
    call = make_call("lamb", sizes, combo, device, **kw)
    del call["steps"]     # one step tensor for the call instead
    return call


def run_mp(ops, call, o, step_t, lr_t, inv_scale_t, found_inf, grad_norm_t):
    ops.fused_lamb_mp_(call["params"], call["grads"], call["exp_avgs"], call["exp_avg_sqs"],
                       call["model_params"], step_t, lr_t, inv_scale_t, found_inf, grad_norm_t,
                       o["beta1"], o["beta2"], o["eps"], o["weight_decay"], o["adam_w_mode"],
                       o["bias_correction"], o["grad_averaging"], o["max_grad_norm"],
                       o["use_nvlamb"])


def check_mp(call, expected, backend_name):
    for i, (p, e) in enumerate(zip(call["params"], expected["params"])):
        _lamb_close(p, e, expected["steps_taken"][i], backend_name)
    for name in ("exp_avgs", "exp_avg_sqs"):
        for actual, e in zip(call[name], expected[name]):
            assert actual.dtype == F32
            assert_bits(actual.reshape(-1), e.float())
    for i, (mp, p) in enumerate(zip(call["model_params"], call["params"])):
        if p.dtype == F32:
            assert_bits(mp, p.to(mp.dtype))   # the fp32 result rounded once
        else:
            _lamb_close(mp, expected["params"][i], expected["steps_taken"][i], backend_name)


def run_and_check_mp(backend_name, device, call, options, first_count=1, steps=3, lr=None):
    """``steps`` steps, the count (the number of the step taken) from ``first_count`` on,
    incremented by the caller; each checked against the reference."""
    o = dict(HYPER["lamb"], **options)
    if lr is not None:
        o["lr"] = lr
    ops = _backend.ops_for(torch.device(device))
    inv_scale_t = torch.tensor([f32(INV_SCALE)], device=device)
    found_inf = torch.zeros(1, device=device)
    lr_t = torch.tensor([f32(o["lr"])], device=device)
    for k in range(steps):
        count = first_count + k
        step_t = torch.tensor([float(count)], device=device)
        o["grad_norm"] = true_grad_norm(call, f32(INV_SCALE))
        o["max_grad_norm"] = lamb_max_grad_norm(o["clip"], o["grad_norm"])
        grad_norm_t = torch.tensor([o["grad_norm"]], dtype=F32, device=device)
        # The reference counts from steps taken: count - 1 for every tensor.
        ref_call = dict(call, steps=[torch.tensor(float(count - 1))] * len(call["params"]))
        expected = expected_step("lamb", ref_call, o, f32(INV_SCALE))
        run_mp(ops, call, o, step_t, lr_t, inv_scale_t, found_inf, grad_norm_t)
        check_mp(call, expected, backend_name)
        assert float(step_t) == count          # read, never written
        assert found_inf.item() == 0.0
        for i, g in enumerate(call["grads"]):
            g.copy_(rand(g.numel(), g.dtype, device, seed=1000 * k + i).reshape(g.shape))


OPTION_CASES = [pytest.param(o, id="-".join(f"{k}={v}" for k, v in o.items()))
                for o in LAMB_OPTIONS]


@pytest.mark.parametrize("combo", COMBOS)
@pytest.mark.parametrize("options", OPTION_CASES)
def test_options(backend, device, options, combo):
    run_and_check_mp(backend, device, mp_call(_sizes(555), combo, device), options)


@pytest.mark.parametrize("combo", ["fp32", "O2-fp16", "mixed"])
@pytest.mark.parametrize("n", SHAPES)
def test_shapes_across_chunks(backend, device, n, combo):
    if n == SHAPES[-1] and combo != "mixed":
        pytest.skip("the largest shape runs for mixed dtypes (time)")
    run_and_check_mp(backend, device, mp_call(_sizes(n), combo, device), LAMB_OPTIONS[0],
                     steps=2)


@pytest.mark.parametrize("combo", ["fp32", "O2-fp16", "mixed"])
def test_non_contiguous_tensors(backend, device, combo):
    call = mp_call([CHUNK + 3, 555, 0, 1], combo, device, layout="strided")
    assert not call["params"][0].is_contiguous() and not call["grads"][1].is_contiguous()
    run_and_check_mp(backend, device, call, LAMB_OPTIONS[0])


def test_late_count_and_lr_from_the_tensor(backend, device):
    # A late count (bias corrections near 1) and an lr that is not the default: both come from
    # the tensors, for every tensor of the call.
    run_and_check_mp(backend, device, mp_call([CHUNK + 1, 555, 3], "mixed", device),
                     LAMB_OPTIONS[3], first_count=10000, lr=0.037)


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
@pytest.mark.parametrize("position", ["first", "middle", "last"])
@pytest.mark.parametrize("tensor_index", [0, 2])
def test_found_inf_changes_nothing(backend, device, tensor_index, position, value):
    call = mp_call([CHUNK + 3, 100, CHUNK + 5], "O2-fp16", device)
    target = call["grads"][tensor_index]
    index = {"first": 0, "middle": target.numel() // 2, "last": target.numel() - 1}[position]
    target[index] = value
    before = {key: [t.clone() for t in tensors] for key, tensors in call.items()}
    o = {**HYPER["lamb"], **LAMB_OPTIONS[0], "max_grad_norm": 1.0}
    step_t = torch.tensor([3.0], device=device)
    for flag in (1.0, float("nan")):
        found_inf = torch.tensor([flag], device=device)
        run_mp(_backend.ops_for(torch.device(device)), call, o, step_t,
               torch.tensor([1e-3], device=device), torch.ones(1, device=device), found_inf,
               torch.ones(1, device=device))
        for key, tensors in call.items():
            for actual, saved in zip(tensors, before[key]):
                assert_bits(actual, saved.cpu())
        assert float(step_t) == 3.0


def test_empty_lists(backend, device):
    o = {**HYPER["lamb"], **LAMB_OPTIONS[0], "max_grad_norm": 1.0}
    call = {"params": [], "grads": [], "exp_avgs": [], "exp_avg_sqs": [], "model_params": []}
    found_inf = torch.zeros(1, device=device)
    run_mp(_backend.ops_for(torch.device(device)), call, o, torch.ones(1, device=device),
           torch.ones(1, device=device), torch.ones(1, device=device), found_inf,
           torch.ones(1, device=device))
    assert found_inf.item() == 0.0


@pytest.mark.parametrize("backend", ["native"], indirect=True)
def test_backends_agree(backend, device):
    """The native op and the Python reference on the same inputs: moments bit for bit, the
    parameters within the norms' rounding."""
    native = _backend.ops_for(torch.device(device))
    assert native is not _python
    calls = {name: mp_call([777 * 77, 555, 0, CHUNK + 1], "mixed", device, seed=5)
             for name in ("native", "python")}
    o = {**HYPER["lamb"], **LAMB_OPTIONS[6], "max_grad_norm": 0.5}
    before = {key: [t.clone() for t in calls["native"][key]] for key in ("params",)}
    for name, ops in (("native", native), ("python", _python)):
        run_mp(ops, calls[name], o, torch.tensor([2.0], device=device),
               torch.tensor([0.01], device=device), torch.tensor([f32(INV_SCALE)], device=device),
               torch.zeros(1, device=device), torch.tensor([3.0], device=device))
    for key in ("exp_avgs", "exp_avg_sqs"):
        for a, b in zip(calls["native"][key], calls["python"][key]):
            assert_bits(a, b.cpu())
    # The parameters: within LAMB_RTOL["python"] of the step (the trust ratios' norms are
    # accumulated in different orders) plus one unit in the last place of the result.
    for key in ("params", "model_params"):
        for a, b, p0 in zip(calls["native"][key], calls["python"][key], before["params"]):
            a64, b64 = a.double(), b.double()
            tol = (1e-4 * (a64 - p0.double()).abs() + torch.finfo(a.dtype).eps * a64.abs()
                   + torch.finfo(a.dtype).tiny)
            assert bool(((a64 - b64).abs() <= tol).all())


@pytest.mark.parametrize("backend", ["native"], indirect=True)
def test_same_as_fused_lamb(backend, device):
    """fused_lamb_mp_ is fused_lamb_ with lr and the count from tensors: the same bits."""
    ops = _backend.ops_for(torch.device(device))
    calls = [make_call("lamb", [CHUNK + 1, 555, 0, 3], "mixed", device, seed=9,
                       first_step=4.0) for _ in range(2)]
    o = {**HYPER["lamb"], **LAMB_OPTIONS[1], "max_grad_norm": 0.5}
    scalars = (torch.tensor([f32(INV_SCALE)], device=device), torch.zeros(1, device=device),
               torch.tensor([3.0], device=device))
    hyper = (o["beta1"], o["beta2"], o["eps"], o["weight_decay"], o["adam_w_mode"],
             o["bias_correction"], o["grad_averaging"], o["max_grad_norm"], o["use_nvlamb"])
    a, b = calls
    ops.fused_lamb_(a["params"], a["grads"], a["exp_avgs"], a["exp_avg_sqs"], a["model_params"],
                    a["steps"], *scalars, o["lr"], *hyper)
    ops.fused_lamb_mp_(b["params"], b["grads"], b["exp_avgs"], b["exp_avg_sqs"],
                       b["model_params"], torch.tensor([5.0], device=device),
                       torch.tensor([o["lr"]], device=device), *scalars, *hyper)
    for key in ("params", "model_params", "exp_avgs", "exp_avg_sqs"):
        for x, y in zip(a[key], b[key]):
            assert_bits(x, y.cpu())


@pytest.mark.parametrize("change,message", [
    ("step-dtype", r"step must be a 1-element float32"),
    ("step-elements", r"step must be a 1-element float32"),
    ("lr-elements", r"lr must be a 1-element float32"),
])
@pytest.mark.parametrize("backend", ["native"], indirect=True)
def test_bad_scalars_raise(backend, device, change, message):
    call = mp_call([5, 3], "O2-fp16", device)
    before = [p.clone() for p in call["params"]]
    o = {**HYPER["lamb"], **LAMB_OPTIONS[0], "max_grad_norm": 1.0}
    step_t = torch.ones(1, device=device)
    lr_t = torch.ones(1, device=device)
    if change == "step-dtype":
        step_t = torch.ones(1, dtype=torch.int32, device=device)
    elif change == "step-elements":
        step_t = torch.ones(2, device=device)
    else:
        lr_t = torch.ones(2, device=device)
    with pytest.raises(RuntimeError, match=message):
        run_mp(_backend.ops_for(torch.device(device)), call, o, step_t, lr_t,
               torch.ones(1, device=device), torch.zeros(1, device=device),
               torch.ones(1, device=device))
    for p, saved in zip(call["params"], before):
        assert_bits(p, saved.cpu())


# --- opcheck and torch.compile (the fake kernel, the schema's mutations) ---------------------

def _mp_args(found_inf):
    from test_native_ops import _optimizer_lists
    params, grads, state, models, _ = _optimizer_lists()
    exp_avg_sqs = [torch.rand(p.shape) for p in params]
    return (params, grads, state, exp_avg_sqs, models, torch.full((1,), 3.0),
            torch.full((1,), 1e-3), torch.full((1,), 0.25), found_inf, torch.full((1,), 3.0),
            0.9, 0.999, 1e-6, 1e-2, True, True, True, 1.0, False)


def test_opcheck():
    from test_native_ops import _native_ops_or_skip
    ops = _native_ops_or_skip()
    torch.library.opcheck(ops.fused_lamb_mp_.default, _mp_args(torch.zeros(1)))


def test_torch_compile_traces_a_step():
    from test_native_ops import _native_ops_or_skip
    _native_ops_or_skip()
    op = torch.ops.apex_lite.fused_lamb_mp_

    def step(*args):
        op(*args)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    eager_args, compiled_args = _mp_args(torch.zeros(1)), _mp_args(torch.zeros(1))
    for a, b in zip(eager_args, compiled_args):
        if isinstance(a, list):
            for x, y in zip(a, b):
                y.copy_(x)
    step(*eager_args)
    compiled(*compiled_args)
    for a, b in zip(eager_args, compiled_args):
        if isinstance(a, list):
            for x, y in zip(a, b):
                torch.testing.assert_close(y, x, rtol=0, atol=0)
    assert float(compiled_args[5]) == 3.0     # the step count is read, not written
