"""`python -m apex_lite.check`: what it reports and its exit status."""
import os
import subprocess
import sys

import apex_lite.multi_tensor as mt


def run_check(*args, **env):
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("APEX_LITE_DISABLE_EXT", "APEX_LITE_REQUIRE_EXT")}
    full_env.update(env)
    return subprocess.run([sys.executable, "-m", "apex_lite.check", *args], env=full_env,
                          capture_output=True, text=True, timeout=120)


def native_cpu() -> bool:
    mt._backend.reset()
    env = {k: os.environ.pop(k) for k in ("APEX_LITE_DISABLE_EXT", "APEX_LITE_REQUIRE_EXT")
           if k in os.environ}
    try:
        return mt.backend("cpu")[0] == "native"
    finally:
        os.environ.update(env)
        mt._backend.reset()


def test_report_names_versions_and_backend():
    result = run_check()
    assert result.returncode == 0, result.stderr
    import torch
    assert f"torch      {torch.__version__}" in result.stdout
    assert "backend: " in result.stdout
    cpu_lines = [line for line in result.stdout.splitlines() if line.startswith("cpu")]
    assert len(cpu_lines) == 1


def test_disabled_extension_is_reported_with_its_reason():
    result = run_check(APEX_LITE_DISABLE_EXT="1")
    assert result.returncode == 0
    assert "backend: python (APEX_LITE_DISABLE_EXT=1 is set)" in result.stdout


def test_require_native_fails_on_python_backend():
    result = run_check("--require-native", APEX_LITE_DISABLE_EXT="1")
    assert result.returncode == 1
    assert "FAIL: --require-native, but cpu uses the Python backend" in result.stdout


def test_require_native_passes_only_when_native_is_there():
    result = run_check("--require-native")
    assert result.returncode == (0 if native_cpu() else 1), result.stdout
    if native_cpu():
        assert "backend: native" in result.stdout
    else:
        assert "apex_lite._C" in result.stdout  # the real reason is shown


def test_help():
    result = run_check("--help")
    assert result.returncode == 0 and "--require-native" in result.stdout
