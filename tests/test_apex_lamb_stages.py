"""amp_C's two-stage LAMB ops (``multi_tensor_lamb_stage1_cuda``, ``_stage2_cuda``), which
DeepLearningExamples' BERT optimization.py looks up when imported, against float64 references
of apex's kernels (apex's csrc/multi_tensor_lamb_stage_1.cu and _2.cu): both call forms of apex's
history (the global norm as a number or a tensor; stage 2 with ``lr`` alone or with
``weight_decay`` and ``use_nvlamb``), mixed dtypes as BertLAMB mixed them, the noop flag left
alone. tests/test_apex_era_scripts.py runs BERT's own optimizers through them. The suite runs
once per backend (tools/test.sh); these ops are the same code on both.
"""
import math

import pytest
import torch

from apex_lite.apex_compat import multi_tensor as amp_C
from apex_lite.apex_compat.multi_tensor import multi_tensor_applier
from test_apex_multi_tensor import (DEVICES, NOOPS, assert_rounded_close, flag_value, rand,
                                    tensor_list)

STAGE1 = amp_C.multi_tensor_lamb_stage1_cuda
STAGE2 = amp_C.multi_tensor_lamb_stage2_cuda


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


def stage1_reference(grad, param, m, v, *, decay, step, beta1, beta2, eps, norm, max_norm):
    """apex's LAMBStage1Functor in float64."""
    clip = norm / max_norm if norm > max_norm else 1.0
    g, p, m, v = grad.double() / clip, param.double(), m.double(), v.double()
    m = m * beta1 + (1 - beta1) * g
    v = v * beta2 + (1 - beta2) * g * g
    next_step = step + 1
    update = (m / (1 - beta1 ** next_step)) / ((v / (1 - beta2 ** next_step)).sqrt() + eps)
    return update + decay * p, m, v


def stage2_reference(param, update, param_norm, update_norm, lr, adaptive=True):
    """apex's LAMBStage2Functor in float64 (the ratio where ``adaptive``, else ``lr``)."""
    ratio = lr
    if adaptive and param_norm != 0 and update_norm != 0:
        ratio = lr * param_norm / update_norm
    return param.double() - ratio * update.double()


def _state(grads, device, seed):
    m = [rand(g.shape, torch.float32, device, seed + i) * 0.1 for i, g in enumerate(grads)]
    v = [rand(g.shape, torch.float32, device, seed + 50 + i).abs() * 0.01
         for i, g in enumerate(grads)]
    return m, v


# (grad dtype, param dtype, state dtype, update dtype): fp32; BertLAMB's fp16 model with fp32
# masters (fp16 gradients, the fp16 weights as the update buffer); half everywhere.
STAGE1_LISTS = [(torch.float32,) * 4,
                (torch.float16, torch.float32, torch.float32, torch.float16),
                (torch.bfloat16,) * 4,
                (torch.float16,) * 4]


@pytest.mark.parametrize("dtypes", STAGE1_LISTS, ids=lambda d: "-".join(map(str, d)))
@pytest.mark.parametrize("clipped", [True, False])
# apex's two forms of the norm: a tensor (apex from May 2020), a number (BertLAMB's apex).
@pytest.mark.parametrize("step, norm_as_tensor", [(0, True), (4, False)])
def test_stage1(device, dtypes, clipped, step, norm_as_tensor):
    grad_dtype, param_dtype, state_dtype, update_dtype = dtypes
    grads = tensor_list(grad_dtype, device, 1)
    params = tensor_list(param_dtype, device, 20)
    m32, v32 = _state(grads, device, 40)
    m, v = [t.to(state_dtype) for t in m32], [t.to(state_dtype) for t in v32]
    updates = [torch.full(g.shape, 7.0, dtype=update_dtype, device=device) for g in grads]
    decays = torch.tensor([0.01 if i % 2 else 0.0 for i in range(len(grads))], device=device)
    noop = NOOPS["int32"](device)
    norm, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, noop, [grads], False)
    max_norm = float(norm) / 2 if clipped else float(norm) * 2
    expected = [stage1_reference(g, p, mi, vi, decay=float(d), step=step, beta1=0.9,
                                 beta2=0.999, eps=1e-6, norm=float(norm), max_norm=max_norm)
                for g, p, mi, vi, d in zip(grads, params, m, v, decays)]
    grads_before, params_before = [g.clone() for g in grads], [p.clone() for p in params]
    multi_tensor_applier(STAGE1, noop, [grads, params, m, v, updates], decays, step, 0.9, 0.999,
                         1e-6, norm if norm_as_tensor else float(norm), max_norm)
    for u, mi, vi, (u_ref, m_ref, v_ref) in zip(updates, m, v, expected):
        assert u.dtype == update_dtype and mi.dtype == vi.dtype == state_dtype
        assert_rounded_close(u, u_ref, min(update_dtype, param_dtype, key=_precision))
        assert_rounded_close(mi, m_ref, state_dtype)
        assert_rounded_close(vi, v_ref, state_dtype)
    assert all(torch.equal(a, b) for a, b in zip(grads + params, grads_before + params_before))
    assert flag_value(noop) == 0.0


def _precision(dtype):
    return torch.finfo(dtype).eps * -1   # min() by precision picks the coarsest dtype


# stage 2's call forms: apex before April 2020 (lr alone: the ratio everywhere) and after
# (weight_decay, use_nvlamb: the ratio where use_nvlamb or weight_decay != 0).
STAGE2_FORMS = {"lr only": ((), True), "decay": ((0.01, False), True),
                "no decay": ((0.0, False), False), "no decay, nvlamb": ((0.0, True), True),
                "decay, use_nvlamb None": ((0.01,), True)}


@pytest.mark.parametrize("form", list(STAGE2_FORMS))
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32),
                                    (torch.float32, torch.float16),
                                    (torch.bfloat16, torch.float32)], ids=str)
def test_stage2(device, form, dtypes):
    extra, adaptive = STAGE2_FORMS[form]
    param_dtype, update_dtype = dtypes
    params = tensor_list(param_dtype, device, 60)
    updates = [t * 0.01 for t in tensor_list(update_dtype, device, 70)]
    updates[1].zero_()                      # an update norm of 0: the ratio is lr
    params[2].zero_()                       # a parameter norm of 0: the ratio is lr
    noop = NOOPS["int32"](device)
    _, param_norms = multi_tensor_applier(amp_C.multi_tensor_l2norm, noop, [params], True)
    _, update_norms = multi_tensor_applier(amp_C.multi_tensor_l2norm, noop, [updates], True)
    expected = [stage2_reference(p, u, float(pn), float(un), 0.05, adaptive)
                for p, u, pn, un in zip(params, updates, param_norms, update_norms)]
    updates_before, params_before = [u.clone() for u in updates], [p.clone() for p in params]
    multi_tensor_applier(STAGE2, noop, [params, updates], param_norms, update_norms, 0.05,
                         *extra)
    for p, p_ref in zip(params, expected):
        assert_rounded_close(p, p_ref, param_dtype)
    assert all(torch.equal(a, b) for a, b in zip(updates, updates_before))
    assert flag_value(noop) == 0.0
    if adaptive:   # the ratio is not lr for an ordinary tensor: the case tells the forms apart
        plain = stage2_reference(params_before[3], updates[3], 0.0, 0.0, 0.05, adaptive=False)
        assert not torch.allclose(expected[3], plain, rtol=1e-3, atol=0)


def test_two_stages_make_lamb_steps(device):
    """BertLAMB's sequence (global norm, parameter norms, stage 1, update norms, stage 2) over
    several steps, against LAMB in float64 (apex's formulas, its bias correction for step + 1):
    the stages' state carries from step to step."""
    params = [rand((33, 7), torch.float32, device, 1), rand((5,), torch.float32, device, 2)]
    ref = [p.double() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    m_ref, v_ref = [t.double() for t in m], [t.double() for t in v]
    updates = [torch.empty_like(p) for p in params]
    decays = torch.tensor([0.01, 0.0], device=device)
    noop = NOOPS["int32"](device)
    for step in range(1, 6):
        grads = [rand(p.shape, torch.float32, device, 10 * step + i) * (3.0 if step == 2 else 1)
                 for i, p in enumerate(params)]
        norm = multi_tensor_applier(amp_C.multi_tensor_l2norm, noop, [grads], False)[0]
        param_norms = multi_tensor_applier(amp_C.multi_tensor_l2norm, noop, [params], True)[1]
        multi_tensor_applier(STAGE1, noop, [grads, params, m, v, updates], decays, step, 0.9,
                             0.999, 1e-6, norm.item(), 5.0)
        update_norms = multi_tensor_applier(amp_C.multi_tensor_l2norm, noop, [updates], True)[1]
        multi_tensor_applier(STAGE2, noop, [params, updates], param_norms, update_norms, 1e-2)
        grad_norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
        for i in range(len(ref)):
            u, m_ref[i], v_ref[i] = stage1_reference(
                grads[i], ref[i], m_ref[i], v_ref[i], decay=float(decays[i]), step=step,
                beta1=0.9, beta2=0.999, eps=1e-6, norm=grad_norm, max_norm=5.0)
            ref[i] = stage2_reference(ref[i], u, float(ref[i].norm()), float(u.norm()), 1e-2)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.double(), r, rtol=1e-5, atol=1e-6)


def test_inf_and_nan_pass_through_and_the_flag_is_left_alone(device):
    """apex's stage kernels propagate inf/NaN (their comment says so) and do not touch the
    noop flag: a caller's overflow check sees the non-finite update."""
    grads = [torch.ones(4, device=device), torch.ones(3, device=device)]
    grads[1][1] = float("nan")
    params = [torch.ones(4, device=device), torch.ones(3, device=device)]
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    updates = [torch.zeros_like(p) for p in params]
    noop = NOOPS["int32"](device)
    STAGE1(65536, noop, [grads, params, m, v, updates], torch.zeros(2, device=device), 0, 0.9,
           0.999, 1e-6, 1.0, 1.0)
    assert torch.isfinite(updates[0]).all() and torch.isnan(updates[1][1])
    assert flag_value(noop) == 0.0
    noop.fill_(1)                    # a set flag does not stop them either
    STAGE2(65536, noop, [params, updates], torch.ones(2, device=device),
           torch.ones(2, device=device), 0.1)
    assert torch.isnan(params[1][1]) and flag_value(noop) == 1.0


def test_leaf_parameters_that_require_grad(device):
    """apex's kernels write the tensors' data whatever autograd says; BertLAMB passes
    ``p.data``, other code the parameters themselves."""
    params = [torch.nn.Parameter(torch.ones(3, device=device))]
    grads, m, v = [torch.ones(3, device=device)], [torch.zeros(3, device=device)], \
        [torch.zeros(3, device=device)]
    updates = [torch.zeros(3, device=device)]
    noop = NOOPS["int32"](device)
    STAGE1(65536, noop, [grads, params, m, v, updates], torch.zeros(1, device=device), 0, 0.9,
           0.999, 1e-6, 1.0, 1.0)
    STAGE2(65536, noop, [params, updates], torch.ones(1, device=device),
           torch.ones(1, device=device), 0.1)
    assert params[0].requires_grad and params[0].grad_fn is None
    assert float(params[0].detach()[0]) < 1.0


def test_empty_lists(device):
    noop = NOOPS["int32"](device)
    STAGE1(65536, noop, [[], [], [], [], []], torch.zeros(0), 0, 0.9, 0.999, 1e-6, 1.0, 1.0)
    STAGE2(65536, noop, [[], []], torch.zeros(0), torch.zeros(0), 0.1)


def _stage1_call(device, decays=None, lists=None, step=0, norm=1.0):
    ps = [torch.zeros(3, device=device), torch.zeros(2, device=device)]
    lists = lists if lists is not None else [ps, ps, [torch.zeros_like(p) for p in ps],
                                              [torch.zeros_like(p) for p in ps],
                                              [torch.zeros_like(p) for p in ps]]
    decays = decays if decays is not None else torch.zeros(2, device=device)
    STAGE1(65536, NOOPS["int32"](device), lists, decays, step, 0.9, 0.999, 1e-6, norm, 1.0)


BAD_CALLS = {
    "four lists": (lambda d: _stage1_call(d, lists=[[torch.zeros(3, device=d)]] * 4),
                   ValueError, "takes the tensor lists [grads, params, exp_avgs, exp_avg_sqs, "
                               "updates], got 4 lists"),
    "a decay short": (lambda d: _stage1_call(d, decays=torch.zeros(1, device=d)), TypeError,
                      "per_tensor_decay must be a real tensor with one entry per tensor of the "
                      "lists (2)"),
    "decays as a list": (lambda d: _stage1_call(d, decays=[0.0, 0.0]), TypeError,
                         "got list"),
    "a negative step": (lambda d: _stage1_call(d, step=-1), ValueError, "step=-1"),
    "a norm of two elements": (lambda d: _stage1_call(d, norm=torch.ones(2, device=d)),
                               TypeError, "global_grad_norm must be a number or a 1-element"),
    "misaligned updates": (lambda d: STAGE2(65536, NOOPS["int32"](d),
                                            [[torch.zeros(3, device=d)], []], torch.ones(1),
                                            torch.ones(1), 0.1),
                           ValueError, "updates has 0 tensors but params has 1"),
    "fp64": (lambda d: STAGE2(65536, NOOPS["int32"](d),
                              [[torch.zeros(3, dtype=torch.float64, device=d)],
                               [torch.zeros(3, device=d)]], torch.ones(1), torch.ones(1), 0.1),
             TypeError, "apex's double-precision path is not provided"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_calls_are_named(device, case):
    call, error, message = BAD_CALLS[case]
    with pytest.raises(error, match=".*".join(map(__import__("re").escape,
                                                  message.split("*")))):
        call(device)


def test_apex_code_finds_them_at_import():
    """What BERT's optimization.py does when imported (its names for them)."""
    import apex_lite.apex_compat.multi_tensor as amp_c_module
    lamb_compute_update = amp_c_module.multi_tensor_lamb_stage1_cuda
    lamb_apply_update = amp_c_module.multi_tensor_lamb_stage2_cuda
    assert {"multi_tensor_lamb_stage1_cuda", "multi_tensor_lamb_stage2_cuda"} <= \
        set(amp_c_module.AMP_C_OPS) <= set(amp_c_module.__all__)
    assert callable(lamb_compute_update) and callable(lamb_apply_update)
