"""The Python paths that GPU runs take, emulated on the CPU (issue 35): every loss scaler beside
the parameters whatever the default device; no host read in a step on the Python backend's
fused ops and amp's O2 fused step; a master beyond the half dtype's range named in
OverflowStuckError; the FSDP2 order message's policy in the run's half dtype. The same paths on
a real GPU are in test_amp_cuda.py."""
from __future__ import annotations

import contextlib

import pytest
import torch

from amp_helpers import CountSyncs
from apex_lite import amp
from apex_lite.optimizers import FusedAdam, FusedLAMB, FusedMixedPrecisionLamb, FusedSGD

STEP_PATHS = pytest.mark.parametrize("fused_step", [True, False], ids=["fused", "unfused"])


# ---- 35.1: the loss scalers follow the parameters, not the default device ----------------------

def _two_heads():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _train_losses(num_losses, fused_step, default_device):
    model = _two_heads()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    # Emulates a GPU run: the default device (the CPU there) is not the parameters' device.
    with torch.device(default_device) if default_device else contextlib.nullcontext():
        model, opt = amp.initialize(model, opt, opt_level="O2", num_losses=num_losses,
                                    fused_step=fused_step, verbosity=0)
    scalers = amp.loss_scalers()
    assert all(s.device() in (None, torch.device("cpu")) for s in scalers)
    g = torch.Generator().manual_seed(3)
    for step in range(6):
        x = torch.randn(4, 6, generator=g)
        out = model(x).float()
        opt.zero_grad()
        for loss_id in range(num_losses):
            loss = out[:, loss_id % 3].pow(2).mean() * (loss_id + 1)
            with amp.scale_loss(loss, opt, loss_id=loss_id) as scaled:
                scaled.backward(retain_graph=loss_id + 1 < num_losses)
        opt.step()
    amp.default_handle().__init__()
    return ([p.detach().clone() for p in model.parameters()],
            [(s.loss_scale, s.steps, s.skipped_steps) for s in scalers])


@pytest.mark.parametrize("num_losses", [1, 2, 3])
@STEP_PATHS
def test_every_scaler_follows_the_parameters_not_the_default_device(num_losses, fused_step):
    expected = _train_losses(num_losses, fused_step, None)
    got = _train_losses(num_losses, fused_step, "meta")
    for a, b in zip(expected[0], got[0]):
        assert torch.equal(a, b)
    assert expected[1] == got[1]


# ---- 35.2: no host read in a step on the Python backend -------------------------------------

class CountHostReads(CountSyncs):
    """CountSyncs, and a copy to the CPU of a tensor that is not there (``.to``, ``copy_``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in ("to", "copy_") and args and isinstance(args[0], torch.Tensor):
            target = args[1] if len(args) > 1 else (kwargs or {}).get("device")
            source = args[0] if name == "to" else target
            if isinstance(source, torch.Tensor) and source.device.type != "cpu" and (
                    name == "copy_" or str(target).startswith("cpu")):
                self.count += 1
        return super().__torch_function__(func, types, args, kwargs)


def _six_layers():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])


FUSED = {"FusedAdam": lambda p: FusedAdam(p, lr=1e-3, weight_decay=0.01),
         "FusedLAMB": lambda p: FusedLAMB(p, lr=1e-3, weight_decay=0.01),
         "FusedSGD": lambda p: FusedSGD(p, lr=1e-3, momentum=0.9),
         "FusedMixedPrecisionLamb": lambda p: FusedMixedPrecisionLamb(p, lr=1e-3,
                                                                      weight_decay=0.01)}


@pytest.mark.parametrize("name", sorted(FUSED))
def test_fused_optimizers_read_nothing_on_the_host(python_backend, name):
    model = _six_layers()
    opt = FUSED[name](model.parameters())
    x = torch.randn(4, 8)

    def step():
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    step()     # the first step makes the state
    with CountHostReads() as reads:
        for _ in range(10):
            step()
    assert reads.count == 0


AMP_O2 = {"SGD": lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9),
          "Adam": lambda p: torch.optim.Adam(p, lr=1e-3),
          "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-3),
          "FusedLAMB": lambda p: FusedLAMB(p, lr=1e-3)}


@pytest.mark.parametrize("name", sorted(AMP_O2))
@pytest.mark.parametrize("overflow", [False, True])
def test_amp_o2_fused_step_reads_only_at_the_sync_interval(python_backend, name, overflow):
    model = _six_layers()
    opt = AMP_O2[name](model.parameters())
    model, opt = amp.initialize(model, opt, opt_level="O2", fused_step=True, sync_interval=5,
                                verbosity=0, overflow_patience=None)
    bad = {"on": False}
    model[3].weight.register_hook(lambda g: g * float("inf") if bad["on"] else g)
    x = torch.randn(4, 8)

    def step(i):
        bad["on"] = overflow and i % 3 == 0
        opt.zero_grad()
        with amp.scale_loss(model(x).float().sum(), opt) as scaled:
            scaled.backward()
        opt.step()
    step(1)
    amp.loss_scalers()      # the sync of the first decision, outside the count
    with CountHostReads() as reads:
        for i in range(10):
            step(i)
    # Two syncs (every 5 decisions), one host copy each; nothing else.
    assert reads.count == 2
    assert amp.loss_scalers()[0].skipped_steps == (4 if overflow else 0)


# ---- 35.4: a master beyond the half dtype's range ----------------------------------------------

@STEP_PATHS
def test_a_master_beyond_fp16_range_is_named_in_the_stuck_error(fused_step):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.float16,
                                loss_scale=1.0, overflow_patience=2, fused_step=fused_step,
                                sync_interval=1, verbosity=0)
    master = opt._apex_lite_amp.masters()[0]       # '0.weight'
    x = torch.randn(8, 4)
    with pytest.raises(amp.OverflowStuckError) as info:
        for step in range(10):
            opt.zero_grad()
            with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
                scaled.backward()
            opt.step()
            if step == 0:   # a diverged weight: finite in fp32, beyond fp16's 65504
                with torch.no_grad():
                    master[0, 0] = 70000.0
                opt._apex_lite_amp.copy_masters_to_model()
    message = str(info.value)
    assert "'0.weight'" in message
    assert "beyond the range of torch.float16" in message


# ---- 35.4: the FSDP2 order message suggests the run's half dtype -----------------------------

def test_fsdp_order_message_suggests_the_runs_half_dtype():
    from apex_lite.amp import fsdp
    for half in (torch.float16, torch.bfloat16):
        message = str(fsdp.sharded_after_initialize("amp.scale_loss", "the model", half))
        assert f"MixedPrecisionPolicy(param_dtype={half}, reduce_dtype=torch.float32)" in message


def test_default_half_dtype_is_fp16_on_cuda():
    from apex_lite.amp.opt_levels import default_half_dtype, resolve_properties
    assert default_half_dtype("cuda") == torch.float16
    assert default_half_dtype("cpu") == torch.bfloat16
    assert resolve_properties("O2", device_type="cuda").half_dtype == torch.float16
