"""The attributes apex's fused optimizers carried, which code written for apex reads off them:
fairseq's ``FusedAdamV2`` (fairseq/optim/fused_adam.py) subclasses apex's ``FusedAdam`` and runs
its own step through ``self.multi_tensor_adam``, ``self._dummy_overflow_buf`` and
``self.adam_w_mode``.

- ``ApexOp(name)``: ``optimizer.multi_tensor_adam`` (and apex's other per-instance ops) is
  ``amp_C``'s op of that name (``apex_lite.apex_compat.multi_tensor``), with apex's calling
  convention.
- ``ApexMode(key, ...)``: apex kept its modes per optimizer (``adam_w_mode`` 1 or 0,
  ``use_nvlamb``, ``moment_mode``, ...), apex_lite keeps them per param group (``key``). Read,
  it is apex's value when every group agrees (a RuntimeError names the groups that differ);
  written, it sets every group and the defaults, as apex's attribute set the mode of every
  later step.
- ``DummyOverflowBuf``: ``optimizer._dummy_overflow_buf``, apex's int32 ``[0]`` noop flag, on
  the device of the optimizer's first parameter (made on first read; a plain attribute after
  that, as apex's).
"""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["ApexOp", "ApexMode", "DummyOverflowBuf"]


class ApexOp:
    """A class attribute giving ``amp_C``'s op ``name`` (apex set it on each instance)."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, obj, owner=None):
        # Imported on use: amp_C's module imports the optimizers' update code.
        from . import multi_tensor
        return getattr(multi_tensor, self.name)


class ApexMode:
    """apex's per-optimizer mode ``name`` over the param groups' option ``key``: ``to_apex``
    turns a group's value into apex's (``int`` for apex's 1/0 modes), ``from_apex`` apex's
    into a group's; ``values`` are the values apex accepted."""

    def __init__(self, key: str, to_apex: Callable = int, from_apex: Callable = bool,
                 values=(0, 1)):
        self.key = key
        self.to_apex = to_apex
        self.from_apex = from_apex
        self.values = tuple(values)
        self.name = key

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        values = [self.to_apex(group[self.key]) for group in obj.param_groups]
        if not values:
            return self.to_apex(obj.defaults[self.key])
        if len(set(values)) > 1:
            raise RuntimeError(
                f"{type(obj).__name__}.{self.name}: apex kept one {self.name} per optimizer, "
                f"and this optimizer's param groups differ ({self.key} = "
                f"{[group[self.key] for group in obj.param_groups]}); read "
                f"optimizer.param_groups[i][{self.key!r}] instead")
        return values[0]

    def __set__(self, obj, value) -> None:
        if isinstance(value, torch.Tensor) or value not in self.values:
            raise ValueError(f"{type(obj).__name__}.{self.name} = {value!r}: apex's values are "
                             f"{', '.join(map(repr, self.values))}")
        option = self.from_apex(value)
        obj.defaults[self.key] = option
        for group in obj.param_groups:
            group[self.key] = option


class DummyOverflowBuf:
    """``optimizer._dummy_overflow_buf``: an int32 ``[0]`` on the device of the optimizer's
    first parameter (CPU when it has none), made on first read and kept in the instance."""

    name = "_dummy_overflow_buf"

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        params = [p for group in obj.param_groups for p in group["params"]]
        device = params[0].device if params else torch.device("cpu")
        buffer = torch.zeros(1, dtype=torch.int32, device=device)
        # A non-data descriptor: from now on the instance's own attribute answers (and a write
        # replaces it, as apex's plain attribute).
        obj.__dict__[self.name] = buffer
        return buffer
