"""Fake (meta) kernels for the ``apex_lite`` ops, so torch.compile and opcheck can trace them.

The in-place and ``_out`` ops return nothing; their mutations are declared in the schemas. The
dispatcher calls these kernels instead of the C++ ones whenever a meta tensor is among the
arguments (a list that mixes CPU and meta tensors included), so they check the arguments as the
C++ kernels do (``_checks``, with the ops' argument names), except for memory overlap: meta and
fake tensors have no memory, and the real kernels check it when they run.
"""
from __future__ import annotations

from typing import List, Tuple

import torch

from . import _checks

_registered = False


def _scale_(tensors: List[torch.Tensor], scale: float, found_inf: torch.Tensor) -> None:
    _checks.check_scale_(tensors, found_inf, memory=False)


def _scale_out(inputs: List[torch.Tensor], outputs: List[torch.Tensor], scale: float,
               found_inf: torch.Tensor) -> None:
    _checks.check_scale_out(inputs, outputs, found_inf, memory=False)


def _axpby_(xs: List[torch.Tensor], ys: List[torch.Tensor], a: float, b: float,
            found_inf: torch.Tensor) -> None:
    _checks.check_axpby_(xs, ys, found_inf, memory=False)


def _axpby_out(xs: List[torch.Tensor], ys: List[torch.Tensor], outputs: List[torch.Tensor],
               a: float, b: float, found_inf: torch.Tensor) -> None:
    _checks.check_axpby_out(xs, ys, outputs, found_inf, memory=False)


def _l2norm(tensors: List[torch.Tensor], per_tensor: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    _checks.check_reduction(tensors)
    device = tensors[0].device if tensors else torch.device("cpu")
    total = torch.empty(1, dtype=torch.float32, device=device)
    norms = torch.empty(len(tensors) if per_tensor else 0, dtype=torch.float32, device=device)
    return total, norms


def _nonfinite_flags(tensors: List[torch.Tensor]) -> torch.Tensor:
    _checks.check_reduction(tensors)
    device = tensors[0].device if tensors else torch.device("cpu")
    return torch.empty(len(tensors), dtype=torch.bool, device=device)


def _fused_step(*args) -> None:
    return None


def register() -> None:
    """Registers the fake kernels once (after the ops themselves are loaded)."""
    global _registered
    if _registered:
        return
    for name, fn in (("scale_", _scale_), ("scale_out", _scale_out), ("axpby_", _axpby_),
                     ("axpby_out", _axpby_out), ("l2norm", _l2norm),
                     ("nonfinite_flags", _nonfinite_flags), ("fused_sgd_", _fused_step),
                     ("fused_adam_", _fused_step), ("fused_lamb_", _fused_step)):
        torch.library.register_fake(f"apex_lite::{name}", fn)
    # ---- issue 27: FusedMixedPrecisionLamb's op ----
    torch.library.register_fake("apex_lite::fused_lamb_mp_", _fused_step)
    # ---- end issue 27 ----
    _registered = True
