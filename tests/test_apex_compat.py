"""compat/apex, apex_lite's installable ``apex`` distribution: what metadata checks find, what
each name forwards to, and a library-style engine (tests/apex_engine_client.py) that trains,
checkpoints only the model and the optimizer, and resumes exactly.

The distribution is installed once per session with pip into a temporary ``--target`` (offline:
``--no-index --no-deps --no-build-isolation``, so the environment's setuptools builds it, as
tools/test.sh builds apex_lite), and used by subprocesses only, so that it never shadows
anything in this process.
"""
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from apex_lite.apex_compat import alias

TESTS = Path(__file__).resolve().parent
COMPAT = TESTS.parent / "compat" / "apex"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("apex") is not None,
                                reason="a package named apex is installed here; apex_lite's "
                                       "must never be installed beside another")


@pytest.fixture(scope="module")
def compat_target(tmp_path_factory):
    """compat/apex installed with pip into a fresh --target (from a copy of its source, so that
    the build leaves nothing in the repository)."""
    root = tmp_path_factory.mktemp("compat")
    source = root / "src"
    shutil.copytree(COMPAT, source, ignore=shutil.ignore_patterns("build", "*.egg-info",
                                                                  "__pycache__"))
    target = root / "site"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps",
         "--no-build-isolation", "--disable-pip-version-check", "--quiet", "--target",
         str(target), str(source)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (
        f"pip install --target of compat/apex failed (it needs pip and setuptools in this "
        f"environment):\n{result.stdout}\n{result.stderr}")
    return target


def _python(args, *, site=None, timeout=300):
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(site)] + [p for p in [env.get("PYTHONPATH")]
                                                           if p])
    args = ["-c", args] if isinstance(args, str) else args
    return subprocess.run([sys.executable, *args], cwd=TESTS, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _facts(code, site):
    result = _python(code, site=site)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_metadata_checks_find_it(compat_target):
    facts = _facts("""
import importlib.metadata, importlib.util, json
from packaging.requirements import Requirement
version = importlib.metadata.version("apex")
dist = importlib.metadata.distribution("apex")
print(json.dumps({
    "version": version,
    "find_spec": [importlib.util.find_spec(name) is not None for name in ("apex", "amp_C",
                                                                          "apex_C")],
    # Lightning's RequirementCache("apex"), and a version comparison as libraries write one
    "requirement": Requirement("apex").specifier.contains(version, prereleases=True),
    "at_least_0_1": Requirement("apex>=0.1").specifier.contains(version, prereleases=True),
    "requires": dist.requires,
    "files": sorted(str(f) for f in dist.files if not str(f).endswith((".pyc", "RECORD",
                                                                        "INSTALLER"))),
}))
""", compat_target)
    assert facts["version"] == "0.1+apexlite"
    assert facts["find_spec"] == [True, True, True]
    assert facts["requirement"] and facts["at_least_0_1"]
    assert facts["requires"] == ["apex_lite"]
    assert [f for f in facts["files"] if not f.startswith("apex-0.1+apexlite.dist-info")] == [
        "amp_C.py", "apex/__init__.py", "apex/_apex_lite_forwarder.py", "apex_C.py"]


def test_every_name_forwards_to_apex_lite(compat_target):
    facts = _facts("""
import importlib.util, json
import apex
import amp_C
from apex import amp
from apex.amp import _amp_state
import apex.amp._amp_state   # DeepLearningExamples' GNMT: apex.amp._amp_state stays the state
from apex.optimizers import FusedAdam, FusedLAMB, FusedSGD
from apex.multi_tensor_apply import multi_tensor_applier
import apex.amp.scaler
import apex_lite, apex_lite.amp.scaler, apex_lite.apex_multi_tensor, apex_lite.optimizers
facts = {
    "apex_file": apex.__file__,
    "amp": amp is apex_lite.amp and apex.amp is amp and "state_dict" in amp.__dict__,
    "amp_state": _amp_state is apex_lite.amp._amp_state is apex.amp._amp_state
                 and hasattr(apex.amp._amp_state, "loss_scalers"),
    "optimizers": (FusedAdam, FusedLAMB, FusedSGD) == (apex_lite.optimizers.FusedAdam,
                   apex_lite.optimizers.FusedLAMB, apex_lite.optimizers.FusedSGD),
    "amp_C": amp_C is apex_lite.apex_multi_tensor,
    "applier": multi_tensor_applier is apex_lite.apex_multi_tensor.multi_tensor_applier
               and multi_tensor_applier.available,
    "one_scaler_module": apex.amp.scaler is apex_lite.amp.scaler,
    "find_spec_amp": importlib.util.find_spec("apex.amp") is not None,
    "alias": apex_lite.install_apex_alias(),
}
from apex.parallel import DistributedDataParallel, convert_syncbn_model
from apex.parallel.LARC import LARC
import apex_lite.parallel, apex_lite.parallel.LARC
facts["parallel"] = (apex.parallel is apex_lite.parallel and DistributedDataParallel is
                     apex_lite.parallel.DistributedDataParallel and convert_syncbn_model is
                     apex_lite.parallel.convert_syncbn_model and LARC is
                     apex_lite.parallel.LARC.LARC)
try:
    import apex.contrib
except ImportError as exc:
    facts["contrib"] = str(exc)
print(json.dumps(facts))
""", compat_target)
    assert facts.pop("apex_file") == str(compat_target / "apex" / "__init__.py")
    assert facts.pop("alias").startswith("apex is apex_lite's forwarding package (")
    assert "No module named 'apex.contrib': apex_lite's apex provides apex.amp, " \
           "apex.optimizers, " in facts.pop("contrib")
    assert all(value is True for value in facts.values()), facts


def test_apex_modules_that_scripts_import(compat_target):
    """apex.normalization, apex.fp16_utils, apex_C (a module of the distribution) and every
    subpackage as an attribute of ``apex``, as through the alias."""
    from test_apex_alias import check_apex_modules_client
    result = _python(["apex_modules_client.py", *alias.TARGETS], site=compat_target)
    assert result.returncode == 0, result.stderr
    check_apex_modules_client(result.stdout)


def test_the_runtime_alias_alone_does_not_satisfy_metadata_checks(tmp_path):
    """Why the distribution exists: with the alias only, transformers' check says no apex."""
    out = tmp_path / "out.json"
    result = _python("import apex_lite\napex_lite.install_apex_alias()\n"
                     f"import apex_engine_client\napex_engine_client.main(['--out', {str(out)!r}])")
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text()) == {"apex_available": False}


def test_without_apex_lite_importing_apex_says_what_is_missing(compat_target, tmp_path):
    """The distribution installed where apex_lite is not importable: a clear ImportError."""
    shadow = tmp_path / "apex_lite"   # a package that hides the real apex_lite's modules
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named "
                                        "'apex_lite'\", name='apex_lite')\n")
    result = _python("import apex", site=f"{tmp_path}{os.pathsep}{compat_target}")
    assert result.returncode == 1
    assert "this apex is apex_lite's stand-in for NVIDIA apex" in result.stderr
    assert "apex_lite is not installed" in result.stderr


def _engine(site, tmp_path, name, *args):
    out = tmp_path / f"{name}.json"
    result = _python(["apex_engine_client.py", *args, "--out", str(out)], site=site)
    assert result.returncode == 0, result.stderr
    return json.loads(out.read_text())


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_an_engine_that_drives_apex_trains_and_resumes_exactly(compat_target, tmp_path, level):
    checkpoint = tmp_path / "checkpoint.pt"
    common = ["--opt-level", level, "--steps", "16", "--bad-step", "4"]
    full = _engine(compat_target, tmp_path, "full", *common, "--save-at", "10",
                   "--checkpoint", str(checkpoint))
    resumed = _engine(compat_target, tmp_path, "resumed", *common, "--resume", str(checkpoint))

    assert full["apex_available"] and full["apex_version"] == "0.1+apexlite"
    assert full["amp_module"] == "apex_lite.amp"
    assert full["initialize_calls"] == resumed["initialize_calls"] == 1
    losses = [full["losses"][str(step)] for step in range(16)]
    assert not math.isfinite(losses[4])   # the corrupt batch: skipped, the scale halved
    assert full["loss_scales"]["3"] == 65536.0 and full["loss_scales"]["4"] == 32768.0
    assert losses[-1] < 0.25 * losses[0]
    clipped = [n for step, n in full["clip_norms"].items() if step != "4"]
    assert all(0.0 < n < math.inf for n in clipped) and max(clipped) > 5.0   # clipping acted

    # Resumed from a checkpoint of the model and the optimizer only: the same run, bit for bit,
    # with the loss scale and its counters restored from the optimizer's state.
    assert resumed["losses"] == {str(s): full["losses"][str(s)] for s in range(10, 16)}
    assert resumed["loss_scales"] == {str(s): 32768.0 for s in range(10, 16)}
    assert resumed["amp_state"] == full["amp_state"] == {"loss_scale": 32768.0,
                                                         "unskipped": 11}
    assert resumed["params"] == full["params"]


# ---- the offline install: pip install --no-deps --no-build-isolation ./compat/apex -------------

def _compat_setup():
    """compat/apex/setup.py as a module (its ``setup()`` runs only as ``__main__``)."""
    spec = importlib.util.spec_from_file_location("compat_apex_setup", COMPAT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("command", ["bdist_wheel", "dist_info", "editable_wheel"])
def test_a_wheel_build_without_the_wheel_tool_names_it(command):
    problem = _compat_setup().wheel_tool_problem
    message = problem(["setup.py", command, "--output-dir", "x"], "65.5.0", False)
    assert "setuptools 65.5.0 needs the 'wheel' package" in message
    assert "pip install wheel" in message and "setuptools>=70.1" in message
    assert problem(["setup.py", command], "65.5.0", True) is None        # wheel is there
    assert problem(["setup.py", command], "70.1.0", False) is None       # setuptools has it
    assert problem(["setup.py", command], "84.2.1", False) is None
    assert problem(["setup.py", "egg_info"], "65.5.0", False) is None    # no wheel built


@pytest.mark.skipif(os.environ.get("APEX_LITE_DISABLE_EXT", "") == "1",
                    reason="the install does not depend on the kernel backend: it runs once, "
                           "in the suite's native pass")
def test_the_offline_install_in_a_fresh_venv_works_or_names_what_to_install(tmp_path):
    """The guide's offline command in a venv made as ``python -m venv`` makes one (its pip and
    setuptools as they come; Python 3.11's setuptools is 65.5, which needs ``wheel`` for a
    wheel build, and pip's --no-build-isolation does not install it). 13 s on an idle 2-core
    machine (29 s under load), most of it the venv's ensurepip."""
    venv = tmp_path / "venv"
    made = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True,
                          text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    python = venv / ("Scripts" if os.name == "nt" else "bin") / "python"
    tools = subprocess.run(
        [str(python), "-c", "import importlib.util, json, setuptools; print(json.dumps("
         "[setuptools.__version__, importlib.util.find_spec('wheel') is not None]))"],
        capture_output=True, text=True, timeout=60)
    if tools.returncode != 0:
        pytest.skip(f"this Python's venv has no setuptools (Python 3.12 and later), which any "
                    f"--no-build-isolation install needs: {tools.stderr.strip()[-200:]}")
    setuptools_version, has_wheel = json.loads(tools.stdout)
    source = tmp_path / "src"
    shutil.copytree(COMPAT, source, ignore=shutil.ignore_patterns("build", "*.egg-info",
                                                                  "__pycache__"))
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PIP_REQUIRE_VIRTUALENV")}
    result = subprocess.run(
        [str(python), "-m", "pip", "install", "--no-index", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", str(source)], capture_output=True, text=True,
        timeout=300, env=env)
    output = result.stdout + result.stderr
    assert "invalid command 'bdist_wheel'" not in output
    needs_wheel = not has_wheel and tuple(map(int, setuptools_version.split(".")[:2])) < (70, 1)
    if needs_wheel:
        assert result.returncode != 0
        assert f"setuptools {setuptools_version} needs the 'wheel' package" in output, output
        assert "Run: pip install wheel" in output
        return
    assert result.returncode == 0, output
    version = subprocess.run([str(python), "-c", "import importlib.metadata as m; "
                              "print(m.version('apex'))"], capture_output=True, text=True,
                             timeout=60, env=env)
    assert version.stdout.strip() == "0.1+apexlite", version.stderr
