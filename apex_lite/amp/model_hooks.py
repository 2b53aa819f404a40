"""What amp hangs on the user's modules, parameters and losses, and why each is there.

On each model ``initialize`` prepares (``hang_on_model``):
- ``_DtypeGuard`` (forward pre-hook): a model cast after ``initialize`` is named before its
  forward fails deep in torch, or trains on in the wrong dtype;
- ``_ModelZeroGrad`` (replaces ``model.zero_grad`` on the instance): zeroing the model, as apex
  programs do, also clears amp's O2 master gradients and resets a fully covered optimizer;
- ``_Fp32StateDict`` (state_dict post-hook, models cast to half): the model's checkpoint holds
  fp32, under O2 the masters themselves, as apex's did;
- ``_MastersFollowModelLoads`` (load_state_dict pre- and post-hooks, O2): loading the model
  after ``initialize`` updates the masters, which the optimizer steps.

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
    """A forward pre-hook: a model whose dtype changed after ``initialize`` is named before its
    forward fails deep inside with torch's dtype mismatch (or trains on in the new dtype). The
    run is not pickled with the model."""

    def __init__(self, run, index: int):
        self.run = run
        self.index = index

    def __call__(self, module, args) -> None:
        if self.run is not None:
            self.run.check_dtypes("forward", self.index)

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


class _MastersFollowModelLoads:
    """Keep O2 masters in step with ``model.load_state_dict`` after initialize: an incoming fp32
    value becomes the master exactly; an incoming half value replaces the master only when it
    differs from the master's rounding (so loading the half weights a run saved keeps the masters
    that ``amp.load_state_dict`` restored, in either order). A module-level class with bound-
    method hooks, so that the model still pickles."""

    def __init__(self, pairs: List[tuple]):
        self.pairs = pairs
        self.incoming: Dict[int, torch.Tensor] = {}

    def capture(self, module, state_dict, prefix, *args):
        self.incoming.clear()
        for name, _, master in self.pairs:
            value = state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor) and value.dtype == torch.float32 \
                    and value.shape == master.shape:
                self.incoming[id(master)] = value

    def apply(self, module, incompatible_keys):
        with torch.no_grad():
            for _, model_param, master in self.pairs:
                value = self.incoming.get(id(master))
                if value is not None:
                    master.copy_(value)
                elif not torch.equal(master.to(model_param.dtype), model_param):
                    master.copy_(model_param)
        self.incoming.clear()


class _Fp32StateDict:
    """``state_dict()`` of a model cast to half holds fp32, as apex's did, and better: under O2
    each parameter's fp32 master itself (exact: a model checkpoint alone resumes bit for bit and
    loads into a plain fp32 model); every other half tensor (O3's parameters, half buffers)
    upcast to fp32, which is exact. fp32-kept modules are fp32 already. A state_dict post-hook
    of a module-level class, so that the model still pickles."""

    def __init__(self, pairs: List[tuple]):
        self.masters = {name: master for name, _, master in pairs}

    def __call__(self, module, state_dict, prefix, local_metadata) -> None:
        for key, value in state_dict.items():
            if not key.startswith(prefix) or not isinstance(value, torch.Tensor):
                continue
            master = self.masters.get(key[len(prefix):])
            if master is not None:
                state_dict[key] = master.detach()
            elif value.dtype in (torch.float16, torch.bfloat16):
                state_dict[key] = value.detach().float()


def hang_on_model(model: torch.nn.Module, run, index: int, cast_to_half: bool) -> None:
    """Hang the model's hooks (see the module's docstring) on model ``index`` of ``run``, after
    its cast and its masters were made."""
    pairs = run.master_pairs[index]
    if cast_to_half:
        if pairs:
            follower = _MastersFollowModelLoads(pairs)
            model.register_load_state_dict_pre_hook(follower.capture)
            model.register_load_state_dict_post_hook(follower.apply)
        model.register_state_dict_post_hook(_Fp32StateDict(pairs))
    model.zero_grad = _ModelZeroGrad(model, run)
    model.register_forward_pre_hook(_DtypeGuard(run, index))


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
        self._model_of = amp_opt.model_of
        self._hooks: List = []

    def watch(self, masters: List[torch.Tensor]) -> None:
        """Watch the model parameters behind ``masters`` (those that take gradients)."""
        for master in masters:
            model_param = self._model_of.get(master, master)
            if model_param.requires_grad:
                self._hooks.append(model_param.register_post_accumulate_grad_hook(self._watch))

    def remove(self) -> None:
        """Take the hooks off (a later initialize of the same model takes them over)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
