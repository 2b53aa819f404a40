"""What amp hangs on the user's modules, parameters and losses, and why each is there.

On each model ``initialize`` prepares (``hang_on_model``):
- ``_BeforeForward`` (forward pre-hook): a model cast after ``initialize`` is named before its
  forward fails deep in torch, or trains on in the wrong dtype; the data-parallel wrapper the
  forward runs in is noted (ddp.py); at O2, writes to either copy of a parameter reach the
  other before the forward computes (two_copies.py);
- ``_ModelZeroGrad`` (replaces ``model.zero_grad`` on the instance): zeroing the model, as apex
  programs do, also clears amp's O2 master gradients and resets a fully covered optimizer;
- ``_Fp32StateDict`` (state_dict post-hook, models cast to half): the model's checkpoint holds
  fp32, under O2 the masters themselves, as apex's did;
- ``_MastersFollowModelLoads`` (load_state_dict pre- and post-hooks, O2): loading the model
  after ``initialize`` updates the masters, which the optimizer steps;

On each O2 half parameter, its master (``Fp32Values``, an attribute): both hooks find the fp32
values from the parameter itself, never by module or name, so a tied parameter gives its master
under every name, and a copy of the model (deepcopy, ``torch.save(model)``) its own weights.

On each model parameter an amp optimizer updates (``BackwardWatches``):
- ``_ForeignBackward`` (post-accumulate-grad hook): a backward outside the ``scale_loss``
  blocks given that optimizer is remembered, and its ``step()`` refuses.

On each scaled loss (``scale_loss``):
- ``_BackwardWatch`` (tensor hook): whether the block ran a backward, and a refusal of one that
  runs after the block exited.

The hooks kept with a model (pickled, deep-copied) are module-level classes that drop the run
when pickled; their class paths are also importable from ``apex_lite.amp.handle``, where models
saved before this module existed find them.
"""
from __future__ import annotations

import weakref
from typing import Dict, List

import torch

from .opt_levels import HALF_DTYPES
from .pairs import FP32_ATTR, Fp32Values, fp32_truth  # noqa: F401  (old pickles' class path)


class _BackwardWatch:
    """Whether a backward ran through a ``scale_loss`` block's scaled loss, and a refusal of one
    that runs after the block exited (its gradients would never be unscaled or checked). A hook
    on the scaled loss: it runs before any gradient is written, so the refusal changes nothing."""

    def __init__(self, scaled_loss: torch.Tensor):
        self.ran = False
        self.block_exited = False
        if scaled_loss.requires_grad:
            scaled_loss.register_hook(self._on_backward)

    def _on_backward(self, grad: torch.Tensor) -> None:
        if self.block_exited:
            raise RuntimeError(
                "scaled_loss.backward() was called after its `with amp.scale_loss(...)` block "
                "exited: amp unscales and checks the gradients when the block exits, so these "
                "would reach step() still multiplied by the loss scale. Call "
                "scaled_loss.backward() inside the block.")
        self.ran = True


class _DtypeGuard:
    """The forward pre-hook of models prepared by an earlier apex_lite (``_BeforeForward`` does
    its work now); kept so that such models unpickle, where it does nothing."""

    def __init__(self, run, index: int):
        self.run = run
        self.index = index

    def __call__(self, module, args) -> None:
        if self.run is not None:
            self.run.check_dtypes("forward", self.index)

    def __getstate__(self):
        return {"run": None, "index": self.index}


class _BeforeForward:
    """A forward pre-hook on each model ``initialize`` prepared, before its forward computes:
    a model cast after ``initialize`` is named before the forward fails deep inside with torch's
    dtype mismatch (or trains on in the new dtype); the data-parallel wrapper the forward runs
    inside is noted (ddp.py); at O2, writes to either copy of its parameters made since the last
    check reach the other (two_copies.py), and the writes found next are the forward's own. The
    run is not pickled with the model."""

    def __init__(self, run, index: int):
        self.run = run
        self.index = index

    def __call__(self, module, args) -> None:
        run = self.run
        if run is None:
            return
        run.check_dtypes("forward", self.index)
        first_in_ddp = run.ddp.forward_started(sharded=run.sharding is not None)
        if len(run.pairs):
            run.copies.forward_started(before_broadcast=first_in_ddp)

    def __getstate__(self):
        return {"run": None, "index": self.index}


class _ModelZeroGrad:
    """``model.zero_grad`` after initialize (apex programs such as its DCGAN example zero the
    model, not the optimizer): also clears the O2 master gradients of those parameters and, when
    they are all of an optimizer's, resets it as ``optimizer.zero_grad()`` would (a deferred skip
    decision is made, not dropped). The run is not pickled with the model."""

    def __init__(self, model: torch.nn.Module, run):
        self.model = model
        self.run = run

    def __call__(self, set_to_none: bool = True) -> None:
        type(self.model).zero_grad(self.model, set_to_none)
        if self.run is not None:
            self.run.model_zeroed(self.model, set_to_none)

    def __getstate__(self):
        return {"model": self.model, "run": None}


# ---- a half parameter's fp32 values (pairs.py), found from the parameter itself ------------
# (Fp32Values and fp32_truth are importable here, where models pickled before pairs.py find them.)

class _MastersFollowModelLoads:
    """Keep the fp32 values a parameter carries (O2's masters; a pickled copy's carried values)
    in step with ``model.load_state_dict``. An incoming fp32 value becomes them exactly and the
    half parameter their rounding; for a tied parameter, the first of its names in
    ``named_parameters`` order that the state holds. Otherwise an incoming half value replaces
    them only when it differs from their rounding (so loading the half weights a run saved keeps
    the masters that ``amp.load_state_dict`` restored, in either order). The values are found
    from the parameters at each load, so a copy of the model (which copies its hooks) follows
    its own parameters; a live master is written through its run (two_copies.py), which the
    hooks hold weakly and drop when pickled, so that the model still pickles."""

    def __init__(self, run=None):
        self.incoming: Dict[int, torch.Tensor] = {}
        self.run = None if run is None else weakref.ref(run)

    def __getstate__(self):
        return {"incoming": {}, "run": None}

    def capture(self, module, state_dict, prefix, *args):
        run = None if getattr(self, "run", None) is None else self.run()
        if run is not None:   # writes made before the load reach the other copy first
            run.copies.sync("model.load_state_dict()")
        self.incoming.clear()
        for name, param in module.named_parameters(remove_duplicate=False):
            if getattr(param, FP32_ATTR, None) is None or id(param) in self.incoming:
                continue
            value = state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor) and value.dtype == torch.float32 \
                    and value.shape == param.shape:
                self.incoming[id(param)] = value

    def apply(self, module, incompatible_keys):
        run = None if getattr(self, "run", None) is None else self.run()
        loads = []
        with torch.no_grad():
            for param in module.parameters():
                values = getattr(param, FP32_ATTR, None)
                if values is None:
                    continue
                value = self.incoming.get(id(param))
                if value is None and torch.equal(values.tensor.to(param.dtype), param):
                    continue
                if value is None:
                    value = param.float()   # a half value that differs from their rounding
                if values.live and run is not None:
                    loads.append((values, value))
                else:
                    values.tensor.copy_(value)
                    param.copy_(values.tensor)   # torch wrote the last name's value
        if loads:
            run.copies.load(loads)
        elif run is not None:
            run.copies.record()   # torch's own copy into the half parameters
        self.incoming.clear()


class _Fp32StateDict:
    """``state_dict()`` of a model cast to half holds fp32, as apex's did, and better: under all
    the names of a parameter one tensor, its ``fp32_truth`` (under O2 the master itself: exact,
    so a model checkpoint alone resumes bit for bit and loads into a plain fp32 model; a write
    to the half model that amp did not make is taken into the master first, two_copies.py);
    every other half tensor (half buffers) upcast to fp32, which is exact. fp32-kept modules are
    fp32 already. A state_dict post-hook of a module-level class that holds the run weakly and
    drops it when pickled, so that the model still pickles and a copy of it gives its own
    weights (one pickled before held ``masters``, now unused)."""

    def __init__(self, run=None):
        self.run = None if run is None else weakref.ref(run)

    def __getstate__(self):
        return {"run": None}

    def __call__(self, module, state_dict, prefix, local_metadata) -> None:
        run = None if getattr(self, "run", None) is None else self.run()
        if run is not None:
            run.copies.sync("model.state_dict()", compare_all=True)
        truths: Dict[int, torch.Tensor] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            key = prefix + name
            if isinstance(state_dict.get(key), torch.Tensor):
                truth = truths.get(id(param))
                if truth is None:
                    truth = truths[id(param)] = fp32_truth(param)
                state_dict[key] = truth
        for key, value in state_dict.items():
            if key.startswith(prefix) and isinstance(value, torch.Tensor) \
                    and value.dtype in HALF_DTYPES:
                state_dict[key] = value.detach().float()


def hang_on_model(model: torch.nn.Module, run, index: int, cast_to_half: bool) -> None:
    """Hang the model's hooks (see the module's docstring) on model ``index`` of ``run``, after
    its cast and its masters were made; each O2 master on its half parameter (``Fp32Values``)."""
    if cast_to_half:
        if run.properties.master_weights:
            run.pairs.hang_on_parameters(index)
            follower = _MastersFollowModelLoads(run)
            model.register_load_state_dict_pre_hook(follower.capture)
            model.register_load_state_dict_post_hook(follower.apply)
        model.register_state_dict_post_hook(_Fp32StateDict(run))
    model.zero_grad = _ModelZeroGrad(model, run)
    model.register_forward_pre_hook(_BeforeForward(run, index))


class _ForeignBackward:
    """A post-accumulate-grad hook on each model parameter an optimizer updates: a backward that
    writes its gradient outside the scale_loss blocks given that optimizer is remembered until
    the gradients are cleared, and step() refuses. (amp unscales and checks a gradient when its
    block exits; one written later would be applied unscaled, still scaled, or dropped.) One
    Python call per parameter per backward; not pickled or copied with the model (torch keeps no
    hooks there).

    It holds its AmpOptimizer weakly: torch keeps a parameter's post-accumulate-grad hooks in
    its autograd metadata, where the garbage collector does not look, so a strong reference
    (AmpOptimizer -> model parameter -> hook -> AmpOptimizer) would keep the model, the
    optimizer and amp's run alive for the life of the process."""

    __slots__ = ("amp_opt",)

    def __init__(self, amp_opt):
        self.amp_opt = weakref.ref(amp_opt)

    def __call__(self, param: torch.Tensor) -> None:
        amp_opt = self.amp_opt()
        if amp_opt is not None and not amp_opt.in_scale_loss:
            amp_opt.foreign_backward = True


class BackwardWatches:
    """The ``_ForeignBackward`` hooks of one amp optimizer on the model parameters it updates."""

    def __init__(self, amp_opt):
        self._watch = _ForeignBackward(amp_opt)
        self._pairs = amp_opt.run.pairs
        self._hooks: List = []

    def watch(self, masters: List[torch.Tensor]) -> None:
        """Watch the model parameters behind ``masters`` (those that take gradients)."""
        for master in masters:
            model_param = self._pairs.model_of(master)
            if model_param.requires_grad:
                self._hooks.append(model_param.register_post_accumulate_grad_hook(self._watch))

    def remove(self) -> None:
        """Take the hooks off (a later initialize of the same model takes them over)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
