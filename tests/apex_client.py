"""A training script written for NVIDIA apex, the way libraries that support apex are written.

Like timm's ApexScaler, fairseq, DeepSpeed's amp config and old Megatron scripts, it imports
apex at module top under try/except with has_* flags, takes a non-apex path for what is
missing, clips gradients through amp.master_params, and checkpoints amp.state_dict(). Nothing
in it knows about apex_lite: tests/test_apex_alias.py runs it in a subprocess after
apex_lite.install_apex_alias(), or through `python -m apex_lite.apex_alias`.

    python apex_client.py --opt-level O2 --out result.json
"""
import argparse
import json
import sys

import torch

try:
    from apex import amp
    has_apex = True
except ImportError:
    amp = None
    has_apex = False

try:
    from apex.optimizers import FusedAdam, FusedLAMB, FusedSGD
    has_fused_optimizers = True
except ImportError:
    FusedAdam = FusedLAMB = FusedSGD = None
    has_fused_optimizers = False

try:
    from apex.normalization import FusedLayerNorm as LayerNorm
    has_fused_layernorm = True
except ImportError:
    from torch.nn import LayerNorm
    has_fused_layernorm = False


class ApexLossScaler:
    """A loss scaler wrapper as training libraries write one around apex.amp."""

    state_dict_key = "amp"

    def __call__(self, loss, optimizer, clip_grad=None):
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        norm = None
        if clip_grad is not None:
            norm = torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), clip_grad)
        optimizer.step()
        return norm

    def state_dict(self):
        # Old apex versions had no amp.state_dict; libraries look before they call.
        if "state_dict" in amp.__dict__:
            return amp.state_dict()
        return None

    def load_state_dict(self, state_dict):
        if "load_state_dict" in amp.__dict__:
            amp.load_state_dict(state_dict)


def build(args):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), LayerNorm(32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 1))
    optimizers = {"sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                  "fused_adam": lambda p: FusedAdam(p, lr=1e-2),
                  "fused_sgd": lambda p: FusedSGD(p, lr=0.05, momentum=0.9),
                  "fused_lamb": lambda p: FusedLAMB(p, lr=5e-2)}
    optimizer = optimizers[args.optimizer](model.parameters())
    return amp.initialize(model, optimizer, opt_level=args.opt_level, verbosity=0)


def batches(count):
    generator = torch.Generator().manual_seed(1)
    weights = torch.randn(16, 1, generator=generator)
    for _ in range(count):
        x = torch.randn(32, 16, generator=generator)
        yield x, x @ weights


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--opt-level", default="O1")
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    result = {"has_apex": has_apex, "has_fused_optimizers": has_fused_optimizers,
              "has_fused_layernorm": has_fused_layernorm}
    if not has_apex:   # the library's own path without apex
        json.dump(result, open(args.out, "w"))
        return 0

    model, optimizer = build(args)
    scaler = ApexLossScaler()
    losses, norms = [], []
    for x, y in batches(args.steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        norms.append(float(scaler(loss, optimizer, clip_grad=1.0)))
        losses.append(loss.item())
    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                  scaler.state_dict_key: scaler.state_dict()}

    # Resume in a fresh model and optimizer, as after a restart.
    resumed_model, resumed_optimizer = build(args)
    resumed_model.load_state_dict(checkpoint["model"])
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])
    ApexLossScaler().load_state_dict(checkpoint[ApexLossScaler.state_dict_key])
    x, y = next(batches(1))
    with torch.no_grad():
        same = torch.equal(model(x), resumed_model(x))

    result.update(
        amp_module=amp.__name__, optimizer=type(optimizer).__module__ + "." +
        type(optimizer).__name__, losses=losses, clip_norms=norms,
        checkpoint_keys=sorted(checkpoint), amp_state_keys=sorted(checkpoint["amp"]),
        saved_scaler=checkpoint["amp"]["loss_scaler0"],
        resumed_scaler=amp.state_dict()["loss_scaler0"],
        resumed_outputs_equal=same,
        layer_norm=LayerNorm.__module__ + "." + LayerNorm.__name__,
        layer_norm_dtype=str(model[1].weight.dtype),
        model_dtype=str(model[0].weight.dtype),
        master_dtype=str(next(iter(amp.master_params(optimizer))).dtype))
    json.dump(result, open(args.out, "w"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
