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


@pytest.mark.parametrize("level", ["O1", "O2"])
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
