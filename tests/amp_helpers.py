"""Small models and data shared by the amp tests (and the resume worker script)."""
import torch


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
        snap["masters"] = [p.detach().clone() for p in amp.master_params(optimizer)]
        snap["state"] = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
                         for s in optimizer.state.values()]
    return snap


def assert_bitwise_equal(a, b):
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
