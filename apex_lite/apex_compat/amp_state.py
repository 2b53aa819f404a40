"""``amp._amp_state``: what apex kept in its global ``_amp_state`` (the loss scalers, the opt
level's properties, the handle, the verbosity), as views over an ``AmpHandle``'s run. apex code
that reads them works; apex code that writes them is told which API does it instead, except for
the loss scalers' internals that apex code sets (``loss_scaler.py``: ``_loss_scale``,
``_scale_seq_len``, ``_overflow_buf`` and ``update_scale()``), which take effect as in apex.
``import apex.amp._amp_state`` (DeepLearningExamples' GNMT) gives the view itself, as apex's
package attribute shadowed its module of that name (``alias.py``).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

from ..amp.opt_levels import Properties
from .loss_scaler import apex_loss_scaler

if TYPE_CHECKING:
    from ..amp.handle import AmpHandle

_STATE_API = ("amp.initialize(...) (opt level, loss_scale, verbosity), amp.load_state_dict(...) "
              "(a saved loss scale) and amp.loss_scalers() (to read the scalers)")


class _ReadOnlyView:
    """Attributes with apex's names over apex_lite's state; writing one raises, naming the API
    that does it (apex code that set apex's state would otherwise change nothing, silently)."""

    __slots__ = ()
    _what = "amp._amp_state"

    def __setattr__(self, name, value):
        raise AttributeError(f"{self._what} is a read-only view in apex_lite: {name!r} cannot be "
                             f"set. Use {_STATE_API} instead.")

    def __delattr__(self, name):
        self.__setattr__(name, None)

    def __getattr__(self, name):
        mapped = sorted(n for n, v in vars(type(self)).items()
                        if isinstance(v, property) or (callable(v) and not n.startswith("__")))
        if name in mapped:   # a mapped property raised AttributeError: let its message through
            return vars(type(self))[name].__get__(self)
        raise AttributeError(f"{self._what} (apex_lite's read-only view of apex's state) has no "
                             f"attribute {name!r}; it maps {mapped}")


class ApexPropertiesView(_ReadOnlyView):
    """``_amp_state.opt_properties``: the run's resolved properties under apex's names, with
    apex's ``options`` dict and ``enabled``."""

    __slots__ = ("_options",)
    _what = "amp._amp_state.opt_properties"

    def __init__(self, properties: Optional[Properties]):
        options = {"enabled": properties is not None}
        if properties is not None:
            options.update((f.name, getattr(properties, f.name))
                           for f in dataclasses.fields(properties))
        object.__setattr__(self, "_options", options)

    @property
    def options(self) -> dict:
        return dict(self._options)

    def __getattr__(self, name):
        options = object.__getattribute__(self, "_options")
        if name in options:
            return options[name]
        raise AttributeError(f"{self._what} has no attribute {name!r}; it has "
                             f"{sorted(options)}")


class AmpStateView(_ReadOnlyView):
    """``amp._amp_state``: what apex kept in its global ``_amp_state``, read from a handle (the
    default one; resolved at every read, so that it follows re-initialisation):
    ``loss_scalers`` (apex's ``loss_scale()`` on each), ``opt_properties``, ``handle`` and
    ``verbosity``. Read-only: writing raises, naming the public API."""

    __slots__ = ("_handle_of",)

    def __init__(self, handle_of):
        object.__setattr__(self, "_handle_of", handle_of)

    @property
    def handle(self) -> "AmpHandle":
        return self._handle_of()

    @property
    def loss_scalers(self) -> tuple:
        run = self.handle._run
        if run is None or not run.enabled:
            return ()
        return tuple(apex_loss_scaler(scaler, run) for scaler in run.scalers)

    @property
    def opt_properties(self) -> ApexPropertiesView:
        run = self.handle._run
        if run is None:
            raise AttributeError("amp._amp_state.opt_properties is set by amp.initialize, which "
                                 "has not been called yet (apex had none before it either)")
        return ApexPropertiesView(run.properties if run.enabled else None)

    @property
    def verbosity(self) -> int:
        run = self.handle._run
        return getattr(run, "verbosity", 1)   # apex's default before initialize

    def __repr__(self) -> str:
        run = self.handle._run
        if run is None:
            return "<amp._amp_state (apex_lite): before amp.initialize>"
        if not run.enabled:
            return "<amp._amp_state (apex_lite): amp disabled>"
        return (f"<amp._amp_state (apex_lite): {run.properties.opt_level}, "
                f"{len(run.scalers)} loss scaler(s)>")
