"""apex_lite.install_apex_alias and `python -m apex_lite.apex_alias`: apex code runs unmodified.

Every case runs in its own Python process, so the alias (an entry in sys.modules and a finder on
sys.meta_path) never leaks into other tests. tests/apex_client.py is the apex code: written the
way libraries that support apex are, it knows nothing about apex_lite.
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from apex_lite.apex_compat import alias

TESTS = Path(__file__).resolve().parent

def _have_fused_optimizers() -> bool:
    try:
        from apex_lite.optimizers import FusedAdam, FusedLAMB, FusedSGD  # noqa: F401
    except ImportError:
        return False
    return True


HAVE_OPTIMIZERS = _have_fused_optimizers()


def _python(code_or_args, *, path_first=None, cwd=TESTS):
    """Run Python (a -c snippet, or an argument list) in a fresh process."""
    env = dict(os.environ)
    if path_first:
        env["PYTHONPATH"] = os.pathsep.join([str(path_first)] +
                                            [p for p in [env.get("PYTHONPATH")] if p])
    args = ["-c", code_or_args] if isinstance(code_or_args, str) else code_or_args
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=180)


def _client(tmp_path, *client_args, through_command=False, before=""):
    """Run apex_client.py with the alias; returns its JSON result."""
    out = tmp_path / "result.json"
    argv = [*client_args, "--out", str(out)]
    if through_command:
        result = _python(["-m", "apex_lite.apex_alias", "apex_client.py", *argv])
    else:
        result = _python(f"{before}\nimport apex_lite\napex_lite.install_apex_alias()\n"
                         f"import apex_client\nraise SystemExit(apex_client.main({argv!r}))")
    assert result.returncode == 0, result.stderr
    return json.loads(out.read_text())


# Tests that install the alias for real; the refusal tests below bring their own apex.
no_apex_here = pytest.mark.skipif(importlib.util.find_spec("apex") is not None,
                                  reason="a package named apex is installed here, and the alias "
                                         "refuses to shadow it")


@no_apex_here
def test_without_the_alias_the_client_takes_its_no_apex_path(tmp_path):
    out = tmp_path / "result.json"
    result = _python(["apex_client.py", "--out", str(out)])
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text()) == {"has_apex": False, "has_fused_optimizers": False,
                                           "has_fused_layernorm": False}


@no_apex_here
@pytest.mark.parametrize("level", ["O1", "O2", "O4", "O5"])
def test_the_client_trains_clips_and_checkpoints_through_the_alias(tmp_path, level):
    result = _client(tmp_path, "--opt-level", level)
    assert result["has_apex"] and result["amp_module"] == "apex_lite.amp"
    assert result["has_fused_layernorm"]   # apex.normalization: apex_lite's, trained under amp
    assert result["layer_norm"] == "apex_lite.normalization.fused_layer_norm.FusedLayerNorm"
    # O2 and O5 cast it to half with the rest of the model (apex kept only BatchNorm in fp32).
    assert result["layer_norm_dtype"] == ("torch.bfloat16" if level in ("O2", "O5")
                                          else "torch.float32")
    losses = result["losses"]
    assert losses[-1] < 0.2 * losses[0]
    assert all(0 < n < float("inf") for n in result["clip_norms"])
    # timm's check passed: amp.state_dict() went into the checkpoint, in apex's format.
    assert result["checkpoint_keys"] == ["amp", "model", "optimizer"]
    assert "loss_scaler0" in result["amp_state_keys"]
    assert result["saved_scaler"]["unskipped"] > 0
    assert result["resumed_scaler"] == result["saved_scaler"]
    assert result["resumed_outputs_equal"]
    assert result["model_dtype"] == ("torch.bfloat16" if level in ("O2", "O5")
                                     else "torch.float32")
    assert result["master_dtype"] == "torch.float32"   # O2, O5: the fp32 masters


@no_apex_here
def test_rocm_apex_code_runs_o4_and_o5_through_the_alias(tmp_path):
    """tests/rocm_apex_client.py, code written for ROCm apex: its levels, rules and bfloat16
    functions through ``from apex import amp`` (issue 43)."""
    out = tmp_path / "result.json"
    result = _python(f"import apex_lite\napex_lite.install_apex_alias()\n"
                     f"import rocm_apex_client\n"
                     f"raise SystemExit(rocm_apex_client.main(['--out', {str(out)!r}]))")
    assert result.returncode == 0, result.stderr
    result = json.loads(out.read_text())
    o4, o5 = result["levels"]["O4"], result["levels"]["O5"]
    # ROCm apex's properties (frontend.py), as str() of each option.
    rocm = {"O4": ["None", "True", "torch.bfloat16", "None", "None", "1.0"],
            "O5": ["torch.bfloat16", "None", "None", "True", "True", "1.0"]}
    names = ["cast_model_type", "patch_torch_functions", "patch_torch_functions_type",
             "keep_batchnorm_fp32", "master_weights", "loss_scale"]
    for level, seen in (("O4", o4), ("O5", o5)):
        assert seen["options"]["opt_level"] == level
        assert [seen["options"][name] for name in names] == rocm[level]
    for level in (o4, o5):
        assert level["losses"][-1] < 0.3 * level["losses"][0]
        assert level["loss_scale"] == 1.0 and level["amp_state"] == {"loss_scale": 1.0,
                                                                    "unskipped": 20}
        assert level["state_dict_dtypes"] == ["torch.float32", "torch.int64"]
    assert (o4["model_dtype"], o4["bn_dtype"]) == ("torch.float32", "torch.float32")
    assert (o5["model_dtype"], o5["bn_dtype"]) == ("torch.bfloat16", "torch.float32")
    assert all(len(losses) == 2 for losses in result["resumed"].values())
    refusals = result["refusals"]
    assert all(message is not None for message in refusals.values()), refusals
    assert "master_weights with O1 and O4" in refusals["O4 master_weights"]
    assert "must be torch.bfloat16 at opt_level 'O4'" in refusals["O4 fp16 patch type"]
    assert "must be torch.float16 at opt_level 'O1'" in refusals["O1 bf16 patch type"]
    assert "opt_level='O1' or 'O4'" in refusals["O2 patch type"]
    assert "opt_level='O1' or 'O4'" in refusals["O5 patching"]
    assert "Options are 'O0', 'O1', 'O2', 'O3', 'O4', 'O5'" in refusals["O6"]
    assert result["bfloat16_functions"] == {"registered": "torch.bfloat16",
                                            "decorated": "torch.bfloat16"}


@no_apex_here
def test_the_command_runs_a_script_with_the_alias(tmp_path):
    result = _client(tmp_path, "--opt-level", "O2", through_command=True)
    assert result["has_apex"] and result["amp_module"] == "apex_lite.amp"
    assert result["losses"][-1] < 0.2 * result["losses"][0]


@no_apex_here
def test_the_command_runs_a_module_with_the_alias(tmp_path):
    """``python -m apex_lite.apex_alias -m pkg.mod args``: the module runs as __main__, with the
    alias installed, and sees its own arguments (sys.argv[0] its file, as ``python -m``)."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text(
        "import json, sys\n"
        "import apex.amp\n"
        "if __name__ == '__main__':\n"
        "    print(json.dumps({'argv': sys.argv, 'amp': apex.amp.__name__}))\n")
    result = _python(["-m", "apex_lite.apex_alias", "-m", "pkg.mod", "a", "--flag", "-m"],
                     path_first=tmp_path)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["amp"] == "apex_lite.amp"
    assert seen["argv"] == [str(package / "mod.py"), "a", "--flag", "-m"]
    missing = _python(["-m", "apex_lite.apex_alias", "-m"])
    assert missing.returncode == 2 and "-m needs a module name" in missing.stderr


@no_apex_here
def test_the_command_alone_prints_what_it_did():
    result = _python(["-m", "apex_lite.apex_alias"])
    assert result.returncode == 0, result.stderr
    assert "installed the apex alias" in result.stdout
    assert "apex.amp                -> apex_lite.amp (initialize, scale_loss" in result.stdout
    assert "apex.optimizers         -> " in result.stdout
    assert "apex.multi_tensor_apply -> apex_lite.apex_compat.multi_tensor (MultiTensorApply, " \
           "multi_tensor_applier" in result.stdout
    assert "amp_C                   -> apex_lite.apex_compat.multi_tensor" in result.stdout
    assert "apex.normalization      -> apex_lite.normalization" in result.stdout
    assert "apex.fp16_utils         -> apex_lite.fp16_utils" in result.stdout
    assert "apex_C                  -> apex_lite.apex_compat.apex_c (flatten, unflatten)" \
        in result.stdout
    assert "RuntimeWarning" not in result.stderr   # the module is executed once


@no_apex_here
@pytest.mark.skipif(not HAVE_OPTIMIZERS, reason="apex_lite.optimizers has no FusedAdam, "
                    "FusedSGD, FusedLAMB in this checkout yet (another branch writes them); "
                    "unskip once they are merged")
@pytest.mark.parametrize("optimizer", ["fused_adam", "fused_sgd", "fused_lamb"])
def test_fused_optimizers_through_the_alias(tmp_path, optimizer):
    result = _client(tmp_path, "--opt-level", "O2", "--optimizer", optimizer)
    assert result["has_fused_optimizers"]
    assert result["optimizer"].startswith("apex_lite.optimizers")
    assert result["losses"][-1] < 0.5 * result["losses"][0]


@no_apex_here
@pytest.mark.skipif(not HAVE_OPTIMIZERS, reason="apex_lite.optimizers has no FusedAdam, "
                    "FusedSGD, FusedLAMB in this checkout yet (another branch writes them); "
                    "unskip once they are merged")
def test_apex_optimizers_are_apex_lites():
    result = _python("import apex_lite; apex_lite.install_apex_alias()\n"
                     "from apex.optimizers import FusedAdam, FusedSGD, FusedLAMB\n"
                     "import apex_lite.optimizers as o\n"
                     "assert (FusedAdam, FusedSGD, FusedLAMB) == (o.FusedAdam, o.FusedSGD, "
                     "o.FusedLAMB)")
    assert result.returncode == 0, result.stderr


@no_apex_here
def test_without_the_fused_optimizers_apex_optimizers_is_an_import_error(tmp_path):
    """Client code guarding apex.optimizers with try/except ImportError takes its other path
    (what it does while apex_lite.optimizers lacks them)."""
    before = ("import apex_lite.optimizers as o\n"
              "for name in ('FusedAdam', 'FusedSGD', 'FusedLAMB'):\n"
              "    if hasattr(o, name):\n"
              "        delattr(o, name)")
    result = _client(tmp_path, "--opt-level", "O1", before=before)
    assert result["has_apex"] and not result["has_fused_optimizers"]


@no_apex_here
def test_an_alias_whose_target_is_missing_names_both():
    probe = _python("import apex_lite; apex_lite.install_apex_alias()\n"
                    "import apex.optimizers.no_such_module")
    assert "ModuleNotFoundError: No module named 'apex.optimizers.no_such_module': apex_lite's " \
           "apex alias maps it to apex_lite.optimizers.no_such_module, which this apex_lite " \
           "does not have" in probe.stderr


@no_apex_here
def test_what_the_alias_resolves_and_what_it_does_not():
    code = """
import importlib, importlib.util, json, sys
import apex_lite, apex_lite.amp
first = apex_lite.install_apex_alias()
again = apex_lite.install_apex_alias()
import apex
import apex.amp.scaler
from apex import amp
facts = {"first": first, "again": again, "amp_is_apex_lite_amp": amp is apex_lite.amp,
         "attribute": apex.amp is amp, "state_dict_in_dict": "state_dict" in amp.__dict__,
         "scaler": apex.amp.scaler.__name__,
         "spec_kept": apex_lite.amp.__spec__.name == "apex_lite.amp",
         "find_spec": importlib.util.find_spec("apex") is not None}
import apex.parallel
import apex_lite.parallel
facts["parallel"] = apex.parallel is apex_lite.parallel
for name in ("contrib", "transformer"):
    try:
        importlib.import_module(f"apex.{name}")
    except ImportError as exc:
        facts[name + "_import"] = f"{type(exc).__name__}: {exc}"
try:
    apex.contrib
except AttributeError as exc:
    facts["contrib"] = str(exc)
print(json.dumps(facts))
"""
    result = _python(code)
    assert result.returncode == 0, result.stderr
    facts = json.loads(result.stdout)
    assert facts.pop("first").startswith("installed the apex alias: apex.amp -> apex_lite.amp")
    assert facts.pop("again") == "the apex alias was already installed in this process"
    assert facts.pop("parallel") is True
    provided = ", ".join(f"apex.{name}" for name in list(alias.TARGETS)[:-1]) + \
        f" and apex.{list(alias.TARGETS)[-1]}"
    assert facts.pop("contrib_import") == (
        f"ModuleNotFoundError: No module named 'apex.contrib': apex_lite's apex provides "
        f"{provided} only")
    assert facts.pop("transformer_import") == (
        f"ModuleNotFoundError: No module named 'apex.transformer': apex_lite's apex provides "
        f"{provided} only; use {alias.INSTEAD['transformer']} instead")
    assert "has no attribute 'contrib'" in facts.pop("contrib")
    assert facts == {"amp_is_apex_lite_amp": True, "attribute": True, "state_dict_in_dict": True,
                     "scaler": "apex_lite.amp.scaler", "spec_kept": True, "find_spec": True}


@no_apex_here
def test_apex_multi_tensor_apply_and_amp_c_through_the_alias():
    """fairseq's and Megatron's fused clipping finds apex's ops: multi_tensor_applier and amp_C
    are apex_lite's, with _amp_state beside them."""
    code = """
import json
import torch
import apex_lite
first = apex_lite.install_apex_alias()
from apex.multi_tensor_apply import multi_tensor_applier
from apex.amp import _amp_state
import amp_C
from amp_C import multi_tensor_l2norm
import apex_lite.apex_multi_tensor as ours
grads = [torch.ones(3), torch.ones(4)]
buf = torch.zeros(1, dtype=torch.int)
norm, per = multi_tensor_applier(amp_C.multi_tensor_l2norm, buf, [grads], True)
print(json.dumps({"first": first, "same": amp_C is ours and multi_tensor_l2norm is
                  ours.multi_tensor_l2norm and multi_tensor_applier is ours.multi_tensor_applier,
                  "available": multi_tensor_applier.available, "norm": norm.tolist(),
                  "per": per.tolist(), "amp_state": repr(_amp_state)}))
"""
    result = _python(code)
    assert result.returncode == 0, result.stderr
    facts = json.loads(result.stdout)
    assert facts["first"].endswith(
        "apex.multi_tensor_apply -> apex_lite.apex_compat.multi_tensor, "
        "amp_C -> apex_lite.apex_compat.multi_tensor, apex_C -> apex_lite.apex_compat.apex_c")
    assert facts["same"] and facts["available"]
    assert facts["norm"] == [pytest.approx(7 ** 0.5)]
    assert facts["per"] == pytest.approx([3 ** 0.5, 2])
    assert facts["amp_state"] == "<amp._amp_state (apex_lite): before amp.initialize>"


def test_the_alias_leaves_another_amp_c_alone(tmp_path):
    (tmp_path / "amp_C.py").write_text(f"open({str(tmp_path / 'IMPORTED')!r}, 'w').close()\n")
    if importlib.util.find_spec("apex") is not None:
        pytest.skip("a package named apex is installed here")
    result = _python("import apex_lite\nprint(apex_lite.install_apex_alias())\n"
                     "import apex.multi_tensor_apply", path_first=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("amp_C left alone (another amp_C is importable), "
                                          "apex_C -> apex_lite.apex_compat.apex_c")
    command = _python(["-m", "apex_lite.apex_alias"], path_first=tmp_path)
    assert command.returncode == 0, command.stderr
    assert f"amp_C                   -> left alone ({tmp_path / 'amp_C.py'} is not " \
           f"apex_lite's)" in command.stdout
    assert not (tmp_path / "IMPORTED").exists()


# The names apex's own ``from apex.fp16_utils import *`` gives: what its __init__ imports, and
# its three submodules (apex/fp16_utils/__init__.py at e13873de has no __all__).
APEX_FP16_UTILS_STAR = sorted([
    "BN_convert_float", "network_to_half", "prep_param_lists", "model_grads_to_master_grads",
    "master_params_to_model_params", "tofp16", "to_python_float", "clip_grad_norm",
    "convert_module", "convert_network", "FP16Model", "FP16_Optimizer", "LossScaler",
    "DynamicLossScaler", "fp16util", "fp16_optimizer", "loss_scaler"])


def check_apex_modules_client(stdout: str) -> None:
    """What tests/apex_modules_client.py found is apex_lite's, and works (shared with
    test_apex_compat.py)."""
    facts = json.loads(stdout.strip().splitlines()[-1])
    assert facts["submodules"] == alias.TARGETS   # apex.<sub> as an attribute of apex
    assert facts["fp16_utils_star"] == APEX_FP16_UTILS_STAR
    assert facts["fp16_model"] == ["torch.float16"] * 2 + ["torch.float32"] * 2   # BN kept fp32
    assert facts["norm_classes"] == [f"apex_lite.normalization.fused_layer_norm.{name}" for name
                                     in ("FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm",
                                         "MixedFusedRMSNorm")]
    assert facts["layer_norm_equal"] == [True, True, True]
    assert facts["apex_C"] == [[7], True]


@no_apex_here
@pytest.mark.parametrize("how", ["call", "command"])
def test_apex_modules_that_scripts_import_through_the_alias(how):
    """apex.normalization, apex.fp16_utils and apex_C, and every apex_lite subpackage as an
    attribute of ``apex`` (adding one to alias.SUBPACKAGES is covered here at once)."""
    args = ["apex_modules_client.py", *alias.TARGETS]
    if how == "command":
        result = _python(["-m", "apex_lite.apex_alias", *args])
    else:
        result = _python(f"import apex_lite, runpy, sys\napex_lite.install_apex_alias()\n"
                         f"sys.argv = {args!r}\nrunpy.run_path('apex_modules_client.py', "
                         f"run_name='__main__')")
    assert result.returncode == 0, result.stderr
    check_apex_modules_client(result.stdout)


@no_apex_here
def test_import_apex_gives_every_subpackage_lazily():
    """``import apex`` loads nothing more; ``dir(apex)`` and ``from apex import *`` list and
    load the subpackages, as NVIDIA's package (which imported them all) did."""
    code = """
import json, sys
import apex_lite
apex_lite.install_apex_alias()
import apex
before = sorted(m for m in sys.modules if m.startswith(("apex_lite.normalization",
                                                         "apex_lite.fp16_utils")))
listed = [name for name in dir(apex) if not name.startswith("_")]
namespace = {}
exec("from apex import *", namespace)
print(json.dumps({"before": before, "dir": listed,
                  "star": sorted(k for k in namespace if not k.startswith("__")),
                  "star_modules": sorted(m.__name__ for k, m in namespace.items()
                                         if not k.startswith("__"))}))
"""
    result = _python(code)
    assert result.returncode == 0, result.stderr
    facts = json.loads(result.stdout)
    assert facts["before"] == []
    assert facts["dir"] == sorted(alias.TARGETS)
    assert facts["star"] == sorted(alias.TARGETS)
    assert facts["star_modules"] == sorted(alias.TARGETS.values())


# ---- refusals -------------------------------------------------------------------------------

def _fake_apex(root: Path, *files: str, marker_file: str = None) -> Path:
    """A package named apex under root whose import would leave a trace (it must not happen)."""
    package = root / "apex"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        f"open({str(root / 'IMPORTED')!r}, 'w').close()\n")
    for name in files:
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text("")
    if marker_file:
        (package / marker_file).write_text("")
    return root


@pytest.mark.parametrize("files,named", [
    (["amp/__init__.py", "amp/_amp_state.py"], "amp/_amp_state.py"),                # with amp
    (["optimizers/__init__.py", "optimizers/fused_adam.py"], "optimizers/fused_adam.py"),  # 2025+
])
def test_refuses_nvidia_apex_without_importing_it(tmp_path, files, named):
    root = _fake_apex(tmp_path / "site", *files)
    result = _python("import apex_lite\napex_lite.install_apex_alias()", path_first=root)
    assert result.returncode == 1
    assert f"ApexAliasError: NVIDIA apex is installed (apex at {root / 'apex'}, which has " \
           f"{named}); apex_lite will not shadow it" in result.stderr
    assert "pip uninstall apex" in result.stderr
    assert not (root / "IMPORTED").exists()
    command = _python(["-m", "apex_lite.apex_alias"], path_first=root)
    assert command.returncode == 1 and "refused: NVIDIA apex is installed" in command.stderr
    assert not (root / "IMPORTED").exists()


def test_refuses_another_package_named_apex(tmp_path):
    root = _fake_apex(tmp_path / "site")
    result = _python("import apex_lite\napex_lite.install_apex_alias()", path_first=root)
    assert result.returncode == 1
    assert "a package named apex is importable from" in result.stderr
    assert "neither NVIDIA apex nor apex_lite's" in result.stderr
    assert not (root / "IMPORTED").exists()


def test_refuses_an_apex_already_imported():
    result = _python("import sys, types\nsys.modules['apex'] = types.ModuleType('apex')\n"
                     "import apex_lite\napex_lite.install_apex_alias()")
    assert result.returncode == 1
    assert "a package named apex is already imported" in result.stderr


def test_leaves_apex_lites_forwarding_package_alone(tmp_path):
    from apex_lite import apex_alias   # the module alone installs nothing
    root = _fake_apex(tmp_path / "site", marker_file=apex_alias.FORWARDER_MARKER)
    result = _python("import sys, apex_lite\nprint(apex_lite.install_apex_alias())\n"
                     "print('apex' in sys.modules)", path_first=root)
    assert result.returncode == 0, result.stderr
    assert "apex is apex_lite's forwarding package" in result.stdout
    assert result.stdout.splitlines()[-1] == "False"
    assert not (root / "IMPORTED").exists()


def test_the_earlier_module_names_give_the_apex_compat_modules():
    """apex_lite.apex_alias and apex_lite.apex_multi_tensor moved into apex_lite.apex_compat;
    the old names import the same module objects (one finder, one set of ops)."""
    import apex_lite
    import apex_lite.apex_alias
    import apex_lite.apex_multi_tensor
    from apex_lite.apex_compat import alias, multi_tensor
    assert apex_lite.apex_alias is alias and apex_lite.apex_multi_tensor is multi_tensor
    assert apex_lite.install_apex_alias is alias.install_apex_alias
