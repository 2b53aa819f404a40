"""timm drives apex_lite as it drives apex: timm's ``ApexScaler`` (``timm.utils``) trains timm models
at O1 and O2 through the ``apex`` alias, timm's code unmodified. Run by tools/gpu_check.sh as

    python -m apex_lite.apex_alias tools/gpu_timm_check.py [--device cuda] [--steps 30]

(the alias must be in place before timm imports apex: timm.utils.cuda sets ``has_apex`` at its
import). Per model and level: a few steps of SGD on one fixed batch through
``ApexScaler.__call__`` (scale_loss, backward, clip of ``amp.master_params``, step), the first
and last losses (the last must be finite and lower), and ``ApexScaler.state_dict()`` loaded back
(timm's checkpoint of the amp state). Prints one JSON line per run and exits 1 when one fails.
"""
from __future__ import annotations

import argparse
import inspect
import json
import sys
import time

import torch

# (timm model name, keyword arguments, input shape without the batch)
MODELS = [("resnet18", {}, (3, 32, 32)),
          ("vit_tiny_patch16_224", {"img_size": 64}, (3, 64, 64))]


def train(model_name: str, kwargs: dict, shape, level: str, device, steps: int) -> dict:
    import timm
    from apex import amp   # the alias: apex_lite's amp
    from timm.utils import ApexScaler
    torch.manual_seed(0)
    model = timm.create_model(model_name, num_classes=10, **kwargs).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, verbosity=0)
    scaler = ApexScaler()
    # Older timm versions whose __call__ leaves the step to the caller have a step() and no
    # need_update; today's step in __call__.
    leaves_step = hasattr(scaler, "step") and \
        "need_update" not in inspect.signature(ApexScaler.__call__).parameters
    x = torch.randn(8, *shape, device=device)
    y = torch.randint(0, 10, (8,), device=device)
    losses = []
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        scaler(loss, optimizer, clip_grad=1.0, clip_mode="norm",
               parameters=list(model.parameters()))
        if leaves_step:
            scaler.step(optimizer)
        losses.append(float(loss))
    seconds = time.perf_counter() - start
    state = scaler.state_dict()
    scaler.load_state_dict(state)
    ok = bool(torch.isfinite(torch.tensor(losses[-1]))) and losses[-1] < losses[0]
    ok = ok and isinstance(state, dict) and "loss_scaler0" in state
    amp.initialize([], enabled=False)
    return {"model": model_name, "level": level, "ok": ok, "first_loss": losses[0],
            "last_loss": losses[-1], "steps": steps, "seconds": round(seconds, 3),
            "state_keys": sorted(state) if isinstance(state, dict) else repr(state)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--levels", default="O1,O2")
    args = parser.parse_args(argv)
    import timm
    import timm.utils.cuda as timm_cuda
    import apex
    print(json.dumps({"timm": timm.__version__, "apex": getattr(apex, "__file__", "?"),
                      "timm_has_apex": bool(getattr(timm_cuda, "has_apex", False))}))
    if not getattr(timm_cuda, "has_apex", False):
        print("timm.utils.cuda found no apex: run through python -m apex_lite.apex_alias")
        return 1
    failed = 0
    for name, kwargs, shape in MODELS:
        for level in args.levels.split(","):
            try:
                result = train(name, kwargs, shape, level, torch.device(args.device), args.steps)
            except Exception as exc:   # reported per run, the other runs go on
                result = {"model": name, "level": level, "ok": False,
                          "error": f"{type(exc).__name__}: {exc}"}
            failed += not result["ok"]
            print(json.dumps(result))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
