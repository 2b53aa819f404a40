"""O2's masters behave as plain torch parameters on both step paths (issue 40).

Whatever code does to the optimizer's parameters between ``scale_loss`` and ``step()`` (writes or
reads ``.grad``, in any order; hooks the optimizer's step; compiles the step; wraps them in
``nn.Parameter``; passes a closure), the fused step does what the unfused step does, and both do
what fp32 training would. Every test runs on both paths ("fused", "unfused"); the suite runs
with the native kernels and with the Python backend (a pure install: torch's fused kernels carry
the fused step), so each rule holds on both installs.
"""
from __future__ import annotations

import importlib

import pytest
import torch

from apex_lite import amp
from apex_lite.amp.master_grads import LazyGrad, is_lazy

PATHS = {"fused": True, "unfused": False}
_optimizer_hooks = importlib.import_module("torch.optim.optimizer")


def _setup(path, opt_class=torch.optim.SGD, opt_level="O2", **opt_kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    opt = opt_class(model.parameters(), lr=0.1, **opt_kwargs)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, verbosity=0,
                                fused_step=PATHS[path] if opt_level == "O2" else None)
    if opt_level == "O2":
        assert opt._apex_lite_amp.path.fused == PATHS[path]
    return model, opt


def _batch(i=0):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


def _backward(model, opt, i=0):
    x, y = _batch(i)
    loss = torch.nn.functional.mse_loss(model(x).float(), y)
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    return loss


def _masters(opt):
    return [p for group in opt.param_groups for p in group["params"]]


def _values(opt):
    return [p.detach().clone() for p in _masters(opt)]


def _both_paths(run):
    """``run(path)`` on each path; the results, compared bit for bit."""
    results = {}
    for path in PATHS:
        amp.default_handle().__init__()
        results[path] = run(path)
    # The same to fp32 rounding: the fused kernel and torch's optimizer order their fp32
    # operations differently.
    for a, b in zip(results["fused"], results["unfused"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    return results["fused"]


# ---- row 1: writes to a master's .grad, in any order with reads ---------------------------------

@pytest.mark.parametrize("order", ["writes only", "read first", "read between", "read after"])
def test_writes_to_master_grads_are_applied_as_torch_applies_them(order):
    def run(path):
        model, opt = _setup(path)
        masters = _masters(opt)
        before = _values(opt)
        _backward(model, opt)
        if order == "read first":
            masters[3].grad.norm()
        masters[0].grad = None
        if order == "read between":
            masters[3].grad.abs().sum()
        masters[1].grad = torch.zeros_like(masters[1])
        del masters[2].grad
        if order == "read after":
            float(masters[3].grad.norm())
        opt.step()
        after = _values(opt)
        assert [torch.equal(a, b) for a, b in zip(before, after)] == [True, True, True, False]
        return after
    _both_paths(run)


def test_an_in_place_edit_of_a_master_grad_is_applied():
    def run(path):
        model, opt = _setup(path)
        _backward(model, opt)
        masters = _masters(opt)
        true = masters[0].grad.clone()
        masters[0].grad.mul_(0.0)
        masters[1].grad[0] = 5.0
        opt.step()
        return _values(opt) + [true]
    fused = _both_paths(run)
    assert fused[-1].abs().sum() > 0


# ---- row 2: clearing the half model's gradients between scale_loss and step ------------------

@pytest.mark.parametrize("read", [False, True])
def test_a_cleared_half_gradient_is_not_applied_read_or_not(read):
    """``model[0].zero_grad()`` (a submodule: amp's model hook does not see it) after the
    backward: layer 0 is not updated, as in fp32 training, on both paths, read or not."""
    def run(path):
        model, opt = _setup(path, torch.optim.AdamW)
        before = _values(opt)
        _backward(model, opt)
        if read:
            sum(float(p.grad.norm()) for p in _masters(opt))   # a grad-norm logger
        model[0].zero_grad()
        opt.step()
        after = _values(opt)
        assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])
        assert not torch.equal(after[2], before[2])
        return after
    _both_paths(run)


# ---- row 3: torch's optimizer step hooks ----------------------------------------------------

@pytest.mark.parametrize("path", PATHS)
def test_step_hooks_fire_once_per_step_with_torchs_arguments(path):
    model, opt = _setup(path)
    calls = []
    handles = [
        opt.register_step_pre_hook(lambda o, a, k: calls.append(("pre", o, a, k))),
        opt.register_step_post_hook(lambda o, a, k: calls.append(("post", o, a, k))),
        _optimizer_hooks.register_optimizer_step_pre_hook(
            lambda o, a, k: calls.append(("global pre", o, a, k))),
        _optimizer_hooks.register_optimizer_step_post_hook(
            lambda o, a, k: calls.append(("global post", o, a, k))),
    ]
    try:
        for i in range(2):
            opt.zero_grad()
            _backward(model, opt, i)
            opt.step()
    finally:
        for handle in handles:
            handle.remove()
    assert [c[0] for c in calls] == ["global pre", "pre", "post", "global post"] * 2
    assert all(o is opt and a == (opt,) and k == {} for _, o, a, k in calls)


@pytest.mark.parametrize("path", PATHS)
def test_step_hooks_fire_on_a_skipped_step_too(path):
    """Once per step() call on every path: a step skipped on the device (the fused step with
    the decision there) cannot be told from an applied one without a sync."""
    model, opt = _setup(path)
    calls = []
    handle = opt.register_step_post_hook(lambda *a: calls.append(1))
    x, y = _batch()
    with amp.scale_loss(torch.nn.functional.mse_loss(model(x).float(), y), opt) as scaled:
        scaled.backward()
        model[0].weight.grad.view(-1)[0] = float("inf")   # an overflow
    before = _values(opt)
    opt.step()
    handle.remove()
    assert calls == [1]
    assert all(torch.equal(a, b) for a, b in zip(before, _values(opt)))


# ---- row 4: tensors made under inference_mode -----------------------------------------------

def test_a_first_read_under_inference_mode_makes_no_inference_tensor():
    def run(path):
        model, opt = _setup(path)
        masters = _masters(opt)
        for i in range(3):
            opt.zero_grad()
            _backward(model, opt, i)
            if i == 0:
                with torch.inference_mode():   # a logger
                    sum(float(p.grad.norm()) for p in masters)
            torch.nn.utils.clip_grad_norm_(masters, 1.0)
            assert not any(p.grad.is_inference() for p in masters)
            opt.step()
        return _values(opt)
    _both_paths(run)


# ---- row 5: the masters are plain tensors -----------------------------------------------------

@pytest.mark.parametrize("path", PATHS)
def test_masters_are_plain_tensors_that_parameters_can_wrap(path):
    model, opt = _setup(path)
    _backward(model, opt)
    masters = _masters(opt)
    assert all(type(m) is torch.Tensor for m in masters)
    assert type(torch.nn.Parameter(masters[0])) is torch.nn.Parameter
    assert len(torch.nn.ParameterList(amp.master_params(opt))) == 4
    opt.step()


# ---- row 6: torch.compile of the step ---------------------------------------------------------

@pytest.mark.parametrize("path", PATHS)
def test_a_compiled_step_equals_eager(path):
    torch._dynamo.reset()

    def train(step):
        model, opt = _setup(path, torch.optim.Adam)
        for i in range(3):
            opt.zero_grad()
            _backward(model, opt, i)
            step(opt)
        return _values(opt)

    @torch.compile
    def compiled(opt):
        opt.step()

    eager = train(lambda opt: opt.step())
    amp.default_handle().__init__()
    for a, b in zip(train(compiled), eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("path", PATHS)
def test_a_step_that_fails_part_way_can_be_taken_again(path):
    model, opt = _setup(path)
    _backward(model, opt)
    before = _values(opt)

    def fail(*args):
        raise RuntimeError("a hook failed")
    handle = opt.register_step_pre_hook(fail)
    with pytest.raises(RuntimeError, match="a hook failed"):
        opt.step()
    handle.remove()
    assert all(torch.equal(a, b) for a, b in zip(before, _values(opt)))
    opt.step()   # not "step() was called twice"
    assert not torch.equal(before[0], _values(opt)[0])


# ---- gradients after step(), after zero_grad(set_to_none=False), and memory --------------------

def test_grads_after_step_are_the_ones_applied():
    def run(path):
        model, opt = _setup(path)
        _backward(model, opt)
        amp.clip_grad_norm_(opt, 0.05)
        opt.step()
        return [p.grad.clone() for p in _masters(opt)]
    _both_paths(run)


def test_zero_grad_without_set_to_none_shows_zeros():
    def run(path):
        model, opt = _setup(path, torch.optim.SGD, momentum=0.9)
        for i in range(2):
            opt.zero_grad(set_to_none=False)
            grads = [p.grad for p in _masters(opt)]
            assert i == 0 or all(g is not None and not g.any() for g in grads)
            _backward(model, opt, i)
            opt.step()
        opt.zero_grad(set_to_none=False)
        return [p.grad.clone() for p in _masters(opt)] + _values(opt)
    _both_paths(run)


def test_the_fp32_gradient_buffer_goes_back_after_a_step_with_no_read():
    model, opt = _setup("fused", torch.optim.AdamW)
    group = next(iter(opt._apex_lite_amp.groups().values()))
    for i in range(3):
        opt.zero_grad()
        _backward(model, opt, i)
        if i == 0:
            float(_masters(opt)[0].grad.norm())   # one read, at step 0
            assert all(v is not None for v in group.grads.values)
        opt.step()
        assert all((v is not None) == (i == 0) for v in group.grads.values)
    assert all(is_lazy(p.grad) for p in _masters(opt))
    assert "gradients: 4 torch.bfloat16 tensors" in str(amp.report())
    assert "torch.float32 tensors" not in str(amp.report()).split("gradients:")[1].split("\n")[0]


def test_a_read_is_a_plain_attribute_read():
    model, opt = _setup("fused")
    _backward(model, opt)
    master = _masters(opt)[0]
    assert type(master.grad) is LazyGrad and is_lazy(master.grad)
    # Metadata reads make nothing.
    assert master.grad.shape == master.shape and master.grad.dtype == torch.float32
    assert is_lazy(master.grad)
    # torch's foreach utilities keep one fused call over a list of them.
    assert torch.utils._foreach_utils._has_foreach_support(
        [p.grad for p in _masters(opt)], master.device)


# ---- row 7: step(closure) --------------------------------------------------------------------

def _closure(model, opt, i=0):
    def closure():
        opt.zero_grad()
        return _backward(model, opt, i)
    return closure


def _lbfgs_evaluations(opt_level):
    """The losses of every closure evaluation of 3 LBFGS steps (5 iterations each), in fp32
    (``opt_level`` None) or under amp."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=5)
    if opt_level:
        model, opt = amp.initialize(model, opt, opt_level=opt_level, verbosity=0)
    x, y = _batch()
    losses = []

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        if opt_level:
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
        else:
            loss.backward()
        losses.append(float(loss.detach()))
        return loss
    for _ in range(3):
        opt.step(closure)
    return torch.tensor(losses)


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
def test_lbfgs_steps_with_a_closure_that_runs_scale_loss(opt_level):
    """Each of LBFGS's evaluations within a step sees the weights it moved (at O2 the masters,
    rounded into the model first): the same evaluations as fp32 training, to half precision."""
    fp32 = _lbfgs_evaluations(None)
    amp.default_handle().__init__()
    evaluations = _lbfgs_evaluations(opt_level)
    assert len(evaluations) == len(fp32) == 15
    tolerance = 0.0 if opt_level == "O0" else 0.1
    torch.testing.assert_close(evaluations, fp32, rtol=tolerance, atol=tolerance * 1e-2)


@pytest.mark.parametrize("path", PATHS)
def test_a_closure_step_equals_the_step_without_one(path):
    model, opt = _setup(path, torch.optim.SGD, momentum=0.9)
    for i in range(3):
        loss = opt.step(_closure(model, opt, i))
        assert isinstance(loss, torch.Tensor)
    with_closure = _values(opt)
    amp.default_handle().__init__()
    model, opt = _setup(path, torch.optim.SGD, momentum=0.9)
    for i in range(3):
        opt.zero_grad()
        _backward(model, opt, i)
        opt.step()
    for a, b in zip(with_closure, _values(opt)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_closure_whose_backward_is_outside_scale_loss_is_refused():
    model, opt = _setup("unfused", opt_level="O1")

    def closure():
        opt.zero_grad()
        x, y = _batch()
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        return loss
    before = _values(opt)
    with pytest.raises(RuntimeError, match=r"step\(closure\): .*inside `with amp.scale_loss"):
        opt.step(closure)
    assert all(torch.equal(a, b) for a, b in zip(before, _values(opt)))
