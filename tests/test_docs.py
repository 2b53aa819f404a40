"""The documentation: its pages' Python blocks run, every public function and class of the API
reference has a docstring that names its arguments, and the README is a front door whose links
resolve. (CI builds the Sphinx site itself: .ci/run, tools/build_docs.sh.)"""
import importlib
import inspect
import os
import re
import subprocess
import sys

import pytest

import doc_blocks

ROOT = doc_blocks.ROOT
HERE = os.path.dirname(os.path.abspath(__file__))

# What the API reference documents (docs/api/): each module's public names (its __all__, or the
# names listed here), their public methods and properties.
PUBLIC = {
    "apex_lite.amp": None,
    "apex_lite.optimizers": None,
    "apex_lite.multi_tensor": None,
    "apex_lite.parallel": None,
    "apex_lite.parallel.LARC": ["LARC"],
    "apex_lite.normalization": ["FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm",
                                "MixedFusedRMSNorm"],
    "apex_lite.normalization.fused_layer_norm": [
        "fused_layer_norm_affine", "fused_layer_norm", "fused_rms_norm_affine", "fused_rms_norm",
        "mixed_dtype_fused_layer_norm_affine", "mixed_dtype_fused_rms_norm_affine",
        "manual_rms_norm"],
    "apex_lite.fp16_utils": ["FP16_Optimizer", "LossScaler", "DynamicLossScaler", "FP16Model",
                             "tofp16", "network_to_half", "convert_network", "convert_module",
                             "BN_convert_float", "prep_param_lists",
                             "model_grads_to_master_grads", "master_params_to_model_params",
                             "to_python_float", "clip_grad_norm"],
    "apex_lite.amp.master_grads": ["LazyGrad"],
    "apex_lite.apex_compat.alias": ["install_apex_alias", "ApexAliasError"],
    "apex_lite.apex_compat.apex_c": ["flatten", "unflatten"],
}
# Names whose value is not ours to document (torch's enum, apex's constant tables).
NOT_OURS = {"apex_lite.parallel.ReduceOp", "apex_lite.amp.OPT_LEVELS"}


def _surface():
    """(qualified name, object, doc owner) for every public callable the reference shows."""
    for module_name, names in PUBLIC.items():
        module = importlib.import_module(module_name)
        for name in (names if names is not None else module.__all__):
            qualified = f"{module_name}.{name}"
            obj = getattr(module, name)
            if qualified in NOT_OURS or not callable(obj):
                continue
            yield qualified, obj
            if inspect.isclass(obj) and obj.__module__.startswith("apex_lite"):
                for attr, value in vars(obj).items():
                    if attr.startswith("_"):
                        continue
                    if isinstance(value, property):
                        yield f"{qualified}.{attr}", value
                    elif isinstance(value, (staticmethod, classmethod)):
                        yield f"{qualified}.{attr}", value.__func__
                    elif inspect.isfunction(value):
                        yield f"{qualified}.{attr}", value


def _arguments(obj):
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return []
    return [p.name for p in signature.parameters.values()
            if p.name not in ("self", "cls") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _docstring(obj):
    """The text that documents ``obj``: its docstring (a class's and its __init__'s), with
    the docstrings of the functions it delegates to (":func:`apex_lite...`")."""
    parts = [inspect.getdoc(obj) or ""]
    if inspect.isclass(obj) and "__init__" in vars(obj):
        parts.append(inspect.getdoc(obj.__init__) or "")
    for target in re.findall(r":func:`(apex_lite\.[\w.]+)`", parts[0]):
        module_name, _, name = target.rpartition(".")
        parts.append(inspect.getdoc(getattr(importlib.import_module(module_name), name)) or "")
    return "\n".join(parts)


SURFACE = list(_surface())


def test_the_surface_covers_the_packages_the_reference_documents():
    names = {name for name, _ in SURFACE}
    for expected in ("apex_lite.amp.initialize", "apex_lite.amp.scale_loss",
                     "apex_lite.amp.AmpHandle.initialize", "apex_lite.optimizers.FusedAdam",
                     "apex_lite.multi_tensor.scale", "apex_lite.parallel.SyncBatchNorm",
                     "apex_lite.normalization.FusedLayerNorm",
                     "apex_lite.fp16_utils.FP16_Optimizer"):
        assert expected in names
    assert len(SURFACE) > 150


@pytest.mark.parametrize("name,obj", SURFACE, ids=[name for name, _ in SURFACE])
def test_every_public_function_and_class_documents_its_arguments(name, obj):
    doc = _docstring(obj)
    assert doc.strip(), f"{name} has no docstring"
    missing = [a for a in _arguments(obj) if not re.search(rf"\b{re.escape(a)}\b", doc)]
    assert not missing, f"the docstring of {name} does not name its arguments {missing}"


def test_the_docstring_check_can_fail():
    def undocumented(alpha, beta=1):
        """Uses alpha only."""
    assert [a for a in _arguments(undocumented)
            if not re.search(rf"\b{a}\b", _docstring(undocumented))] == ["beta"]


# ---- the guides' code ------------------------------------------------------------------------

def test_every_python_block_of_the_pages_runs():
    """Each page's blocks in order, in one fresh process (doc_blocks.py), on the backend this
    run uses (the environment is inherited)."""
    done = subprocess.run([sys.executable, os.path.join(HERE, "doc_blocks.py")], cwd=HERE,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    ran = [line for line in done.stdout.splitlines() if line.startswith("ok ")]
    assert len(ran) == len(doc_blocks.pages())


def test_every_python_block_is_run_or_says_why_not():
    blocks = [b for path in doc_blocks.pages() for b in doc_blocks.parse(path).blocks]
    runnable = [b for b in blocks if b.not_run is None]
    assert len(runnable) >= 15, "the guides' examples are meant to run"
    for block in blocks:
        assert block.not_run is None or len(block.not_run) > 10, (block.page, block.line)


def test_a_failing_block_fails_the_page_and_a_bare_not_run_is_refused(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- test-setup\nx = 1\n-->\n\n```python\nassert x == 2, 'wrong'\n```\n")
    with pytest.raises(AssertionError, match="wrong"):
        doc_blocks.run_page(doc_blocks.parse(str(page)))
    page.write_text("```python\nx = 1\n```\n<!-- test-check\nassert x == 2, 'shown'\n-->\n")
    with pytest.raises(AssertionError, match="shown"):
        doc_blocks.run_page(doc_blocks.parse(str(page)))
    page.write_text("<!-- not-run: needs torchrun -->\n```python\nraise SystemExit(1)\n```\n")
    doc_blocks.run_page(doc_blocks.parse(str(page)))
    page.write_text("<!-- not-run: -->\n```python\npass\n```\n")
    with pytest.raises(ValueError, match="needs its reason"):
        doc_blocks.parse(str(page))


# ---- the README --------------------------------------------------------------------------------

def test_the_readme_is_a_front_door_whose_links_resolve():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert len(text.splitlines()) <= 200
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert len(local) >= 10
    for link in local:
        assert os.path.exists(os.path.join(ROOT, link)), f"README links to a missing {link}"
    for command in ('python -c "import torch" 2>/dev/null || pip install torch==2.13.0; '
                    'pip install . && python examples/amp_recipe.py', "bash tools/test.sh"):
        assert command in text
