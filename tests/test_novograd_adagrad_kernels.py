"""The fused NovoGrad and Adagrad ops (fused_novograd_, fused_adagrad_) on every backend and device.

As test_optimizer_kernels.py (whose helpers and fixtures this file uses): the references are
written from the per-element contract (csrc/cpu/fused_novograd.cpp, fused_adagrad.cpp) in float64,
each operation rounded to fp32, independently of the Python backend. Adagrad's reference is exact:
both backends match it bit for bit. NovoGrad's per-layer inf norm is exact, so with norm_type 0
everything matches bit for bit too; its L2 norm is accumulated by each backend in its own order,
so with norm_type 2 the second moment, the moments and the parameters are compared within
NORM_RTOL[backend] of their change plus one unit in the last place.
"""
from __future__ import annotations

import math

import pytest
import torch

from apex_lite.multi_tensor import _backend, _python
from test_multi_tensor import CHUNK, assert_bits, backend, device, rand  # noqa: F401 (fixtures)
from test_optimizer_kernels import (COMBOS, F16, F32, INV_SCALE, MANY_SIZES, _flat64, _laid_out,
                                    f32, rnd)

# Relative error of the fp32-accumulated L2 norms (test_multi_tensor.py's L2NORM_RTOL), which
# reaches the step through the denominator.
NORM_RTOL = {"native": 1e-5, "python": 1e-4}

NOVOGRAD_OPTIONS = [
    dict(norm_type=2, init_zero=False, reg_inside_moment=False, grad_averaging=True,
         bias_correction=True, weight_decay=0.0),
    dict(norm_type=0, init_zero=False, reg_inside_moment=False, grad_averaging=True,
         bias_correction=True, weight_decay=1e-2),
    dict(norm_type=2, init_zero=True, reg_inside_moment=True, grad_averaging=False,
         bias_correction=True, weight_decay=1e-2),
    dict(norm_type=0, init_zero=True, reg_inside_moment=True, grad_averaging=True,
         bias_correction=False, weight_decay=0.0),
    dict(norm_type=0, init_zero=False, reg_inside_moment=True, grad_averaging=False,
         bias_correction=True, weight_decay=3e-2),
    dict(norm_type=2, init_zero=False, reg_inside_moment=False, grad_averaging=False,
         bias_correction=False, weight_decay=3e-2),
]
ADAGRAD_OPTIONS = [dict(adagrad_w_mode=w, weight_decay=d) for w in (False, True)
                   for d in (0.0, 1e-2)]
HYPER = {"novograd": dict(lr=1e-2, beta1=0.95, beta2=0.98, eps=1e-8),
         "adagrad": dict(lr=1e-2, eps=1e-10)}
STATE = {"novograd": ("exp_avgs", "exp_avg_sqs"), "adagrad": ("sums",)}
KIND_OPTIONS = {"novograd": NOVOGRAD_OPTIONS[0], "adagrad": ADAGRAD_OPTIONS[1]}
KINDS = ["novograd", "adagrad"]


# --- the float64 references ---------------------------------------------------------------

def ref_norm(g, norm_type) -> float:
    if g.numel() == 0:
        return 0.0
    if norm_type == 0:   # apex's fmaxf: NaN elements passed over, 0 when all are NaN
        finite_or_inf = g[~g.isnan()]
        return float(finite_or_inf.abs().max()) if finite_or_inf.numel() else 0.0
    return f32(math.sqrt(float((g * g).sum())))


def ref_novograd(p, g, m, v, count_before, o, inv_scale):
    """Returns (p, m, v, step, moment_change): step is lr * update and moment_change beta3 * g
    (the tolerances' scales)."""
    g = rnd(g * inv_scale)
    n = ref_norm(g, o["norm_type"])
    b2, c2 = f32(o["beta2"]), f32(1.0 - o["beta2"])
    if count_before == 0 and not o["init_zero"]:
        v = n
    elif o["norm_type"] == 2:
        v = f32(math.sqrt(f32(f32(b2 * f32(v * v)) + f32(c2 * f32(n * n)))))
    else:
        v = f32(f32(b2 * v) + f32(c2 * n))
    count = count_before + 1.0
    r1 = r2 = 1.0
    if o["bias_correction"]:
        r1 = f32(1.0 / (1.0 - o["beta1"] ** count))
        r2 = f32(1.0 / math.sqrt(1.0 - o["beta2"] ** count))
    denom = f32(f32(v * r2) + f32(o["eps"]))
    wd = f32(o["weight_decay"])
    beta3 = f32(1.0 - o["beta1"] if o["grad_averaging"] else 1.0)
    if o["reg_inside_moment"]:
        g = rnd(g / denom)
        if o["weight_decay"] != 0:
            g = rnd(g + rnd(wd * p))
    change = rnd(beta3 * g)
    m = rnd(rnd(f32(o["beta1"]) * m) + change)
    update = rnd(m * r1)
    if not o["reg_inside_moment"]:
        update = rnd(update / denom)
        if o["weight_decay"] != 0:
            update = rnd(update + rnd(wd * p))
    step = rnd(f32(o["lr"]) * update)
    return rnd(p - step), m, v, step, change


def ref_adagrad(p, g, h, o, inv_scale):
    g = rnd(g * inv_scale)
    wd = f32(o["weight_decay"])
    if o["weight_decay"] != 0 and not o["adagrad_w_mode"]:
        g = rnd(g + rnd(wd * p))
    h = rnd(h + rnd(g * g))
    update = rnd(g / rnd(rnd(h.sqrt()) + f32(o["eps"])))
    if o["weight_decay"] != 0 and o["adagrad_w_mode"]:
        update = rnd(update + rnd(wd * p))
    return rnd(p - rnd(f32(o["lr"]) * update)), h


# --- calls --------------------------------------------------------------------------------

def make_call(kind, sizes, combo, device, seed=0, layout="contiguous", first_step=0.0):
    """The tensors of one call: params, grads, state, model_params (sentinel 7.0), steps."""
    dtypes = [COMBOS[combo][i % len(COMBOS[combo])] for i in range(len(sizes))]
    call = {"params": [], "grads": [], "model_params": [], "steps": [],
            **{name: [] for name in STATE[kind]}}
    for i, (n, (p_dtype, g_dtype, m_dtype)) in enumerate(zip(sizes, dtypes)):
        s = seed + 10 * i
        call["params"].append(_laid_out(rand(n, p_dtype, device, s), layout))
        call["grads"].append(_laid_out(rand(n, g_dtype, device, s + 1), layout))
        if dtypes[0][2] is not None:
            call["model_params"].append(_laid_out(torch.full((n,), 7.0, dtype=m_dtype,
                                                             device=device), layout))
        if kind == "novograd":
            call["exp_avgs"].append(_laid_out(rand(n, F32, device, s + 2) * 2 ** -4, layout))
            call["exp_avg_sqs"].append(torch.full((1,) if i % 2 else (), 0.5 + i, device=device))
        else:
            call["sums"].append(_laid_out(rand(n, F32, device, s + 2).abs(), layout))
        call["steps"].append(torch.full(() if i % 2 else (1,), first_step, device=device))
    return call


def run_step(kind, ops, call, o, inv_scale_t, found_inf):
    if kind == "novograd":
        ops.fused_novograd_(call["params"], call["grads"], call["exp_avgs"], call["exp_avg_sqs"],
                            call["model_params"], call["steps"], inv_scale_t, found_inf, o["lr"],
                            o["beta1"], o["beta2"], o["eps"], o["weight_decay"],
                            o["bias_correction"], o["grad_averaging"], o["reg_inside_moment"],
                            o["norm_type"], o["init_zero"])
    else:
        ops.fused_adagrad_(call["params"], call["grads"], call["sums"], call["model_params"],
                           call["steps"], inv_scale_t, found_inf, o["lr"], o["eps"],
                           o["weight_decay"], o["adagrad_w_mode"])


def _close(actual, expected64, scale64, rtol):
    actual64 = actual.detach().cpu().double().reshape(-1)
    expected = expected64.to(actual.dtype).double()
    tol = rtol * scale64.abs() + torch.finfo(actual.dtype).eps * expected.abs() \
        + torch.finfo(actual.dtype).tiny
    err = (actual64 - expected).abs()
    assert bool((err <= tol).all()), f"off by up to {float((err / tol).max()):.3g} x the tolerance"


def check(kind, call, o, backend_name, inv_scale):
    """One step of the op against the reference computed from the call as it stands."""
    ps, gs = _flat64(call["params"]), _flat64(call["grads"])
    counts = [float(s) for s in call["steps"]]
    exact = kind == "adagrad" or o["norm_type"] == 0
    rtol = 0.0 if exact else NORM_RTOL[backend_name]
    expected = []
    for i, (p, g) in enumerate(zip(ps, gs)):
        if kind == "novograd":
            m = call["exp_avgs"][i].detach().cpu().double().reshape(-1)
            v = float(call["exp_avg_sqs"][i])
            expected.append(ref_novograd(p, g, m, v, counts[i], o, inv_scale))
        else:
            h = call["sums"][i].detach().cpu().double().reshape(-1)
            expected.append(ref_adagrad(p, g, h, o, inv_scale))
    yield
    for i, e in enumerate(expected):
        param, model = call["params"][i], call["model_params"][i] if call["model_params"] else None
        if exact:
            assert_bits(param.reshape(-1), e[0].to(param.dtype))
            if model is not None:
                assert_bits(model.reshape(-1), e[0].to(model.dtype))
        else:
            _close(param, e[0], e[3], rtol)
            if model is not None:
                _close(model, e[0], e[3], rtol)
        state = call["exp_avgs"][i] if kind == "novograd" else call["sums"][i]
        assert state.dtype == F32
        if exact:
            assert_bits(state.reshape(-1), e[1].float())
        else:
            _close(state, e[1], e[4], rtol)
        if kind == "novograd":
            v = call["exp_avg_sqs"][i]
            assert v.dtype == F32
            if exact:
                assert float(v) == e[2]
            else:
                assert abs(float(v) - e[2]) <= rtol * abs(e[2]) + 1e-45
        assert float(call["steps"][i]) == counts[i] + 1.0


def run_and_check(kind, backend_name, device, call, options, steps=3):
    o = dict(HYPER[kind], **options)
    ops = _backend.ops_for(torch.device(device))
    inv_scale_t = torch.tensor([f32(INV_SCALE)], device=device)
    found_inf = torch.zeros(1, device=device)
    for step in range(steps):
        checker = check(kind, call, o, backend_name, f32(INV_SCALE))
        next(checker)
        run_step(kind, ops, call, o, inv_scale_t, found_inf)
        next(checker, None)
        assert found_inf.item() == 0.0
        for i, g in enumerate(call["grads"]):   # fresh gradients for the next step
            g.copy_(rand(g.numel(), g.dtype, device, seed=1000 * step + i).reshape(g.shape))


def _sizes(n):
    return [n, 7, 0, n]


# --- results against the references -------------------------------------------------------

OPTION_CASES = [pytest.param(kind, o, id=f"{kind}-" + "-".join(f"{k}={v}" for k, v in o.items()))
                for kind, table in (("novograd", NOVOGRAD_OPTIONS), ("adagrad", ADAGRAD_OPTIONS))
                for o in table]


@pytest.mark.parametrize("combo", sorted(COMBOS))
@pytest.mark.parametrize("kind,options", OPTION_CASES)
def test_options(backend, device, kind, options, combo):
    run_and_check(kind, backend, device, make_call(kind, _sizes(555), combo, device), options)


@pytest.mark.parametrize("combo", ["fp32", "O2-bf16", "mixed"])
@pytest.mark.parametrize("n", [0, 1, CHUNK, CHUNK + 1, 2 * CHUNK + 5])
@pytest.mark.parametrize("kind", KINDS)
def test_shapes_across_chunks(backend, device, kind, n, combo):
    run_and_check(kind, backend, device, make_call(kind, [n, 7, 0, 3], combo, device),
                  KIND_OPTIONS[kind], steps=2)


@pytest.mark.parametrize("norm_type", [0, 2])
def test_novograd_norms_across_chunks(backend, device, norm_type):
    # The largest magnitude in the last chunk of a tensor (the partials are combined).
    call = make_call("novograd", [3 * CHUNK + 5, 555], "mixed", device)
    call["grads"][0][-3] = 300.0
    run_and_check("novograd", backend, device, call,
                  dict(NOVOGRAD_OPTIONS[0], norm_type=norm_type), steps=1)


@pytest.mark.parametrize("combo", ["fp32", "O2-fp16", "mixed"])
@pytest.mark.parametrize("kind", KINDS)
def test_non_contiguous_tensors(backend, device, kind, combo):
    call = make_call(kind, [CHUNK + 3, 555, 0, 1], combo, device, layout="strided")
    assert not call["params"][0].is_contiguous() and not call["grads"][1].is_contiguous()
    run_and_check(kind, backend, device, call, KIND_OPTIONS[kind])


@pytest.mark.parametrize("kind", KINDS)
def test_many_tensors_and_late_counts(backend, device, kind):
    call = make_call(kind, MANY_SIZES, "mixed", device)
    for i in range(0, len(MANY_SIZES), 3):
        call["steps"][i].fill_(float(i % 5))
    call["steps"][1].fill_(9999.0)
    run_and_check(kind, backend, device, call, dict(KIND_OPTIONS[kind], norm_type=0)
                  if kind == "novograd" else KIND_OPTIONS[kind])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", ["native"], indirect=True)
def test_backends_agree_bit_for_bit(backend, device, kind):
    """Adagrad, and NovoGrad with the (exact) inf norm: the native op and the Python reference
    write the same bits."""
    native = _backend.ops_for(torch.device(device))
    assert native is not _python
    sizes = [777 * 777, 555, 0, CHUNK + 1] + MANY_SIZES[:50]
    calls = {name: make_call(kind, sizes, "mixed", device, seed=5) for name in ("n", "p")}
    o = dict(HYPER[kind], **KIND_OPTIONS[kind])
    if kind == "novograd":
        o["norm_type"] = 0
    for _ in range(3):
        for name, ops in (("n", native), ("p", _python)):
            run_step(kind, ops, calls[name], o, torch.tensor([f32(INV_SCALE)], device=device),
                     torch.zeros(1, device=device))
        for key, tensors in calls["n"].items():
            for a, b in zip(tensors, calls["p"][key]):
                assert_bits(a, b.cpu())


@pytest.mark.parametrize("backend", ["native"], indirect=True)
@pytest.mark.parametrize("device", ["cpu"], indirect=True)
def test_novograd_does_not_depend_on_the_thread_count(backend, device):
    results = []
    saved = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            call = make_call("novograd", [777 * 777, 555, CHUNK + 1], "mixed", "cpu", seed=9)
            run_step("novograd", _backend.ops_for(torch.device("cpu")), call,
                     dict(HYPER["novograd"], **NOVOGRAD_OPTIONS[0]), torch.ones(1),
                     torch.zeros(1))
            results.append(call)
    finally:
        torch.set_num_threads(saved)
    for key, tensors in results[0].items():
        for a, b in zip(tensors, results[1][key]):
            assert_bits(a, b)


# --- found_inf, inv_scale, empty calls --------------------------------------------------------

FLAG_SIZES = [CHUNK + 3, 100, 77, 300, CHUNK + 5]


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
@pytest.mark.parametrize("position", ["first", "middle", "last"])
@pytest.mark.parametrize("tensor_index", [0, 2, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_found_inf_changes_nothing(backend, device, kind, tensor_index, position, value):
    call = make_call(kind, FLAG_SIZES, "O2-bf16", device)
    target = call["grads"][tensor_index]
    index = {"first": 0, "middle": target.numel() // 2, "last": target.numel() - 1}[position]
    target[index] = value
    before = {key: [t.clone() for t in tensors] for key, tensors in call.items()}
    found_inf = torch.ones(1, device=device)
    run_step(kind, _backend.ops_for(torch.device(device)), call,
             dict(HYPER[kind], **KIND_OPTIONS[kind]),
             torch.tensor([f32(INV_SCALE)], device=device), found_inf)
    for key, tensors in call.items():
        for actual, saved in zip(tensors, before[key]):
            assert_bits(actual, saved.cpu())
    assert found_inf.item() == 1.0


@pytest.mark.parametrize("grad_dtype", [F32, torch.bfloat16, F16])
@pytest.mark.parametrize("kind", KINDS)
def test_inv_scale_unscales_loss_scaled_gradients(backend, device, kind, grad_dtype):
    # Gradients scaled by 2**16 and unscaled by 2**-16 step exactly as the true ones.
    ops = _backend.ops_for(torch.device(device))
    scaled = make_call(kind, [CHUNK + 1, 555, 0], "O2-bf16", device, seed=3)
    scaled["grads"] = [(rand(g.numel(), F32, device, seed=i) * 2.0 ** -12 * 2.0 ** 16)
                       .to(grad_dtype) for i, g in enumerate(scaled["grads"])]
    true = {key: [t.clone() for t in tensors] for key, tensors in scaled.items()}
    true["grads"] = [g.float() * 2.0 ** -16 for g in scaled["grads"]]
    o = dict(HYPER[kind], **KIND_OPTIONS[kind])
    run_step(kind, ops, scaled, o, torch.tensor([2.0 ** -16], device=device),
             torch.zeros(1, device=device))
    run_step(kind, ops, true, o, torch.ones(1, device=device), torch.zeros(1, device=device))
    for key in ("params", "model_params", *STATE[kind], "steps"):
        for a, b in zip(scaled[key], true[key]):
            assert_bits(a, b.cpu())


@pytest.mark.parametrize("kind", KINDS)
def test_empty_lists(backend, device, kind):
    call = {"params": [], "grads": [], "model_params": [], "steps": [],
            **{name: [] for name in STATE[kind]}}
    found_inf = torch.zeros(1, device=device)
    run_step(kind, _backend.ops_for(torch.device(device)), call,
             dict(HYPER[kind], **KIND_OPTIONS[kind]), torch.ones(1, device=device), found_inf)
    assert found_inf.item() == 0.0


# --- bad arguments (CPU) ------------------------------------------------------------------

BAD = [
    ("novograd", lambda c, o: o.update(norm_type=1), r"norm_type is 1"),
    ("novograd", lambda c, o: c["exp_avg_sqs"].__setitem__(1, torch.zeros(2)),
     r"exp_avg_sqs\[1\] must be a 1-element float32 CPU tensor"),
    ("novograd", lambda c, o: c.update(exp_avg_sqs=c["exp_avg_sqs"][:1]),
     r"params has 2 tensors but exp_avg_sqs has 1"),
    ("novograd", lambda c, o: c["exp_avgs"].__setitem__(0, c["exp_avgs"][0].half()),
     r"exp_avgs\[0\] has dtype Half; optimizer state is float32"),
    ("adagrad", lambda c, o: c["sums"].__setitem__(1, c["sums"][1].reshape(1, -1)),
     r"params\[1\] has shape \[6\] but sums\[1\] has \[1, 6\]"),
    ("adagrad", lambda c, o: c["grads"].__setitem__(0, c["grads"][0].double()),
     r"grads\[0\] has dtype Double"),
    ("adagrad", lambda c, o: c.update(steps=c["steps"][:1]),
     r"params has 2 tensors but steps has 1"),
]


@pytest.mark.parametrize("kind,change,message", BAD, ids=[f"{k}-{i}" for i, (k, _, _) in
                                                           enumerate(BAD)])
@pytest.mark.parametrize("backend", ["native"], indirect=True)
@pytest.mark.parametrize("device", ["cpu"], indirect=True)
def test_bad_arguments_raise_and_change_nothing(backend, device, kind, change, message):
    call = make_call(kind, [3, 6], "O2-bf16", "cpu")
    o = dict(HYPER[kind], **KIND_OPTIONS[kind])
    change(call, o)
    watched = call["params"] + call[STATE[kind][0]] + call["model_params"] + call["steps"]
    before = [t.clone() for t in watched]
    with pytest.raises(RuntimeError, match=message):
        run_step(kind, _backend.ops_for(torch.device("cpu")), call, o, torch.ones(1),
                 torch.zeros(1))
    for actual, saved in zip(watched, before):
        assert_bits(actual, saved)


@pytest.mark.parametrize("flag", [0.0, 1.0])
@pytest.mark.parametrize("kind", KINDS)
def test_python_reference_reads_nothing_on_the_host(kind, flag):
    """found_inf, the step counts and NovoGrad's norms stay on the device (a read is a sync on
    CUDA): no value is read on the host, whether the step is taken or skipped."""
    from amp_helpers import CountSyncs
    call = make_call(kind, [555, 0, CHUNK + 1], "mixed", "cpu")
    before = {key: [t.clone() for t in tensors] for key, tensors in call.items()}
    o = dict(HYPER[kind], **KIND_OPTIONS[kind])
    with CountSyncs() as syncs:
        run_step(kind, _python, call, o, torch.ones(1), torch.full((1,), flag))
    assert syncs.count == 0
    changed = any(not torch.equal(a, b) for key in call for a, b in zip(call[key], before[key]))
    assert changed == (flag == 0.0)
