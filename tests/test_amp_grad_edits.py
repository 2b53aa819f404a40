"""Where an O2 step's gradients live after scale_loss, and which edits of them step() applies.

Issue 30: at O2 the model's half ``.grad`` still holds the gradients multiplied by the loss scale
after ``scale_loss`` (the true ones are the masters'). An edit of them between the block and
``step()`` (``clip_grad_norm_`` / ``clip_grad_value_`` on ``model.parameters()``, in-place
arithmetic, a replaced ``.grad``) would be applied as a clip of the scaled values (the fused step)
or ignored (the unfused step): ``step()`` refuses it, naming the parameter and the fix, and
changes nothing. amp's own accumulation across blocks does not count; O1 and O3 are unchanged.

Issue 32: every parameter of an optimizer given to ``scale_loss`` holds its unscaled fp32
gradient after the block, on both step paths, through ``param_groups``, the keys of
``optimizer.state`` and ``amp.master_params``; edits made there are what ``step()`` applies.
Parameters that are both the model's and the optimizer's (modules kept in fp32) hold their true
gradient, and edits to them are applied.

Every test runs on the fused and the unfused step (and, as the whole suite, on both backends:
the fused step is forced where the Python backend serves)."""
from __future__ import annotations

import math

import pytest
import torch

from amp_helpers import assert_bitwise_equal, snapshot
from apex_lite import amp
from apex_lite.amp.master_grads import is_lazy

PATHS = pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
_RAW_GRAD = torch._C.TensorBase.grad   # a .grad read that no Python property intercepts


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _bn_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                               torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _batch(i):
    g = torch.Generator().manual_seed(300 + i)
    return torch.randn(16, 8, generator=g), 4.0 * torch.randn(16, 4, generator=g)


def _loss(model, i=0):
    x, y = _batch(i)
    return torch.nn.functional.mse_loss(model(x).float(), y)


def _setup(fused, make_model=_mlp, opt_level="O2", momentum=0.0, **kwargs):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    kwargs.setdefault("verbosity", 0)
    if opt_level == "O2":
        kwargs["fused_step"] = fused
    model, opt = amp.initialize(model, opt, opt_level=opt_level, **kwargs)
    if opt_level == "O2":
        assert opt._apex_lite_amp.path.fused == fused
    return model, opt


def _backward(model, opt, i=0, **kwargs):
    with amp.scale_loss(_loss(model, i), opt, **kwargs) as scaled:
        scaled.backward()


def _params(opt):
    return [p for group in opt.param_groups for p in group["params"]]


def _fresh_handle():
    amp.default_handle().__init__()


def _scaler_state():
    """amp.state_dict() without the master weights (compared by snapshot())."""
    state = amp.state_dict()
    return {key: ({k: v for k, v in value.items() if k != "master_weights"}
                  if isinstance(value, dict) else value) for key, value in state.items()}


# ---- issue 30: edits of the model's half gradients ----------------------------------------------

def _first_weight(model):
    return model[0].weight


EDITS = {
    "clip_grad_norm_": lambda model: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0),
    "clip_grad_value_": lambda model: torch.nn.utils.clip_grad_value_(model.parameters(), 0.5),
    "in-place": lambda model: _first_weight(model).grad.mul_(0.5),
    "in-place-bias": lambda model: model[2].bias.grad.add_(1.0),
    "replaced": lambda model: setattr(_first_weight(model), "grad",
                                      _first_weight(model).grad.clone()),
}


@PATHS
@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edit_of_the_model_half_gradients_is_refused_and_changes_nothing(fused, edit):
    model, opt = _setup(fused, momentum=0.9)
    _backward(model, opt, 0)
    opt.step()                               # state to keep unchanged (momentum buffers)
    opt.zero_grad()
    _backward(model, opt, 1)
    EDITS[edit](model)
    before, amp_before = snapshot(model, opt), _scaler_state()
    with pytest.raises(RuntimeError) as info:
        opt.step()
    message = str(info.value)
    name = "2.bias" if edit == "in-place-bias" else "0.weight"
    assert repr(name) in message
    assert "amp.clip_grad_norm_(optimizer, max_norm)" in message
    assert "amp.master_params(optimizer)" in message
    assert_bitwise_equal(before, snapshot(model, opt))
    assert _scaler_state() == amp_before
    # Training goes on after the refusal: a fresh backward steps as usual.
    opt.zero_grad()
    _backward(model, opt, 2)
    opt.step()


@PATHS
def test_an_edit_between_two_accumulated_blocks_is_refused_before_the_next_backward(fused):
    model, opt = _setup(fused)
    _backward(model, opt, 0)
    _first_weight(model).grad.mul_(0.5)
    before = snapshot(model, opt)
    grads = [_RAW_GRAD.__get__(p).clone() for p in _params(opt)
             if _RAW_GRAD.__get__(p) is not None]
    with pytest.raises(RuntimeError, match=r"'0\.weight'.*amp\.clip_grad_norm_"):
        _backward(model, opt, 1)
    assert_bitwise_equal(before, snapshot(model, opt))
    after = [_RAW_GRAD.__get__(p) for p in _params(opt) if _RAW_GRAD.__get__(p) is not None]
    assert len(after) == len(grads) and all(torch.equal(a, b) for a, b in zip(grads, after))


@PATHS
@pytest.mark.parametrize("how", ["two blocks", "delay_unscale", "model.zero_grad between steps"])
def test_amp_own_accumulation_and_clearing_are_not_edits(fused, how):
    model, opt = _setup(fused)
    for step in range(2):
        if how == "model.zero_grad between steps":
            model.zero_grad(set_to_none=False)
        else:
            opt.zero_grad()
        _backward(model, opt, 2 * step, delay_unscale=how == "delay_unscale")
        if how != "model.zero_grad between steps":
            _backward(model, opt, 2 * step + 1)
        opt.step()


@PATHS
def test_zero_grad_after_the_block_is_a_no_op_step_not_an_edit(fused):
    model, opt = _setup(fused)
    _backward(model, opt)
    opt.zero_grad(set_to_none=False)
    before = snapshot(model, opt)
    opt.step()                               # zeros: SGD without momentum moves nothing
    assert_bitwise_equal(before, snapshot(model, opt))


def _true_grads(model, opt):
    """The true gradients of one backward of ``_loss(model, 0)``, read on the unfused path."""
    _backward(model, opt)
    return [p.grad.clone() for p in _params(opt)]


def _update_norm(before, after, lr=0.1):
    return math.sqrt(sum(((b - a) ** 2).sum().item() for a, b in zip(after, before))) / lr


@PATHS
@pytest.mark.parametrize("how", ["amp.clip_grad_norm_", "master_params", "param_groups"])
def test_documented_ways_clip_the_true_gradients(fused, how):
    ref_model, ref_opt = _setup(False)
    true = _true_grads(ref_model, ref_opt)
    norm = math.sqrt(sum((g.double() ** 2).sum().item() for g in true))
    assert norm > 2.0                        # the clip below changes the step
    _fresh_handle()
    model, opt = _setup(fused)
    masters = [p.detach().clone() for p in opt._apex_lite_amp.masters()]
    _backward(model, opt)
    if how == "amp.clip_grad_norm_":
        returned = amp.clip_grad_norm_(opt, 1.0)
    elif how == "master_params":
        returned = torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 1.0)
    else:
        returned = torch.nn.utils.clip_grad_norm_(
            [p for g in opt.param_groups for p in g["params"] if p.grad is not None], 1.0)
    torch.testing.assert_close(returned.double().item(), norm, rtol=1e-5, atol=0)
    opt.step()
    coef = 1.0 / (norm + 1e-6)
    for before, after, g in zip(masters, opt._apex_lite_amp.masters(), true):
        torch.testing.assert_close(after, before - 0.1 * coef * g, rtol=1e-5, atol=1e-7)
    assert abs(_update_norm(masters, list(opt._apex_lite_amp.masters())) - 1.0) < 1e-4


@PATHS
def test_no_edit_steps_the_same_on_both_paths(fused):
    model, opt = _setup(fused)
    masters = [p.detach().clone() for p in opt._apex_lite_amp.masters()]
    _backward(model, opt)
    opt.step()
    after = [p.detach().clone() for p in opt._apex_lite_amp.masters()]
    _fresh_handle()
    model, opt = _setup(not fused)
    _backward(model, opt)
    opt.step()
    for a, b in zip(after, opt._apex_lite_amp.masters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    assert _update_norm(masters, after) > 0


@pytest.mark.parametrize("clip", ["norm", "value"])
def test_o1_clip_on_model_parameters_matches_torch(clip):
    def clip_(params):
        if clip == "norm":
            return torch.nn.utils.clip_grad_norm_(params, 1.0)
        return torch.nn.utils.clip_grad_value_(params, 0.05)

    reference = _mlp()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for i in range(3):
        ref_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = reference(_batch(i)[0])
        torch.nn.functional.mse_loss(out.float(), _batch(i)[1]).backward()
        clip_(list(reference.parameters()))
        ref_opt.step()
    model, opt = _setup(None, opt_level="O1", half_dtype=torch.bfloat16)
    for i in range(3):
        opt.zero_grad()
        _backward(model, opt, i)
        clip_(list(model.parameters()))
        opt.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_o3_clip_on_model_parameters_is_applied():
    model, opt = _setup(None, opt_level="O3", half_dtype=torch.bfloat16)
    before = [p.detach().float().clone() for p in model.parameters()]
    _backward(model, opt)
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert total > 2.0
    opt.step()
    assert abs(_update_norm(before, [p.detach().float() for p in model.parameters()]) - 1.0) < 2e-2


# ---- issue 32: the optimizer's parameters hold the true gradients ------------------------------

def _grads_after_block(fused, make_model, how="param_groups"):
    model, opt = _setup(fused, make_model, momentum=0.9)   # state entries to key on
    _backward(model, opt)
    if how == "param_groups":
        params = _params(opt)
    elif how == "state":
        opt.step()                           # state keys exist after a first step
        opt.zero_grad()
        _backward(model, opt, 1)
        order = {id(p): i for i, p in enumerate(_params(opt))}   # the paths fill it in
        params = sorted(opt.state.keys(), key=lambda p: order[id(p)])  # different orders
    else:
        params = list(amp.master_params(opt))
    return [None if p.grad is None else p.grad.clone() for p in params], model, opt


@pytest.mark.parametrize("how", ["param_groups", "state", "master_params"])
@pytest.mark.parametrize("make_model", [_mlp, _bn_net], ids=["mlp", "batchnorm"])
def test_every_optimizer_parameter_holds_its_unscaled_fp32_gradient(make_model, how):
    unfused, _, plain_opt = _grads_after_block(False, make_model, how)
    assert all(g is not None and g.dtype == torch.float32 for g in unfused)
    _fresh_handle()
    fused, model, opt = _grads_after_block(True, make_model, how)
    assert len(fused) == len(unfused)
    for a, b in zip(fused, unfused):
        assert a is not None and a.dtype == torch.float32
        assert torch.equal(a, b)
    # And they are the unscaled ones: a scale of 65536 would put them far above these.
    assert max(g.abs().max().item() for g in fused) < 1e3


@PATHS
def test_kept_fp32_parameters_never_keep_scaled_gradients(fused):
    model, opt = _setup(fused, _bn_net)
    _backward(model, opt)
    bn = model[1]
    assert bn.weight.dtype == torch.float32
    raw = _RAW_GRAD.__get__(bn.weight)       # not through any property: what is stored
    assert raw is not None and raw.abs().max().item() < 1e3
    _fresh_handle()
    ref_model, ref_opt = _setup(False, _bn_net)
    _backward(ref_model, ref_opt)
    assert torch.equal(raw, ref_model[1].weight.grad)


def _mmengine_clip(optimizer, max_norm):
    """What mmengine's OptimWrapper does to clip (``clip_grad=dict(max_norm=...)``): the params
    of every param group that require a gradient and have one, torch's clip, the norm logged as
    a float."""
    params = []
    for param_group in optimizer.param_groups:
        params.extend(param_group["params"])
    params = list(filter(lambda p: p.requires_grad and p.grad is not None, params))
    if len(params) > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm)
        return float(grad_norm)
    return None


def _larc_edit(optimizer, trust_coefficient=0.02, clip=True, eps=1e-8):
    """The gradient edit of apex.parallel.LARC before its inner step: a per-parameter adaptive
    rate from the parameter's and the gradient's norms, written into ``p.grad.data`` (weight
    decay absorbed into the gradient)."""
    with torch.no_grad():
        saved = []
        for group in optimizer.param_groups:
            weight_decay = group.get("weight_decay", 0)
            saved.append(weight_decay)
            group["weight_decay"] = 0
            for p in group["params"]:
                if p.grad is None:
                    continue
                param_norm = torch.norm(p.data)
                grad_norm = torch.norm(p.grad.data)
                if param_norm != 0 and grad_norm != 0:
                    rate = trust_coefficient * param_norm / (
                        grad_norm + param_norm * weight_decay + eps)
                    if clip:
                        rate = min(rate / group["lr"], 1)
                    p.grad.data += weight_decay * p.data
                    p.grad.data *= rate
    return saved


def _restore_weight_decay(optimizer, saved):
    for group, weight_decay in zip(optimizer.param_groups, saved):
        group["weight_decay"] = weight_decay


def _train_with(fused, make_model, edit, steps=3, two_groups=False):
    model = make_model()
    if two_groups:   # the masters of the half layers and the kept fp32 parameters apart
        bn = list(model[1].parameters())
        rest = [p for p in model.parameters() if all(p is not q for q in bn)]
        opt = torch.optim.SGD([{"params": rest}, {"params": bn, "lr": 0.05}], lr=0.1,
                              momentum=0.9, weight_decay=1e-3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O2", fused_step=fused, verbosity=0)
    logged = []
    for i in range(steps):
        opt.zero_grad()
        _backward(model, opt, i)
        logged.append(edit(opt))
        opt.step()
        if edit is _larc_edit:
            _restore_weight_decay(opt, logged[-1])
    return [p.detach().clone() for p in opt._apex_lite_amp.masters()], logged


def _grad_norm_logged(optimizer):
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


EDITS_32 = {
    "mmengine clip": lambda opt: _mmengine_clip(opt, 1.0),
    "apex LARC": _larc_edit,
    "grad norm logged": lambda opt: _grad_norm_logged(opt).item(),
    "in-place on a master": lambda opt: opt.param_groups[0]["params"][0].grad.mul_(0.25),
}


@pytest.mark.parametrize("two_groups", [False, True], ids=["one group", "two groups"])
@pytest.mark.parametrize("make_model", [_mlp, _bn_net], ids=["mlp", "batchnorm"])
@pytest.mark.parametrize("edit", list(EDITS_32))
def test_code_that_drives_apex_through_param_groups_trains_alike_on_both_paths(edit, make_model,
                                                                               two_groups):
    if two_groups and make_model is _mlp:
        pytest.skip("two groups: the half masters and the BatchNorm's fp32 parameters")
    unfused, unfused_log = _train_with(False, make_model, EDITS_32[edit], two_groups=two_groups)
    _fresh_handle()
    fused, fused_log = _train_with(True, make_model, EDITS_32[edit], two_groups=two_groups)
    for a, b in zip(fused, unfused):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if edit in ("mmengine clip", "grad norm logged"):
        for a, b in zip(fused_log, unfused_log):
            assert a < 1e3                   # the true norm, not one multiplied by the scale
            assert a == pytest.approx(b, rel=1e-5)
    # The edits changed the training: it differs from a run without them.
    _fresh_handle()
    plain, _ = _train_with(True, make_model, lambda opt: None, two_groups=two_groups)
    if edit != "grad norm logged":
        assert any(not torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(fused, plain))
    else:
        for a, b in zip(fused, plain):
            assert torch.equal(a, b)


@PATHS
def test_clip_of_model_parameters_with_kept_fp32_modules_is_refused_for_the_half_ones(fused):
    """clip_grad_norm_(model.parameters()) edits the half gradients too: refused, whole."""
    model, opt = _setup(fused, _bn_net)
    _backward(model, opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    before = snapshot(model, opt)
    with pytest.raises(RuntimeError, match=r"'0\.weight'"):
        opt.step()
    assert_bitwise_equal(before, snapshot(model, opt))


@PATHS
def test_an_edit_of_a_kept_fp32_parameter_is_applied(fused):
    """A parameter kept in fp32 is the model's and the optimizer's: its .grad is the true one,
    and an edit of it is what the step applies."""
    def run(fused, scale):
        model, opt = _setup(fused, _bn_net)
        before = model[1].weight.detach().clone()
        _backward(model, opt)
        model[1].weight.grad.mul_(scale)
        grad = model[1].weight.grad.clone()
        opt.step()
        return before - model[1].weight.detach(), grad

    update, grad = run(fused, 0.5)
    torch.testing.assert_close(update, 0.1 * grad, rtol=1e-6, atol=1e-7)
    _fresh_handle()
    other, _ = run(not fused, 0.5)
    torch.testing.assert_close(update, other, rtol=1e-6, atol=1e-9)


def test_unused_gradients_are_not_materialised_on_the_fused_step():
    """Where nothing uses the optimizer's gradients the fused step holds no fp32 master
    gradient (its memory advantage): each master's .grad is a lazy one, which holds no
    memory; the first use of one makes them, once, for every master."""
    model, opt = _setup(True, _bn_net)
    amp_opt = opt._apex_lite_amp
    _backward(model, opt)
    half_masters = [m for m in amp_opt.masters() if amp.default_handle()._run.pairs.is_master(m)]
    assert half_masters and all(is_lazy(m.grad) for m in half_masters)
    opt.step()
    assert all(is_lazy(m.grad) for m in half_masters)
    opt.zero_grad()
    _backward(model, opt, 1)
    assert half_masters[-1].grad is not None     # a read is only a read
    assert all(is_lazy(m.grad) for m in half_masters)
    half_masters[-1].grad.norm()                 # one use makes them all
    assert not any(is_lazy(m.grad) or m.grad is None for m in half_masters)


# ---- the watch itself, on both backends ---------------------------------------------------------

def _watches():
    from apex_lite.multi_tensor import _python
    from apex_lite.multi_tensor._backend import ops_for
    watches = {"python": _python.watch_grads}
    native = ops_for(torch.device("cpu"))
    if native is not _python:
        watches["native"] = native.watch_grads
    return watches


@pytest.mark.parametrize("edit, changed", [
    ("nothing", -1), ("in-place", 1), ("view in-place", 2), ("replaced", 0),
    ("set to None", -1), ("cleared", -1), ("not recorded", -1)])
def test_the_watch_sees_in_place_edits_and_new_tensors_alike_on_both_backends(edit, changed):
    for backend, make in _watches().items():
        params = [torch.zeros(3, requires_grad=True) for _ in range(3)]
        for p in params:
            p.grad = torch.ones(3)
        watch = make(params)
        if edit != "not recorded":
            watch.record()
        if edit == "in-place":
            params[1].grad.mul_(0.5)
        elif edit == "view in-place":
            params[2].grad[1:].zero_()
        elif edit == "replaced":
            params[0].grad = params[0].grad.clone()
        elif edit == "set to None":
            params[1].grad = None
        elif edit == "cleared":
            params[1].grad.mul_(2.0)
            watch.clear()
        assert watch.changed() == changed, backend
