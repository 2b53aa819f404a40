"""Small models and data shared by the amp tests (and the resume worker script)."""
import pytest
import torch
from torch.overrides import TorchFunctionMode

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Net(torch.nn.Module):
    """Linear -> BatchNorm -> ReLU -> Linear: a half-castable model with a norm layer."""

    def __init__(self, d_in=8, d_hidden=16, d_out=1):
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, d_hidden)
        self.bn = torch.nn.BatchNorm1d(d_hidden)
        self.fc2 = torch.nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def batch(step, n=32, d_in=8, generator_seed=1234):
    """A deterministic regression batch for ``step``: y = sum of x, a little noise."""
    g = torch.Generator().manual_seed(generator_seed + step)
    x = torch.randn(n, d_in, generator=g)
    y = x.sum(1, keepdim=True) * 0.5 + 0.01 * torch.randn(n, 1, generator=g)
    return x, y


def train_step(model, optimizer, step, amp_module, loss_id=0):
    x, y = batch(step)
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x).float(), y)
    with amp_module.scale_loss(loss, optimizer, loss_id=loss_id) as scaled:
        scaled.backward()
    optimizer.step()
    return loss.detach()


def inject_inf(tensor):
    """A hook that makes a gradient hold inf (one overflow)."""
    return tensor.register_hook(lambda g: torch.full_like(g, float("inf")))


def snapshot(model, optimizer=None):
    """Clones of the params, master weights and optimizer state, for bitwise comparisons."""
    from apex_lite import amp
    snap = {"params": [p.detach().clone() for p in model.parameters()]}
    if optimizer is not None:
        # What the optimizer updates, read without amp.master_params (which, between a backward
        # and its step, would unscale the fused step's lazy gradients into master gradients).
        amp_opt = getattr(optimizer, "_apex_lite_amp", None)
        masters = amp_opt.masters() if amp_opt is not None else amp.master_params(optimizer)
        snap["masters"] = [p.detach().clone() for p in masters]
        snap["state"] = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
                         for s in optimizer.state.values()]
    return snap


def assert_bitwise_equal(a, b, fresh_state_ok=False):
    """``a`` and ``b`` hold the same bits. With ``fresh_state_ok``, optimizer state that ``b``
    has and ``a`` had not yet may be fresh: all zeros (step 0), what torch's optimizers create on
    a first step and the fused step creates before a skipped one (whose skip only the device
    knows); that state steps exactly as no state would."""
    if fresh_state_ok and len(a.get("state", [])) == 0 and len(b.get("state", [])) > 0:
        for state in b["state"]:
            for value in state.values():
                assert not torch.is_tensor(value) or not value.any(), state
        b = dict(b, state=[])
    assert a.keys() == b.keys()
    for key in a:
        assert len(a[key]) == len(b[key]), key
        for x, y in zip(a[key], b[key]):
            if isinstance(x, dict):
                assert x.keys() == y.keys()
                for k in x:
                    torch.testing.assert_close(x[k], y[k], rtol=0, atol=0, equal_nan=True)
            else:
                torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)


class CountSyncs(TorchFunctionMode):
    """Counts the tensor methods that read a value on the host (a sync on CUDA) while active."""
    SYNCS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "nonzero", "cpu",
             "numpy"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.SYNCS:
            self.count += 1
        return func(*args, **(kwargs or {}))
