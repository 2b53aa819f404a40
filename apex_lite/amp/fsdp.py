"""amp on PyTorch FSDP2 (``fully_shard``): what ``initialize`` checks and sets up on a sharded
model. The mesh-wide forms of amp's norms are in fsdp_norms.py.

The supported order is the one FSDP2 users write: build the model, ``fully_shard`` each block and
then the root, build the optimizer over the sharded parameters, then ``amp.initialize``. The
other order cannot work: ``fully_shard`` replaces every parameter by a DTensor shard, so amp and
the optimizer would hold tensors the model no longer uses. amp names the supported order at the
first ``scale_loss`` or ``step()`` after such a ``fully_shard`` (``sharded_after_initialize``).

How the opt levels run on FSDP2 (decided here, and why; the checks read the run's properties,
not the level's name, so O4 runs as O1 and O5 as O2):

- O0, O1, O4: every unit computes in fp32 (no ``param_dtype``, or float32), under autocast at
  O1 and O4 as without FSDP. Gradients are fp32 shards.
- O2, O5: the sharded fp32 parameters are the master weights; nothing is copied. The half compute
  is FSDP2's own: ``MixedPrecisionPolicy(param_dtype=half)`` all-gathers each unit's shards in
  half for its forward and backward. FSDP2 reduce-scatters the gradients and writes them into fp32
  gradient shards, which amp unscales and checks like an fp32 model's. The step path is chosen
  as without FSDP (``step_path.choose``): the fused step updates each master shard and its
  optimizer state in one pass over the local shards; the unfused step unscales the gradient
  shards in place (they are the masters' gradients) and runs the optimizer's own step. There
  is no half parameter to write: the next all-gather casts again.
- O3: amp casts the sharded parameters to half in place, through FSDP2's own conversion
  (``module._apply``, the path of ``model.to(dtype)``, which keeps the Parameter objects the
  optimizer holds). The optimizer steps half shards, with a static loss scale of 1.0.
- The policy is required of the user, not set by amp. FSDP2 has no public way to change a unit's
  policy after ``fully_shard``: it lives in private fields of three objects, turned into dtypes
  at the first forward, which would tie amp to one torch release. And keeping modules in fp32
  needs a unit structure that only the user's ``fully_shard`` calls can give. A unit without the
  level's policy is refused with the exact calls to write. A policy that contradicts the level is
  refused with the reason.
- ``reduce_dtype``: amp's messages ask for float32, for fp16 and for bf16 alike. The gradient
  shards are fp32 either way (FSDP2 casts the reduced gradient to the parameter's dtype), so an
  fp32 reduce costs only the reduce-scatter's bytes (twice a half reduce's). In return the sum of
  the ranks' scaled gradients is not rounded to 8 bits (bf16) or 11 bits (fp16), and in fp16 a
  sum of finite terms cannot overflow into a skip that no rank's own gradients asked for. A
  ``reduce_dtype`` equal to the run's half dtype is accepted (where it computes in half).
- Kept fp32 modules (``keep_batchnorm_fp32``, ``keep_fp32_modules``): FSDP2 computes every
  parameter of a unit in one dtype, so each kept module must be a unit of its own that computes
  in fp32 (``fully_shard(model.bn)``, no ``param_dtype``). amp hands it the half activations
  or casts them to fp32, and its output back to half, as without FSDP (casting.py's ``wrap_kept``).
  A kept module inside a half unit is refused, and the message names the calls.
- Parameters outside every unit (a model partly sharded, with no ``fully_shard`` at its root)
  are plain tensors and take amp's usual path (O2, O5: cast to half, with fp32 master copies).
  FSDP2 does not synchronise their gradients; that stays the user's business, as without amp.
- The overflow flag is all-reduced (MAX) over the process group of the parameters' device mesh,
  so every rank skips or steps together. Norms for clipping sum the local shards' squares over
  the mesh. The kernels run on local shards (``local_shards``).
- ``FusedLAMB`` and ``FusedNovoGrad`` are refused on sharded parameters: LAMB's trust ratio and
  NovoGrad's per-layer gradient norm need each parameter's whole norm, which a shard-local
  kernel does not see.

What amp cannot see under FSDP2: a ``loss.backward()`` outside ``scale_loss`` after the
block's own backward and before ``step()``. FSDP2 writes the gradient shards itself, so the
post-accumulate-grad hooks that catch it elsewhere never fire on them.
"""
from __future__ import annotations

import dataclasses
import itertools
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..optimizers.fused_lamb import FusedLAMB
from ..optimizers.fused_novograd import FusedNovoGrad
from ..optimizers.update import dtensor_class, local_shards
from . import casting
from .opt_levels import HALF_DTYPES, OPT_LEVELS

__all__ = ["Sharding", "inspect", "is_sharded", "local_shards", "sharded_after_initialize",
           "newly_sharded", "registered_unsharded"]

_KEEP_OPTIONS = "keep_batchnorm_fp32 / keep_fp32_modules"


def is_sharded(tensor) -> bool:
    """Whether ``tensor`` is a DTensor (an FSDP2 shard)."""
    dtensor = dtensor_class()
    return dtensor is not None and isinstance(tensor, dtensor)


def _fsdp_module_class() -> Optional[type]:
    """FSDP2's ``FSDPModule``, or None while nothing has imported FSDP2 (no model can be sharded
    then). torch 2.6+ has it in torch.distributed.fsdp, 2.4-2.5 in the _composable package."""
    for name in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        cls = getattr(sys.modules.get(name), "FSDPModule", None)
        if cls is not None:
            return cls
    return None


def _policy(module: torch.nn.Module):
    """The ``MixedPrecisionPolicy`` that ``fully_shard`` gave ``module``. FSDP2 has no public
    getter: this reads the unit's state, the one private read amp makes of FSDP2."""
    try:
        return module._get_fsdp_state()._mp_policy
    except AttributeError as exc:
        raise RuntimeError(
            f"apex_lite cannot read the MixedPrecisionPolicy of a fully_shard unit "
            f"({type(module).__name__}) in torch {torch.__version__}, whose FSDP2 keeps it "
            f"elsewhere; amp needs it to check the policy against the opt level. Please report "
            f"this with your torch version.") from exc


def _expression(model_label: str, name: str) -> str:
    """Python that reaches the submodule ``name`` (as ``named_modules`` spells it) of the model
    called ``model_label``: "blocks.0.norm" -> "model.blocks[0].norm"."""
    if not name:
        return model_label
    out = model_label
    for part in name.split("."):
        if part.isdigit():
            out += f"[{part}]"
        elif part.isidentifier():
            out += f".{part}"
        else:
            return f"{model_label}.get_submodule({name!r})"
    return out


def _unit_label(name: str) -> str:
    return f"{name!r}" if name else "the root"


@dataclasses.dataclass
class Unit:
    """One ``fully_shard`` unit of a model: the module it was called on, its policy, and the
    parameters it shards (those of the module not claimed by a unit further down)."""
    model_index: int
    name: str
    module: torch.nn.Module
    policy: object
    params: List[Tuple[str, torch.nn.Parameter]]

    def compute_dtype(self) -> torch.dtype:
        """The dtype of the unit's forward and backward: the policy's ``param_dtype``, else the
        parameters' own."""
        return self.policy.param_dtype or self.params[0][1].dtype

    def unsharded_bytes(self) -> int:
        """Bytes of the unit's parameters all-gathered for its forward and backward."""
        size = self.compute_dtype().itemsize
        return sum(p.numel() * size for _, p in self.params)


class Sharding:
    """What ``initialize`` learned about the FSDP2 units of its models (``inspect``)."""

    def __init__(self, units: List[Unit], mesh, models: Sequence[torch.nn.Module]):
        self.units = units
        self.mesh = mesh
        self.models = list(models)
        self.model_count = len(self.models)

    # ---- what the run uses -------------------------------------------------------------------
    def process_group(self):
        """The group over which every rank of the mesh must decide together: the mesh's own
        group when it has one dimension, else a group of all its ranks."""
        if self.mesh.ndim == 1:
            return self.mesh.get_group()
        ranks = sorted(self.mesh.mesh.flatten().tolist())
        if len(ranks) == dist.get_world_size():
            return None   # the default group
        return dist.new_group(ranks)

    def world_size(self) -> int:
        return self.mesh.size()

    # ---- validation (before initialize changes anything) ---------------------------------
    def check(self, properties,
              kept: Sequence[Sequence[Tuple[str, torch.nn.Module]]]) -> None:
        """Raise when a unit's policy does not give the opt level's dtypes (see the module
        doc), when a kept fp32 module shares a unit with half parameters, or when O2 finds units
        without a policy (the error shows the fully_shard calls to write)."""
        half = properties.half_dtype
        casts_half = properties.cast_model_type in HALF_DTYPES
        level = properties.opt_level
        computes_half = casts_half or properties.patch_torch_functions_type is not None
        missing: List[Unit] = []
        for unit in self.units:
            kept_ids = {id(p) for _, module in kept[unit.model_index]
                        for p in module.parameters()}
            flags = [id(p) in kept_ids for _, p in unit.params]
            if any(flags) and not all(flags):
                raise ValueError(self._mixed_unit_message(unit, kept[unit.model_index],
                                                          properties))
            is_kept = all(flags)
            want = properties.cast_model_type if casts_half and not is_kept else torch.float32
            # The parameters' dtype once amp has cast them: half only without master weights
            # (O3); O2's sharded fp32 parameters are the masters and stay fp32.
            stored = half if casts_half and not properties.master_weights and not is_kept \
                else torch.float32
            param_dtype = unit.policy.param_dtype
            computes = param_dtype or stored
            if computes != want:
                if param_dtype is None and want in HALF_DTYPES:
                    missing.append(unit)
                    continue
                raise ValueError(self._conflict_message(unit, properties, want, is_kept))
            allowed = (None, torch.float32, half) if computes_half else (None, torch.float32)
            if unit.policy.reduce_dtype not in allowed:
                raise ValueError(
                    f"amp.initialize(opt_level={level!r}): {self._where(unit)} reduces "
                    f"gradients in {unit.policy.reduce_dtype} (MixedPrecisionPolicy's "
                    f"reduce_dtype), but at {level} the reduce runs in float32"
                    f"{f' or in the half dtype {half}' if computes_half else ''}. Pass "
                    f"reduce_dtype=torch.float32 to its fully_shard call.")
        if missing:
            raise ValueError(self._missing_policy_message(missing, properties))

    def check_optimizers(self, optimizers: Sequence[torch.optim.Optimizer],
                         model_params: set) -> None:
        """Raise for an optimizer built before ``fully_shard`` (it holds the tensors the model
        had then) and for FusedLAMB and FusedNovoGrad on shards."""
        for i, opt in enumerate(optimizers):
            params = [p for group in opt.param_groups for p in group["params"]]
            stale = next((p for p in params if id(p) not in model_params
                          and not is_sharded(p)), None)
            if stale is not None:
                raise ValueError(
                    f"optimizer {i} holds a tensor of shape {tuple(stale.shape)} that the "
                    f"sharded model no longer has: fully_shard replaces each parameter by a "
                    f"DTensor shard, so an optimizer must be built after it. The order is: "
                    f"build the model; fully_shard each block, then the root; optimizer = "
                    f"torch.optim.AdamW(model.parameters(), ...); then model, optimizer = "
                    f"amp.initialize(model, optimizer, ...).")
            if isinstance(opt, (FusedLAMB, FusedNovoGrad)) and \
                    any(is_sharded(p) for p in params):
                what = "trust ratio" if isinstance(opt, FusedLAMB) else "per-layer gradient norm"
                raise ValueError(
                    f"optimizer {i} is {type(opt).__name__} over parameters sharded by "
                    f"fully_shard; its {what} needs each parameter's whole norm, which a "
                    f"shard-local kernel cannot compute. Use FusedAdam or torch.optim.AdamW on "
                    f"a sharded model.")

    def _model_label(self, index: int) -> str:
        return "model" if self.model_count == 1 else f"models[{index}]"

    def _where(self, unit: Unit) -> str:
        what = "the fully_shard unit at the root" if not unit.name else \
            f"the fully_shard unit {unit.name!r}"
        return what if self.model_count == 1 else f"{what} of model {unit.model_index}"

    def _call(self, unit: Unit, policy: str) -> str:
        target = _expression(self._model_label(unit.model_index), unit.name)
        return f"fully_shard({target}{', mp_policy=' + policy if policy else ''})"

    def _bottom_up(self, units: List[Unit]) -> List[Unit]:
        """``units`` in the order fully_shard must be called: each after the units inside it,
        siblings in model order (where its subtree ends in ``named_modules``, deeper first)."""
        position = {}
        for index, model in enumerate(self.models):
            names = [name for name, _ in model.named_modules()]
            for unit in units:
                if unit.model_index == index:
                    end = max(i for i, name in enumerate(names) if not unit.name or
                              name == unit.name or name.startswith(unit.name + "."))
                    depth = unit.name.count(".") + 1 if unit.name else 0
                    position[id(unit)] = (index, end, -depth)
        return sorted(units, key=lambda u: position[id(u)])

    @staticmethod
    def _policy_line(half: torch.dtype) -> str:
        return (f"mp_policy = MixedPrecisionPolicy(param_dtype={half}, "
                f"reduce_dtype=torch.float32)")

    def _missing_policy_message(self, units: List[Unit], properties) -> str:
        half = properties.half_dtype
        units = self._bottom_up(units)
        names = ", ".join(_unit_label(u.name) for u in units)
        calls = "\n".join(f"    {self._call(u, 'mp_policy')}" for u in units)
        return (
            f"amp.initialize(opt_level={properties.opt_level!r}) on a model sharded with "
            f"fully_shard: {properties.opt_level} computes in {half}, and on FSDP2 that is "
            f"FSDP2's own mixed precision, which these units lack (they would compute in "
            f"float32): {names}. Pass the policy to their fully_shard calls:\n"
            f"    from torch.distributed.fsdp import MixedPrecisionPolicy\n"
            f"    {self._policy_line(half)}\n{calls}\n"
            f"The sharded fp32 parameters stay the master weights (nothing is copied); "
            f"reduce_dtype=torch.float32 sums the ranks' gradients in fp32. amp does not set "
            f"the policy itself: FSDP2 has no public way to change it after fully_shard.")

    def _conflict_message(self, unit: Unit, properties, want: torch.dtype,
                          is_kept: bool) -> str:
        level, half = properties.opt_level, properties.half_dtype
        computes = unit.policy.param_dtype
        where = self._where(unit)
        if is_kept:
            return (f"amp.initialize(opt_level={level!r}): {where} holds modules kept in fp32 "
                    f"({_KEEP_OPTIONS}), but its MixedPrecisionPolicy "
                    f"computes them in {computes}. Give it no param_dtype: "
                    f"{self._call(unit, '')}.")
        if want == torch.float32:   # O0, O1, O4, or a model left in fp32
            levels = "'O2' or 'O5'" if computes == torch.bfloat16 else "'O2'"
            return (f"amp.initialize(opt_level={level!r}): {where} computes in {computes} "
                    f"(MixedPrecisionPolicy(param_dtype={computes})), but {level} computes in "
                    f"float32{' under autocast' if properties.patch_torch_functions else ''}. "
                    f"For half compute with fp32 master weights on FSDP2, use opt_level={levels} "
                    f"with this policy; or remove param_dtype from its fully_shard call.")
        if properties.master_weights:
            fix = f"{self._policy_line(half)}; {self._call(unit, 'mp_policy')}"
        else:
            fix = (f"{self._call(unit, '')} (amp casts the shards to {half}) or "
                   f"mp_policy=MixedPrecisionPolicy(param_dtype={half})")
        like = OPT_LEVELS[level].like   # O5 is bf16 by definition: O2 takes another half dtype
        other = f"; or choose {f'opt_level={like!r} with ' if like else ''}half_dtype={computes} " \
            f"in amp.initialize" if computes in HALF_DTYPES else ""
        return (f"amp.initialize(opt_level={level!r}): {where} computes in {computes}, but "
                f"{level} computes in {want} (half_dtype). Pass the policy of the level: "
                f"{fix}{other}.")

    def _mixed_unit_message(self, unit: Unit, kept, properties) -> str:
        unit_ids = {id(p) for _, p in unit.params}
        inside = [name for name, module in kept
                  if any(id(p) in unit_ids for p in module.parameters())]
        label = self._model_label(unit.model_index)
        calls = "\n".join(f"    fully_shard({_expression(label, name)})" for name in inside)
        policy = "mp_policy=mp_policy" if properties.master_weights else ""
        parent = f"fully_shard({_expression(label, unit.name)}{', ' + policy if policy else ''})"
        return (
            f"amp.initialize(opt_level={properties.opt_level!r}): "
            f"{', '.join(map(repr, inside))} {'is' if len(inside) == 1 else 'are'} kept in fp32 "
            f"({_KEEP_OPTIONS}), but {self._where(unit)} shards their parameters with others that "
            f"compute in {properties.half_dtype}; FSDP2 computes all parameters of a unit in "
            f"one dtype. Make each kept module a unit of its own, computing in fp32 (no "
            f"param_dtype), before its parent's call:\n{calls}\n    {parent}\n"
            f"or let them compute in half (keep_batchnorm_fp32=False, or drop them from "
            f"keep_fp32_modules).")

    # ---- setting the model up (after validation) ---------------------------------------------
    @staticmethod
    def cast_model(model: torch.nn.Module, dtype: torch.dtype,
                   kept: Sequence[Tuple[str, torch.nn.Module]], *, cast_shards: bool) -> None:
        """Cast ``model``'s floating buffers and unsharded parameters to ``dtype`` outside its
        ``kept`` modules (Parameter objects keep their identity; under O2 masters.py has taken the
        unsharded parameters' masters first), and with ``cast_shards`` (O3) the sharded
        parameters too; kept modules keep fp32 parameters and hand ``dtype`` back."""
        keep = {id(t) for _, module in kept
                for t in itertools.chain(module.parameters(), module.buffers())}

        def to_half(t: torch.Tensor) -> torch.Tensor:
            if id(t) in keep or not t.is_floating_point() or (is_sharded(t) and not cast_shards):
                return t
            return t.to(dtype)

        if cast_shards:
            # FSDP2's conversion path (what model.to(dtype) runs): each unit re-registers its
            # shards after the cast.
            model._apply(to_half)
        else:
            # Nothing FSDP2 holds changes: buffers (FSDP2 does not shard them) and parameters
            # outside every unit, where they stand.
            for module in model.modules():
                for name, buf in module._buffers.items():
                    if buf is not None:
                        module._buffers[name] = to_half(buf)
                for param in module._parameters.values():
                    cast = None if param is None else to_half(param)
                    if cast is not param:
                        param.data = cast   # the Parameter object stays
        for _, module in kept:
            casting.wrap_kept(module, dtype)

    # ---- amp.report --------------------------------------------------------------------------
    def largest_unit(self) -> Tuple[str, int, List[str]]:
        """The label and bytes of the unit whose all-gathered parameters are the largest (what a
        rank holds beyond its shards while a unit computes), and the dtypes units compute in."""
        largest = max(self.units, key=Unit.unsharded_bytes)
        dtypes = sorted({str(u.compute_dtype()) for u in self.units})
        return _unit_label(largest.name), largest.unsharded_bytes(), dtypes


def inspect(models: Sequence[torch.nn.Module]) -> Optional[Sharding]:
    """The FSDP2 units of ``models``, or None when none is sharded. Reshards the units first
    (public ``FSDPModule.reshard``), so that the shards are the registered parameters even if a
    forward ran before ``initialize``. Raises for DTensor parameters that no unit holds and for
    units on different meshes."""
    fsdp_module = _fsdp_module_class()
    if fsdp_module is None and dtensor_class() is None:
        return None
    units: List[Unit] = []
    meshes = []
    for index, model in enumerate(models):
        owners: Dict[str, torch.nn.Module] = {}
        if fsdp_module is not None:
            for name, module in model.named_modules():
                if isinstance(module, fsdp_module):
                    module.reshard()
                    owners[name] = module
        by_owner: Dict[str, Unit] = {}
        for name, param in model.named_parameters():
            if not is_sharded(param):
                continue
            owner = _owner(name, owners)
            if owner is None:
                raise ValueError(
                    f"parameter {name!r} of model {index} is a DTensor that no fully_shard unit "
                    f"of this model holds: amp supports models sharded with FSDP2's fully_shard. "
                    f"Pass the module that fully_shard was applied to (the root), not a part "
                    f"of it.")
            unit = by_owner.get(owner)
            if unit is None:
                unit = by_owner[owner] = Unit(index, owner, owners[owner],
                                              _policy(owners[owner]), [])
                units.append(unit)
            unit.params.append((name, param))
            if param.device_mesh not in meshes:
                meshes.append(param.device_mesh)
    if not units:
        return None
    if len(meshes) > 1:
        raise ValueError(
            f"the sharded parameters live on {len(meshes)} different device meshes "
            f"({', '.join(map(str, meshes))}); amp decides every step over one mesh. Shard "
            f"all units of the model(s) given to one amp.initialize on the same mesh.")
    return Sharding(units, meshes[0], models)


def _owner(param_name: str, owners: Dict[str, torch.nn.Module]) -> Optional[str]:
    """The unit that shards ``param_name``: its innermost enclosing module that fully_shard was
    called on (fully_shard runs bottom-up, each call taking the parameters not taken below)."""
    path = param_name.rpartition(".")[0]
    while True:
        if path in owners:
            return path
        if not path:
            return None
        path = path.rpartition(".")[0]


def sharded_after_initialize(caller: str, label: str, half_dtype: torch.dtype) -> RuntimeError:
    """The error for ``fully_shard`` applied after ``amp.initialize`` (the other order);
    ``half_dtype``: the run's (fp16 on CUDA unless the user chose), which the policy it suggests
    computes in, so that the next ``initialize`` with the same arguments accepts it."""
    return RuntimeError(
        f"{caller}: {label} was sharded with fully_shard after amp.initialize, which replaced "
        f"its parameters by DTensor shards that amp and the optimizer do not hold. amp supports "
        f"the order FSDP2 uses: build the model; fully_shard each block, then the root (with "
        f"mp_policy=MixedPrecisionPolicy(param_dtype={half_dtype}, "
        f"reduce_dtype=torch.float32) for O2); build the optimizer over model.parameters(); "
        f"then model, optimizer = amp.initialize(model, optimizer, ...).")


def newly_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds fully_shard units (asked of a model that had none at
    ``initialize``, on an error path: a walk over its modules)."""
    fsdp_module = _fsdp_module_class()
    return fsdp_module is not None and any(isinstance(m, fsdp_module) for m in model.modules())


def registered_unsharded(first: torch.Tensor, now: Optional[torch.Tensor]) -> bool:
    """Whether ``now`` is FSDP2's unsharded parameter standing where the shard ``first`` was
    registered (between forward and backward of a unit that keeps its parameters unsharded
    after forward, ``reshard_after_forward=False``)."""
    return now is not None and is_sharded(first) and not is_sharded(now) \
        and now.shape == first.shape
