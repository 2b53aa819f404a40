"""``amp.FP8``: the options of fp8 matmuls under amp, one frozen config (``initialize(...,
fp8=amp.FP8(...))``; ``fp8=True`` is ``amp.FP8()``).

Note: the default ``min_features``. fp8 pays off on a Linear when the time its three matmuls
save (they run at about twice bf16's rate on Hopper and newer) exceeds the time spent casting
the input, the weight and the gradient to fp8 (an amax pass, a cast pass, a transposed copy
for the backward: about 7 bytes moved per element with the casts compiled, about 16 eager).
For ``M`` tokens and a square ``d x d`` layer on an H100 (bf16 ~720 TFLOP/s achieved, fp8
~1350, HBM ~2.9 TB/s) that is ``6Md^2/720e12 - 6Md^2/1350e12 > 7(2Md + d^2)/2.9e12 + ~30 us``
of small kernels: d = 2048 gains ~1.1x at 16k tokens and loses (~0.9x) at 4k; d = 4096 gains
~1.4x; d = 1024 loses (~0.75x). Hence 2048, an estimate: no GPU was lent while this was
written, so it is arithmetic, not a measurement. ``bench/fp8.py`` on a GPU
(``tools/gpu_check.sh``) measures the crossover over a grid of shapes and prints the smallest
size where fp8 is not slower; pass ``min_features=`` for your shapes.
"""
from __future__ import annotations

import dataclasses
import fnmatch
from typing import Optional, Tuple

import torch

RECIPES = ("current", "delayed")
# CUDA's rule for fp8 matmuls (cuBLASLt): the dimensions a matrix is laid out along are
# multiples of 16. Enforced on every device, so that a CPU run tells what a GPU run will do.
MULTIPLE = 16
DEFAULT_MIN_FEATURES = 2048


@dataclasses.dataclass(frozen=True)
class FP8:
    """How amp runs ``nn.Linear`` matmuls in fp8 (at O2 and O5): pass
    ``amp.initialize(..., fp8=amp.FP8(...))``, or ``fp8=True`` for these defaults.

    Each eligible Linear (``torch.nn.Linear`` itself or a subclass that keeps its ``forward``;
    in and out features multiples of 16 and both at least ``min_features``; in the half model,
    not in a module kept fp32) runs its forward matmul and both backward matmuls through
    ``torch._scaled_mm``: the input and the weight in float8_e4m3fn, the output's gradient in
    float8_e5m2, each with one scale per tensor, accumulated in fp32, written in the layer's
    half dtype. The weights, the masters, the optimizer and the checkpoints are as at O2.

    Scales are powers of two: the largest ``2**k`` that keeps the tensor's amax within the
    format's largest value (divided by ``2**margin``), so the scaling itself never rounds and
    the result is the same on every device and under ``torch.compile``.

    Args:
        recipe: "current" (default): each tensor's scale comes from its own amax, at every call.
            "delayed": as Transformer Engine's DelayedScaling, from the largest amax of the
            last ``amax_history`` steps (a step: the forwards and backwards between two
            ``optimizer.step()`` calls, whose amaxes are folded in at the second; a forward,
            for a model initialised without an optimizer); a tensor
            above that range is clipped at the format's largest value (the saturation counts
            say so). A layer with no history yet (the first step) uses its current amax. Each
            step's amaxes are all-reduced (max) over the run's process group, so every rank
            scales alike.
        amax_history: steps of amax history per tensor under "delayed" (default 16).
        min_features: the smallest in and out features a Linear may have to run in fp8
            (default 2048: the module's docstring says why); smaller layers stay in half.
        margin: scales are divided by ``2**margin`` (headroom against growth; default 0).
        exclude: Linear layers kept in half: module types, or qualified names as
            ``named_modules()`` spells them (fnmatch patterns allowed), e.g. ``("lm_head",)``.
        counts: count per layer and role (input, weight, grad) the elements clipped at the fp8
            maximum and the nonzero elements flushed to zero, on the device, read through
            ``amp.report().fp8`` (default True).
        fast_accum: the forward matmul uses the GPU's faster fp8 accumulation
            (``use_fast_accum``; the backward's never do); no effect on the CPU (default True).
        compile_casts: compile the casts to fp8 (amax, scale, cast and counts) with
            ``torch.compile`` into a few fused kernels. None (default): on CUDA, where triton
            is importable; True: required; False: never (eager casts move about twice the
            bytes, which makes fp8 slower than half on most layers).

    Raises:
        ValueError: an unknown recipe, or a value out of range.
        TypeError: an ``exclude`` rule that is neither a module type nor a name.
    """
    recipe: str = "current"
    amax_history: int = 16
    min_features: int = DEFAULT_MIN_FEATURES
    margin: int = 0
    exclude: Tuple = ()
    counts: bool = True
    fast_accum: bool = True
    compile_casts: Optional[bool] = None

    def __post_init__(self):
        if self.recipe not in RECIPES:
            raise ValueError(f"amp.FP8(recipe={self.recipe!r}): the recipes are 'current' (each "
                             f"tensor scaled by its own amax) and 'delayed' (by the largest "
                             f"amax of the last amax_history steps)")
        for name, low in (("amax_history", 1), ("min_features", MULTIPLE), ("margin", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"amp.FP8({name}={value!r}): an int >= {low}")
        if self.margin > 64:
            raise ValueError(f"amp.FP8(margin={self.margin}): scales are divided by "
                             f"2**margin; a margin above 64 leaves nothing of the fp8 range")
        for name in ("counts", "fast_accum"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"amp.FP8({name}={getattr(self, name)!r}): True or False")
        if not (self.compile_casts is None or isinstance(self.compile_casts, bool)):
            raise ValueError(f"amp.FP8(compile_casts={self.compile_casts!r}): None (on CUDA "
                             f"where triton is importable), True or False")
        exclude = self.exclude
        if isinstance(exclude, (str, type)):
            exclude = (exclude,)
        exclude = tuple(exclude)
        for rule in exclude:
            if not isinstance(rule, str) and not (isinstance(rule, type)
                                                  and issubclass(rule, torch.nn.Module)):
                raise TypeError(f"amp.FP8(exclude=...) takes nn.Module subclasses or module "
                                f"names, got {rule!r}")
        object.__setattr__(self, "exclude", exclude)

    def excludes(self, name: str, module: torch.nn.Module) -> bool:
        """Whether ``exclude`` names the module ``name``.

        Args:
            name: its qualified name, as ``named_modules()`` spells it.
            module: the module.

        Returns:
            True when a rule matches it.
        """
        for rule in self.exclude:
            if isinstance(rule, str):
                if name == rule or fnmatch.fnmatchcase(name, rule):
                    return True
            elif isinstance(module, rule):
                return True
        return False

    def describe(self) -> str:
        """One line: the recipe and the options that matter for it.

        Returns:
            e.g. "recipe delayed (amax history 16 steps), min_features 2048, margin 0".
        """
        recipe = f"recipe {self.recipe}" + (f" (amax history {self.amax_history} steps)"
                                            if self.recipe == "delayed" else "")
        return (f"{recipe}, min_features {self.min_features}, margin {self.margin}, counts "
                f"{'on' if self.counts else 'off'}")


def resolve(fp8) -> Optional[FP8]:
    """``initialize``'s ``fp8`` argument as a config: None/False -> None, True -> ``FP8()``."""
    if fp8 is None or fp8 is False:
        return None
    if fp8 is True:
        return FP8()
    if isinstance(fp8, FP8):
        return fp8
    raise TypeError(f"amp.initialize(fp8=...) takes True, False, None or an amp.FP8(...) "
                    f"config, got {type(fp8).__name__}; e.g. "
                    f"fp8=amp.FP8(recipe='delayed', min_features=1024)")
