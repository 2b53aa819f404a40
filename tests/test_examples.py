"""The examples and benchmarks run end to end at tiny sizes and print what they promise.

Each script runs in its own process, as a user would run it. The processes are started all at
once (one thread each) and each test waits for its own, so the file costs about as long as the
slowest script rather than their sum.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 240

SCRIPTS = {
    "amp_recipe": ["examples/amp_recipe.py", "--device", "cpu", "--batch-size", "16",
                   "--width", "32", "--batches", "2", "--epochs", "2", "--threads", "1"],
    "cnn_batchnorm": ["examples/cnn_batchnorm.py", "--device", "cpu", "--steps", "30",
                      "--batch-size", "16", "--image-size", "8", "--channels", "8,16",
                      "--noise", "0.5", "--threads", "1"],
    "dcgan_O1": ["examples/dcgan_multi_loss.py", "--device", "cpu", "--opt-level", "O1",
                 "--iterations", "4", "--batch-size", "8", "--ngf", "8", "--ndf", "8",
                 "--log-every", "2", "--threads", "1"],
    "dcgan_O2": ["examples/dcgan_multi_loss.py", "--device", "cpu", "--opt-level", "O2",
                 "--iterations", "4", "--batch-size", "8", "--ngf", "8", "--ndf", "8",
                 "--log-every", "2", "--threads", "1"],
    "distributed": ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                    "examples/distributed.py", "--steps", "20", "--width", "32"],
    "step_overhead": ["bench/step_overhead.py", "--smoke", "--threads", "1"],
    "train_smoke": ["bench/train.py", "--smoke", "--threads", "1"],   # + --json, per run
    "optimizers": ["bench/optimizers.py", "--smoke", "--threads", "1"],
}

NUMBER = r"([-+]?(?:\d+\.?\d*(?:e[-+]?\d+)?|nan|inf))"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Start every script; `runs(name)` waits for one and returns (returncode, stdout, stderr)."""
    out_dir = tmp_path_factory.mktemp("example_runs")
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    processes = {}
    for name, argv in SCRIPTS.items():
        extra = ["--json", str(out_dir / "train.json")] if name == "train_smoke" else []
        processes[name] = subprocess.Popen([sys.executable, *argv, *extra], cwd=REPO_ROOT,
                                           env=env, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True)
    finished = {}

    def wait(name):
        if name not in finished:
            try:
                stdout, stderr = processes[name].communicate(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                processes[name].kill()
                stdout, stderr = processes[name].communicate()
                pytest.fail(f"{name} ran past {TIMEOUT_S} s\n{stdout}\n{stderr}")
            finished[name] = (processes[name].returncode, stdout, stderr)
        return finished[name]

    wait.out_dir = out_dir
    yield wait
    for process in processes.values():
        if process.poll() is None:
            process.kill()
            process.communicate()


def _ok(runs, name):
    code, stdout, stderr = runs(name)
    assert code == 0, f"{name} exited with {code}\nstdout:\n{stdout}\nstderr:\n{stderr}"
    return stdout, stderr


def _row(stdout: str, label: str, columns: int):
    """The numbers of the table row that starts with `label`."""
    match = re.search(rf"^{re.escape(label)}\s+" + r"\s+".join([NUMBER + "x?"] * columns),
                      stdout, re.MULTILINE)
    assert match, f"no table row for {label!r} in:\n{stdout}"
    return [float(v) for v in match.groups()]


@pytest.mark.parametrize("label", ["default precision", "O0", "O1", "O2", "O3"])
def test_amp_recipe_table_row(runs, label):
    stdout, _ = _ok(runs, "amp_recipe")
    ms_per_step, speedup, peak_mib, final_loss = _row(stdout, label, 4)
    assert ms_per_step > 0 and speedup > 0
    assert math.isfinite(final_loss) and final_loss > 0
    assert math.isfinite(peak_mib)   # resident-set peak is measured on Linux


def test_amp_recipe_o0_matches_default_precision(runs):
    """O0 is fp32 with a loss scale of 1: the same arithmetic as the plain loop."""
    stdout, _ = _ok(runs, "amp_recipe")
    assert _row(stdout, "O0", 4)[3] == _row(stdout, "default precision", 4)[3]


@pytest.mark.parametrize("module,tensor,dtype", [
    ("Conv2d", "weight", "torch.bfloat16"),
    ("BatchNorm2d", "weight", "torch.float32"),
    ("BatchNorm2d", "bias", "torch.float32"),
    ("BatchNorm2d", "running_mean", "torch.float32"),
    ("BatchNorm2d", "running_var", "torch.float32"),
    ("optimizer", "master param", "torch.float32"),
])
def test_cnn_batchnorm_dtypes_under_o2(runs, module, tensor, dtype):
    stdout, _ = _ok(runs, "cnn_batchnorm")
    assert re.search(rf"^{module}\s+{tensor}\s+{re.escape(dtype)}$", stdout, re.MULTILINE), stdout


def test_cnn_batchnorm_converges(runs):
    stdout, _ = _ok(runs, "cnn_batchnorm")
    first, last = map(float, re.search(r"first ([\d.]+), last ([\d.]+)", stdout).groups())
    assert last < 0.5 * first
    assert "converged: yes" in stdout


@pytest.mark.parametrize("name", ["dcgan_O1", "dcgan_O2"])
def test_dcgan_three_losses(runs, name):
    stdout, stderr = _ok(runs, name)
    assert "losses finite: yes" in stdout
    scales = re.search(r"^loss scales: (.*)$", stdout, re.MULTILINE).group(1)
    assert [s.split("=")[0] for s in scales.split(", ")] == \
        ["loss_scaler0", "loss_scaler1", "loss_scaler2"]
    losses = re.search(r"final Loss_D: (\S+)\s+Loss_G: (\S+)", stdout).groups()
    assert all(math.isfinite(float(v)) for v in losses)
    assert "[4/4] Loss_D:" in stderr   # progress goes through logging


def test_step_overhead_smoke(runs):
    stdout, _ = _ok(runs, "step_overhead")
    for variant in ("plain", "GradScaler", "amp O1"):
        assert math.isfinite(_row(stdout, variant, 1)[0])
    assert re.search(r"step time\s+amp O1 / GradScaler = " + NUMBER, stdout)


def test_optimizers_smoke(runs):
    stdout, _ = _ok(runs, "optimizers")
    assert re.search(r"^CPU: .*flags: ", stdout, re.MULTILINE)
    for workload in ("200 tensors, 20K fp32 params (smoke)", "400 tensors of 25 elements (smoke)"):
        for variant in ("sgd foreach", "sgd fused", "sgd ours", "adamw foreach", "adamw fused",
                        "adamw ours", "O2 adamw torch", "O2 adamw ours", "O2 lamb ours",
                        "floor sgd", "floor adamw", "floor O2 adamw"):
            ms, ratio, gbps = _row(stdout, f"{workload:<40} {variant}", 3)
            assert ms > 0 and ratio > 0 and math.isfinite(gbps)
    assert len(re.findall(r"^target: .*: " + NUMBER + " (met|MISSED)$", stdout, re.MULTILINE)) == 3


def test_train_smoke_table_and_json(runs):
    stdout, stderr = _ok(runs, "train_smoke")
    for workload in ("mlp", "cnn", "transformer"):
        for variant in ("fp32", "autocast", "O1", "O2", "O3"):
            ms, speed_fp32, speed_auto, peak, train_mib, mem, loss, dloss = \
                _row(stdout, f"{workload:<12}{variant}", 7) + [0.0]
            assert ms > 0 and math.isfinite(loss)
    record = json.loads((runs.out_dir / "train.json").read_text())
    results = record["results"]
    assert set(results) == {"mlp", "cnn", "transformer"}
    for per_variant in results.values():
        assert set(per_variant) == {"fp32", "autocast", "O1", "O2", "O3"}
        for r in per_variant.values():
            assert len(r["losses"]) == len(r["scales"]) > len(r["times_ms"]) > 0
            assert r["peak_bytes"] >= r["baseline_bytes"] > 0
    # The plot is made when matplotlib is importable and skipped, with a log line, when not.
    png = runs.out_dir / "train.png"
    assert png.exists() or "matplotlib is not installed" in stderr


def test_distributed_example_trains_on_two_ranks(runs):
    stdout, _ = _ok(runs, "distributed")
    last = re.search(r"step +19 +loss " + NUMBER + r" +loss scale " + NUMBER +
                     r" +skipped (\d+)/20 +\(2 ranks\)", stdout)
    assert last, stdout
    assert math.isfinite(float(last.group(1))) and int(last.group(3)) == 0
