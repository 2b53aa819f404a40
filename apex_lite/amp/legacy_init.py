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
    """apex's legacy ``amp.init``: cast torch's operations to ``patch_type`` in this thread,
    through ``torch.autocast`` (CPU, and CUDA where there is one), until the returned handle's
    ``_deactivate()``. torch's autocast lists decide what runs in half, not apex's.

    Args:
        enabled: False returns a handle that casts nothing (``is_active()`` is False).
        loss_scale: accepted for apex's signature; does nothing here (use
            ``amp.initialize`` and ``amp.scale_loss`` for loss scaling).
        patch_type: ``torch.float16`` (NVIDIA apex) or ``torch.bfloat16`` (ROCm apex).
        enable_caching: accepted for apex's signature; does nothing.
        verbose: accepted for apex's signature; does nothing.
        allow_banned: accepted for apex's signature; does nothing.

    Returns:
        A ``LegacyHandle``: ``is_active()``, and ``_deactivate()``, which ends the casts.

    Raises:
        ValueError: another ``patch_type``, as ROCm apex refused it (a RuntimeError there).
    """
    if patch_type not in _PATCH_TYPES:
        raise ValueError(f"amp.init(patch_type={patch_type!r}): the supported types are "
                         f"torch.float16 and torch.bfloat16")
    return LegacyHandle(patch_type, bool(enabled))
