"""The same front end on a CUDA model: fp16 by default, flags on the device, skips exact."""
import pytest
import torch

from amp_helpers import Net, batch, inject_inf, snapshot, assert_bitwise_equal, requires_cuda
from apex_lite import amp

pytestmark = requires_cuda


def _cuda_step(model, opt, step):
    x, y = (t.cuda() for t in batch(step))
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x).float(), y)
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()


@pytest.mark.parametrize("level, param_dtype, out_dtype", [
    ("O1", torch.float32, torch.float32),
    ("O2", torch.float16, torch.float32),
    ("O3", torch.float16, torch.float32),
])
def test_cuda_models_default_to_fp16(level, param_dtype, out_dtype):
    model = Net().cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    assert model.fc1.weight.dtype == param_dtype
    assert model(batch(0)[0].cuda()).dtype == out_dtype
    for step in range(3):
        _cuda_step(model, opt, step)
    masters = list(amp.master_params(opt))
    assert all(m.is_cuda for m in masters)
    if level == "O2":
        assert masters[0].dtype == torch.float32
        for m, p in zip(masters, model.parameters()):
            torch.testing.assert_close(p, m.to(p.dtype), rtol=0, atol=0)


@pytest.mark.parametrize("level, param_dtype, autocast_dtype", [
    ("O4", torch.float32, torch.bfloat16), ("O5", torch.bfloat16, None)])
def test_cuda_rocm_levels_are_bf16_where_o1_and_o2_are_fp16(level, param_dtype, autocast_dtype):
    model = Net().cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    seen = []
    model.fc1.register_forward_hook(
        lambda module, args, out: seen.append((out.dtype, torch.is_autocast_enabled("cuda"))))
    assert model.fc1.weight.dtype == param_dtype and model.bn.weight.dtype == torch.float32
    assert model(batch(0)[0].cuda()).dtype == torch.float32
    assert seen == [(torch.bfloat16, autocast_dtype is not None)]
    assert amp._amp_state.opt_properties.patch_torch_functions_type == autocast_dtype
    for step in range(3):
        _cuda_step(model, opt, step)
    assert amp.loss_scalers()[0].loss_scale == 1.0
    assert opt._apex_lite_amp.path.fused == (level == "O5")


@pytest.mark.parametrize("level", ["O1", "O2", "O4", "O5"])
def test_cuda_skip_is_bit_for_bit(level):
    model = Net().cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    _cuda_step(model, opt, 0)
    before = snapshot(model, opt)
    hook = inject_inf(model.fc1.weight)
    _cuda_step(model, opt, 1)
    hook.remove()
    assert_bitwise_equal(before, snapshot(model, opt))
    assert amp.default_handle()._run.scalers[0].skipped_steps >= 1


# ---- the GPU-only Python paths (issue 35) ---------------------------------------------------------

def _cuda_net(seed=0):
    torch.manual_seed(seed)
    return Net().cuda()


def _train(make_opt, *, fused_step=None, steps=4, num_losses=1, clip=None, micro=1,
           read_masters=False, **kwargs):
    """O2 training of Net on CUDA; returns the model, the optimizer and the masters."""
    model = _cuda_net()
    opt = make_opt(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level="O2", fused_step=fused_step,
                                num_losses=num_losses, verbosity=0, **kwargs)
    for step in range(steps):
        x, y = (t.cuda() for t in batch(step))
        opt.zero_grad()
        for m in range(micro):
            out = model(x).float()
            for loss_id in range(num_losses):
                loss = torch.nn.functional.mse_loss(out, y) * (loss_id + 1)
                with amp.scale_loss(loss, opt, loss_id=loss_id,
                                    delay_unscale=m + 1 < micro) as scaled:
                    scaled.backward(retain_graph=loss_id + 1 < num_losses)
        if read_masters:
            assert all(p.grad is not None for p in amp.master_params(opt))
        if clip is not None:
            amp.clip_grad_norm_(opt, clip[0], clip[1])
        opt.step()
    masters = [p.detach().clone() for p in opt._apex_lite_amp.masters()]
    amp.default_handle().__init__()
    return model, opt, masters


def _close(a, b, tol=1e-3):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol)


ADAM = lambda params: torch.optim.Adam(params, lr=1e-3)  # noqa: E731


@pytest.mark.parametrize("num_losses", [1, 2, 3])
def test_cuda_every_loss_scaler_is_on_the_parameters_device(num_losses):
    model = _cuda_net()
    opt = ADAM(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level="O2", num_losses=num_losses, verbosity=0)
    assert opt._apex_lite_amp.path.fused
    assert [s.device().type for s in amp.loss_scalers()] == ["cuda"] * num_losses
    amp.default_handle().__init__()
    fused = _train(ADAM, num_losses=num_losses)[2]
    unfused = _train(ADAM, num_losses=num_losses, fused_step=False)[2]
    _close(fused, unfused)


@pytest.mark.parametrize("norm_type", [2.0, 1.0])
def test_cuda_fused_clip_grad_norm_matches_the_unfused_step(norm_type):
    fused = _train(ADAM, clip=(0.5, norm_type))[2]
    unfused = _train(ADAM, clip=(0.5, norm_type), fused_step=False)[2]
    _close(fused, unfused)


def test_cuda_delay_unscale_and_master_params_match_the_unfused_step():
    for kwargs in (dict(micro=3), dict(read_masters=True), dict(micro=2, read_masters=True)):
        fused = _train(ADAM, **kwargs)[2]
        unfused = _train(ADAM, fused_step=False, **kwargs)[2]
        _close(fused, unfused)


@pytest.mark.parametrize("name", ["FusedLAMB", "SGD-dampening"])
def test_cuda_lamb_and_sgd_with_dampening_under_amp(name):
    from apex_lite.optimizers import FusedLAMB
    make = (lambda p: FusedLAMB(p, lr=1e-3, weight_decay=0.01)) if name == "FusedLAMB" else \
        (lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, dampening=0.1))
    model, opt, fused = _train(make, fused_step=True)
    unfused = _train(make, fused_step=False)[2]
    _close(fused, unfused)


def test_cuda_grad_scaler_hands_its_scale_to_the_fused_optimizers():
    from apex_lite.optimizers import FusedAdam
    results = []
    for make in (lambda p: FusedAdam(p, lr=1e-3), lambda p: torch.optim.Adam(p, lr=1e-3)):
        model = _cuda_net()
        opt = make(model.parameters())
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 10)
        for step in range(4):
            x, y = (t.cuda() for t in batch(step))
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        results.append([p.detach().clone() for p in model.parameters()])
    _close(*results, tol=1e-5)


def test_cuda_apex_amp_c_ops():
    from apex_lite import apex_multi_tensor as amp_C
    from apex_lite.apex_multi_tensor import multi_tensor_applier
    g = torch.Generator(device="cuda").manual_seed(0)
    xs = [torch.randn(n, device="cuda", generator=g) for n in (7, 4096, 100003)]
    noop = torch.zeros(1, dtype=torch.int, device="cuda")
    outs = [torch.empty_like(x, dtype=torch.float16) for x in xs]
    multi_tensor_applier(amp_C.multi_tensor_scale, noop, [xs, outs], 0.5)
    for x, o in zip(xs, outs):
        assert torch.equal(o, (x * 0.5).half())
    ys = [torch.randn_like(x) for x in xs]
    expected = [2.0 * x + 3.0 * y for x, y in zip(xs, ys)]
    sums = [torch.empty_like(x) for x in xs]
    multi_tensor_applier(amp_C.multi_tensor_axpby, noop, [xs, ys, sums], 2.0, 3.0, -1)
    _close(sums, expected, tol=1e-6)
    norm, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, noop, [xs], False)
    torch.testing.assert_close(norm.reshape(()), torch.cat(xs).norm(), rtol=1e-5, atol=1e-5)
    assert noop.item() == 0
    xs[1][5] = float("inf")
    multi_tensor_applier(amp_C.multi_tensor_scale, noop, [xs, outs], 0.5)
    assert noop.item() == 1


def test_cuda_two_gpus_inverse_scale_follows_each_group():
    """A device scale (every parameter on cuda:0 at initialize) and a param group added later
    on cuda:1: the second backward, amp.master_params and a 1-norm clip unscale there."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two CUDA GPUs (this host has {torch.cuda.device_count()}): amp "
                    f"with a param group on a second GPU stays unchecked")

    def run(fused_step):
        torch.manual_seed(0)
        a, b = torch.nn.Linear(8, 8).to("cuda:0"), torch.nn.Linear(8, 1).to("cuda:1")
        opt = torch.optim.SGD(a.parameters(), lr=1e-2, momentum=0.9)
        [a, b], opt = amp.initialize([a, b], opt, opt_level="O2", fused_step=fused_step,
                                     verbosity=0)
        opt.add_param_group({"params": list(b.parameters())})
        for step in range(3):
            x, y = batch(step)
            opt.zero_grad()
            for _ in range(2):       # two backwards: the second accumulates into fp32 grads
                out = b(a(x.to("cuda:0")).to("cuda:1")).float()
                with amp.scale_loss(torch.nn.functional.mse_loss(out, y.to("cuda:1")),
                                    opt) as scaled:
                    scaled.backward()
            list(amp.master_params(opt))
            amp.clip_grad_norm_(opt, 1.0, norm_type=1.0)
            opt.step()
        masters = [p.detach().cpu() for p in opt._apex_lite_amp.masters()]
        amp.default_handle().__init__()
        return masters
    _close(run(True), run(False))


@pytest.mark.parametrize("backend", ["native", "python"])
@pytest.mark.parametrize("make", ["Adam", "SGD", "FusedLAMB"])
def test_cuda_fused_step_never_syncs(backend, make, monkeypatch):
    """Between the sync_interval reads, the fused step reads nothing on the host: torch raises
    on any synchronising call under set_sync_debug_mode("error")."""
    from apex_lite.multi_tensor import _backend
    from apex_lite.optimizers import FusedLAMB
    if backend == "python":
        monkeypatch.setenv("APEX_LITE_DISABLE_EXT", "1")
        monkeypatch.delenv("APEX_LITE_REQUIRE_EXT", raising=False)
    _backend.reset()
    makers = {"Adam": ADAM, "SGD": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
              "FusedLAMB": lambda p: FusedLAMB(p, lr=1e-3)}
    model = _cuda_net()
    opt = makers[make](model.parameters())
    model, opt = amp.initialize(model, opt, opt_level="O2", fused_step=True, num_losses=2,
                                sync_interval=1000, verbosity=0)
    if backend == "python" and make != "FusedLAMB":   # torch's fused kernels carry the step
        assert "torch's fused kernels" in opt._apex_lite_amp.path.describe()
    batches = [tuple(t.cuda() for t in batch(step)) for step in range(6)]

    def step(x, y):
        opt.zero_grad()
        out = model(x).float()
        for loss_id in range(2):
            with amp.scale_loss(torch.nn.functional.mse_loss(out, y), opt,
                                loss_id=loss_id) as scaled:
                scaled.backward(retain_graph=loss_id == 0)
        amp.clip_grad_norm_(opt, 1.0)
        opt.step()
    step(*batches[0])          # the first step builds the buckets and the state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, y in batches[1:]:
            step(x, y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        _backend.reset()
    assert amp.loss_scalers()[0].steps == 6


@pytest.mark.parametrize("name", ["Adam", "SGD"])
def test_cuda_torch_kernels_route_trains_as_the_native_kernels(name, monkeypatch):
    """Without native kernels (a pure install) O2's default step runs on torch's fused kernels
    over fp32 gradient chunks: the same training as the native kernels to fp32 rounding, and a
    skipped step (inf injected) changes nothing, bit for bit."""
    from apex_lite.multi_tensor import _backend
    make = ADAM if name == "Adam" else (lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9))
    native = _train(make)[2]
    monkeypatch.setenv("APEX_LITE_DISABLE_EXT", "1")
    monkeypatch.delenv("APEX_LITE_REQUIRE_EXT", raising=False)
    _backend.reset()
    try:
        model, opt, torch_route = _train(make)
        _close(torch_route, native, tol=1e-5)
        model = _cuda_net()
        model, opt = amp.initialize(model, make(model.parameters()), opt_level="O2",
                                    verbosity=0)
        assert "torch's fused kernels" in opt._apex_lite_amp.path.describe()
        x, y = (t.cuda() for t in batch(0))
        for inject in (False, True):
            before = [p.detach().clone() for p in model.parameters()] + \
                [m.detach().clone() for m in opt._apex_lite_amp.masters()]
            opt.zero_grad()
            with amp.scale_loss(torch.nn.functional.mse_loss(model(x).float(), y),
                                opt) as scaled:
                scaled.backward()
                if inject:
                    next(model.parameters()).grad.view(-1)[-1] = float("inf")
            opt.step()
            after = [p.detach() for p in model.parameters()] + \
                [m.detach() for m in opt._apex_lite_amp.masters()]
            assert all(torch.equal(a, b) for a, b in zip(before, after)) == inject
    finally:
        _backend.reset()
