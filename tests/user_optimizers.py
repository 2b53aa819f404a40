"""Optimizer wrappers as users' code has them, written here to behave as the published ones do
(the tests of issue 49 run them under amp and in fp32).

- ``SAM``: sharpness-aware minimisation as davda54/sam implements it (the one most training code
  copies): ``first_step`` moves the optimizer's parameters in place to ``w + e(w)`` under
  ``no_grad`` and keeps ``old_p``; ``second_step`` puts them back with ``p.data = old_p`` and calls
  ``base_optimizer.step()`` itself. davda54's takes the base optimizer's class; many copies also
  take an optimizer already built (here: an instance, when amp.initialize made it first).
- ``Lookahead``: timm's (``timm.optim.Lookahead``, what its ``lookahead_*`` optimizers build): it
  skips ``Optimizer.__init__`` on purpose, shares the base optimizer's ``param_groups``, keeps its
  slow weights in the base optimizer's ``state``, and saves and loads through the base.
"""
from __future__ import annotations

from collections import defaultdict

import torch


class SAM(torch.optim.Optimizer):
    def __init__(self, params, base_optimizer, rho=0.05, adaptive=False, **kwargs):
        if rho < 0.0:
            raise ValueError(f"rho must be non-negative: {rho}")
        super().__init__(params, dict(rho=rho, adaptive=adaptive, **kwargs))
        if isinstance(base_optimizer, torch.optim.Optimizer):
            self.base_optimizer = base_optimizer
            for group in base_optimizer.param_groups:
                group.setdefault("rho", rho)
                group.setdefault("adaptive", adaptive)
        else:
            self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups
        self.defaults.update(self.base_optimizer.defaults)

    @torch.no_grad()
    def first_step(self, zero_grad=False):
        grad_norm = self._grad_norm()
        for group in self.param_groups:
            scale = group["rho"] / (grad_norm + 1e-12)
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.data.clone()
                e_w = (torch.pow(p, 2) if group["adaptive"] else 1.0) * p.grad * scale.to(p)
                p.add_(e_w)                       # to the local maximum w + e(w)
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad=False):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.data = self.state[p]["old_p"]   # back to w
        self.base_optimizer.step()                # the sharpness-aware update
        if zero_grad:
            self.zero_grad()

    def _grad_norm(self):
        device = self.param_groups[0]["params"][0].device
        return torch.norm(torch.stack([
            ((torch.abs(p) if group["adaptive"] else 1.0) * p.grad).norm(p=2).to(device)
            for group in self.param_groups for p in group["params"] if p.grad is not None]), p=2)

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self.base_optimizer.param_groups = self.param_groups


class Lookahead(torch.optim.Optimizer):
    def __init__(self, base_optimizer, alpha=0.5, k=6):
        # Optimizer.__init__ is not called, on purpose (as timm's).
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"Invalid slow update rate: {alpha}")
        if not 1 <= k:
            raise ValueError(f"Invalid lookahead steps: {k}")
        defaults = dict(lookahead_alpha=alpha, lookahead_k=k, lookahead_step=0)
        self._base_optimizer = base_optimizer
        self.param_groups = base_optimizer.param_groups
        self.defaults = base_optimizer.defaults
        self.defaults.update(defaults)
        self.state = defaultdict(dict)
        for name, default in defaults.items():
            for group in self._base_optimizer.param_groups:
                group.setdefault(name, default)
        self._optimizer_step_pre_hooks = dict()
        self._optimizer_step_post_hooks = dict()

    @torch.no_grad()
    def update_slow(self, group):
        for fast_p in group["params"]:
            if fast_p.grad is None:
                continue
            param_state = self._base_optimizer.state[fast_p]
            if "lookahead_slow_buff" not in param_state:
                param_state["lookahead_slow_buff"] = torch.empty_like(fast_p)
                param_state["lookahead_slow_buff"].copy_(fast_p)
            slow = param_state["lookahead_slow_buff"]
            slow.add_(fast_p - slow, alpha=group["lookahead_alpha"])
            fast_p.copy_(slow)

    def sync_lookahead(self):
        for group in self._base_optimizer.param_groups:
            self.update_slow(group)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._base_optimizer.step(closure)
        for group in self._base_optimizer.param_groups:
            group["lookahead_step"] += 1
            if group["lookahead_step"] % group["lookahead_k"] == 0:
                self.update_slow(group)
        return loss

    def state_dict(self):
        return self._base_optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self._base_optimizer.load_state_dict(state_dict)
        self.param_groups = self._base_optimizer.param_groups
