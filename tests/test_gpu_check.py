"""tools/gpu_check.sh between GPU leases: its dry run works end to end, its summary says what a
person must read, and the test selection it runs on a GPU (``-k cuda``) finds every CUDA test."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import gpu_check  # noqa: E402
import gpu_check_report as report  # noqa: E402

PARTS = ["versions", "build", "tests_native", "tests_python", "sanitizer", "bench_kernels",
         "bench_optimizers", "bench_o2_step", "bench_train", "bench_resnet_bn", "bench_fp8",
         "timm"]


@pytest.mark.skipif(os.environ.get("APEX_LITE_DISABLE_EXT", "") == "1",
                    reason="runs once per suite run (the native pass): ~30 s")
def test_dry_run_checks_the_plumbing_and_writes_the_summary(tmp_path):
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("APEX_LITE_REQUIRE_EXT",)}
    env["PYTHONPATH"] = str(ROOT)   # the dry run's parts import this tree's apex_lite
    done = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "--dry-run", str(out),
                           "--scratch", str(tmp_path / "scratch")], capture_output=True,
                          text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["log.txt", "summary.json", "summary.md"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"] == "dry run"
    assert [part["name"] for part in summary["parts"]] == PARTS
    assert all(part["status"] == "dry run" for part in summary["parts"]), summary["parts"]
    tests = next(part for part in summary["parts"] if part["name"] == "tests_native")
    assert int(tests["summary"].split()[0]) > 1000      # -k cuda found the CUDA tests
    assert "test_optimizer_kernels_cuda.py" in tests["summary"]   # gated here, named
    text = (out / "summary.md").read_text()
    assert text.startswith("# apex_lite GPU check: DRY RUN\n")
    assert "| part | result | time | notes |" in text
    assert "would run: " in text and "TORCH_CUDA_ARCH_LIST=" in text


def test_a_non_empty_outdir_is_refused(tmp_path):
    (tmp_path / "old.txt").write_text("x")
    with pytest.raises(SystemExit):
        gpu_check.main(["--dry-run", str(tmp_path)])


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="test_multi_tensor" name="test_scale[native-cuda-fp32]"/>
<testcase classname="test_multi_tensor" name="test_axpby[native-cuda-bf16]">
  <failure message="AssertionError: off by 3 ulps">trace</failure></testcase>
<testcase classname="test_multi_tensor_cuda" name="test_ops_on_a_non_current_device">
  <skipped type="pytest.skip" message="needs two CUDA GPUs (this host has 1): the device guards
  stay unchecked"/></testcase>
<testcase classname="test_amp_cuda" name="test_cuda_fp16"/>
</testsuite></testsuites>"""


def _check_with(tmp_path, parts, junit_text=JUNIT, bench=None):
    (tmp_path / "junit.xml").write_text(junit_text)
    counts = report.read_junit(tmp_path / "junit.xml")
    check = gpu_check.GpuCheck(tmp_path / "out", tmp_path / "scratch", False, 100.0, 1)
    check.host.update(gpu="NVIDIA H100 80GB HBM3 x1", device_count=1, torch="2.11.0")
    check.junits.append(counts)
    check.bench.update(bench or {})
    for name, status in parts:
        check.part(name, name, status)
    return check, counts


def test_a_failed_test_fails_the_run_and_the_summary_names_it(tmp_path, capsys):
    check, counts = _check_with(tmp_path, [("build", "passed"), ("tests_native", "failed")])
    assert report.junit_summary(counts) == "2 passed, 1 failed, 1 skipped"
    assert check.finish() == 1
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["verdict"] == "failed"
    assert summary["failed_tests"] == [
        "test_multi_tensor::test_axpby[native-cuda-bf16]: AssertionError: off by 3 ulps"]
    text = (tmp_path / "out" / "summary.md").read_text()
    assert text.startswith("# apex_lite GPU check: FAILED")
    assert "## Failed tests" in text and "off by 3 ulps" in text
    assert "## Unchecked on this host" in text and "non-current device" in text
    assert "1 x needs two CUDA GPUs (this host has 1)" in text


def test_skips_of_a_tool_that_cannot_run_do_not_fail_the_run(tmp_path, capsys):
    check, _ = _check_with(tmp_path, [("build", "passed"), ("memcheck", "skipped")],
                           junit_text=JUNIT.replace('<failure message="AssertionError: off by '
                                                    '3 ulps">trace</failure>', ""))
    assert check.finish() == 0
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["verdict"] == "passed"


def test_headline_ratios_come_from_the_benches_records(tmp_path, capsys):
    bench = {"kernels": {"copy_gbps": 3000.0, "workloads": {"200 fp32 grads": {
                 "native": {"ms": 1.0, "x_floor": 1.1, "x_copy": 1.2},
                 "torch": {"ms": 2.0, "x_floor": 2.2, "x_copy": 2.4}}}},
             "o2_step": {"results": {
                 "fp32 AdamW(fused)": {"ms": 2.0, "peak_mib": 100.0},
                 "GradScaler AdamW(fused)": {"ms": 4.0, "peak_mib": 110.0},
                 "O2 AdamW": {"ms": 2.2, "peak_mib": 100.0}}},
             "resnet_bn": {"results": {"fp32": {"ms": 10.0, "peak_mib": 400.0},
                                       "autocast": {"ms": 5.0, "peak_mib": 300.0},
                                       "O2": {"ms": 5.5, "peak_mib": 330.0}}}}
    check, _ = _check_with(tmp_path, [("build", "passed")], bench=bench)
    check.finish()
    lines = json.loads((tmp_path / "out" / "summary.json").read_text())["headlines"]
    assert "device-to-device copy: 3000 GB/s (read + write)" in lines
    assert "200 fp32 grads: native 1.20x the copy time, 0.50x torch's op (2.40x the copy " \
           "time)" in lines
    assert "O2 step, O2 AdamW: 1.10x the time and 1.00x the peak of fp32 AdamW(fused); 0.55x " \
           "the time and 0.91x the peak of GradScaler + AdamW(fused)" in lines
    assert "ResNet-18 + BatchNorm, O2: 0.82x the peak of fp32, 1.10x autocast's; 1.10x " \
           "autocast's time" in lines


def test_fp8_headlines_come_from_its_record(tmp_path, capsys):
    bench = {"fp8": {"layers": {"target_speedup": 1.41, "slowest_default_eligible": 1.07,
                                "crossover": 2048, "default_min_features": 2048,
                                "extras": {"counts off": {"x_fp8": 0.98},
                                           "eager casts": {"x_fp8": 1.6}}},
                     "decoder": {"parameters": 124e6, "step_speedup": 1.12, "loss_gap": 0.004,
                                 "spec": {"steps": 150}}}}
    check, _ = _check_with(tmp_path, [("build", "passed")], bench=bench)
    check.finish()
    lines = json.loads((tmp_path / "out" / "summary.json").read_text())["headlines"]
    assert "fp8 Linear 16384 x 4096 x 4096 fwd+bwd: 1.41x bf16's speed (target >= 1.3x on an " \
           "H100); slowest layer amp's default puts in fp8: 1.07x (target >= 1.0x)" in lines
    assert "fp8 crossover: at least bf16's speed at every M from d = 2048 (default " \
           "min_features 2048, estimated before this); with its counts off fp8 takes 0.98x " \
           "its time, with eager casts 1.60x" in lines
    assert "fp8 decoder (124M): step 1.12x bf16's speed, loss gap +0.40% after 150 steps " \
           "(target within 1%)" in lines


def _is_cuda_gate(node: ast.AST) -> bool:
    """A skip on the GPU's absence (a parametrization with a "cuda" value is not: the value is
    in the test's id)."""
    text = ast.unparse(node)
    if "parametrize" in text:
        return False
    return "requires_cuda" in text or "torch.cuda.is_available" in text


def test_every_cuda_gated_test_has_cuda_in_its_id():
    """gpu_check.py selects the GPU's tests with ``-k cuda``: a test that needs a GPU (a
    requires_cuda or torch.cuda.is_available() skip, or a module gated so) must say cuda in its
    name or its module's."""
    unnamed = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        module_gated = any(isinstance(n, ast.Assign) and any(
            getattr(t, "id", "") == "pytestmark" for t in n.targets) and _is_cuda_gate(n.value)
            or isinstance(n, ast.Expr) and "require_cuda_kernels(" in ast.unparse(n)
            for n in tree.body)
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test"):
                continue
            body = [n for statement in node.body for n in ast.walk(statement)]
            gated = module_gated or any(_is_cuda_gate(d) for d in node.decorator_list) or any(
                _is_cuda_gate(n) for n in body if isinstance(n, ast.If))
            if gated and "cuda" not in node.name and "cuda" not in path.stem:
                unnamed.append(f"{path.name}::{node.name}")
    assert not unnamed, unnamed
