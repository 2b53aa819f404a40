"""O2's fused step through torch's own fused optimizer kernels (issue 29): the route without
native kernels (``apex_lite/multi_tensor/_torch_fused.py``).

The ops against the Python reference (``_python``, the native kernels' contract) to fp32
rounding, on random data, across chunk boundaries (the chunk made small), on non-contiguous and
empty tensors, through the list path and the held lists; a set ``found_inf`` (inf and NaN in
the gradients at the first, a middle and the last element) writes nothing; what torch's kernels
do not compute goes to the reference bit for bit; the fp32 temporary stays one chunk. Then amp:
the default O2 step without native kernels takes this route, holds no fp32 master gradients,
trains as the unfused step and as the native kernels do, and a skipped step changes nothing.
The amp tests force the Python backend, so that both CI runs (native and Python) cover the
route; every other step-path rule is tested on it by the suite's Python-backend run."""
from __future__ import annotations

import copy
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from amp_helpers import assert_bitwise_equal, snapshot
from apex_lite import amp
from apex_lite.amp.master_grads import is_lazy
from apex_lite.multi_tensor import _backend, _python, _torch_fused
from apex_lite.optimizers import FusedAdagrad, FusedAdam, FusedSGD

HALVES = [torch.bfloat16, torch.float16]


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(_torch_fused, "CHUNK_ELEMENTS", 1000)


def _shapes():
    """Sizes around the 1000-element chunk, an empty and a 0-dim tensor, and two laid out
    otherwise (transposed, channels_last): (shape, make non-contiguous)."""
    return [((0,), None), ((), None), ((7,), None), ((999,), None), ((1000,), None),
            ((1001,), None), ((2500,), None), ((40, 30), "t"), ((2, 3, 11, 13), "cl")]


def _tensor(shape, layout, dtype, generator, scale=1.0):
    if layout == "t":
        t = (torch.randn(shape[::-1], generator=generator) * scale).t()
    else:
        t = torch.randn(shape, generator=generator) * scale
        if layout == "cl":
            t = t.contiguous(memory_format=torch.channels_last)
    return t.to(dtype)


def _lists(grad_dtype, seed=0, scale=1024.0):
    g = torch.Generator().manual_seed(seed)
    shapes = _shapes()
    masters = [_tensor(s, l, torch.float32, g) for s, l in shapes]
    grads = [_tensor(s, l, grad_dtype, g, scale) for s, l in shapes]
    exp_avgs = [torch.zeros_like(m) for m in masters]
    exp_avg_sqs = [torch.zeros_like(m) for m in masters]
    steps = [torch.zeros((), dtype=torch.float32) for _ in masters]
    models = [m.to(grad_dtype) for m in masters] if grad_dtype != torch.float32 else []
    return dict(params=masters, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs,
                model_params=models, steps=steps)


def _clone(lists):
    return {k: [t.clone() for t in v] for k, v in lists.items()}


def _adam(ops, lists, inv, found, hyper):
    ops.fused_adam_(lists["params"], lists["grads"], lists["exp_avgs"], lists["exp_avg_sqs"],
                    lists["model_params"], lists["steps"], inv, found, *hyper)


def _assert_updated_alike(ours, ref, names=("params", "exp_avgs", "exp_avg_sqs")):
    for name in names:
        for a, b in zip(ours[name], ref[name]):
            torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7, msg=name)
    for a, b in zip(ours["steps"], ref["steps"]):
        assert torch.equal(a, b)
    # The model parameters are the masters rounded once, bit for bit.
    for model, master in zip(ours["model_params"], ours["params"]):
        assert torch.equal(model, master.to(model.dtype))


ADAM = {"adamw": (1e-3, 0.9, 0.999, 1e-8, 0.01, True, True),
        "adam-l2": (1e-2, 0.8, 0.99, 1e-6, 0.1, False, True)}


@pytest.mark.parametrize("grad_dtype", HALVES + [torch.float32])
@pytest.mark.parametrize("flavour", sorted(ADAM))
def test_adam_matches_the_reference_across_chunks(small_chunks, grad_dtype, flavour):
    ours = _lists(grad_dtype)
    ref = _clone(ours)
    inv = torch.tensor([1 / 1024.0])
    for _ in range(3):
        _adam(_torch_fused, ours, inv, torch.zeros(1), ADAM[flavour])
        _adam(_python, ref, inv, torch.zeros(1), ADAM[flavour])
    _assert_updated_alike(ours, ref)
    assert all(float(s) == 3.0 for s in ours["steps"])


@pytest.mark.parametrize("grad_dtype", HALVES)
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_a_set_found_inf_writes_nothing(small_chunks, grad_dtype, where, value):
    """The op does not look for inf/NaN itself (amp's check sets found_inf): with it set nothing
    is written, whatever the gradients hold, in the list path and the held lists alike."""
    lists = _lists(grad_dtype)
    _adam(_torch_fused, lists, torch.tensor([1 / 1024.0]), torch.zeros(1), ADAM["adamw"])
    grads = [g for g in lists["grads"] if g.numel() > 1000]   # ones that span chunks
    target = grads[0] if where == "first" else grads[len(grads) // 2] if where == "middle" \
        else grads[-1]
    index = {"first": 0, "middle": target.numel() // 2, "last": target.numel() - 1}[where]
    target[torch.unravel_index(torch.tensor(index), target.shape)] = value
    before = _clone(lists)
    _adam(_torch_fused, lists, torch.tensor([1 / 1024.0]), torch.ones(1), ADAM["adamw"])
    held = _torch_fused.hold_lists(lists["params"], [_Source(g) for g in lists["grads"]],
                                   lists["model_params"],
                                   [lists["exp_avgs"], lists["exp_avg_sqs"], lists["steps"]])
    assert held.fused_adam_(torch.tensor([1 / 1024.0]), torch.ones(1), *ADAM["adamw"])
    for name in ("params", "exp_avgs", "exp_avg_sqs", "model_params", "steps"):
        for a, b in zip(lists[name], before[name]):
            assert torch.equal(a, b), name


class _Source:
    """A stand-in for a half model parameter: what the held lists read ``.grad`` from."""

    def __init__(self, grad):
        self.grad = grad


@pytest.mark.parametrize("grad_dtype", HALVES)
def test_held_lists_step_as_the_list_path_bit_for_bit(small_chunks, grad_dtype):
    listed, held_lists = _lists(grad_dtype), _lists(grad_dtype)
    sources = [_Source(g) for g in held_lists["grads"]]
    held = _torch_fused.hold_lists(held_lists["params"], sources, held_lists["model_params"],
                                   [held_lists["exp_avgs"], held_lists["exp_avg_sqs"],
                                    held_lists["steps"]])
    for i in range(3):
        found = torch.ones(1) if i == 1 else torch.zeros(1)
        inv = torch.tensor([1 / 512.0])
        _adam(_torch_fused, listed, inv, found, ADAM["adam-l2"])
        assert held.fused_adam_(inv, found, *ADAM["adam-l2"])
    for name in listed:
        for a, b in zip(listed[name], held_lists[name]):
            assert torch.equal(a, b), name
    sources[3].grad = None      # a missing gradient: the list path's business
    assert held.fused_adam_(torch.ones(1), torch.zeros(1), *ADAM["adamw"]) is False
    sources[3].grad = held_lists["grads"][3].float()     # mixed dtypes: likewise
    assert held.fused_adam_(torch.ones(1), torch.zeros(1), *ADAM["adamw"]) is False


SGD = {"plain": (0.1, 0.0, 0.0, 0.0, False, False),
       "momentum-wd": (0.1, 0.9, 0.0, 0.01, False, False),
       "nesterov": (0.05, 0.9, 0.0, 0.01, True, False),
       "dampening": (0.1, 0.5, 0.3, 0.0, False, False)}


@pytest.mark.parametrize("grad_dtype", HALVES + [torch.float32])
@pytest.mark.parametrize("flavour", sorted(SGD))
def test_sgd_matches_the_reference_across_chunks(small_chunks, grad_dtype, flavour):
    ours = _lists(grad_dtype)
    hyper = SGD[flavour]
    if hyper[1] == 0.0:
        ours["exp_avgs"] = []
    ref = _clone(ours)
    inv = torch.tensor([1 / 1024.0])
    for i in range(3):
        first = i == 0 and hyper[1] != 0.0
        for ops, lists in ((_torch_fused, ours), (_python, ref)):
            ops.fused_sgd_(lists["params"], lists["grads"], lists["exp_avgs"],
                           lists["model_params"], inv, torch.zeros(1), *hyper, first)
    _assert_updated_alike(ours, ref, names=("params", "exp_avgs"))


ADAGRAD = {"plain": (0.1, 1e-10, 0.0, False), "l2": (0.05, 1e-6, 0.1, False)}


@pytest.mark.parametrize("grad_dtype", HALVES + [torch.float32])
@pytest.mark.parametrize("flavour", sorted(ADAGRAD))
def test_adagrad_matches_the_reference_across_chunks(small_chunks, grad_dtype, flavour):
    ours = _lists(grad_dtype)
    ref = _clone(ours)
    inv = torch.tensor([1 / 1024.0])
    for i in range(3):
        found = torch.ones(1) if i == 1 else torch.zeros(1)
        for ops, lists in ((_torch_fused, ours), (_python, ref)):
            ops.fused_adagrad_(lists["params"], lists["grads"], lists["exp_avgs"],
                               lists["model_params"], lists["steps"], inv, found,
                               *ADAGRAD[flavour])
    _assert_updated_alike(ours, ref, names=("params", "exp_avgs"))
    assert all(float(s) == 2.0 for s in ours["steps"])


def test_state_laid_out_unlike_its_parameter_is_paired_element_for_element(small_chunks):
    """torch's kernels walk each tensor's memory in order: a parameter, gradient and state of
    different layouts (a contiguous state loaded for a transposed parameter, a parameter with
    gaps) would pair the wrong elements. Such tensors are staged; the step is the reference's."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(50, 30, generator=g)
    gapped = torch.randn(40, 64, generator=g)[:, ::2]          # not dense
    params = [base.t().contiguous().t(), gapped, torch.randn(1200, generator=g)]
    ours = dict(params=params,
                grads=[torch.randn(p.shape, generator=g).bfloat16() for p in params],
                exp_avgs=[torch.randn(p.shape, generator=g).abs() * 0.1 for p in params],
                exp_avg_sqs=[torch.randn(p.shape, generator=g).abs() * 0.1 for p in params],
                model_params=[p.bfloat16() for p in params],
                steps=[torch.full((), 4.0) for _ in params])
    assert not ours["params"][0].is_contiguous() and ours["exp_avgs"][0].is_contiguous()
    ref = _clone(ours)
    for i in range(2):
        found = torch.ones(1) if i == 1 else torch.zeros(1)
        _adam(_torch_fused, ours, torch.tensor([0.25]), found, ADAM["adamw"])
        _adam(_python, ref, torch.tensor([0.25]), found, ADAM["adamw"])
    _assert_updated_alike(ours, ref)


def test_what_torch_does_not_compute_is_the_reference_bit_for_bit():
    """Adam without bias correction and SGD's weight decay after the momentum (apex's options)
    go to the Python reference, per call."""
    ours = _lists(torch.bfloat16)
    ref = _clone(ours)
    hyper = (1e-3, 0.9, 0.999, 1e-8, 0.01, True, False)
    inv = torch.tensor([1 / 1024.0])
    _adam(_torch_fused, ours, inv, torch.zeros(1), hyper)
    _adam(_python, ref, inv, torch.zeros(1), hyper)
    sgd = (0.1, 0.9, 0.0, 0.01, False, True)
    for ops, lists in ((_torch_fused, ours), (_python, ref)):
        ops.fused_sgd_(lists["params"], lists["grads"], lists["exp_avgs"], lists["model_params"],
                       inv, torch.zeros(1), *sgd, False)
    adagrad = (0.1, 1e-10, 0.01, True)
    for ops, lists in ((_torch_fused, ours), (_python, ref)):
        ops.fused_adagrad_(lists["params"], lists["grads"], lists["exp_avg_sqs"],
                           lists["model_params"], lists["steps"], inv, torch.zeros(1), *adagrad)
    for name in ours:
        for a, b in zip(ours[name], ref[name]):
            assert torch.equal(a, b), name


def test_chunks_cover_every_element_once_within_the_limit():
    rng = random.Random(0)
    for _ in range(200):
        limit = rng.randint(1, 50)
        sizes = [rng.choice([0, 1, rng.randint(1, 120)]) for _ in range(rng.randint(1, 12))]
        odd = {i for i in range(len(sizes)) if rng.random() < 0.2 and sizes[i] > 1}
        tensors = [torch.empty(n, 2).t() if i in odd else torch.empty(n)
                   for i, n in enumerate(sizes)]
        chunks = _torch_fused._pieces([tensors], limit)
        covered = []
        for chunk in chunks:
            total = sum(tensors[i].numel() if part is None else part.stop - part.start
                        for i, part in chunk)
            assert total <= limit or (len(chunk) == 1 and chunk[0][1] is None
                                      and chunk[0][0] in odd | {i for i, n in enumerate(sizes)
                                                                 if n * (2 if i in odd else 1)
                                                                 > limit}), (chunk, limit)
            for i, part in chunk:
                n = tensors[i].numel()
                covered.extend((i, k) for k in (range(n) if part is None else
                                                range(part.start, part.stop)))
        assert covered == [(i, k) for i, t in enumerate(tensors) for k in range(t.numel())]


class _Allocations(TorchDispatchMode):
    """The element counts of every tensor allocated in the block."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.empty, torch.ops.aten.empty_strided,
                                   torch.ops.aten.empty_like, torch.ops.aten._to_copy):
            self.sizes.append(out.numel())
        return out


def test_the_fp32_temporary_is_one_chunk(monkeypatch):
    monkeypatch.setattr(_torch_fused, "CHUNK_ELEMENTS", 5000)
    g = torch.Generator().manual_seed(0)
    masters = [torch.randn(n, generator=g) for n in (3000, 12000, 700, 9000)]
    lists = dict(params=masters, grads=[torch.randn(m.shape, generator=g).bfloat16()
                                        for m in masters],
                 exp_avgs=[torch.zeros_like(m) for m in masters],
                 exp_avg_sqs=[torch.zeros_like(m) for m in masters],
                 model_params=[m.bfloat16() for m in masters],
                 steps=[torch.zeros(()) for _ in masters])
    with _Allocations() as allocations:
        _adam(_torch_fused, lists, torch.tensor([0.5]), torch.zeros(1), ADAM["adamw"])
    assert max(allocations.sizes) == 5000     # one chunk of fp32 gradients, never all 24700


# ---- amp's O2 step on this route ---------------------------------------------------------------

OPTIMIZERS = {
    "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1),
    "Adam": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=1e-2),
    "SGD-nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True,
                                              weight_decay=1e-2),
    "SGD-dampening": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.5, dampening=0.3),
    "FusedAdam": lambda p: FusedAdam(p, lr=1e-2, weight_decay=1e-2),
    "FusedSGD": lambda p: FusedSGD(p, lr=0.05, momentum=0.9),
    "FusedAdagrad": lambda p: FusedAdagrad(p, lr=0.05, weight_decay=1e-2),
}


def _net():
    torch.manual_seed(0)
    # 60 x 40 weights and a BatchNorm kept in fp32: several chunks once they are made small.
    return torch.nn.Sequential(torch.nn.Linear(40, 60), torch.nn.ReLU(),
                               torch.nn.BatchNorm1d(60), torch.nn.Linear(60, 3))


def _train(name, fused_step, steps=6, inject_at=(), clip=None):
    amp_handle = amp.AmpHandle()
    amp._default_handle = amp_handle
    model = _net()
    model, opt = amp.initialize(model, OPTIMIZERS[name](model.parameters()), opt_level="O2",
                                verbosity=0, fused_step=fused_step)
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(16, 40, generator=g), torch.randn(16, 3, generator=g)
        opt.zero_grad()
        with amp.scale_loss(torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y),
                            opt) as scaled:
            scaled.backward()
            if i in inject_at:
                model[0].weight.grad.view(-1)[-1] = float("nan")
            if i == 0 and fused_step is not False:   # no fp32 master gradient is held
                assert all(m.grad is None or is_lazy(m.grad) for m in opt._apex_lite_amp.masters()
                           if m.dtype == torch.float32 and m.dim() == 2)
        if clip == "amp":
            amp.clip_grad_norm_(opt, 0.5)
        elif clip == "apex":
            torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 0.5)
        opt.step()
    return model, opt


@pytest.mark.parametrize("clip", [None, "amp", "apex"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_default_o2_step_without_native_kernels_trains_as_the_unfused_step(
        python_backend, small_chunks, name, clip):
    model, opt = _train(name, None, inject_at={2}, clip=clip)
    assert "fused step (torch's fused kernels" in opt._apex_lite_amp.path.describe()
    assert amp.loss_scalers()[0].skipped_steps == 1
    ref_model, ref_opt = _train(name, False, inject_at={2}, clip=clip)
    for a, b in zip(opt._apex_lite_amp.masters(), ref_opt._apex_lite_amp.masters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(model.parameters(), opt._apex_lite_amp.masters()):
        assert torch.equal(a, b.to(a.dtype))
    state, ref_state = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert state.keys() == ref_state.keys()
    for key, entry in state.items():
        for k, value in entry.items():
            torch.testing.assert_close(value, ref_state[key][k], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["AdamW", "SGD-dampening"])
def test_trains_as_the_native_kernels_do(small_chunks, monkeypatch, name):
    """The same training on the native kernels and on torch's, to fp32 rounding (skipped only
    when the native extension is not built)."""
    if _backend.backend("cpu")[0] != "native":
        pytest.skip("the native kernels do not serve the CPU in this run")
    native_model, native_opt = _train(name, None, inject_at={2})
    with monkeypatch.context() as patched:
        patched.setenv("APEX_LITE_DISABLE_EXT", "1")
        patched.delenv("APEX_LITE_REQUIRE_EXT", raising=False)
        _backend.reset()
        try:
            model, opt = _train(name, None, inject_at={2})
            assert "torch's fused kernels" in opt._apex_lite_amp.path.describe()
        finally:
            _backend.reset()
    for a, b in zip(opt._apex_lite_amp.masters(), native_opt._apex_lite_amp.masters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["AdamW", "SGD-nesterov", "SGD-dampening"])
def test_a_skipped_step_changes_nothing(python_backend, small_chunks, name):
    model, opt = _train(name, None, steps=2)
    before = snapshot(model, opt)
    state = copy.deepcopy(opt.state_dict())
    g = torch.Generator().manual_seed(9)
    opt.zero_grad()     # the common step: gradients checked where they stand, not accumulated
    with amp.scale_loss(model(torch.randn(16, 40, generator=g).bfloat16()).float().sum(),
                        opt) as scaled:
        scaled.backward()
        model[3].weight.grad.view(-1)[0] = float("-inf")
    opt.step()
    assert_bitwise_equal(before, snapshot(model, opt))
    for key, entry in state["state"].items():
        for k, value in entry.items():
            assert torch.equal(value, opt.state_dict()["state"][key][k]), k
    assert amp.loss_scalers()[0].skipped_steps == 1


def test_o2_holds_fp32_trainings_bytes_per_parameter(python_backend):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    model, opt = amp.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-3),
                                opt_level="O2", verbosity=0)
    with amp.scale_loss(model(torch.randn(4, 64)).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    # half param 2 + half grad 2 + fp32 master 4 + Adam state 8 (+ a 4-byte step per tensor),
    # as the native fused step; the unfused step holds 4 more (fp32 master gradients).
    assert 16.0 <= amp.report().bytes_per_parameter < 16.01


STANDALONE = {
    "FusedAdam": (lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.1),
                  lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)),
    "FusedSGD": (lambda p: FusedSGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
                 lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True,
                                           weight_decay=0.01)),
    "FusedAdagrad": (lambda p: FusedAdagrad(p, lr=0.1, weight_decay=0.01),
                     lambda p: torch.optim.Adagrad(p, lr=0.1, weight_decay=0.01)),
}


@pytest.mark.parametrize("name", sorted(STANDALONE))
def test_standalone_optimizers_step_fp32_parameters_on_torchs_kernels(python_backend, name):
    """Without native kernels FusedSGD, FusedAdam and FusedAdagrad step fp32 parameters with
    torch's fused kernels (not the Python reference's many passes): torch's own optimizer's
    update, to fp32 rounding; half parameters still go to the reference."""
    ours_make, torch_make = STANDALONE[name]
    g = torch.Generator().manual_seed(5)
    start = [torch.randn(shape, generator=g) for shape in ((300, 7), (1100,), (5,))]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    theirs = [torch.nn.Parameter(t.clone()) for t in start]
    ours_opt, torch_opt = ours_make(ours), torch_make(theirs)
    for _ in range(4):
        grads = [torch.randn(t.shape, generator=g) for t in start]
        for params, opt in ((ours, ours_opt), (theirs, torch_opt)):
            for p, grad in zip(params, grads):
                p.grad = grad.clone()
            opt.step()
    assert all(update.ops is _torch_fused for _, update in ours_opt._fused_updates())
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
