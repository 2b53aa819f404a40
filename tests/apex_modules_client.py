"""apex code that imports the rest of apex, as scripts written for NVIDIA apex do: apex's imagenet
example (``from apex.fp16_utils import *``, ``from apex import amp, optimizers``), transformers'
T5, timm's and Megatron's norms (``apex.normalization``, its functional forms and autograd
Functions), BERT's scripts (``import apex_C``), and ``import apex`` followed by attribute access.
It knows nothing about apex_lite: tests/test_apex_alias.py runs it through the alias and
tests/test_apex_compat.py with the ``apex`` distribution.

    python apex_modules_client.py amp normalization ...   # prints a JSON of what it found
"""
import json
import sys

import torch

import apex
from apex import amp, optimizers  # noqa: F401  (apex's imagenet example)
from apex.normalization import FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm
from apex.normalization.fused_layer_norm import (FusedLayerNormAffineFunction,
                                                 fused_layer_norm_affine, fused_rms_norm_affine)
import apex_C


def main(submodules):
    star = {}
    exec("from apex.fp16_utils import *", star)
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    weight, bias = torch.randn(8), torch.randn(8)
    expected = torch.nn.functional.layer_norm(x, (8,), weight, bias, 1e-6)
    tensors = [torch.randn(3), torch.randn(2, 2)]
    flat = apex_C.flatten(tensors)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    fp16_model = star["FP16Model"](net)
    facts = {
        "submodules": {name: getattr(apex, name).__name__ for name in submodules},
        "fp16_utils_star": sorted(name for name in star if not name.startswith("__")),
        "fp16_model": [str(p.dtype) for p in fp16_model.parameters()],
        "norm_classes": [cls.__module__ + "." + cls.__name__ for cls in
                         (FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm)],
        "layer_norm_equal": [
            torch.equal(fused_layer_norm_affine(x, weight, bias, (8,)), expected),
            torch.allclose(FusedLayerNormAffineFunction.apply(x, weight, bias, (8,), 1e-6),
                           expected, atol=1e-6),
            torch.allclose(fused_rms_norm_affine(x, weight, (8,)),
                           x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * weight,
                           atol=1e-6)],
        "apex_C": [list(flat.shape),
                   all(torch.equal(a, b) for a, b in zip(apex_C.unflatten(flat, tensors),
                                                         tensors))],
    }
    print(json.dumps(facts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
