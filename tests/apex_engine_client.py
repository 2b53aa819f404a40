"""A training engine that drives NVIDIA apex itself, written the way such libraries are.

- apex is detected through package metadata, as transformers' ``is_apex_available`` does
  (``find_spec`` and ``importlib.metadata.version``);
- ``amp.initialize`` runs lazily inside the first training step, guarded by
  ``hasattr(optimizer, "_amp_stash")`` (OpenMMLab's mmengine ``ApexOptimWrapper``), and a
  resumed optimizer state waits for it through the same test;
- gradients are clipped Megatron-style with ``multi_tensor_applier(amp_C.multi_tensor_l2norm,
  ...)`` and ``amp_C.multi_tensor_scale`` on ``amp.master_params(optimizer)``;
- checkpoints hold the model's and the optimizer's state dicts only, never ``amp.state_dict()``
  (transformers' Trainer);
- the loss scale is read through ``apex.amp._amp_state`` (atorch, older research code).

Nothing here knows about apex_lite. tests/test_apex_compat.py runs it in subprocesses with
apex_lite's ``apex`` distribution (compat/apex) installed into a temporary --target:

    python apex_engine_client.py --opt-level O2 --steps 16 --save-at 10 --checkpoint ck.pt \
        --out full.json
    python apex_engine_client.py --opt-level O2 --steps 16 --resume ck.pt --out resumed.json
"""
import argparse
import importlib.metadata
import importlib.util
import json
import sys

import torch


def is_apex_available() -> bool:
    """transformers' check: an importable module and an installed distribution."""
    if importlib.util.find_spec("apex") is None:
        return False
    try:
        importlib.metadata.version("apex")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


APEX_AVAILABLE = is_apex_available()
if APEX_AVAILABLE:
    import amp_C
    from apex import amp
    from apex.amp import _amp_state
    from apex.multi_tensor_apply import multi_tensor_applier


def clip_grad_norm(parameters, max_norm: float) -> float:
    """Megatron's fused clipping: one multi-tensor norm, one multi-tensor scale."""
    grads = [p.grad for p in parameters if p.grad is not None]
    overflow_buf = torch.zeros(1, dtype=torch.int, device=grads[0].device)
    norm, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, overflow_buf, [grads], False)
    total = norm.item()
    coefficient = max_norm / (total + 1e-6)
    if coefficient < 1.0:
        multi_tensor_applier(amp_C.multi_tensor_scale, overflow_buf, [grads, grads], coefficient)
    return total


class ApexOptimWrapper:
    """mmengine's ApexOptimWrapper, reduced to what it does with apex."""

    def __init__(self, optimizer, opt_level: str):
        self.optimizer = optimizer
        self.opt_level = opt_level
        self.initialize_calls = 0
        self._pending_state = None

    def optim_context(self, model):
        # amp.initialize adds "_amp_stash" to the optimizers it initialises.
        if not hasattr(self.optimizer, "_amp_stash"):
            self.initialize_calls += 1
            model, self.optimizer = amp.initialize(model, self.optimizer,
                                                   opt_level=self.opt_level)
            if self._pending_state is not None:
                self.optimizer.load_state_dict(self._pending_state)
                self._pending_state = None

    def update_params(self, loss, max_norm: float) -> float:
        with amp.scale_loss(loss, self.optimizer) as scaled_loss:
            scaled_loss.backward()
        norm = clip_grad_norm(list(amp.master_params(self.optimizer)), max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return norm

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if hasattr(self.optimizer, "_amp_stash"):
            self.optimizer.load_state_dict(state)
        else:
            self._pending_state = state   # loaded once amp.initialize ran


def batch(step: int, bad_step: int):
    """A regression batch from a fixed teacher; the batch of ``bad_step`` holds an inf, as a
    corrupt sample would (its loss is not finite: amp skips that step)."""
    generator = torch.Generator().manual_seed(100 + step)
    teacher = torch.Generator().manual_seed(7)
    weights = torch.randn(16, 1, generator=teacher)
    x = torch.randn(64, 16, generator=generator)
    y = x @ weights
    if step == bad_step:
        x[3, 5] = float("inf")
    return x, y


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=2e-2)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--opt-level", default="O1")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--bad-step", type=int, default=4)
    parser.add_argument("--save-at", type=int, default=None)
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    result = {"apex_available": APEX_AVAILABLE}
    if not APEX_AVAILABLE:
        json.dump(result, open(args.out, "w"))
        return 0
    torch.set_num_threads(1)
    model, optimizer = build()
    wrapper = ApexOptimWrapper(optimizer, args.opt_level)
    start = 0
    if args.resume:
        checkpoint = torch.load(args.resume, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        wrapper.load_state_dict(checkpoint["optimizer"])
        start = checkpoint["step"]
    losses, scales, norms = {}, {}, {}
    for step in range(start, args.steps):
        x, y = batch(step, args.bad_step)
        wrapper.optim_context(model)
        loss = torch.nn.functional.mse_loss(model(x), y)
        norms[step] = wrapper.update_params(loss, max_norm=5.0)
        losses[step] = loss.item()
        scales[step] = _amp_state.loss_scalers[0].loss_scale()
        if args.save_at is not None and step + 1 == args.save_at:
            torch.save({"model": model.state_dict(), "optimizer": wrapper.state_dict(),
                        "step": step + 1}, args.checkpoint)
    result.update(
        apex_version=importlib.metadata.version("apex"), amp_module=amp.__name__,
        initialize_calls=wrapper.initialize_calls, losses=losses, loss_scales=scales,
        clip_norms=norms, amp_state=amp.state_dict()["loss_scaler0"],
        params=[p.detach().double().flatten().tolist() for p in model.state_dict().values()])
    json.dump(result, open(args.out, "w"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
