"""setup.py's decisions, without compiling: pure-Python by default, the --cuda_ext checks.

The real builds (``--cpp_ext`` through pip and build_ext) are run by CI; these tests cover the
paths that must stop before any compiler runs.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import stat
import subprocess
import sys
import types

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def setup_module_():
    spec = importlib.util.spec_from_file_location("apex_lite_setup", os.path.join(ROOT, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines functions only: setup() runs under __main__
    return module


def _run_setup(*args, **env):
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("APEX_LITE_CPP_EXT", "APEX_LITE_CUDA_EXT")}
    environment.update(env)
    return subprocess.run([sys.executable, "setup.py", *args], cwd=ROOT, env=environment,
                          capture_output=True, text=True, timeout=300)


def test_default_is_pure_python():
    result = _run_setup("--name")
    assert result.returncode == 0, result.stderr
    assert "configuration: pure Python" in result.stdout
    assert "apex_lite" in result.stdout.splitlines()[-1]


@pytest.mark.skipif(torch.version.cuda is not None, reason="torch has CUDA here")
@pytest.mark.parametrize("how", [("--cuda_ext",), ("APEX_LITE_CUDA_EXT",)])
def test_cuda_ext_with_cpu_only_torch_stops_before_compiling(how):
    if how[0].startswith("--"):
        result = _run_setup("--cuda_ext", "--name")
    else:
        result = _run_setup("--name", APEX_LITE_CUDA_EXT="1")
    assert result.returncode != 0
    assert "CPU-only build" in result.stderr and "drop --cuda_ext" in result.stderr


def _fake_toolchain(tmp_path, release):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    nvcc = bin_dir / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    fake_torch = types.SimpleNamespace(__version__="2.13.0+cu124",
                                       version=types.SimpleNamespace(cuda="12.4"))
    fake_extension = types.SimpleNamespace(CUDA_HOME=str(tmp_path))
    return fake_torch, fake_extension


def test_cuda_major_mismatch_is_an_error_naming_both(setup_module_, tmp_path):
    fake_torch, fake_extension = _fake_toolchain(tmp_path, "13.0")
    with pytest.raises(SystemExit, match=r"major version mismatch.*13\.0.*12\.4"):
        setup_module_._check_cuda_toolchain(fake_torch, fake_extension)


def test_cuda_minor_mismatch_is_a_warning(setup_module_, tmp_path, capsys):
    fake_torch, fake_extension = _fake_toolchain(tmp_path, "12.6")
    nvcc, version = setup_module_._check_cuda_toolchain(fake_torch, fake_extension)
    assert version == "12.6" and nvcc.endswith("nvcc")
    assert "minor version mismatch" in capsys.readouterr().out


def test_missing_nvcc_is_named(setup_module_, tmp_path):
    fake_torch, _ = _fake_toolchain(tmp_path, "12.4")
    with pytest.raises(SystemExit, match="nvcc was not found"):
        setup_module_._check_cuda_toolchain(fake_torch, types.SimpleNamespace(CUDA_HOME=None))


def test_flags_are_removed_from_argv(setup_module_, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["setup.py", "bdist_wheel", "--cpp_ext", "--cpp_ext"])
    assert setup_module_._take_flag("--cpp_ext")
    assert sys.argv == ["setup.py", "bdist_wheel"]
    assert not setup_module_._take_flag("--cuda_ext")


@pytest.mark.parametrize("value,expected", [("default", []), ("avx2", ["-mavx2"])])
def test_cpu_arch_override(setup_module_, monkeypatch, value, expected):
    monkeypatch.setenv("APEX_LITE_CPU_ARCH", value)
    assert setup_module_.cpu_arch() == value
    assert setup_module_.cpu_arch_flags(value)[:len(expected)] == expected


# ---- the torch floor, the wheel tool, the build record (issue 44) -----------------------------

@pytest.mark.parametrize("version,native", [("2.4.1", False), ("2.3.1+cu121", True)])
def test_a_torch_below_the_floor_stops_at_once_naming_the_versions(setup_module_, version,
                                                                   native):
    floor = ".".join(map(str, setup_module_.TORCH_FLOOR))
    with pytest.raises(SystemExit, match=rf"torch {re.escape(version)} is installed, but .* "
                                         rf"need torch {floor} or newer"):
        setup_module_.check_torch_version(version, native)


@pytest.mark.parametrize("version", [None, "2.5.0", "2.5.1+cu124", "2.15.0", "3.0.0a0"])
def test_the_floor_and_newer_torch_pass(setup_module_, version):
    setup_module_.check_torch_version(version, True)


def test_the_floor_is_what_install_requires_and_the_readme_say(setup_module_):
    floor = ".".join(map(str, setup_module_.TORCH_FLOOR))
    assert f'TORCH_FLOOR[0]}}.{{TORCH_FLOOR[1]}}"' in open(os.path.join(ROOT, "setup.py")).read()
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert f"torch {floor} or newer" in readme


@pytest.mark.parametrize("command", ["bdist_wheel", "dist_info"])
def test_a_wheel_build_without_the_wheel_tool_is_named(setup_module_, command):
    with pytest.raises(SystemExit, match=r"setuptools 65\.5\.0 needs the 'wheel' package.*"
                                         r"pip install wheel"):
        setup_module_.check_wheel_tool(["setup.py", command], "65.5.0", False)
    setup_module_.check_wheel_tool(["setup.py", command], "65.5.0", True)
    setup_module_.check_wheel_tool(["setup.py", command], "70.1.0", False)
    setup_module_.check_wheel_tool(["setup.py", "build_ext"], "65.5.0", False)


def _tiny_tree(tmp_path, source):
    """setup.py with one C++ source and an empty package: a native build in seconds."""
    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc" / "one.cpp").write_text(source)
    (tmp_path / "apex_lite").mkdir()
    (tmp_path / "apex_lite" / "__init__.py").write_text("")
    shutil.copy(os.path.join(ROOT, "setup.py"), tmp_path / "setup.py")
    environment = dict(os.environ, APEX_LITE_CPP_EXT="1", MAX_JOBS="1",
                       APEX_LITE_CPU_ARCH="default")
    return subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tmp_path,
                          env=environment, capture_output=True, text=True, timeout=300)


def test_a_failed_native_build_leaves_no_build_record(tmp_path):
    done = _tiny_tree(tmp_path, "#error this build fails\n")
    assert done.returncode != 0
    assert not (tmp_path / "apex_lite" / "_build_info.py").exists()


def test_a_native_build_records_itself_once_built(tmp_path):
    done = _tiny_tree(tmp_path, "int apex_lite_tiny() { return 0; }\n")
    assert done.returncode == 0, done.stderr[-2000:]
    record = (tmp_path / "apex_lite" / "_build_info.py").read_text()
    assert f"TORCH_VERSION = {torch.__version__!r}" in record
