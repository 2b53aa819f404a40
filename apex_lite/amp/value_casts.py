"""What a cast reaches inside a value: the floating tensors in a model's inputs and outputs (O2,
O3, O5, ``cast_model_outputs``) and in the arguments of apex's cast decorators.

apex's ``applier`` (amp/_initialize.py) cast tensors, called ``.to(dtype)`` on any other object
that had one (a custom batch class, apex's contract: "a .to(dtype) method which converts its
floating-point Tensors"), rebuilt Mappings as plain dicts and other iterables as
``type(value)(generator)``. Where that silently did nothing or failed, a half layer then met
fp32 or the cast raised; here instead:

- Mappings keep their type and everything on them (``defaultdict``'s ``default_factory``,
  ``OrderedDict``, ``collections.UserDict`` and transformers' ``BatchEncoding`` / ``BatchFeature``,
  ``ModelOutput``): the object is copied and its floating members replaced. apex called
  ``BatchEncoding.to(dtype)``, which only logs "not supported" and casts nothing.
- namedtuples are rebuilt as their own type (apex's ``type(value)(generator)`` raised).
- dataclasses are copied with their floating fields cast (apex left them as they were).
- An ``nn.Module`` passed as an argument is never cast (apex's ``.to(dtype)`` would have cast the
  module itself).

Integer and bool tensors (token ids, labels, masks) and everything else are left as they are.
Plain tuples, lists and dicts are rebuilt; any other value with nothing to cast is returned as it
is. The caller's objects are never changed in place.
"""
from __future__ import annotations

import collections.abc
import copy
import dataclasses
from typing import Any, Callable, Optional

import torch


def _rebuilt_sequence(value, items):
    if isinstance(value, list):
        new = copy.copy(value)
        new[:] = items
        return new
    if hasattr(type(value), "_fields"):   # a namedtuple
        return type(value)(*items)
    return type(value)(items)


def _rebuilt_mapping(value, changed: dict):
    """``value`` with ``changed`` keys replaced: a copy of its own type where it can be written
    to, a plain dict (apex's result) where it cannot."""
    if isinstance(value, collections.abc.MutableMapping):
        new = copy.copy(value)
        for key, item in changed.items():
            new[key] = item
        return new
    return {key: changed.get(key, item) for key, item in value.items()}


def _rebuilt_dataclass(value, changed: dict):
    new = copy.copy(value)
    for name, item in changed.items():
        object.__setattr__(new, name, item)   # frozen dataclasses too
    return new


def _map(value: Any, fn: Callable[[torch.Tensor], torch.Tensor],
         dtype: Optional[torch.dtype]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value) if value.is_floating_point() else value
    # A forward's positional and keyword arguments, the common case: plain containers, rebuilt.
    kind = type(value)
    if kind is tuple:
        return tuple([_map(v, fn, dtype) for v in value])
    if kind is list:
        return [_map(v, fn, dtype) for v in value]
    if kind is dict:
        return {key: _map(item, fn, dtype) for key, item in value.items()}
    if value is None or isinstance(value, (str, bytes, int, float, bool, torch.nn.Module)):
        return value
    if isinstance(value, (list, tuple)):
        items = [_map(v, fn, dtype) for v in value]
        if all(new is old for new, old in zip(items, value)):
            return value
        return _rebuilt_sequence(value, items)
    if isinstance(value, collections.abc.Mapping):
        changed = {}
        for key, item in value.items():
            new = _map(item, fn, dtype)
            if new is not item:
                changed[key] = new
        return _rebuilt_mapping(value, changed) if changed else value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changed = {}
        for field in dataclasses.fields(value):
            item = getattr(value, field.name)
            new = _map(item, fn, dtype)
            if new is not item:
                changed[field.name] = new
        return _rebuilt_dataclass(value, changed) if changed else value
    if dtype is not None and callable(getattr(value, "to", None)):
        return _to_dtype(value, dtype)
    return value


def _to_dtype(value: Any, dtype: torch.dtype) -> Any:
    """apex's contract for a custom batch class: its own ``.to(dtype)`` casts its floating
    tensors."""
    try:
        return value.to(dtype)
    except Exception as err:
        raise TypeError(
            f"amp casts the floating tensors of a model's inputs and outputs to {dtype} and, as "
            f"apex did, calls .to({dtype}) on an object it cannot look into; "
            f"{type(value).__qualname__}.to({dtype}) raised {type(err).__name__}: {err}. Give "
            f"the class a .to(dtype) that casts its floating tensors (and leaves the others), "
            f"or pass the tensors in a dict, list, tuple, namedtuple or dataclass, which amp "
            f"looks into itself.") from err


def apply_to_floats(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with ``fn`` applied to every floating tensor inside lists, tuples
    (namedtuples as their type), Mappings and dataclasses, rebuilt as their own types; other
    objects as they are (see the module's docstring)."""
    return _map(value, fn, None)


def cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with its floating tensors cast to ``dtype``, as ``apply_to_floats`` finds them;
    an object it cannot look into that has a ``.to()`` (not a module) is cast by its own
    ``.to(dtype)``, apex's contract for a custom batch class."""
    return _map(value, lambda t: t.to(dtype), dtype)


def first_tensor(value: Any) -> Optional[torch.Tensor]:
    """The first floating tensor inside ``value`` (as ``apply_to_floats`` walks it), or None."""
    found = []

    def note(t: torch.Tensor) -> torch.Tensor:
        if not found:
            found.append(t)
        return t

    _map(value, note, None)
    return found[0] if found else None
