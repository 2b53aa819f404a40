"""The fused optimizer ops (fused_sgd_, fused_adam_, fused_lamb_) on every backend and device.

The references here are written from the per-element contract (csrc/cpu/fused_*.cpp, the comment
block in apex_lite/multi_tensor/_python.py), independently of the Python backend: each operation
on fp32 values is done in float64 and rounded to fp32, which gives the correctly rounded fp32
result (float64 carries more than 2 * 24 + 2 bits), so the SGD and Adam references are exact:
both backends must match them, and each other, bit for bit (tolerance 0), after every one of
several steps with the state carried. LAMB's moments are exact too; its trust ratios come from
norms that each backend accumulates in its own order, so its parameters are compared within
LAMB_RTOL[backend] of the step plus one unit in the last place of the result.

Native cases skip or fail as in test_multi_tensor.py, whose ``backend`` and ``device`` fixtures
this file uses (native cases are skipped with the loader's reason when the extension is not
built, failed instead with ``APEX_LITE_REQUIRE_EXT=1``, skipped with ``APEX_LITE_DISABLE_EXT=1``).

Bad arguments: the C++ kernels check every list length, shape, dtype, device and the 1-element
tensors (BAD_ARGUMENTS; a tensor on another device is not among them: the dispatcher sends a
call holding a meta or CUDA tensor to that device's kernel, so the CPU kernel's device checks
only back it up). The Python backend raises, through torch, for unequal list lengths,
shapes that do not broadcast and inv_scale / found_inf / grad_norm / steps with more than one
element; it does not check dtypes (state not fp32, float64 params or grads, float64 inv_scale,
found_inf, grad_norm or steps), devices, or shapes that broadcast (a (1, 3) gradient for a (2, 3)
parameter), and it raises only after it has updated the state in place when model_params or
steps are wrong. Those checks exist only in C++ (python_raises=False below).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import pytest
import torch

from apex_lite.multi_tensor import _backend, _python
from test_multi_tensor import CHUNK, assert_bits, backend, device, rand  # noqa: F401 (fixtures)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

SHAPES = [0, 1, 555, CHUNK, CHUNK + 1, 777 * 777]
STEPS = 3

# (param, grad, model param) dtypes per tensor of a call, cycled over its tensors; None: no model
# parameters. "O2" is amp's form: fp32 masters, half gradients in, half model parameters out.
COMBOS = {
    "fp32": [(F32, F32, None)],
    "O2-bf16": [(F32, BF16, BF16)],
    "O2-fp16": [(F32, F16, F16)],
    "bf16-param": [(BF16, BF16, None)],
    "fp16-param": [(F16, F16, None)],
    "fp16-param-fp32-grad-bf16-model": [(F16, F32, BF16)],
    "mixed": [(F32, F32, F32), (BF16, F16, F16), (F16, BF16, BF16), (F32, BF16, F16),
              (BF16, F32, F32)],
}

# LAMB: |result - reference| <= LAMB_RTOL * |lr * ratio * update| + one ulp of the result. The
# trust ratios' norms are fp32 accumulations (native: fp32 blocks of 2048 squares summed in
# double; python: torch's fp32 _foreach_norm) where the reference's are float64. Measured over
# LAMB_OPTIONS and tensors of up to 600K elements: native 2.4e-7, python 3.9e-5 (the step's
# relative error beyond one fp32 ulp of the result).
LAMB_RTOL = {"native": 1e-6, "python": 1e-4}

SGD_OPTIONS = [
    dict(momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, wd_after_momentum=False,
         first_run=False),
    dict(momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False, wd_after_momentum=False,
         first_run=True),
    dict(momentum=0.9, dampening=0.1, weight_decay=1e-2, nesterov=False, wd_after_momentum=False,
         first_run=False),
    dict(momentum=0.9, dampening=0.0, weight_decay=1e-2, nesterov=True, wd_after_momentum=False,
         first_run=True),
    dict(momentum=0.8, dampening=0.3, weight_decay=3e-2, nesterov=False, wd_after_momentum=True,
         first_run=True),
    dict(momentum=0.0, dampening=0.0, weight_decay=1e-2, nesterov=False, wd_after_momentum=True,
         first_run=False),
]
ADAM_OPTIONS = [dict(adam_w_mode=w, bias_correction=b, weight_decay=d)
                for w in (True, False) for b in (True, False) for d in (0.0, 1e-2)]
# clip: "off" (max_grad_norm 0), "active" (max_grad_norm a quarter of the gradients' norm),
# "inactive" (max_grad_norm above it).
LAMB_OPTIONS = [
    dict(adam_w_mode=True, grad_averaging=True, use_nvlamb=False, weight_decay=1e-2,
         clip="active", bias_correction=True),
    dict(adam_w_mode=True, grad_averaging=True, use_nvlamb=False, weight_decay=0.0,
         clip="active", bias_correction=True),
    dict(adam_w_mode=True, grad_averaging=True, use_nvlamb=True, weight_decay=0.0,
         clip="inactive", bias_correction=True),
    dict(adam_w_mode=False, grad_averaging=True, use_nvlamb=False, weight_decay=1e-2,
         clip="off", bias_correction=True),
    dict(adam_w_mode=True, grad_averaging=False, use_nvlamb=False, weight_decay=1e-2,
         clip="inactive", bias_correction=False),
    dict(adam_w_mode=False, grad_averaging=False, use_nvlamb=True, weight_decay=1e-2,
         clip="active", bias_correction=True),
    dict(adam_w_mode=True, grad_averaging=True, use_nvlamb=True, weight_decay=1e-2,
         clip="off", bias_correction=False),
]
HYPER = {"sgd": dict(lr=0.05),
         "adam": dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8),
         "lamb": dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-6)}
STATE = {"sgd": ("momentum_buffers",), "adam": ("exp_avgs", "exp_avg_sqs"),
         "lamb": ("exp_avgs", "exp_avg_sqs")}
INV_SCALE = 0.3   # not a power of two: the unscaling product rounds


def f32(x: float) -> float:
    """x rounded to fp32 (nearest even), as a Python float."""
    return float(torch.tensor(x, dtype=torch.float64).float())


def rnd(t: torch.Tensor) -> torch.Tensor:
    """A float64 tensor rounded to fp32, kept in float64."""
    return t.float().double()


# --- the float64 references ---------------------------------------------------------------
# p, g, state: flat float64 tensors holding the fp32 (or exactly upcast half) values before the
# step; they return the new fp32 values in float64.

def ref_sgd(p, g, buf, o, inv_scale, first_run):
    wd = f32(o["weight_decay"])
    g = rnd(g * inv_scale)
    if o["weight_decay"] != 0 and not o["wd_after_momentum"]:
        g = rnd(g + rnd(wd * p))
    if o["momentum"] != 0:
        momentum = f32(o["momentum"])
        buf = g if first_run else rnd(rnd(momentum * buf) + rnd(f32(1.0 - o["dampening"]) * g))
        g = rnd(g + rnd(momentum * buf)) if o["nesterov"] else buf
    if o["weight_decay"] != 0 and o["wd_after_momentum"]:
        g = rnd(g + rnd(wd * p))
    return rnd(p - rnd(f32(o["lr"]) * g)), buf


def ref_adam_update(p, g, m, v, count, o, beta3):
    """Adam's direction from the true gradient g; returns (update, m, v)."""
    wd, b1, b2 = f32(o["weight_decay"]), o["beta1"], o["beta2"]
    if o["weight_decay"] != 0 and not o["adam_w_mode"]:
        g = rnd(g + rnd(wd * p))
    m = rnd(rnd(f32(b1) * m) + rnd(f32(beta3) * g))
    v = rnd(rnd(f32(b2) * v) + rnd(rnd(f32(1.0 - b2) * g) * g))
    r1, r2 = 1.0, 1.0
    if o["bias_correction"]:
        r1, r2 = f32(1.0 / (1.0 - b1 ** count)), f32(1.0 / math.sqrt(1.0 - b2 ** count))
    # The float64 root of an fp32 value rounds to the correctly rounded fp32 root.
    denom = rnd(rnd(rnd(v.sqrt()) * r2) + f32(o["eps"]))
    update = rnd(rnd(m * r1) / denom)
    if o["weight_decay"] != 0 and o["adam_w_mode"]:
        update = rnd(update + rnd(wd * p))
    return update, m, v


def ref_adam(p, g, m, v, count, o, inv_scale):
    update, m, v = ref_adam_update(p, rnd(g * inv_scale), m, v, count, o, 1.0 - o["beta1"])
    return rnd(p - rnd(f32(o["lr"]) * update)), m, v


def ref_lamb_clip(o, grad_norm):
    """The gradients' divisor, or None when they are not clipped."""
    norm, limit = f32(grad_norm), f32(o["max_grad_norm"])
    if o["max_grad_norm"] > 0 and norm > limit:
        return f32(norm / limit)
    return None


def ref_lamb(p, g, m, v, count, o, inv_scale, clip):
    """Returns (p, m, v, step): step is lr * ratio * update, for the tolerance."""
    g = rnd(g * inv_scale)
    if clip is not None:
        g = rnd(g / clip)
    beta3 = 1.0 - o["beta1"] if o["grad_averaging"] else 1.0
    update, m, v = ref_adam_update(p, g, m, v, count, o, beta3)
    ratio = f32(o["lr"])
    if o["use_nvlamb"] or o["weight_decay"] != 0:
        p_norm = f32(math.sqrt(float((p * p).sum())))
        u_norm = f32(math.sqrt(float((update * update).sum())))
        if p_norm != 0 and u_norm != 0:
            ratio = f32(ratio * f32(p_norm / u_norm))
    step = rnd(ratio * update)
    return rnd(p - step), m, v, step


# --- calls --------------------------------------------------------------------------------

def _laid_out(t: torch.Tensor, layout: str) -> torch.Tensor:
    """t itself, or a non-contiguous view (every other element of a buffer) holding its values."""
    if layout == "contiguous":
        return t
    view = torch.full((2 * t.numel(),), 7.0, dtype=t.dtype, device=t.device)[::2]
    view.copy_(t)
    return view


def make_call(kind: str, sizes: List[int], combo: str, device, seed: int = 0,
              layout: str = "contiguous", momentum: bool = True, first_step: float = 0.0
              ) -> Dict[str, List[torch.Tensor]]:
    """The tensors of one call: params, grads, state, model_params (sentinel 7.0), steps."""
    dtypes = [COMBOS[combo][i % len(COMBOS[combo])] for i in range(len(sizes))]
    with_model = dtypes[0][2] is not None
    call = {"params": [], "grads": [], "model_params": [], "steps": []}
    for name in STATE[kind]:
        call[name] = []
    for i, (n, (p_dtype, g_dtype, m_dtype)) in enumerate(zip(sizes, dtypes)):
        s = seed + 10 * i
        call["params"].append(_laid_out(rand(n, p_dtype, device, s), layout))
        call["grads"].append(_laid_out(rand(n, g_dtype, device, s + 1), layout))
        if with_model:
            call["model_params"].append(_laid_out(torch.full((n,), 7.0, dtype=m_dtype,
                                                             device=device), layout))
        if kind == "sgd":
            if momentum:
                call["momentum_buffers"].append(_laid_out(rand(n, F32, device, s + 2), layout))
        else:
            call["exp_avgs"].append(_laid_out(rand(n, F32, device, s + 2) * 2 ** -4, layout))
            call["exp_avg_sqs"].append(_laid_out(rand(n, F32, device, s + 3).abs() * 2 ** -6,
                                                 layout))
        # 0-dim and 1-element step counts are both accepted.
        shape = () if i % 2 else (1,)
        call["steps"].append(torch.full(shape, first_step, dtype=F32, device=device))
    return call


def true_grad_norm(call, inv_scale: float) -> float:
    """The float64 norm of the unscaled gradients (what the caller passes LAMB as grad_norm)."""
    total = sum(float((rnd(g.detach().cpu().double() * inv_scale) ** 2).sum())
                for g in call["grads"])
    return math.sqrt(total)


def lamb_max_grad_norm(clip: str, grad_norm: float) -> float:
    return {"off": 0.0, "active": 0.25 * grad_norm, "inactive": 4.0 * grad_norm}[clip]


def run_step(kind, ops, call, o, inv_scale_t, found_inf, grad_norm_t=None):
    """Calls the backend's op on the call's tensors; o holds every hyper-parameter."""
    if kind == "sgd":
        ops.fused_sgd_(call["params"], call["grads"], call["momentum_buffers"],
                       call["model_params"], inv_scale_t, found_inf, o["lr"], o["momentum"],
                       o["dampening"], o["weight_decay"], o["nesterov"], o["wd_after_momentum"],
                       o["first_run"])
    elif kind == "adam":
        ops.fused_adam_(call["params"], call["grads"], call["exp_avgs"], call["exp_avg_sqs"],
                        call["model_params"], call["steps"], inv_scale_t, found_inf, o["lr"],
                        o["beta1"], o["beta2"], o["eps"], o["weight_decay"], o["adam_w_mode"],
                        o["bias_correction"])
    else:
        ops.fused_lamb_(call["params"], call["grads"], call["exp_avgs"], call["exp_avg_sqs"],
                        call["model_params"], call["steps"], inv_scale_t, found_inf, grad_norm_t,
                        o["lr"], o["beta1"], o["beta2"], o["eps"], o["weight_decay"],
                        o["adam_w_mode"], o["bias_correction"], o["grad_averaging"],
                        o["max_grad_norm"], o["use_nvlamb"])


def _flat64(tensors):
    return [t.detach().cpu().double().reshape(-1) for t in tensors]


def expected_step(kind, call, o, inv_scale, first_run=False):
    """The reference's params (fp32 values), state and LAMB steps for the call as it stands."""
    ps, gs = _flat64(call["params"]), _flat64(call["grads"])
    counts = [float(s) + 1.0 for s in call["steps"]]
    out = {"params": [], "steps_taken": []}
    for name in STATE[kind]:
        out[name] = []
    clip = ref_lamb_clip(o, o["grad_norm"]) if kind == "lamb" else None
    buffers = _flat64(call.get("momentum_buffers", []))
    for i, (p, g) in enumerate(zip(ps, gs)):
        if kind == "sgd":
            buf = buffers[i] if buffers else None
            p, buf = ref_sgd(p, g, buf, o, inv_scale, first_run)
            if call["momentum_buffers"]:
                out["momentum_buffers"].append(buf)
        else:
            m = call["exp_avgs"][i].detach().cpu().double().reshape(-1)
            v = call["exp_avg_sqs"][i].detach().cpu().double().reshape(-1)
            if kind == "adam":
                p, m, v = ref_adam(p, g, m, v, counts[i], o, inv_scale)
            else:
                p, m, v, step = ref_lamb(p, g, m, v, counts[i], o, inv_scale, clip)
                out["steps_taken"].append(step)
            out["exp_avgs"].append(m)
            out["exp_avg_sqs"].append(v)
        out["params"].append(p)
    return out


def _lamb_close(actual, expected64, step64, backend_name):
    tol = (LAMB_RTOL[backend_name] * step64.abs()
           + torch.finfo(actual.dtype).eps * expected64.abs() + torch.finfo(actual.dtype).tiny)
    err = (actual.cpu().double().reshape(-1) - expected64.to(actual.dtype).double()).abs()
    assert bool((err <= tol).all()), \
        f"LAMB result off by up to {float((err / tol).max()):.3g} x the tolerance"


def check_step(kind, call, expected, backend_name, steps_before):
    for i, (p, e) in enumerate(zip(call["params"], expected["params"])):
        if kind == "lamb":
            _lamb_close(p, e, expected["steps_taken"][i], backend_name)
        else:
            assert_bits(p.reshape(-1), e.to(p.dtype))
    for name in STATE[kind]:
        for actual, e in zip(call[name], expected[name]):
            assert actual.dtype == F32
            assert_bits(actual.reshape(-1), e.float())
    for i, (mp, p) in enumerate(zip(call["model_params"], call["params"])):
        # The model parameter is the updated fp32 value rounded once to its dtype: for an fp32
        # parameter, the parameter rounded.
        if p.dtype == F32:
            assert_bits(mp, p.to(mp.dtype))
        elif kind == "lamb":
            _lamb_close(mp, expected["params"][i], expected["steps_taken"][i], backend_name)
        else:
            assert_bits(mp.reshape(-1), expected["params"][i].to(mp.dtype))
    if kind != "sgd":
        for s, before in zip(call["steps"], steps_before):
            assert float(s) == before + 1.0


def run_and_check(kind, backend_name, device, call, options, steps=STEPS):
    """steps steps in a row with the state carried; each checked against the reference computed
    from the tensors as they stood before it."""
    o = dict(HYPER[kind], **options)
    ops = _backend.ops_for(torch.device(device))
    inv_scale_t = torch.tensor([f32(INV_SCALE)], device=device)
    found_inf = torch.zeros(1, device=device)
    for step in range(steps):
        grad_norm_t = None
        if kind == "lamb":
            o["grad_norm"] = true_grad_norm(call, f32(INV_SCALE))
            o["max_grad_norm"] = lamb_max_grad_norm(o["clip"], o["grad_norm"])
            grad_norm_t = torch.tensor([o["grad_norm"]], dtype=F32, device=device)
        first_run = kind == "sgd" and options["first_run"] and step == 0
        step_o = dict(o, first_run=first_run)
        steps_before = [float(s) for s in call["steps"]]
        expected = expected_step(kind, call, step_o, f32(INV_SCALE), first_run)
        run_step(kind, ops, call, step_o, inv_scale_t, found_inf, grad_norm_t)
        check_step(kind, call, expected, backend_name, steps_before)
        assert found_inf.item() == 0.0
        for i, g in enumerate(call["grads"]):   # fresh gradients for the next step
            g.copy_(rand(g.numel(), g.dtype, device, seed=1000 * step + i).reshape(g.shape))


def _sizes(n: int) -> List[int]:
    """A call around a tensor of n elements, spanning several tensors, one of them empty."""
    return [n, 7, 0, n]


KIND_OPTIONS = {"sgd": SGD_OPTIONS[3], "adam": ADAM_OPTIONS[1], "lamb": LAMB_OPTIONS[0]}


def _make(kind, sizes, combo, device, options=None, **kw):
    """make_call for options (KIND_OPTIONS[kind] by default): no SGD buffers without momentum."""
    if kind == "sgd":
        kw["momentum"] = (options or KIND_OPTIONS["sgd"])["momentum"] != 0
    return make_call(kind, sizes, combo, device, **kw)


# --- results against the references -------------------------------------------------------

OPTION_CASES = [pytest.param(kind, o, id=f"{kind}-" + "-".join(f"{k}={v}" for k, v in o.items()))
                for kind, table in (("sgd", SGD_OPTIONS), ("adam", ADAM_OPTIONS),
                                    ("lamb", LAMB_OPTIONS))
                for o in table]


@pytest.mark.parametrize("combo", sorted(COMBOS))
@pytest.mark.parametrize("kind,options", OPTION_CASES)
def test_options(backend, device, kind, options, combo):
    call = _make(kind, _sizes(555), combo, device, options)
    run_and_check(kind, backend, device, call, options)


@pytest.mark.parametrize("combo", ["fp32", "O2-bf16", "mixed"])
@pytest.mark.parametrize("n", SHAPES)
@pytest.mark.parametrize("kind", ["sgd", "adam", "lamb"])
def test_shapes_across_chunks(backend, device, kind, n, combo):
    if n == SHAPES[-1] and combo == "O2-bf16":
        pytest.skip("the largest shape runs for fp32 and mixed dtypes (time)")
    run_and_check(kind, backend, device, _make(kind, _sizes(n), combo, device),
                  KIND_OPTIONS[kind])


@pytest.mark.parametrize("combo", ["fp32", "O2-fp16", "mixed"])
@pytest.mark.parametrize("kind", ["sgd", "adam", "lamb"])
def test_non_contiguous_tensors(backend, device, kind, combo):
    call = _make(kind, [CHUNK + 3, 555, 0, 1], combo, device, layout="strided")
    assert not call["params"][0].is_contiguous() and not call["grads"][1].is_contiguous()
    run_and_check(kind, backend, device, call, KIND_OPTIONS[kind])


@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_late_step_counts(backend, device, kind):
    # Bias corrections near 1 and counts that differ between the tensors of one call.
    call = _make(kind, [CHUNK + 1, 555, 3], "mixed", device, first_step=9999.0)
    call["steps"][1].fill_(41.0)
    run_and_check(kind, backend, device, call, KIND_OPTIONS[kind])


# Enough tensors that the CPU op reads their metadata in several parallel tasks (the Adam-like
# ops' scan takes 128 parameters a task), empty ones among them.
MANY_SIZES = [0 if i % 97 == 13 else 1 + (i * 37) % 300 for i in range(700)]


@pytest.mark.parametrize("kind", ["sgd", "adam", "lamb"])
def test_many_tensors(backend, device, kind):
    """Hundreds of tensors in one call; Adam's and LAMB's step counts differ within and across
    the scan's tasks (each task keeps its own last bias correction)."""
    call = _make(kind, MANY_SIZES, "mixed", device)
    if kind != "sgd":
        for i in range(0, len(MANY_SIZES), 3):
            call["steps"][i].fill_(float(i % 5))
    run_and_check(kind, backend, device, call, KIND_OPTIONS[kind])


@pytest.mark.parametrize("sizes", [[777 * 777, 555, 0, CHUNK + 1], MANY_SIZES],
                         ids=["large", "many"])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("backend", ["native"], indirect=True)
def test_backends_agree_bit_for_bit(backend, device, kind, sizes):
    native = _backend.ops_for(torch.device(device))
    assert native is not _python
    calls = {name: _make(kind, sizes, "mixed", device, seed=5) for name in ("native", "python")}
    o = dict(HYPER[kind], **KIND_OPTIONS[kind])
    inv_scale_t = torch.tensor([f32(INV_SCALE)], device=device)
    for step in range(STEPS):
        o["first_run"] = kind == "sgd" and step == 0
        for name, ops in (("native", native), ("python", _python)):
            run_step(kind, ops, calls[name], o, inv_scale_t, torch.zeros(1, device=device))
        for key, tensors in calls["native"].items():
            for a, b in zip(tensors, calls["python"][key]):
                assert_bits(a, b.cpu())


@pytest.mark.parametrize("betas", [(1.0, 0.999), (0.9, 1.0), (0.9, 1.5)],
                         ids=["r1_inf", "r2_inf", "r2_nan"])
@pytest.mark.parametrize("backend", ["native"], indirect=True)
def test_degenerate_bias_corrections_agree(backend, device, betas):
    """Betas the optimizers refuse but the ops take (apex's amp_C op does not check them): a bias
    correction of 0 gives an infinite reciprocal, a negative one a NaN root, in C++ as in the
    reference (where Python itself would raise)."""
    native = _backend.ops_for(torch.device(device))
    calls = {name: _make("adam", [555, 3], "mixed", device, seed=9) for name in ("n", "p")}
    o = dict(HYPER["adam"], **KIND_OPTIONS["adam"], beta1=betas[0], beta2=betas[1])
    for name, ops in (("n", native), ("p", _python)):
        run_step("adam", ops, calls[name], o, torch.tensor([f32(INV_SCALE)], device=device),
                 torch.zeros(1, device=device))
    for key, tensors in calls["n"].items():
        for a, b in zip(tensors, calls["p"][key]):
            assert_bits(a, b.cpu())


@pytest.mark.parametrize("backend", ["native"], indirect=True)
@pytest.mark.parametrize("device", ["cpu"], indirect=True)
def test_lamb_does_not_depend_on_the_thread_count(backend, device):
    # The per-tensor norms are combined in segment order, whichever thread summed a segment.
    results = []
    saved = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            call = make_call("lamb", [777 * 777, 555, CHUNK + 1], "mixed", "cpu", seed=9)
            o = {**HYPER["lamb"], **LAMB_OPTIONS[0], "grad_norm": 900.0, "max_grad_norm": 1.0}
            run_step("lamb", _backend.ops_for(torch.device("cpu")), call, o, torch.ones(1),
                     torch.zeros(1), torch.full((1,), 900.0))
            results.append(call)
    finally:
        torch.set_num_threads(saved)
    for key, tensors in results[0].items():
        for a, b in zip(tensors, results[1][key]):
            assert_bits(a, b)


# --- LAMB's trust ratio edge cases ----------------------------------------------------------

@pytest.mark.parametrize("case", ["zero-param", "zero-update", "both-zero"])
def test_lamb_trust_ratio_edges(backend, device, case):
    # A zero norm makes the ratio 1 (the step is lr * update): the reference decides the same.
    options = dict(LAMB_OPTIONS[2]) if case == "zero-update" else dict(LAMB_OPTIONS[0])
    call = make_call("lamb", [555, CHUNK + 2, 0], "O2-bf16", device)
    if case in ("zero-param", "both-zero"):
        call["params"][0].zero_()
    if case in ("zero-update", "both-zero"):
        # No gradient and no moments: the Adam direction is 0 (and with weight decay in AdamW
        # mode, weight_decay * p, which is 0 for a zero parameter).
        call["grads"][0].zero_()
        call["exp_avgs"][0].zero_()
        call["exp_avg_sqs"][0].zero_()
    run_and_check("lamb", backend, device, call, options, steps=1)


# --- found_inf, inv_scale, empty calls --------------------------------------------------------

FLAG_SIZES = [CHUNK + 3, 100, 77, 300, CHUNK + 5]


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
@pytest.mark.parametrize("position", ["first", "middle", "last"])
@pytest.mark.parametrize("tensor_index", [0, 2, 4])
@pytest.mark.parametrize("kind", ["sgd", "adam", "lamb"])
def test_found_inf_changes_nothing(backend, device, kind, tensor_index, position, value):
    call = _make(kind, FLAG_SIZES, "O2-bf16", device)
    target = call["grads"][tensor_index]
    target[{"first": 0, "middle": target.numel() // 2, "last": target.numel() - 1}[position]] = value
    before = {key: [t.clone() for t in tensors] for key, tensors in call.items()}
    o = {**HYPER[kind], **KIND_OPTIONS[kind], "grad_norm": 1.0, "max_grad_norm": 1.0}
    found_inf = torch.ones(1, device=device)
    run_step(kind, _backend.ops_for(torch.device(device)), call, o,
             torch.tensor([f32(INV_SCALE)], device=device), found_inf,
             torch.ones(1, device=device))
    for key, tensors in call.items():
        for actual, saved in zip(tensors, before[key]):
            assert_bits(actual, saved.cpu())
    assert found_inf.item() == 1.0


@pytest.mark.parametrize("grad_dtype", [F32, BF16, F16])
@pytest.mark.parametrize("kind", ["sgd", "adam", "lamb"])
def test_inv_scale_unscales_loss_scaled_gradients(backend, device, kind, grad_dtype):
    # Gradients of a loss scaled by 2**16, unscaled by inv_scale 2**-16, step exactly as the
    # true gradients (exact powers of two in fp32) with inv_scale 1.
    ops = _backend.ops_for(torch.device(device))
    scaled = _make(kind, [CHUNK + 1, 555, 0], "O2-bf16", device, seed=3)
    scaled["grads"] = [(rand(g.numel(), F32, device, seed=i) * 2.0 ** -12 * 2.0 ** 16)
                       .to(grad_dtype) for i, g in enumerate(scaled["grads"])]
    true = {key: [t.clone() for t in tensors] for key, tensors in scaled.items()}
    true["grads"] = [g.float() * 2.0 ** -16 for g in scaled["grads"]]
    o = {**HYPER[kind], **KIND_OPTIONS[kind], "grad_norm": 1.0, "max_grad_norm": 0.5}
    norm = torch.ones(1, device=device)
    run_step(kind, ops, scaled, o, torch.tensor([2.0 ** -16], device=device),
             torch.zeros(1, device=device), norm)
    run_step(kind, ops, true, o, torch.ones(1, device=device), torch.zeros(1, device=device), norm)
    for key in ("params", "model_params", *STATE[kind], "steps"):
        for a, b in zip(scaled[key], true[key]):
            assert_bits(a, b.cpu())


@pytest.mark.parametrize("kind", ["sgd", "adam", "lamb"])
def test_empty_lists(backend, device, kind):
    o = {**HYPER[kind], **KIND_OPTIONS[kind], "grad_norm": 1.0, "max_grad_norm": 1.0}
    call = {"params": [], "grads": [], "model_params": [], "steps": [],
            **{name: [] for name in STATE[kind]}}
    found_inf = torch.zeros(1, device=device)
    run_step(kind, _backend.ops_for(torch.device(device)), call, o,
             torch.ones(1, device=device), found_inf, torch.ones(1, device=device))
    assert found_inf.item() == 0.0


# --- bad arguments (CPU) ------------------------------------------------------------------

def _small_call(kind):
    return _make(kind, [3, 6], "O2-bf16", "cpu")


def _reshaped(tensors, index, *shape):
    out = list(tensors)
    out[index] = out[index].reshape(-1)[:1].expand(*shape).clone() if shape else out[index]
    return out


def _retyped(tensors, index, dtype):
    out = list(tensors)
    out[index] = out[index].to(dtype)
    return out


# (name, kinds, change to the call or to the scalar tensors, message of the C++ check,
#  whether the Python backend raises too)
BAD_ARGUMENTS = [
    ("grads-length", "sgd adam lamb", lambda c, s: c.update(grads=c["grads"][:1]),
     r"params has 2 tensors but grads has 1", True),
    ("grad-shape", "sgd adam lamb", lambda c, s: c.update(grads=_reshaped(c["grads"], 1, 2, 3)),
     r"params\[1\] has shape \[6\] but grads\[1\] has \[2, 3\]", True),
    ("grad-shape-broadcast", "adam", lambda c, s: c.update(grads=_reshaped(c["grads"], 1, 1, 6)),
     r"params\[1\] has shape \[6\] but grads\[1\] has \[1, 6\]", False),
    ("param-dtype", "sgd adam lamb",
     lambda c, s: c.update(params=_retyped(c["params"], 0, torch.float64)),
     r"params\[0\] has dtype Double; only float32, float16 and bfloat16", False),
    ("grad-dtype", "sgd adam lamb",
     lambda c, s: c.update(grads=_retyped(c["grads"], 1, torch.float64)),
     r"grads\[1\] has dtype Double", False),
    ("state-dtype", "sgd adam lamb",
     lambda c, s: c.update({STATE_KEY[c["kind"]]: _retyped(c[STATE_KEY[c["kind"]]], 1, F16)}),
     r"\[1\] has dtype Half; optimizer state is float32", False),
    ("state-length", "sgd adam lamb",
     lambda c, s: c.update({STATE_KEY[c["kind"]]: c[STATE_KEY[c["kind"]]][:1]}),
     r"params has 2 tensors but (momentum_buffers|exp_avgs) has 1", True),
    ("state-shape", "adam lamb",
     lambda c, s: c.update(exp_avg_sqs=_reshaped(c["exp_avg_sqs"], 1, 3, 2)),
     r"params\[1\] has shape \[6\] but exp_avg_sqs\[1\] has \[3, 2\]", True),
    ("momentum-without-buffers", "sgd", lambda c, s: c.update(momentum_buffers=[]),
     r"momentum is 0.9 but momentum_buffers is empty", True),
    ("model-length", "sgd adam lamb", lambda c, s: c.update(model_params=c["model_params"][:1]),
     r"model_params has 1 tensors but params has 2", True),
    ("model-shape", "adam",
     lambda c, s: c.update(model_params=_reshaped(c["model_params"], 1, 2, 3)),
     r"params\[1\] has shape \[6\] but model_params\[1\] has \[2, 3\]", True),
    ("model-dtype", "adam",
     lambda c, s: c.update(model_params=_retyped(c["model_params"], 0, torch.float64)),
     r"model_params\[0\] has dtype Double", False),
    ("steps-length", "adam lamb", lambda c, s: c.update(steps=c["steps"][:1]),
     r"params has 2 tensors but steps has 1", True),
    ("steps-elements", "adam lamb", lambda c, s: c["steps"].__setitem__(0, torch.zeros(2)),
     r"steps\[0\] must be a 1-element float32 CPU tensor", True),
    ("steps-dtype", "adam lamb",
     lambda c, s: c["steps"].__setitem__(0, torch.zeros(1, dtype=torch.float64)),
     r"steps\[0\] must be a 1-element float32 CPU tensor", False),
    ("inv_scale-elements", "sgd adam lamb", lambda c, s: s.update(inv_scale=torch.ones(2)),
     r"inv_scale must be a 1-element float32 CPU tensor, got 2 elements", True),
    ("inv_scale-dtype", "sgd adam lamb",
     lambda c, s: s.update(inv_scale=torch.ones(1, dtype=torch.float64)),
     r"inv_scale must be a 1-element float32 CPU tensor", False),
    ("found_inf-elements", "sgd adam lamb", lambda c, s: s.update(found_inf=torch.zeros(2)),
     r"found_inf must be a 1-element float32 CPU tensor, got 2 elements", True),
    ("found_inf-dtype", "sgd adam lamb",
     lambda c, s: s.update(found_inf=torch.zeros(1, dtype=torch.float64)),
     r"found_inf must be a 1-element float32 CPU tensor", False),
    ("grad_norm-elements", "lamb", lambda c, s: s.update(grad_norm=torch.ones(2)),
     r"grad_norm must be a 1-element float32 CPU tensor, got 2 elements", True),
    ("grad_norm-dtype", "lamb", lambda c, s: s.update(grad_norm=torch.ones(1).double()),
     r"grad_norm must be a 1-element float32 CPU tensor", False),
]
STATE_KEY = {"sgd": "momentum_buffers", "adam": "exp_avgs", "lamb": "exp_avgs"}


def _bad_argument_cases():
    for name, kinds, change, message, python_raises in BAD_ARGUMENTS:
        for kind in kinds.split():
            for backend_name in ("native", "python") if python_raises else ("native",):
                yield pytest.param(backend_name, kind, change, message,
                                   id=f"{backend_name}-{kind}-{name}")


@pytest.mark.parametrize("backend,kind,change,message", list(_bad_argument_cases()),
                         indirect=["backend"])
@pytest.mark.parametrize("device", ["cpu"], indirect=True)
def test_bad_arguments_raise(backend, device, kind, change, message):
    call = dict(_small_call(kind), kind=kind)
    scalars = {"inv_scale": torch.ones(1), "found_inf": torch.zeros(1),
               "grad_norm": torch.ones(1)}
    change(call, scalars)
    o = {**HYPER[kind], **KIND_OPTIONS[kind], "grad_norm": 1.0, "max_grad_norm": 1.0}
    ops = _backend.ops_for(torch.device("cpu"))
    if backend == "native":
        with pytest.raises(RuntimeError, match=message):
            run_step(kind, ops, call, o, scalars["inv_scale"], scalars["found_inf"],
                     scalars["grad_norm"])
    else:
        with pytest.raises((RuntimeError, ValueError)):
            run_step(kind, ops, call, o, scalars["inv_scale"], scalars["found_inf"],
                     scalars["grad_norm"])


@pytest.mark.parametrize("backend", ["native"], indirect=True)
@pytest.mark.parametrize("device", ["cpu"], indirect=True)
def test_bad_arguments_change_nothing(backend, device):
    # The C++ kernels check everything before they write: a call refused for its last list
    # leaves the state as it was.
    call = _small_call("adam")
    before = [t.clone() for t in call["exp_avgs"] + call["params"]]
    call["model_params"] = call["model_params"][:1]
    o = dict(HYPER["adam"], **KIND_OPTIONS["adam"])
    with pytest.raises(RuntimeError, match="model_params has 1 tensors"):
        run_step("adam", _backend.ops_for(torch.device("cpu")), call, o, torch.ones(1),
                 torch.zeros(1))
    for actual, saved in zip(call["exp_avgs"] + call["params"], before):
        assert_bits(actual, saved)
    assert [float(s) for s in call["steps"]] == [0.0, 0.0]


@pytest.mark.parametrize("kind", ["sgd", "adam", "lamb"])
@pytest.mark.parametrize("index", [0, 300, 699])
@pytest.mark.parametrize("backend", ["native"], indirect=True)
@pytest.mark.parametrize("device", ["cpu"], indirect=True)
def test_bad_argument_among_many_tensors(backend, device, kind, index):
    """A bad tensor in any of the parallel scan's tasks raises the error that names it, before
    anything is written (parameters, state, model parameters, step counts)."""
    call = _make(kind, MANY_SIZES, "O2-bf16", "cpu")
    watched = call["params"] + call[STATE_KEY[kind]] + call["model_params"] + call["steps"]
    before = [t.clone() for t in watched]
    call["grads"][index] = call["grads"][index].double()
    o = {**HYPER[kind], **KIND_OPTIONS[kind], "grad_norm": 1.0, "max_grad_norm": 1.0}
    with pytest.raises(RuntimeError, match=rf"grads\[{index}\] has dtype Double"):
        run_step(kind, _backend.ops_for(torch.device("cpu")), call, o, torch.ones(1),
                 torch.zeros(1), torch.ones(1))
    for actual, saved in zip(watched, before):
        assert_bits(actual, saved)


# --- a step count shared by two parameters (issue 33) ---------------------------------------
# A count that two parameters share would advance once per parameter in a step, and their bias
# corrections would depend on the order they are stepped in: both backends refuse it, by
# address, before anything is written, naming the lowest j whose count an earlier i holds.

def _share(steps, i, j, how):
    """steps[j] made to share steps[i]'s element."""
    steps[j] = steps[i] if how == "same tensor" else steps[i].view(steps[i].shape)


# (sizes, pairs (i, j): steps[j] shares steps[i]'s element, the pair the error names,
#  whether the steps are put in falling address order first)
SHARED_STEP_CASES = {
    "two of three": ([3, 6, 5], [(0, 2)], (0, 2), False),
    # Many tensors (the parallel scan's tasks), two shared counts: steps[300] takes steps[400]'s
    # element, so j = 400 is the lowest index whose address an earlier one (300) holds.
    "many, two pairs": (MANY_SIZES, [(5, 650), (400, 300)], (300, 400), False),
    "many, falling addresses": (MANY_SIZES, [(650, 5)], (5, 650), True),
}


@pytest.mark.parametrize("how", ["same tensor", "view of one element"])
@pytest.mark.parametrize("case", sorted(SHARED_STEP_CASES))
@pytest.mark.parametrize("kind", ["adam", "lamb"])
@pytest.mark.parametrize("device", ["cpu"], indirect=True)
def test_a_shared_step_count_is_refused(backend, device, kind, case, how):
    sizes, pairs, named, falling = SHARED_STEP_CASES[case]
    call = _make(kind, sizes, "O2-bf16", "cpu")
    if falling:   # the counts of one buffer, in falling address order
        call["steps"] = list(torch.zeros(len(sizes)).unbind(0))[::-1]
    for i, j in pairs:
        _share(call["steps"], i, j, how)
    watched = call["params"] + call[STATE_KEY[kind]] + call["model_params"] + call["steps"]
    before = [t.clone() for t in watched]
    o = {**HYPER[kind], **KIND_OPTIONS[kind], "grad_norm": 1.0, "max_grad_norm": 1.0}
    i, j = named
    with pytest.raises(ValueError, match=rf"^apex_lite::fused_{kind}_: steps\[{j}\] shares its "
                                         rf"memory with steps\[{i}\]: each parameter needs a "
                                         rf"step count of its own .* a clone\(\) of the shared "
                                         rf"one\.$"):
        run_step(kind, _backend.ops_for(torch.device("cpu")), call, o, torch.ones(1),
                 torch.zeros(1), torch.ones(1))
    for actual, saved in zip(watched, before):
        assert_bits(actual, saved)


@pytest.mark.parametrize("falling", [False, True])
@pytest.mark.parametrize("kind", ["adam", "lamb"])
@pytest.mark.parametrize("device", ["cpu"], indirect=True)
def test_distinct_elements_of_one_buffer_are_distinct_step_counts(backend, device, kind,
                                                                  falling):
    """What apex_multi_tensor passes: views of the elements of one buffer, each its own count
    (in rising address order, and falling: the check's scan and its sort)."""
    call = _make(kind, MANY_SIZES, "O2-bf16", "cpu", first_step=2.0)
    counts = list(torch.full((len(MANY_SIZES),), 2.0).unbind(0))
    call["steps"] = counts[::-1] if falling else counts
    o = {**HYPER[kind], **KIND_OPTIONS[kind], "grad_norm": 1.0, "max_grad_norm": 1.0}
    run_step(kind, _backend.ops_for(torch.device("cpu")), call, o, torch.ones(1),
             torch.zeros(1), torch.ones(1))
    assert [float(s) for s in call["steps"]] == [3.0] * len(MANY_SIZES)
