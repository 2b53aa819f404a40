"""Where dtypes change: the model's forward (autocast for O1/O4, input/output casts for
O2/O3/O5), the modules kept fp32 inside a half model, and apex's function decorators.

Nothing here patches torch: a model's forward is wrapped on that model instance only, and the
decorators act only while ``torch.autocast`` is enabled (so they work under O1 and under a user's
own autocast, and are no-ops elsewhere).
"""
from __future__ import annotations

import contextlib
import fnmatch
import functools
import itertools
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from .value_casts import apply_to_floats, cast_floats, first_tensor

_MARK = "__apex_lite_cast__"


def _caster(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t.to(dtype)


class CastForward:
    """A model's forward under amp: floating inputs cast to ``input_dtype``, the call run under
    ``torch.autocast`` when ``autocast_dtype`` is set, floating outputs cast to ``output_dtype``.
    A module-level class (not a closure) so that a wrapped model still pickles."""

    def __init__(self, forward: Callable, device_type: str, *,
                 input_dtype: Optional[torch.dtype] = None,
                 autocast_dtype: Optional[torch.dtype] = None,
                 output_dtype: Optional[torch.dtype] = None):
        self.forward = forward
        self.device_type = device_type
        self.input_dtype = input_dtype
        self.autocast_dtype = autocast_dtype
        self.output_dtype = output_dtype
        functools.update_wrapper(self, forward)

    def __call__(self, *args, **kwargs):
        if self.input_dtype is not None:
            args = cast_floats(args, self.input_dtype)
            kwargs = cast_floats(kwargs, self.input_dtype)
        if self.autocast_dtype is not None:
            with torch.autocast(self.device_type, dtype=self.autocast_dtype):
                output = self.forward(*args, **kwargs)
        else:
            output = self.forward(*args, **kwargs)
        if self.output_dtype is not None:
            output = cast_floats(output, self.output_dtype)
        return output


def wrap_forward(module: torch.nn.Module, **cast_kwargs) -> None:
    """Replace ``module``'s forward (on the instance) with a ``CastForward`` around it."""
    device_type = next((p.device.type for p in module.parameters()), "cpu")
    module.forward = CastForward(module.forward, device_type, **cast_kwargs)


def _matches(name: str, module: torch.nn.Module, rule) -> bool:
    if isinstance(rule, str):
        return name == rule or fnmatch.fnmatchcase(name, rule)
    return isinstance(module, rule)


def modules_kept_fp32(model: torch.nn.Module, keep_batchnorm_fp32: bool,
                      keep_fp32_modules: Sequence) -> List[Tuple[str, torch.nn.Module]]:
    """The outermost modules of ``model`` that stay fp32 under a half cast: affine BatchNorm
    when ``keep_batchnorm_fp32`` (as apex), and those named by ``keep_fp32_modules`` (module types,
    or qualified names / fnmatch patterns as ``named_modules`` spells them)."""
    rules = list(keep_fp32_modules)
    kept: List[Tuple[str, torch.nn.Module]] = []
    inside: Set[int] = set()
    for name, module in model.named_modules():
        if id(module) in inside:
            continue
        is_bn = isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.affine
        if (keep_batchnorm_fp32 and is_bn) or any(_matches(name, module, r) for r in rules):
            kept.append((name, module))
            inside.update(id(m) for m in module.modules())
    return kept


def check_keep_rules(models: Sequence[torch.nn.Module], keep_fp32_modules: Sequence) -> None:
    """Refuse rules of the wrong kind, and name rules that match no module (a typo otherwise
    silently leaves the module in half)."""
    for rule in keep_fp32_modules:
        if isinstance(rule, str):
            if not any(_matches(n, m, rule) for model in models for n, m in model.named_modules()):
                raise ValueError(f"keep_fp32_modules names {rule!r}, which matches no module; "
                                 f"use a name as model.named_modules() spells it (e.g. "
                                 f"'encoder.norm') or a pattern such as '*.norm'")
        elif not (isinstance(rule, type) and issubclass(rule, torch.nn.Module)):
            raise TypeError(f"keep_fp32_modules takes nn.Module subclasses or module names, "
                            f"got {rule!r}")


# ---- modules kept fp32 inside a half model ------------------------------------------------
#
# Note [kept norms run on the half activations]: apex kept BatchNorm's parameters fp32 and ran it
# on the half activations (cuDNN's batch norm takes that mix); torch's kernels do the same today.
# Casting a kept BatchNorm's input to fp32 instead makes it save an fp32 copy of its input for
# backward where the half activation would do (twice the bytes), and pays a cast each way around
# every BatchNorm in both passes: at O2 a CNN took more memory than fp32 training (issue 53). So
# a kept module whose forward is one of those below, holding fp32 parameters or statistics, takes
# a half input as it is where the table says, there torch's kernels accumulate in fp32 and round
# once to half: the values of the fp32 round trip, within a rounding (tests/test_amp_kept_norms.py
# measures every row on the CPU). Everywhere else (another device or layout, an fp32 input, a
# module with no fp32 tensor, for which the kernel would run in pure half, any other module) the
# input is cast to fp32 and the output back to half, as before.
#   BatchNorm1d/2d/3d, torch's SyncBatchNorm: CPU, contiguous input only (its channels-last and
#     strided backward sums a bf16 bias gradient in bf16: 7e-2 off where the round trip is 1e-6);
#     CUDA, any layout (cuDNN for fp16; torch's CUDA kernel, which takes fp32 parameters for fp16
#     and bf16 input and accumulates in fp32, elsewhere; MIOpen for fp16 on ROCm).
#   InstanceNorm1d/2d/3d (BatchNorm over a contiguous copy): CPU and CUDA, any layout.
#   GroupNorm: CPU, any layout; torch's CUDA group norm reads its weight in the input's dtype.
#   LayerNorm: nowhere. CUDA's kernel takes no mix, and the CPU's rounds its weight and bias
#     gradients through half (bf16: 4e-2 off where the round trip is 1e-6).
ANY_LAYOUT, CONTIGUOUS = "any layout", "contiguous"
_BATCH_NORM = {"cpu": CONTIGUOUS, "cuda": ANY_LAYOUT}
_HALF_INPUT_FORWARDS: Dict[Callable, Dict[str, str]] = {
    torch.nn.modules.batchnorm._BatchNorm.forward: _BATCH_NORM,
    torch.nn.SyncBatchNorm.forward: _BATCH_NORM,
    torch.nn.modules.instancenorm._InstanceNorm.forward: {"cpu": ANY_LAYOUT, "cuda": ANY_LAYOUT},
    torch.nn.GroupNorm.forward: {"cpu": ANY_LAYOUT},
}


def register_half_input_forward(forward: Callable, layouts: Dict[str, str]) -> None:
    """Declare that a norm layer's ``forward`` (the function of its class) runs on a half input
    with fp32 parameters and statistics as exactly as on that input's fp32 upcast, per device
    type: on inputs of ``ANY_LAYOUT`` or only ``CONTIGUOUS`` ones. amp then hands such a layer
    kept fp32 O2's half activations as they are (apex_lite's SyncBatchNorm registers itself)."""
    _HALF_INPUT_FORWARDS[forward] = dict(layouts)


def half_input_layouts(module: torch.nn.Module) -> Dict[str, str]:
    """Where ``module``, kept fp32, runs on half activations as they are: device type -> the
    layouts it takes there (Note [kept norms run on the half activations]); empty where its
    input is always cast to fp32."""
    layouts = _HALF_INPUT_FORWARDS.get(getattr(type(module), "forward", None), {})
    holds_fp32 = any(t.dtype == torch.float32 for t in itertools.chain(
        module.parameters(recurse=False), module.buffers(recurse=False)))
    return dict(layouts) if holds_fp32 else {}


def _takes_as_is(args, kwargs, dtype: torch.dtype, layouts: Dict[str, str]) -> bool:
    found = []

    def check(t: torch.Tensor) -> torch.Tensor:
        layout = layouts.get(t.device.type)
        found.append(t.dtype == dtype and layout is not None
                     and (layout == ANY_LAYOUT or t.is_contiguous()))
        return t

    apply_to_floats((args, kwargs), check)
    return bool(found) and all(found)


class KeptForward:
    """The forward of a module kept fp32 inside a model cast to ``half_dtype``: on half inputs
    where ``half_input_layouts`` allows (device type -> ``ANY_LAYOUT`` or ``CONTIGUOUS``) it runs
    as it is (fp32 parameters, half activations); otherwise its floating inputs are cast to fp32.
    Floating outputs leave in ``half_dtype`` for the layers after it. A module-level class (not a
    closure) so that a wrapped model still pickles."""

    def __init__(self, forward: Callable, half_dtype: torch.dtype,
                 half_input_layouts: Optional[Dict[str, str]] = None):
        self.forward = forward
        self.half_dtype = half_dtype
        self.half_input_layouts = dict(half_input_layouts or {})
        functools.update_wrapper(self, forward)

    def __call__(self, *args, **kwargs):
        if not (self.half_input_layouts and _takes_as_is(args, kwargs, self.half_dtype,
                                                         self.half_input_layouts)):
            cast = _caster(torch.float32)
            args = apply_to_floats(args, cast)
            kwargs = apply_to_floats(kwargs, cast)
        return apply_to_floats(self.forward(*args, **kwargs), _caster(self.half_dtype))


def wrap_kept(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Replace the forward of ``module``, kept fp32 inside a model cast to ``dtype``, with a
    ``KeptForward`` around it (on the instance)."""
    module.forward = KeptForward(module.forward, dtype, half_input_layouts(module))


def cast_model(model: torch.nn.Module, dtype: torch.dtype,
               kept: Sequence[Tuple[str, torch.nn.Module]]) -> None:
    """Cast the floating parameters and buffers of ``model`` to ``dtype`` in place (Parameter
    objects keep their identity), except inside the ``kept`` modules, whose forward is wrapped
    (``wrap_kept``) to hand ``dtype`` back to the half layers after them."""
    skip: Set[int] = set()
    for _, module in kept:
        skip.update(id(m) for m in module.modules())

    def to_half(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    for module in model.modules():
        if id(module) not in skip:
            module._apply(to_half, recurse=False)
    for _, module in kept:
        wrap_kept(module, dtype)


# ---- apex's function decorators -------------------------------------------------------------

def _autocast_state(args, kwargs) -> Tuple[Optional[str], Optional[torch.dtype]]:
    """The device type of the first tensor argument (else of the first floating tensor inside a
    list, tuple, dict or dataclass argument: apex cast tensors in lists and tuples too) and
    autocast's dtype there, when autocast is enabled for that device type; else (None, None)."""
    tensor = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
    if tensor is None:
        tensor = first_tensor((args, kwargs))
    if tensor is not None:
        device_type = tensor.device.type
        if torch.is_autocast_enabled(device_type):
            return device_type, torch.get_autocast_dtype(device_type)
    return None, None


def _cast_call(fn, args, kwargs, device_type: str, dtype: torch.dtype):
    cast = _caster(dtype)
    with torch.autocast(device_type, enabled=False):
        return fn(*apply_to_floats(args, cast), **apply_to_floats(kwargs, cast))


def _widest(args, kwargs) -> torch.dtype:
    dtypes = []
    apply_to_floats((args, kwargs), lambda t: dtypes.append(t.dtype) or t)
    widest = dtypes[0] if dtypes else torch.float32
    for d in dtypes[1:]:
        widest = torch.promote_types(widest, d)
    return widest


def _decorate(kind: str, fn: Callable) -> Callable:
    original = getattr(fn, _MARK, (None, fn))[1]

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        device_type, autocast_dtype = _autocast_state(args, kwargs)
        if device_type is None:
            return original(*args, **kwargs)
        if kind == "half":
            dtype = autocast_dtype
        elif kind == "bfloat16":
            dtype = torch.bfloat16
        elif kind == "float":
            dtype = torch.float32
        else:
            dtype = _widest(args, kwargs)
        return _cast_call(original, args, kwargs, device_type, dtype)

    setattr(wrapper, _MARK, (kind, original))
    return wrapper


def half_function(fn: Callable) -> Callable:
    """Under autocast, run ``fn`` with its floating tensor arguments cast to autocast's half
    dtype; elsewhere call it unchanged.

    Args:
        fn: the function to wrap (a decorator: ``@amp.half_function``).

    Returns:
        The wrapped function (functools.wraps keeps its name).
    """
    return _decorate("half", fn)


def bfloat16_function(fn: Callable) -> Callable:
    """Under autocast (in either half dtype), run ``fn`` with its floating tensor arguments cast
    to bfloat16 (ROCm apex's decorator); elsewhere call it unchanged.

    Args:
        fn: the function to wrap (a decorator: ``@amp.bfloat16_function``).

    Returns:
        The wrapped function (functools.wraps keeps its name).
    """
    return _decorate("bfloat16", fn)


def float_function(fn: Callable) -> Callable:
    """Under autocast, run ``fn`` in fp32 (floating tensor arguments cast to float32).

    Args:
        fn: the function to wrap (a decorator: ``@amp.float_function``).

    Returns:
        The wrapped function (functools.wraps keeps its name).
    """
    return _decorate("float", fn)


def promote_function(fn: Callable) -> Callable:
    """Under autocast, run ``fn`` with floating tensor arguments cast to the widest of their
    dtypes (apex's promote: fp16 and fp32 arguments give fp32).

    Args:
        fn: the function to wrap (a decorator: ``@amp.promote_function``).

    Returns:
        The wrapped function (functools.wraps keeps its name).
    """
    return _decorate("promote", fn)


def _register(kind: str, module, name: str) -> None:
    if not hasattr(module, name):
        raise ValueError(f"No function named {name!r} in module {module!r}.")
    fn = getattr(module, name)
    if not callable(fn):
        raise TypeError(f"{module!r}.{name} is a {type(fn).__name__}, not a function")
    setattr(module, name, _decorate(kind, fn))


def register_half_function(module, name: str) -> None:
    """Make ``module.name`` a ``half_function`` (replaces the attribute on that module, at your
    request; registering again with another kind replaces the earlier registration).

    Args:
        module: the module (or any object) holding the function.
        name: the function's attribute name on ``module``.

    Raises:
        ValueError: ``module`` has no attribute ``name``.
    """
    _register("half", module, name)


def register_bfloat16_function(module, name: str) -> None:
    """Make ``module.name`` a ``bfloat16_function`` (ROCm apex's registry form).

    Args:
        module: the module (or any object) holding the function.
        name: the function's attribute name on ``module``.

    Raises:
        ValueError: ``module`` has no attribute ``name``.
    """
    _register("bfloat16", module, name)


def register_float_function(module, name: str) -> None:
    """Make ``module.name`` a ``float_function``.

    Args:
        module: the module (or any object) holding the function.
        name: the function's attribute name on ``module``.

    Raises:
        ValueError: ``module`` has no attribute ``name``.
    """
    _register("float", module, name)


def register_promote_function(module, name: str) -> None:
    """Make ``module.name`` a ``promote_function``.

    Args:
        module: the module (or any object) holding the function.
        name: the function's attribute name on ``module``.

    Raises:
        ValueError: ``module`` has no attribute ``name``.
    """
    _register("promote", module, name)


@contextlib.contextmanager
def disable_casts():
    """Inside, autocast is off (on CPU, and on CUDA where present): code runs in the dtypes of its
    inputs, as apex's ``disable_casts``. A context manager: ``with amp.disable_casts(): ...``.

    Yields:
        None.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.autocast("cpu", enabled=False))
        if torch.cuda.is_available():
            stack.enter_context(torch.autocast("cuda", enabled=False))
        yield
