"""An optimizer's ``state`` and its groups' ``params`` lists that count their changes, so that
the fused steps' cached lists see a state tensor, a state entry or a parameter replaced.

The fused updates (``update.py``) build their tensor lists once and reuse them, held in C++ with
the native backend, while the parameter set and the state stay the same. torch's optimizers look
``state[p]`` up at every step, so code that replaces a state tensor
(``optimizer.state[p]["exp_avg"] = torch.zeros_like(p)``, a common way to reset a moment) or a
whole entry (``optimizer.state[p] = {...}``) changes what they step. A cached list would go on
stepping the old tensor, and the new one would never move: a silent wrong result. Looking the
state up again at every step would be a per-parameter Python loop of the kind the cached lists
avoid (checking the three Adam entries of 4000 parameters: 0.57 ms a step on the 2-core CPU).

So the steps watch the state instead: ``watch_state(optimizer)``, called by every fused step,
gives the optimizer a ``WatchedState`` in place of its ``defaultdict(dict)`` (once; again after
``load_state_dict`` replaces it), whose dict entries become ``WatchedEntry``s holding the same
values (and so do plain dicts put there later, when a plan next covers them:
``watch_entries``). Each counts every change made to it or to the state in the state's
``version``; a plan built at one version is rebuilt at the next step when the version moved.
Setting an entry to the object it holds already is no change. That costs nothing per step but
one comparison. The fused optimizers' param groups get the same for their ``params`` lists
(``WatchedList``, ``watch_params``): their cached updates see a parameter swapped in place
(``group["params"][i] = p``), which keeps the list's identity and length.

What stays as torch has it: ``WatchedState`` is a ``defaultdict``, its entries are dicts, and
``state_dict()`` returns plain dicts (a post hook copies each entry, so that
``torch.load(..., weights_only=True)`` reads the checkpoint); pickling and ``copy.deepcopy``
give plain ones too. What differs: an entry that existed before the first fused step (loaded by
``load_state_dict``, or made by user code) is replaced by a watched dict holding the same
tensors, so a reference to the old dict object taken before that step no longer reaches the
optimizer's state. A tensor changed in place (``exp_avg.zero_()``) needs no watching: the lists
hold the tensors themselves.
"""
from __future__ import annotations

import collections

import torch

__all__ = ["WatchedState", "WatchedEntry", "WatchedList", "watch_state", "watch_entries",
           "watch_params", "state_version"]

# The optimizer attribute that records that the state_dict post hook is registered (an
# optimizer copied by deepcopy or pickle has neither the attribute nor the hook).
_HOOKED = "_apex_lite_plain_state_dict"
_ABSENT = object()


class _CountsChanges:
    """The mutating methods of a dict, each reporting a change to ``_changed()`` (setting a key
    to the object it holds already is no change)."""

    __slots__ = ()

    def _changed(self) -> None:
        raise NotImplementedError

    def __setitem__(self, key, value):
        if self.get(key, _ABSENT) is value:
            return
        super().__setitem__(key, value)
        self._changed()

    def __delitem__(self, key):
        super().__delitem__(key)
        self._changed()

    def pop(self, *args):
        self._changed()
        return super().pop(*args)

    def popitem(self):
        self._changed()
        return super().popitem()

    def clear(self):
        super().clear()
        self._changed()

    def setdefault(self, key, default=None):
        if key not in self:
            self._changed()
        return super().setdefault(key, default)

    def update(self, *args, **kwargs):
        super().update(*args, **kwargs)
        self._changed()

    def __ior__(self, other):
        self.update(other)
        return self


class WatchedState(_CountsChanges, collections.defaultdict):
    """An optimizer's ``state`` (a ``defaultdict``) whose ``version`` counts every change to it
    and to its ``WatchedEntry`` entries."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.version = 0

    def _changed(self) -> None:
        self.version += 1

    def __missing__(self, key):
        # state[p] of a parameter without state: a new watched entry, as defaultdict(dict) would
        # make a new dict.
        entry = self[key] = WatchedEntry(self)
        return entry

    def __reduce_ex__(self, protocol):
        # Pickled and deep-copied as torch's own state: a plain defaultdict.
        return (collections.defaultdict, (self.default_factory,), None, None, iter(self.items()))


class WatchedEntry(_CountsChanges, dict):
    """One parameter's entry of a ``WatchedState``: a dict whose changes count in the state's
    ``version``."""

    __slots__ = ("_state",)

    def __init__(self, state: WatchedState, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._state = state

    def _changed(self) -> None:
        self._state.version += 1

    def __reduce_ex__(self, protocol):
        # Pickled and deep-copied as a plain dict.
        return (dict, (dict(self),))


class WatchedList(list):
    """A param group's ``params`` list whose ``version`` counts every change to it, so that an
    optimizer's cached updates see a parameter replaced in place
    (``group["params"][i] = new_param``), which keeps the list's identity and length."""

    def __init__(self, *args):
        super().__init__(*args)
        self.version = 0

    def __setitem__(self, index, value):
        super().__setitem__(index, value)
        self.version += 1

    def __delitem__(self, index):
        super().__delitem__(index)
        self.version += 1

    def __iadd__(self, other):
        self.extend(other)
        return self

    def __imul__(self, count):
        result = super().__imul__(count)
        self.version += 1
        return result

    def append(self, value):
        super().append(value)
        self.version += 1

    def extend(self, values):
        super().extend(values)
        self.version += 1

    def insert(self, index, value):
        super().insert(index, value)
        self.version += 1

    def pop(self, *args):
        self.version += 1
        return super().pop(*args)

    def remove(self, value):
        super().remove(value)
        self.version += 1

    def clear(self):
        super().clear()
        self.version += 1

    def sort(self, *args, **kwargs):
        super().sort(*args, **kwargs)
        self.version += 1

    def reverse(self):
        super().reverse()
        self.version += 1

    def __reduce_ex__(self, protocol):
        # Pickled and deep-copied as a plain list.
        return (list, (list(self),))


def watch_params(group: dict) -> WatchedList:
    """``group["params"]``, made a ``WatchedList`` holding the same parameters when it is not
    one (a list put there by user code is then a new object)."""
    params = group["params"]
    if type(params) is not WatchedList:
        params = group["params"] = WatchedList(params)
    return params


def watch_state(optimizer: torch.optim.Optimizer) -> WatchedState:
    """``optimizer.state``, made a ``WatchedState`` when it is not one (its dict entries made
    ``WatchedEntry``s holding the same values); the first time, also registers the state_dict
    post hook that returns the entries as plain dicts."""
    state = optimizer.state
    if type(state) is not WatchedState:
        watched = WatchedState(getattr(state, "default_factory", dict))
        for key, entry in state.items():
            dict.__setitem__(watched, key,
                             WatchedEntry(watched, entry) if type(entry) is dict else entry)
        optimizer.state = state = watched
    if not getattr(optimizer, _HOOKED, False):
        optimizer.register_state_dict_post_hook(_plain_entries)
        setattr(optimizer, _HOOKED, True)
    return state


def watch_entries(state, params) -> None:
    """Makes the entries of ``params`` in ``state`` that are plain dicts (put there since
    ``watch_state`` made it) ``WatchedEntry``s holding the same values; a ``state`` that is not
    a ``WatchedState`` is left alone."""
    if type(state) is not WatchedState:
        return
    for p in params:
        entry = state.get(p)
        if type(entry) is dict:
            state[p] = WatchedEntry(state, entry)


def state_version(state) -> object:
    """What changes whenever ``state`` does: a ``WatchedState``'s version, None for any other
    mapping (whose changes the caller announces with ``invalidate()``)."""
    return state.version if type(state) is WatchedState else None


def _plain_entries(optimizer, state_dict: dict) -> None:
    """state_dict post hook: each ``WatchedEntry`` of ``state_dict["state"]`` as a plain dict
    (the same tensors), as torch's optimizers return it."""
    packed = state_dict["state"]
    for key, entry in list(packed.items()):
        if type(entry) is WatchedEntry:
            packed[key] = dict(entry)
