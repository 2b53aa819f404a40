"""The examples and benchmarks run end to end at tiny sizes and print what they promise.

Each script runs in its own process, as a user would run it. The processes are started all at
once (one thread each) and each test waits for its own, so the file costs about as long as the
slowest script rather than their sum.
"""
from __future__ import annotations

import importlib.util
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
                   "--width", "32", "--batches", "8", "--epochs", "3", "--threads", "1"],
    # + --plot, per run
    # --plot given without matplotlib: both scripts stop at once, saying how to install it.
    "amp_recipe_no_matplotlib": ["examples/amp_recipe.py", "--plot", "never.png"],
    "train_no_matplotlib": ["bench/train.py", "--smoke", "--plot", "never.png"],
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
    "fsdp": ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
             "examples/fsdp.py", "--steps", "20", "--width", "32", "--blocks", "2"],
    "step_overhead": ["bench/step_overhead.py", "--smoke", "--threads", "1"],
    "train_smoke": ["bench/train.py", "--smoke", "--threads", "1"],   # + --json --plot, per run
    "optimizers": ["bench/optimizers.py", "--smoke", "--threads", "1"],
    "o2_step": ["bench/o2_step.py", "--smoke", "--threads", "1"],
    "o2_route_floor": ["bench/o2_route_floor.py", "--smoke", "--threads", "1"],
    "fsdp_bench": ["bench/fsdp.py", "--smoke", "--variants", "torch mp,apex_lite O2"],
    "normalization": ["bench/normalization.py", "--smoke", "--threads", "1"],
    "fp8_bench": ["bench/fp8.py", "--smoke"],   # + --json, per run
}
# A stand-in for matplotlib that fails to import, put first on these scripts' path.
WITHOUT_MATPLOTLIB = {"amp_recipe_no_matplotlib", "train_no_matplotlib"}

NUMBER = r"([-+]?(?:\d+\.?\d*(?:e[-+]?\d+)?|nan|inf))"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Start every script; `runs(name)` waits for one and returns (returncode, stdout, stderr)."""
    out_dir = tmp_path_factory.mktemp("example_runs")
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    blocker = out_dir / "no_matplotlib" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text('raise ImportError("blocked by test_examples.py")\n')
    extras = {"amp_recipe": ["--plot", str(out_dir / "amp_recipe.png")],
              "train_smoke": ["--json", str(out_dir / "train.json"),
                              "--plot", str(out_dir / "train.png")],
              "fsdp": ["--checkpoint", str(out_dir / "fsdp_checkpoint")],
              "fp8_bench": ["--json", str(out_dir / "fp8.json")]}
    processes = {}
    for name, argv in SCRIPTS.items():
        run_env = env
        if name in WITHOUT_MATPLOTLIB:
            run_env = dict(env, PYTHONPATH=os.pathsep.join(
                [str(blocker.parent)] + [p for p in [env.get("PYTHONPATH")] if p]))
        processes[name] = subprocess.Popen([sys.executable, *argv, *extras.get(name, [])],
                                           cwd=REPO_ROOT, env=run_env, stdout=subprocess.PIPE,
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


RECIPE_LEVELS = ["default precision", "O0", "O1", "O2", "O3"]


@pytest.mark.parametrize("label", RECIPE_LEVELS)
def test_amp_recipe_table_row(runs, label):
    """Every level learns the teacher's map: the last epoch's loss is well below the first's."""
    stdout, _ = _ok(runs, "amp_recipe")
    ms_per_step, speedup, peak_mib, first_epoch, last_epoch, held_out = _row(stdout, label, 6)
    assert ms_per_step > 0 and speedup > 0
    assert math.isfinite(peak_mib)   # resident-set peak is measured on Linux
    assert 0.8 < first_epoch < 1.2   # an untrained network, unit-variance targets
    assert last_epoch < 0.95 * first_epoch
    assert math.isfinite(held_out) and held_out < first_epoch


def test_amp_recipe_o0_matches_default_precision(runs):
    """O0 is fp32 with a loss scale of 1: the same arithmetic as the plain loop."""
    stdout, _ = _ok(runs, "amp_recipe")
    assert _row(stdout, "O0", 6)[3:] == _row(stdout, "default precision", 6)[3:]


def test_amp_recipe_says_what_columns_and_figures_mean(runs):
    stdout, _ = _ok(runs, "amp_recipe")
    header = next(line for line in stdout.splitlines() if line.startswith("opt level"))
    for column in ("ms/step", "speed-up", "peak MiB", "train loss ep 1", "train loss ep 3",
                   "held-out loss"):
        assert column in header
    text = " ".join(stdout.split())   # the notes are wrapped
    assert "train loss ep N: the mean over epoch N's 8 batches" in text
    assert "held-out loss: after the last epoch, on 512 inputs never trained on" in text
    recipe = _load_script("examples/amp_recipe.py")
    import torch
    assert recipe.what_the_figures_mean(torch.device("cpu"), torch.bfloat16) in text


def _load_script(relative: str):
    """A script of the repository imported as a module (its main() does not run)."""
    spec = importlib.util.spec_from_file_location(Path(relative).stem, REPO_ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("flags,expected", [
    ({"avx2", "avx512_bf16"}, "avx512_bf16: bf16 matmuls run on its bf16 units"),
    ({"avx2", "amx_bf16", "amx_tile"}, "amx_bf16: bf16 matmuls run on its bf16 units"),
    ({"avx2", "fma"}, "but no avx512_bf16/amx_bf16: torch runs bf16 matmuls through slow "
                      "fallbacks"),
    (None, "no /proc/cpuinfo"),
])
def test_amp_recipe_machine_line_follows_the_cpu(monkeypatch, flags, expected):
    import torch
    recipe = _load_script("examples/amp_recipe.py")
    monkeypatch.setattr(recipe, "cpu_flags", lambda: flags)
    line = recipe.what_the_figures_mean(torch.device("cpu"), torch.bfloat16)
    assert expected in line and torch.backends.cpu.get_cpu_capability() in line


@pytest.mark.parametrize("flags,half_units", [
    ({"avx2", "avx512_bf16"}, True), ({"avx2", "amx_bf16"}, True), ({"avx2", "fma"}, False),
    (None, False),
])
def test_amp_recipe_half_units_follow_the_cpu_flags(monkeypatch, flags, half_units):
    import torch
    recipe = _load_script("examples/amp_recipe.py")
    monkeypatch.setattr(recipe, "cpu_flags", lambda: flags)
    assert recipe.has_half_units(torch.device("cpu"), torch.bfloat16) is half_units
    assert recipe.has_half_units(torch.device("cpu"), torch.float16) is False


def test_amp_recipe_default_sizes_follow_the_hardware():
    """Large where half units exist (the levels differ as in real training), small elsewhere."""
    import torch
    recipe = _load_script("examples/amp_recipe.py")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert recipe.default_sizes(cpu, False) == recipe.default_sizes(cuda, False) == dict(
        batch_size=64, width=512, layers=3, batches=32, epochs=3)
    assert recipe.default_sizes(cpu, True) == dict(batch_size=128, width=2048, layers=3,
                                                   batches=24, epochs=3)
    assert recipe.default_sizes(cuda, True) == recipe.FULL_SIZES


@pytest.mark.parametrize("half_units", [True, False])
def test_amp_recipe_flags_win_over_the_hardware_sizes(monkeypatch, half_units):
    recipe = _load_script("examples/amp_recipe.py")
    monkeypatch.setattr(recipe, "has_half_units", lambda device, dtype: half_units)
    _, args = recipe.parse_args(["--device", "cpu"])
    expected = recipe.CPU_HALF_UNIT_SIZES if half_units else recipe.SMALL_SIZES
    assert {name: getattr(args, name) for name in expected} == expected
    _, args = recipe.parse_args(["--device", "cpu", "--width", "96", "--batches", "5"])
    assert (args.width, args.batches, args.batch_size) == (96, 5, expected["batch_size"])
    _, args = recipe.parse_args(["--device", "cpu", "--full", "--epochs", "1"])
    assert {name: getattr(args, name) for name in recipe.FULL_SIZES} == {
        **recipe.FULL_SIZES, "epochs": 1}


def _check_png(path: Path, stderr: str, panels: list) -> None:
    """The PNG exists, opens with matplotlib's reader, and the script drew the panels."""
    image = pytest.importorskip("matplotlib.image")
    assert path.stat().st_size > 0
    pixels = image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
    drawn = re.search(rf"wrote {re.escape(str(path))} \(panels: (.*)\)$", stderr, re.MULTILINE)
    assert drawn, stderr
    assert drawn.group(1).split("; ") == panels


def test_amp_recipe_plot(runs):
    _, stderr = _ok(runs, "amp_recipe")
    _check_png(runs.out_dir / "amp_recipe.png", stderr,
               ["step time: median ms/step", "training loss (MSE per batch)",
                "loss scale (amp.loss_scalers()[0])"])


def test_amp_recipe_plot_function_draws_three_panels(tmp_path):
    """The plot of made-up results: one panel per figure kind, each curve per level."""
    pytest.importorskip("matplotlib")
    recipe = _load_script("examples/amp_recipe.py")
    rows = [(name, {"ms_per_step": 1.0 + i, "step_losses": [1.0, 0.5, 0.25],
                    "loss_scales": [2.0 ** 16, 2.0 ** 15, 2.0 ** 15]})
            for i, name in enumerate(RECIPE_LEVELS)]
    titles = recipe.plot(rows, tmp_path / "plot.png")
    assert [t.split(" ")[0] for t in titles] == ["step", "training", "loss"]
    assert (tmp_path / "plot.png").stat().st_size > 0


@pytest.mark.parametrize("name", sorted(WITHOUT_MATPLOTLIB))
def test_plot_without_matplotlib_stops_with_the_install_command(runs, name):
    code, stdout, stderr = runs(name)
    assert code == 2, stderr
    assert "--plot needs matplotlib" in stderr and "pip install matplotlib" in stderr
    assert not (REPO_ROOT / "never.png").exists()


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


def test_fp8_bench_smoke_reports_numerics_and_no_speed_on_the_cpu(runs):
    stdout, _ = _ok(runs, "fp8_bench")
    assert "This measures no speed" in stdout
    gap = float(re.search(r"loss gap of fp8 against O5 bf16 after 4 steps: " + NUMBER + "%",
                          stdout).group(1))
    assert abs(gap) < 5
    record = json.loads((runs.out_dir / "fp8.json").read_text())
    assert record["decoder"]["runs"]["fp8"]["fp8_layers"] == 9
    assert "step_ms" in record["decoder"]["runs"]["bf16"] and "layers" not in record


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


def test_o2_step_smoke(runs):
    stdout, _ = _ok(runs, "o2_step")
    assert re.search(r"^cpu: .*flags ", stdout, re.MULTILINE)
    for variant in ("fp32 AdamW(fused)", "O2 AdamW", "O2 AdamW unfused", "O2 FusedAdam",
                    "fp32 SGD(fused)", "O2 SGD", "O2 SGD unfused"):
        ms, ratio, peak, peak_ratio, steps_peak, steps_ratio = _row(stdout, variant, 6)
        assert ms > 0 and ratio > 0 and math.isfinite(peak)
    assert re.search(r"^O2 AdamW\s.* " + re.escape(_default_o2_step()), stdout, re.MULTILINE)
    assert re.search(r"^O2 SGD unfused\s.*unfused step \(fused_step=False\)$", stdout,
                     re.MULTILINE)


def test_normalization_bench_smoke(runs):
    """Every norm row against torch's module, timed in the same run."""
    stdout, _ = _ok(runs, "normalization")
    assert re.search(r"^cpu: .*flags ", stdout, re.MULTILINE)
    rows = {"float32": ("FusedLayerNorm", "FusedRMSNorm", "memory_efficient"),
            "bfloat16": ("FusedLayerNorm", "FusedRMSNorm", "memory_efficient"),
            "bf16 in, fp32 params": ("FusedLayerNorm", "MixedFusedLayerNorm", "FusedRMSNorm",
                                     "MixedFusedRMSNorm")}
    for kind, columns in rows.items():
        for norm in ("LayerNorm", "RMSNorm"):
            title = f"{norm} 64x96 {kind}"
            assert _row(stdout, f"{title:<44} {'torch':>20}", 2)[1] == 1.0
            for column in columns:
                if column.endswith(norm) or column == "memory_efficient":
                    ms, ratio = _row(stdout, f"{title:<44} {column:>20}", 2)
                    assert ms > 0 and ratio > 0


def test_o2_route_floor_smoke(runs):
    """The route's floor: fp32, the bare route with its breakdown, amp's O2 (the pure install's
    fused step whatever is built: the script disables the native kernels)."""
    stdout, _ = _ok(runs, "o2_route_floor")
    assert re.search(r"^cpu: .*flags ", stdout, re.MULTILINE)
    fp32 = re.search(r"^fp32 AdamW\(fused\): .* = ([0-9.]+) ms$", stdout, re.MULTILINE)
    route = re.search(r"^route, no amp: .* = ([0-9.]+) ms: ([0-9.]+)x fp32 \(([0-9.]+)x "
                      r"without the check\)$", stdout, re.MULTILINE)
    parts = re.search(r"^its step, by pass: +counts ([0-9.]+) \+ conversion ([0-9.]+) \+ kernel "
                      r"([0-9.]+) \+ rounding ([0-9.]+) ", stdout, re.MULTILINE)
    amp_row = re.search(r"^amp O2: .*x the route \(fused step \(torch's fused kernels, ", stdout,
                        re.MULTILINE)
    assert fp32 and route and parts and amp_row, stdout
    assert float(fp32.group(1)) > 0 and float(route.group(2)) > 0
    assert all(float(value) > 0 for value in parts.groups())


def test_fsdp_bench_smoke(runs):
    stdout, _ = _ok(runs, "fsdp_bench")
    for variant in ("torch mp", "apex_lite O2"):
        ms, ratio, peak, peak_ratio, steps_peak, steps_ratio = _row(stdout, variant, 6)
        assert ms > 0 and ratio > 0 and peak > 0 and steps_peak > 0
    assert re.search(r"^apex_lite O2\s.* " + re.escape(_default_o2_step()), stdout, re.MULTILINE)


def _default_o2_step() -> str:
    """How amp's default O2 step on the CPU for AdamW and SGD begins, as report() says: the
    fused step, through the native kernels where they serve the CPU and through torch's fused
    kernels otherwise (the scripts run with this process's environment)."""
    from apex_lite.multi_tensor import backend
    return "fused step" if backend("cpu")[0] == "native" else \
        "fused step (torch's fused kernels"


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
    _check_png(runs.out_dir / "train.png", stderr,
               [f"{workload}: {panel}" for workload in ("mlp", "cnn", "transformer")
                for panel in ("step time, median ms/step", "training loss", "loss scale")])


def test_distributed_example_trains_on_two_ranks(runs):
    stdout, _ = _ok(runs, "distributed")
    last = re.search(r"step +19 +loss " + NUMBER + r" +loss scale " + NUMBER +
                     r" +skipped (\d+)/20 +\(2 ranks\)", stdout)
    assert last, stdout
    assert math.isfinite(float(last.group(1))) and int(last.group(3)) == 0


def test_fsdp_example_trains_sharded_on_two_ranks(runs):
    stdout, _ = _ok(runs, "fsdp")
    first = re.search(r"step +0 +loss " + NUMBER, stdout)
    last = re.search(r"step +19 +loss " + NUMBER + r" +loss scale " + NUMBER +
                     r" +skipped (\d+)/20 +\(2 ranks\)", stdout)
    assert first and last, stdout
    assert float(last.group(1)) < float(first.group(1))          # it learns
    assert "optimizer 0 (AdamW): " + _default_o2_step() in stdout
    assert "all-gathered in torch.bfloat16" in stdout             # O2's half compute, by FSDP2
    assert "FSDP2: 3 fully_shard unit(s) over 2 rank(s)" in stdout
    assert re.search(r"saved \S+fsdp_checkpoint at step 20", stdout)   # through DCP
