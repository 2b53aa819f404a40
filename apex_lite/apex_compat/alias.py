"""``import apex`` resolved to apex_lite, for code that imports NVIDIA apex itself.

    import apex_lite
    apex_lite.install_apex_alias()        # before the code that imports apex
    from apex import amp                  # apex_lite.amp
    from apex.optimizers import FusedAdam # apex_lite.optimizers.FusedAdam

or, without touching the code: ``python -m apex_lite.apex_alias train.py [args]`` (also
``-m package.module``). ``python -m apex_lite.apex_alias`` alone installs the alias in its own
process and prints what each name resolves to.

What it does: puts a stand-in package ``apex`` in ``sys.modules`` and a finder on
``sys.meta_path`` that maps ``apex.<name>[...]`` to the apex_lite module ``TARGETS[name][...]``
(``apex.<sub>`` to ``apex_lite.<sub>`` for each name in ``SUBPACKAGES``, and
``apex.multi_tensor_apply`` to ``apex_lite.apex_compat.multi_tensor``) and, when no other module
of that name is importable, apex's compiled top-level modules (``TOP_LEVEL``: ``amp_C``, the
multi-tensor ops, and ``apex_C``, flatten/unflatten) to apex_lite's modules too. Targets are
imported when the alias is, not before; ``apex.<sub>`` is also an attribute of ``apex``, loaded
on first use (``import apex; apex.normalization.FusedLayerNorm``). The modules are apex_lite's
own objects, so ``'state_dict' in amp.__dict__`` (timm's ApexScaler) holds. Other parts of apex
(``apex.contrib``, ``apex.transformer``, ...) raise ModuleNotFoundError, an ImportError, naming
what to use instead where there is something, so code that guards them with ``try/except
ImportError`` takes its non-apex path.

When it refuses (``ApexAliasError``), nothing is changed: a package named ``apex`` is
importable, or already imported, and is not apex_lite's. Such a package is NVIDIA's when its
directory holds one of ``NVIDIA_MARKERS`` (files that every NVIDIA apex release has had, before
and after amp's removal); it is only looked at on disk, never imported (NVIDIA's ``apex``
imports its CUDA extensions). apex_lite's own installable ``apex`` package (``compat/apex``)
identifies itself with a ``FORWARDER_MARKER`` file in its directory; with it installed, ``import
apex`` already gives apex_lite and the alias is not needed. That package's ``__init__`` serves
its subpackages through the same finder (``forward_subpackages``).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Dict, List, Optional

# apex's subpackages that apex_lite provides under the same name: apex.<name> is apex_lite.<name>.
SUBPACKAGES = ("amp", "optimizers", "parallel", "normalization", "fp16_utils")
# Every apex subpackage apex_lite provides, and where it lives in apex_lite.
TARGETS = {**{name: f"apex_lite.{name}" for name in SUBPACKAGES},
           "multi_tensor_apply": "apex_lite.apex_compat.multi_tensor"}
# apex's compiled top-level modules: the multi-tensor ops (amp_C) and flatten/unflatten (apex_C).
TOP_LEVEL = {"amp_C": "apex_lite.apex_compat.multi_tensor",
             "apex_C": "apex_lite.apex_compat.apex_c"}
# apex's modules whose package attribute of the same name is an object (apex/amp/__init__.py:
# ``from ._amp_state import _amp_state``): ``import apex.amp._amp_state`` (DeepLearningExamples'
# GNMT) must leave ``apex.amp._amp_state`` that object, so the import gives the object itself.
# alias name -> (the apex_lite module, the attribute).
SHADOWED_MODULES = {"apex.amp._amp_state": ("apex_lite.amp", "_amp_state")}
# What to use instead of the parts of apex that apex_lite does not provide.
INSTEAD = {
    "transformer": "torch.distributed.tensor.parallel or Megatron-Core",
}
NVIDIA_MARKERS = ("amp/_amp_state.py", "optimizers/fused_adam.py",
                  "normalization/fused_layer_norm.py")
FORWARDER_MARKER = "_apex_lite_forwarder.py"
# The top-level modules install_apex_alias found elsewhere and left alone (never imported):
# name -> where.
_foreign_top_level: Dict[str, str] = {}
_ALIAS_ATTRIBUTE = "__apex_lite_alias__"


class ApexAliasError(RuntimeError):
    """Raised by ``install_apex_alias`` when a package named ``apex`` is already there."""


def _package_dirs(spec) -> List[str]:
    if spec.submodule_search_locations:
        return list(spec.submodule_search_locations)
    return [os.path.dirname(spec.origin)] if spec.origin else []


def _existing_apex() -> Optional[Dict[str, object]]:
    """The ``apex`` that an import would find, described without importing it, or None."""
    module = sys.modules.get("apex")
    if module is not None:
        if getattr(module, _ALIAS_ATTRIBUTE, False):
            return {"ours": "alias"}
        spec = getattr(module, "__spec__", None)
    else:
        spec = importlib.util.find_spec("apex")
        if spec is None:
            return None
    dirs = _package_dirs(spec) if spec is not None else []
    where = ", ".join(dirs) or getattr(module, "__file__", None) or "an unknown location"
    if any(os.path.exists(os.path.join(d, FORWARDER_MARKER)) for d in dirs):
        return {"ours": "forwarder", "where": where}
    found = [marker for d in dirs for marker in NVIDIA_MARKERS
             if os.path.exists(os.path.join(d, marker))]
    return {"ours": None, "where": where, "nvidia_markers": found,
            "imported": module is not None}


def _refusal(existing: Dict[str, object]) -> str:
    where = existing["where"]
    if existing["nvidia_markers"]:
        return (f"NVIDIA apex is installed (apex at {where}, which has "
                f"{', '.join(existing['nvidia_markers'])}); apex_lite will not shadow it, since "
                f"code importing apex would then get parts of both. To run apex code on "
                f"apex_lite, uninstall NVIDIA apex (pip uninstall apex) or run without it on "
                f"the path; to keep using NVIDIA apex, do not install the alias.")
    state = "is already imported" if existing["imported"] else "is importable"
    return (f"a package named apex {state} from {where} and it is neither NVIDIA apex nor "
            f"apex_lite's; apex_lite will not shadow it. Remove it from the path (pip "
            f"uninstall apex), or import apex_lite directly: from apex_lite import amp.")


def _provided() -> str:
    names = [f"apex.{name}" for name in TARGETS]
    return f"{', '.join(names[:-1])} and {names[-1]}"


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``apex.<sub>[...]`` for the subpackages in TARGETS as the apex_lite modules, and the
    top-level modules named in ``top_level`` (a subset of TOP_LEVEL)."""

    def __init__(self, top_level):
        self.top_level = frozenset(top_level)
        self._originals = {}   # alias name -> the target module's own __spec__

    def find_spec(self, fullname, path=None, target=None):
        parts = fullname.split(".")
        if fullname in SHADOWED_MODULES:
            package, attribute = SHADOWED_MODULES[fullname]
            self._originals[fullname] = getattr(importlib.import_module(package), attribute)
            return importlib.util.spec_from_loader(fullname, self, is_package=False)
        if fullname in self.top_level:
            target_name = TOP_LEVEL[fullname]
        elif parts[0] != "apex" or len(parts) < 2:
            return None
        elif parts[1] not in TARGETS:
            hint = INSTEAD.get(parts[1])
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: apex_lite's apex provides {_provided()} "
                f"only" + (f"; use {hint} instead" if hint else ""), name=fullname)
        else:
            target_name = ".".join([TARGETS[parts[1]]] + parts[2:])
        try:
            module = importlib.import_module(target_name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not (target_name == exc.name
                                        or target_name.startswith(exc.name + ".")):
                raise   # something the target imports is missing: its own message says what
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: apex_lite's apex alias maps it to "
                f"{target_name}, which this apex_lite does not have", name=fullname) from exc
        self._originals[fullname] = module.__spec__
        return importlib.util.spec_from_loader(fullname, self,
                                               is_package=hasattr(module, "__path__"))

    def create_module(self, spec):
        if spec.name in SHADOWED_MODULES:
            return self._originals[spec.name]   # the object; the import system's writes to it
        return sys.modules[self._originals[spec.name].name]   # raise AttributeError, ignored

    def exec_module(self, module):
        if not isinstance(module, types.ModuleType):
            return   # a SHADOWED_MODULES object, nothing to run
        # The import system set __spec__ to the alias's spec; the module stays apex_lite's.
        module.__spec__ = self._originals[module.__spec__.name]


def _apex_getattr(name):
    """``apex.<name>`` for a subpackage not imported yet (``import apex; apex.amp.initialize``,
    as NVIDIA's ``apex/__init__.py``, which imported its subpackages, allowed)."""
    if name in TARGETS:
        return importlib.import_module(f"apex.{name}")
    raise AttributeError(f"module 'apex' (apex_lite's) has no attribute {name!r}; it provides "
                         f"{_provided()}")


def _apex_dir():
    return sorted(set(TARGETS) | {"__all__", "__path__", "__spec__"})


def _install_finder(top_level) -> None:
    if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder(top_level))


def forward_subpackages():
    """For apex_lite's installable ``apex`` package (``compat/apex``): serve its subpackages
    through the alias's finder (one object per module, ``import apex.amp.scaler`` included) and
    return the package's ``(__getattr__, __dir__, __all__)``. Its top-level modules (``amp_C``,
    ``apex_C``) are modules of their own there."""
    _install_finder(top_level=())
    return _apex_getattr, _apex_dir, list(TARGETS)


def _stand_in() -> types.ModuleType:
    """The ``apex`` package: its subpackages load on first attribute access or import."""
    apex = types.ModuleType("apex", "apex_lite's stand-in for NVIDIA apex "
                                    "(apex_lite.install_apex_alias).")
    apex.__path__ = []   # a package, so that ``import apex.amp`` asks the finders
    apex.__spec__ = importlib.machinery.ModuleSpec("apex", None, is_package=True)
    setattr(apex, _ALIAS_ATTRIBUTE, True)
    apex.__getattr__ = _apex_getattr
    apex.__dir__ = _apex_dir
    apex.__all__ = list(TARGETS)   # ``from apex import *`` imports every subpackage, as apex's
    return apex


def install_apex_alias() -> str:
    """Make ``import apex``, ``apex.<sub>`` for the subpackages in TARGETS, and apex's top-level
    modules (``amp_C``, ``apex_C``) resolve to apex_lite.

    Returns what it did, in a line. Idempotent. Raises ``ApexAliasError``, changing nothing,
    when a package named ``apex`` that is not apex_lite's is importable or imported.
    """
    existing = _existing_apex()
    if existing is not None:
        if existing["ours"] == "alias":
            return "the apex alias was already installed in this process"
        if existing["ours"] == "forwarder":
            return (f"apex is apex_lite's forwarding package ({existing['where']}); "
                    f"nothing to install")
        raise ApexAliasError(_refusal(existing))
    # A top-level module that is not apex_lite's (NVIDIA's compiled amp_C or apex_C, left
    # without their package) is left alone: only looked up, never imported.
    foreign = {}
    for name in TOP_LEVEL:
        module = sys.modules.get(name)
        spec = getattr(module, "__spec__", None) if module is not None else \
            importlib.util.find_spec(name)
        if module is not None or spec is not None:
            foreign[name] = getattr(spec, "origin", None) or f"an {name}"
    _foreign_top_level.clear()
    _foreign_top_level.update(foreign)
    _install_finder([name for name in TOP_LEVEL if name not in foreign])
    sys.modules["apex"] = _stand_in()
    done = [f"apex.{name} -> {target}" for name, target in TARGETS.items()]
    done += [f"{name} left alone (another {name} is importable)" if name in foreign
             else f"{name} -> {target}" for name, target in TOP_LEVEL.items()]
    return f"installed the apex alias: {', '.join(done)}"


def describe_targets() -> List[str]:
    """One line per alias: what it resolves to now, or why it does not."""
    lines = []
    names = {f"apex.{name}": target for name, target in TARGETS.items()}
    names.update(TOP_LEVEL)
    width = max(map(len, names))
    for name, target in names.items():
        if name in _foreign_top_level:
            lines.append(f"  {name:<{width}} -> left alone ({_foreign_top_level[name]} is not "
                         f"apex_lite's)")
            continue
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            lines.append(f"  {name:<{width}} -> {target}: not importable ({exc})")
            continue
        if module.__name__ != target:
            lines.append(f"  {name:<{width}} -> {module.__name__} (not apex_lite's)")
            continue
        exported = list(getattr(module, "__all__", None) or
                        [n for n, v in vars(module).items()
                         if not n.startswith("_") and not isinstance(v, types.ModuleType)])
        shown = ", ".join(exported[:6]) + (", ..." if len(exported) > 6 else "")
        lines.append(f"  {name:<{width}} -> {module.__name__}"
                     + (f" ({shown})" if exported else ""))
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    import runpy

    # Run as ``python -m``, this file may be ``__main__``; the alias must be installed by the
    # package's own module, whose finder and error class everyone else sees.
    from apex_lite.apex_compat import alias as apex_alias

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    try:
        done = apex_alias.install_apex_alias()
    except apex_alias.ApexAliasError as exc:
        print(f"apex_lite.apex_alias: refused: {exc}", file=sys.stderr)
        return 1
    if not argv:
        print(f"apex_lite: {done} (in this process only)")
        print("\n".join(apex_alias.describe_targets()))
        print("To use it: call apex_lite.install_apex_alias() before the code that imports "
              "apex, or run that code through it: python -m apex_lite.apex_alias train.py "
              "[args] (or -m package.module [args]).")
        return 0
    if argv[0] == "-m":
        if len(argv) < 2:
            print("apex_lite.apex_alias: -m needs a module name", file=sys.stderr)
            return 2
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
