"""Fuzz: 1000 random steps with random inf/NaN gradients and losses and random checkpoint/restore
(into fresh objects, in process). No step with a non-finite gradient is ever applied, and the
restored run stays bit for bit equal to an uninterrupted one."""
import copy
import random

import pytest
import torch

from amp_helpers import Net, batch, snapshot, assert_bitwise_equal
from apex_lite import amp

STEPS = 1000


class Trainer:
    """One run on its own AmpHandle (two runs side by side in one process)."""

    def __init__(self, level, init_kwargs, state=None):
        self.level, self.init_kwargs = level, init_kwargs
        self.handle = amp.AmpHandle()
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        self.model, self.opt = self.handle.initialize(model, opt, opt_level=level, verbosity=0,
                                                      **init_kwargs)
        if state is not None:
            self.model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["optimizer"])
            self.handle.load_state_dict(state["amp"])

    def state(self):
        return copy.deepcopy({"model": self.model.state_dict(),
                              "optimizer": self.opt.state_dict(),
                              "amp": self.handle.state_dict()})

    def restored(self):
        """A fresh process resuming from this run's checkpoint."""
        return Trainer(self.level, self.init_kwargs, self.state())

    def step(self, step, fault):
        x, y = batch(step, n=8)
        self.opt.zero_grad()
        loss = torch.nn.functional.mse_loss(self.model(x).float(), y)
        hooks = []
        if fault is not None:
            kind, value, name, index = fault
            if kind == "loss":
                loss = loss * value
            else:
                param = dict(self.model.named_parameters())[name]

                def poison(g, value=value, index=index):
                    g = g.clone()
                    g.view(-1)[index % g.numel()] = value
                    return g
                hooks.append(param.register_hook(poison))
        with self.handle.scale_loss(loss, self.opt) as scaled:
            scaled.backward()
        for hook in hooks:
            hook.remove()
        self.opt.step()
        return loss.detach()


@pytest.mark.parametrize("level, init_kwargs", [
    ("O2", dict(scale_window=4)),
    ("O1", dict(scale_window=7, hysteresis=2, min_loss_scale=2.0 ** 10)),
])
def test_random_faults_and_restores(level, init_kwargs, monkeypatch):
    # Tiny ops: one thread avoids OpenMP spinning on a busy machine (10x faster here).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _fuzz(level, init_kwargs)
    finally:
        torch.set_num_threads(threads)


def _fuzz(level, init_kwargs):
    rng = random.Random(20261121)
    names = [name for name, _ in Net().named_parameters()]
    reference = Trainer(level, init_kwargs)
    live = Trainer(level, init_kwargs)
    restores = skipped = 0
    for step in range(STEPS):
        fault = None
        if rng.random() < 0.15:
            fault = ("loss" if rng.random() < 0.2 else "grad",
                     rng.choice([float("inf"), float("-inf"), float("nan")]),
                     rng.choice(names), rng.randrange(1 << 16))
        if rng.random() < 0.02:
            live = live.restored()
            restores += 1
        before = snapshot(live.model, live.opt)
        loss_ref = reference.step(step, fault)
        loss_live = live.step(step, fault)
        scaler = live.handle.loss_scalers()[0]
        after = snapshot(live.model, live.opt)
        if fault is not None:
            assert scaler.last_step_skipped, step
            assert_bitwise_equal(before, after)
            skipped += 1
        else:
            assert not scaler.last_step_skipped, step
        assert all(torch.isfinite(p).all() for p in after["masters"] + after["params"]), step
        torch.testing.assert_close(loss_live, loss_ref, rtol=0, atol=0, equal_nan=True)
    assert restores >= 10 and skipped >= 100
    assert_bitwise_equal(snapshot(reference.model, reference.opt),
                         snapshot(live.model, live.opt))
    assert live.handle.state_dict()["loss_scaler0"] == reference.handle.state_dict()["loss_scaler0"]
    counters = lambda s: (s.loss_scale, s.unskipped, s.hysteresis_left, s.steps,  # noqa: E731
                          s.skipped_steps, s.last_step_skipped)
    assert [counters(s) for s in live.handle.loss_scalers()] == \
           [counters(s) for s in reference.handle.loss_scalers()]
