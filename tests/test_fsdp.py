"""amp on PyTorch FSDP2 (``fully_shard``): real ranks on gloo, compared with one process.

One launch of two ranks (tests/workers/fsdp_worker.py --job main) trains every case of
``CASES`` (each opt level; nested units, units kept unsharded after forward, a partly sharded
model with and without a root unit; clipping; gradient accumulation, also with FSDP2's gradient
sync off), every O2 case on the fused and on the unfused step (``fused_step=True`` / ``False``:
amp's default depends on the backend), with inf written into a gradient on rank 1 at one step.
It also collects what amp refuses and the default step path, runs O2 with BatchNorm kept fp32,
and saves a DCP checkpoint on each step path. Then two new ranks resume from them and one rank
loads them (DCP reshards 2 -> 1). Each launch ends with the teardown of examples/fsdp.py and
fails when a gloo thread outlives destroy_process_group. The single-process references run
here, in the test's own process (no process group), with the same model, global batches and
opt level.

Tolerances, from the numbers measured when the test was written (2 ranks, gloo, CPU):
- O0 (fp32): the distance between the two runs' master weights after 20 steps is at most 1e-5
  of the distance the weights travelled (measured 1.6e-7: summation order only);
- O1-O5 (bf16): at most 3% (measured 0.4-1.1%, accumulation cases included). Each rank rounds
  its half-batch gradient products to bf16 before FSDP2 sums them in fp32, where one process
  rounds the whole batch's;
- gradient norms for clipping: 2% relative (measured at most 0.5%);
- the fused against the unfused O2 step on the same shards: 5e-4 of the distance travelled
  (measured 1e-7 with SGD, 6.4e-5 with AdamW, whose fused update orders its fp32 arithmetic
  differently), with the same decisions.
Applied and skipped steps and loss scales must be equal, step by step; a DCP resume is bit
for bit.
"""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import gloo_ranks
from apex_lite import amp
from apex_lite.multi_tensor import backend

WORKER_PATH = Path(__file__).parent / "workers" / "fsdp_worker.py"


def _fsdp2_available() -> bool:
    if not dist.is_available() or not dist.is_gloo_available():
        return False
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401  (torch 2.6+)
    except ImportError:
        return False
    return True


pytestmark = pytest.mark.skipif(not _fsdp2_available(),
                                reason="torch.distributed with gloo and FSDP2 is not available")

_spec = importlib.util.spec_from_file_location("fsdp_worker", WORKER_PATH)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

HALF_TOLERANCE, FP32_TOLERANCE, NORM_TOLERANCE, PATH_TOLERANCE = 0.03, 1e-5, 0.02, 5e-4
# The O2 cases that run on both step paths, by the name they share.
BOTH_PATHS = [case.name[:-len("_fused")] for case in worker.CASES
              if case.name.endswith("_fused")]


def _start(job: str, out: Path, world: int):
    return gloo_ranks.start(WORKER_PATH, ["--job", job, "--out", str(out)], world)


def _finish(job: str, out: Path, procs, timeout: float = 150):
    gloo_ranks.finish(procs, job, timeout)
    return [torch.load(out / f"{job}_rank{r}.pt", weights_only=False) for r in range(len(procs))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The ranks' results: {"main": [rank0, rank1], "resume": [...], "reshard": [rank0]}."""
    out = tmp_path_factory.mktemp("fsdp")
    results = {"main": _finish("main", out, _start("main", out, 2))}
    resume, reshard = _start("resume", out, 2), _start("reshard", out, 1)   # side by side
    results["resume"] = _finish("resume", out, resume)
    results["reshard"] = _finish("reshard", out, reshard)
    return results


def _reference(case):
    """The case trained in this process, without FSDP, on the whole global batches."""
    handle = amp.AmpHandle()
    model = worker.build(case)
    optimizer = worker.make_optimizer(case, model)
    model, optimizer = worker.initialize(case, handle, model, optimizer)
    record = worker.train(case, model, optimizer, handle)
    record["masters"] = worker.masters_of(handle, optimizer)
    record["fused"] = optimizer._apex_lite_amp.path.fused
    initial = [p.detach().float() for p in worker.build(case).parameters() if p.requires_grad]
    return record, initial


def _distance(a, b) -> float:
    return math.sqrt(sum(float(((x.float() - y.float()) ** 2).sum()) for x, y in zip(a, b)))


@pytest.mark.parametrize("name", [case.name for case in worker.CASES])
def test_matches_one_process_with_the_same_skips(runs, name):
    case = worker.CASE[name]
    ranks = [r["cases"][name] for r in runs["main"]]
    reference, initial = _reference(case)
    fused = case.kwargs.get("fused_step") is True   # the step path the case names
    assert reference["fused"] == fused and all(r["fused"] == fused for r in ranks)
    applied = [step != worker.INJECT_STEP for step in range(case.steps)]
    assert reference["applied"] == applied
    if case.micro == 1:   # with accumulation the scaler's last decision is the last backward's
        assert reference["skipped"] == [not a for a in applied]
    for rank, got in enumerate(ranks):
        # inf on rank 1 only: every rank skips that step, as the one process does.
        assert got["applied"] == applied, f"rank {rank}"
        assert got["skipped"] == reference["skipped"], f"rank {rank}"
        assert got["scale"] == reference["scale"], f"rank {rank}"
        for a, b in zip(got["masters"], ranks[0]["masters"]):
            assert torch.equal(a, b)
    travelled = _distance(reference["masters"], initial)
    tolerance = FP32_TOLERANCE if case.level == "O0" else HALF_TOLERANCE
    assert _distance(ranks[0]["masters"], reference["masters"]) <= tolerance * travelled
    losses = [sum(r["loss"][i] for r in ranks) / len(ranks) for i in range(case.steps)]
    assert losses == pytest.approx(reference["loss"], rel=tolerance, abs=1e-6)
    if case.clip is not None:
        for rank, got in enumerate(ranks):
            assert got["norm"] == pytest.approx(reference["norm"], rel=NORM_TOLERANCE), \
                f"rank {rank}"
    if reference["master_grads"] is not None:   # read through amp.master_params, unscaled
        for got, want in zip(ranks[0]["master_grads"], reference["master_grads"]):
            torch.testing.assert_close(got.float(), want.float(), rtol=0,
                                       atol=NORM_TOLERANCE * float(want.abs().max()))


@pytest.mark.parametrize("name", BOTH_PATHS)
def test_the_fused_and_the_unfused_step_train_alike_on_shards(runs, name):
    """The two O2 step paths on the same shards: the same decisions, and masters that differ
    by fp32 rounding (see the tolerances above)."""
    for result in runs["main"]:
        fused, unfused = result["cases"][f"{name}_fused"], result["cases"][f"{name}_unfused"]
        assert fused["applied"] == unfused["applied"]
        assert fused["skipped"] == unfused["skipped"] and fused["scale"] == unfused["scale"]
        initial = [p.detach().float() for p in worker.build(worker.CASE[f"{name}_fused"])
                   .parameters() if p.requires_grad]
        assert _distance(fused["masters"], unfused["masters"]) <= \
            PATH_TOLERANCE * _distance(unfused["masters"], initial)


@pytest.mark.parametrize("path", worker.STEP_PATHS)
def test_O2_and_O3_compute_in_half_and_keep_what_each_level_keeps(runs, path):
    cases = runs["main"][0]["cases"]
    assert all(m.dtype == torch.float32 for m in cases[f"O2_{path}"]["masters"])   # masters
    assert all(m.dtype == torch.float32 for m in cases[f"O5_{path}"]["masters"])
    assert all(m.dtype == torch.float32 for m in cases["O4"]["masters"])   # fp32 weights
    assert cases[f"O5_{path}"]["scale"] == [1.0] * len(cases[f"O5_{path}"]["scale"])
    assert all(m.dtype == torch.bfloat16 for m in cases["O3"]["masters"])  # O3: no masters
    report = cases[f"O2_{path}"]["report"]
    assert "all-gathered in torch.bfloat16" in report
    assert ("optimizer 0 (SGD): fused step" if path == "fused" else
            "optimizer 0 (SGD): unfused step (fused_step=False)") in report
    assert "master weights: none" in report            # no second copy of anything


def test_the_default_step_path_is_fused_on_either_backend(runs):
    """The native kernels where they serve the CPU, torch's fused kernels otherwise."""
    native = backend(torch.device("cpu"))[0] == "native"
    for result in runs["main"]:
        line = result["default_step_path"]
        if native:
            assert line == "optimizer 0 (SGD): fused step", line
        else:
            assert line == ("optimizer 0 (SGD): fused step (torch's fused kernels, half "
                            "gradients converted to fp32 1 MiB at a time on cpu)"), line


@pytest.mark.parametrize("path", worker.STEP_PATHS)
def test_report_counts_this_ranks_shards(runs, path):
    total = sum(p.numel() for p in worker.build(worker.CASE[f"O2_{path}"]).parameters())
    for rank, result in enumerate(runs["main"]):
        report = result["cases"][f"O2_{path}"]["report"]
        # SGD with momentum: fp32 parameter, gradient and momentum shards, 12 bytes per element
        # of this rank's shards, about a half of the model's each (on either step path: the
        # unfused step's fp32 master gradients are the gradient shards themselves).
        assert "bytes held per model parameter: 12.00" in report
        held = float(report.split("this rank holds ")[1].split(" KiB")[0]) * 1024
        assert abs(held - 12 * total / 2) <= 12 * worker.WIDTH * 4, (rank, held, total)


@pytest.mark.parametrize("path", worker.STEP_PATHS)
def test_batchnorm_kept_fp32_in_units_of_its_own(runs, path):
    result = runs["main"][0]["kept_batchnorm"][path]
    seen = result["dtypes"]
    # The half activations as they are, with fp32 statistics (issue 53: no fp32 copy).
    assert seen["batch_norm_input"] == torch.bfloat16
    assert seen["batch_norm_running_mean"] == torch.float32
    assert seen["blocks.0.norm"] == {"output": torch.bfloat16, "param": torch.float32}
    assert seen["head"] == {"output": torch.bfloat16, "param": torch.float32}
    assert seen["blocks.0.fc1"]["param"] == torch.bfloat16     # all-gathered in half
    assert result["record"]["skipped"] == [False] * 3
    assert "model modules kept fp32: blocks.0.norm, blocks.1.norm, head" in result["report"]


@pytest.mark.parametrize("key, expected", [
    ("order_O1", ["sharded with fully_shard after amp.initialize",
                  "fully_shard each block, then the root", "then model, optimizer = "
                  "amp.initialize(model, optimizer, ...)"]),
    ("order_O2", ["sharded with fully_shard after amp.initialize",
                  # the run's half dtype (bf16 on the CPU; fp16 on CUDA: test_amp_cuda.py)
                  "mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
                  "reduce_dtype=torch.float32)"]),
    ("optimizer_before_shard", ["an optimizer must be built after it"]),
    ("O2_no_policy", [
        "mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
        "reduce_dtype=torch.float32)\n"
        "    fully_shard(model.blocks[0].fc1, mp_policy=mp_policy)\n"
        "    fully_shard(model.blocks[0], mp_policy=mp_policy)\n"
        "    fully_shard(model.blocks[1].fc1, mp_policy=mp_policy)\n"
        "    fully_shard(model.blocks[1], mp_policy=mp_policy)\n"
        "    fully_shard(model, mp_policy=mp_policy)\n"]),
    ("O1_half_policy", ["computes in torch.bfloat16", "O1 computes in float32 under autocast",
                        "opt_level='O2'"]),
    ("O0_half_reduce", ["reduces gradients in torch.bfloat16", "reduce_dtype=torch.float32"]),
    ("O4_half_policy", ["computes in torch.bfloat16", "O4 computes in float32 under autocast",
                        "opt_level='O2' or 'O5'"]),
    ("O5_no_policy", ["opt_level='O5'", "O5 computes in torch.bfloat16",
                      "MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
                      "reduce_dtype=torch.float32)"]),
    ("O5_fp16_policy", ["computes in torch.float16, but O5 computes in torch.bfloat16",
                        "opt_level='O2' with half_dtype=torch.float16"]),
    ("O2_fp16_policy", ["computes in torch.float16, but O2 computes in torch.bfloat16",
                        "half_dtype=torch.float16"]),
    ("O3_fp32_policy", ["computes in torch.float32, but O3 computes in torch.bfloat16"]),
    ("batchnorm_in_half_unit", ["'blocks.0.norm' is kept in fp32",
                                "    fully_shard(model.blocks[0].norm)\n"
                                "    fully_shard(model.blocks[0], mp_policy=mp_policy)",
                                "keep_batchnorm_fp32=False"]),
    ("lamb", ["FusedLAMB", "whole norm", "FusedAdam or torch.optim.AdamW"]),
    ("lamb_without_amp", ["DTensors", "whole norm"]),
    ("novograd", ["FusedNovoGrad", "per-layer gradient norm", "FusedAdam or torch.optim.AdamW"]),
    ("novograd_without_amp", ["DTensors", "whole norm"]),
])
def test_refusals_name_the_problem_and_the_fix(runs, key, expected):
    for result in runs["main"]:
        message = result["refusals"][key]
        for text in expected:
            assert text in message, message


def test_fused_adam_steps_shards_without_amp(runs):
    # The fused op on each rank's local shards, as torch's AdamW on the DTensors: fp32 rounding.
    for result in runs["main"]:
        assert result["fused_adam_without_amp"] <= 1e-6


CHECKPOINTS = [case.name for case in worker.CHECKPOINT_CASES]


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_dcp_resume_in_new_processes_is_bitwise(runs, name):
    for rank in range(2):
        saved = runs["main"][rank]["checkpoint"][name]
        resumed = runs["resume"][rank][name]
        assert resumed["record"]["loss"] == saved["record"]["loss"][worker.CHECKPOINT_AT:]
        assert resumed["record"]["applied"] == [True] * (worker.CHECKPOINT_STEPS -
                                                         worker.CHECKPOINT_AT)
        for a, b in zip(resumed["final"], saved["final"]):
            assert torch.equal(a, b)
        _assert_same_state(resumed["loaded"], runs["main"][0]["checkpoint"][name]["saved"])


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_dcp_saved_by_two_ranks_loads_into_one(runs, name):
    loaded = runs["reshard"][0][name]["loaded"]
    _assert_same_state(loaded, runs["main"][0]["checkpoint"][name]["saved"])
    assert loaded["amp"]["loss_scaler0"]["unskipped"] == worker.CHECKPOINT_AT
    assert loaded["optimizer"]["state"]        # Adam's moments came across, whole


def _assert_same_state(got, want, path="state"):
    if isinstance(want, dict):
        assert set(got) == set(want), path
        for key in want:
            _assert_same_state(got[key], want[key], f"{path}/{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want)):
            _assert_same_state(a, b, f"{path}/{i}")
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want), path
    else:
        assert got == want, path
