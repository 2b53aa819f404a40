"""apex's legacy ``amp.init()``: torch functions run in half, process-wide, until deactivated.

apex's first API (before ``initialize``) patched torch's functions so that, from ``amp.init()``
on, matrix products and convolutions ran in half and reductions and losses in fp32, whichever
model called them; ROCm apex added ``patch_type=torch.bfloat16``, and its L0 tests (the casts
and type promotion) still use it. apex_lite patches nothing: ``init`` turns ``torch.autocast`` on
for the calling thread, on the CPU and on CUDA where there is one, in ``patch_type``, which casts
the same kinds of operations (torch's autocast lists, which differ from apex's in places:
torch's documentation lists them), until the handle's ``_deactivate()``. apex's function
decorators (``half_function``, ``bfloat16_function`` and the others) act inside it, as they did.
Loss scaling belongs to ``initialize`` and ``scale_loss``: this handle does none.
"""
from __future__ import annotations

from typing import List

import torch

__all__ = ["init", "LegacyHandle"]

_PATCH_TYPES = (torch.float16, torch.bfloat16)


class LegacyHandle:
    """What ``init`` returns: ``is_active()``, and ``_deactivate()`` (apex's name), which ends the
    casts."""

    def __init__(self, patch_type: torch.dtype, enabled: bool):
        self.patch_type = patch_type
        self._contexts: List[torch.autocast] = []
        if enabled:
            device_types = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
            for device_type in device_types:
                context = torch.autocast(device_type, dtype=patch_type)
                context.__enter__()
                self._contexts.append(context)

    def is_active(self) -> bool:
        return bool(self._contexts)

    def _deactivate(self) -> None:
        while self._contexts:
            self._contexts.pop().__exit__(None, None, None)


def init(enabled=True, loss_scale="dynamic", patch_type=torch.float16, enable_caching=True,
         verbose=False, allow_banned=False) -> LegacyHandle:
    """apex's legacy ``amp.init``: cast torch's operations to ``patch_type`` (float16 or
    bfloat16) in this thread until the returned handle's ``_deactivate()``. ``loss_scale``,
    ``enable_caching``, ``verbose`` and ``allow_banned`` are accepted for apex's signature and do
    nothing here (use ``amp.initialize`` and ``amp.scale_loss`` for loss scaling). Raises
    ValueError for another ``patch_type``, as ROCm apex did (a RuntimeError there)."""
    if patch_type not in _PATCH_TYPES:
        raise ValueError(f"amp.init(patch_type={patch_type!r}): the supported types are "
                         f"torch.float16 and torch.bfloat16")
    return LegacyHandle(patch_type, bool(enabled))
