"""Code written for ROCm apex's amp (its O4 and O5 levels, ``patch_torch_functions_type``,
``bfloat16_function``), importing apex itself: tests/test_apex_alias.py runs it in a subprocess
after apex_lite.install_apex_alias(). It catches RuntimeError around initialize, as code written
for apex does (apex raised it for a bad level or override), and reports what it saw as JSON.

    python rocm_apex_client.py --out result.json
"""
import argparse
import json
import sys
import types

import torch
from apex import amp
from apex.amp import _amp_state


def build(level, **kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return amp.initialize(model, optimizer, opt_level=level, verbosity=0, **kwargs)


def train(model, optimizer, steps):
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 8, generator=generator)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True) * 0.5)
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def refusal(level, **kwargs):
    try:
        build(level, **kwargs)
    except RuntimeError as error:
        return str(error)
    return None


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    result = {"levels": {}}
    checkpoints = {}
    for level in ("O4", "O5"):
        model, optimizer = build(level)
        options = {k: str(v) for k, v in _amp_state.opt_properties.options.items()}
        losses = train(model, optimizer, 20)
        checkpoints[level] = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                              "amp": amp.state_dict()}
        result["levels"][level] = {
            "options": options, "losses": losses,
            "model_dtype": str(model[0].weight.dtype), "bn_dtype": str(model[1].weight.dtype),
            "state_dict_dtypes": sorted({str(v.dtype) for v in model.state_dict().values()}),
            "loss_scale": _amp_state.loss_scalers[0].loss_scale(),
            "amp_state": checkpoints[level]["amp"]["loss_scaler0"]}
    # A checkpoint of each level resumed at the other.
    resumed = {}
    for saved, level in (("O4", "O5"), ("O5", "O4")):
        model, optimizer = build(level)
        model.load_state_dict(checkpoints[saved]["model"])
        optimizer.load_state_dict(checkpoints[saved]["optimizer"])
        amp.load_state_dict(checkpoints[saved]["amp"])
        resumed[f"{saved}->{level}"] = train(model, optimizer, 2)
    result["resumed"] = resumed
    result["refusals"] = {
        "O4 master_weights": refusal("O4", master_weights=False),
        "O4 fp16 patch type": refusal("O4", patch_torch_functions_type=torch.float16),
        "O1 bf16 patch type": refusal("O1", patch_torch_functions_type=torch.bfloat16),
        "O2 patch type": refusal("O2", patch_torch_functions_type=torch.float16),
        "O5 patching": refusal("O5", patch_torch_functions=True),
        "O6": refusal("O6")}
    # bfloat16_function and register_bfloat16_function inside an O4 forward.
    module = types.SimpleNamespace(mm=lambda a, b: a @ b)
    amp.register_bfloat16_function(module, "mm")

    @amp.bfloat16_function
    def add(a, b):
        return a + b

    seen = {}

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            seen.update(registered=str(module.mm(x, self.w).dtype),
                        decorated=str(add(x, x.double().float()).dtype))
            return x @ self.w

    amp.initialize(Model(), opt_level="O4", verbosity=0)(torch.randn(2, 4))
    result["bfloat16_functions"] = seen
    json.dump(result, open(args.out, "w"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
