"""apex-era third-party code, unmodified, through ``import apex`` (issue 51): fairseq's
FusedAdamV2, DeepLearningExamples' GNMT fp_optimizers.py and BERT's optimization.py (today's,
and 2019's BertLAMB over amp_C's LAMB stage ops) and run_pretraining.py's
--allreduce_post_accumulation step. The files are in tests/third_party/ (ORIGINS.md: repository,
path, commit, what was trimmed); tests/apex_era_client.py drives them as their scripts do, in a
process of its own under ``python -m apex_lite.apex_alias``, and trains each model as the
project's fp32 run does and through amp, on the fused and the unfused O2 step where both
apply. The suite runs once per kernel backend (the variables reach the process).
"""
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

pytestmark = pytest.mark.skipif(importlib.util.find_spec("apex") is not None,
                                reason="a package named apex is installed here, and the alias "
                                       "refuses to shadow it")


def _case(tmp_path, case, fused_step="default"):
    out = tmp_path / f"{case}.json"
    result = subprocess.run(
        [sys.executable, "-m", "apex_lite.apex_alias", "apex_era_client.py", "--case", case,
         "--fused-step", fused_step, "--out", str(out)],
        cwd=TESTS, env=dict(os.environ), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(out.read_text())


def _params_close(a, b, rtol, atol):
    worst = max(abs(x - y) - rtol * abs(y) for pa, pb in zip(a, b) for x, y in zip(pa, pb))
    return worst <= atol


def _tracks(amp_run, fp32_run, tol):
    """The amp run's losses follow the fp32 run's, step by step, within ``tol`` (bf16 model
    rounding), and both trained."""
    ours, theirs = amp_run["losses"], fp32_run["losses"]
    assert len(ours) == len(theirs)
    worst = max(abs(a - b) for a, b in zip(ours, theirs))
    assert worst <= tol, (worst, ours, theirs)
    assert all(math.isfinite(v) for v in ours)


def test_fairseq_fused_adam_steps_adamw_through_apexs_attributes(tmp_path):
    """fairseq/optim/fused_adam.py: get_fused_adam_class() picks FusedAdamV2 (apex's FusedAdam
    subclassed, "Apex installation is outdated" without multi_tensor_adam), whose own step runs
    through multi_tensor_adam, _dummy_overflow_buf and adam_w_mode."""
    r = _case(tmp_path, "fairseq")
    assert r["class"] == "FusedAdamV2"
    assert r["attributes"] == {"adam_w_mode": 1, "buf": ["torch.int32", [0]]}
    # AdamW's run (apex's formula: torch's up to fp32 rounding) and not Adam's: adam_w_mode
    # reached the op.
    assert _params_close(r["fairseq_adamw"]["params"], r["torch_adamw"]["params"], 1e-5, 1e-6)
    assert r["fairseq_adamw"]["losses"] == pytest.approx(r["torch_adamw"]["losses"], rel=1e-6)
    assert not _params_close(r["fairseq_adamw"]["params"], r["torch_adam"]["params"], 1e-5,
                             1e-4)
    assert _params_close(r["fairseq_adam"]["params"], r["torch_adam"]["params"], 1e-5, 1e-6)
    assert _params_close(r["fairseq_adamw"]["params"], r["apex_fused_adamw"]["params"], 1e-5,
                         1e-6)
    # fp16 parameters (--memory-efficient-fp16): fp32 math rounded once, as FusedAdam's own.
    assert r["fairseq_adamw_fp16"]["params"] == r["apex_fused_adamw_fp16"]["params"]
    assert r["fairseq_adamw"]["losses"][-1] < 0.9 * r["fairseq_adamw"]["losses"][0]


def _gnmt_scales(initial, interval, decisions, cap=2.0 ** 24):
    """GNMT's expected loss scale after ``decisions`` clean backwards: doubled every
    ``interval`` of them (its _scale_seq_len), from ``initial`` (its _loss_scale)."""
    return min(cap, initial * 2.0 ** (decisions // interval))


@pytest.mark.parametrize("fused_step", ["default", "off"])
def test_gnmt_amp_optimizer_sets_the_initial_scale_and_the_growth_interval(tmp_path,
                                                                         fused_step):
    """seq2seq/train/fp_optimizers.py: ``import apex.amp._amp_state``, then
    loss_scalers[0]._loss_scale = 4096 and _scale_seq_len = 3 (its init_scale and
    upscale_interval), with the trainer's amp.initialize and --train-iter-size 2."""
    r = _case(tmp_path, "gnmt", fused_step)
    amp_run = r["amp"]
    assert amp_run["dtype"] == "torch.bfloat16" and amp_run["scale_window"] == 3
    # Every backward is one decision (apex's too, without delay_overflow_check); the first
    # used 4096.
    assert amp_run["decisions"] == 24
    assert amp_run["scales"] == [4096.0] + [_gnmt_scales(4096.0, 3, 2 * k)
                                            for k in range(1, 13)]
    _tracks(amp_run, r["fp32"], tol=0.02)
    assert amp_run["losses"][-1] < 0.6 * amp_run["losses"][0]


def test_bert_finetuning_imports_optimization_and_trains_bert_adam(tmp_path):
    """BERT's optimization.py (run_glue.py, run_squad.py and run_swag.py import it) looks up
    amp_C.multi_tensor_lamb_stage1_cuda and _stage2_cuda at import; BertAdam under run_squad's
    amp.initialize trains as its fp32 run."""
    r = _case(tmp_path, "bert_finetune")
    assert r["looked_up"] == {"multi_tensor_l2norm": "multi_tensor_l2norm",
                              "lamb_compute_update": "multi_tensor_lamb_stage1_cuda",
                              "lamb_apply_update": "multi_tensor_lamb_stage2_cuda",
                              "scale": "multi_tensor_scale"}
    _tracks(r["amp"], r["fp32"], tol=0.02)
    assert r["fp32"]["losses"][-1] < 0.85 * r["fp32"]["losses"][0]


def test_bert_lamb_of_2019_steps_through_the_lamb_stages(tmp_path):
    """2019's BertLAMB (DeepLearningExamples' only caller of the stage ops): its fp32 run is
    LAMB in float64 from its source and apex's kernels, and under amp it trains the same."""
    r = _case(tmp_path, "bert_lamb_2019")
    assert r["fp32"]["worst_vs_float64"] < 1e-5
    _tracks(r["amp"], r["fp32"], tol=0.02)


@pytest.mark.parametrize("fused_step", ["default", "off"])
def test_bert_pretraining_allreduce_post_accumulation(tmp_path, fused_step):
    """run_pretraining.py: _loss_scale set to --init_loss_scale after initialize; scale_loss
    with delay_overflow_check, then take_optimizer_step (verbatim): its own unscale of the
    all-reduced master gradients into its buffer, swapped into the scaler for update_scale(),
    the masters' gradients dropped through _amp_stash after a skip."""
    r = _case(tmp_path, "bert_pretraining", fused_step)
    amp_run, overflow = r["amp"], r["amp_overflow"]
    assert amp_run["scaled_over_loss"] == [2.0 ** 20] * 24   # the initial scale, kept
    assert amp_run["global_step"] == r["fp32"]["global_step"] == 12
    assert amp_run["skipped_steps"] == 0 and amp_run["typo_kept"] and amp_run["finite"]
    _tracks(amp_run, r["fp32"], tol=0.02)
    # An inf in the gradients of micro-batch 5 (optimizer step 3): that step skipped, the scale
    # halved once, the skip logged with the new scale, training going on.
    assert overflow["skipped_steps"] == 1 and overflow["global_step"] == 11
    assert overflow["scales"] == [2.0 ** 20] * 2 + [2.0 ** 19] * 10
    assert r["logged"] == [["PARAMETER", {"loss_scale": 2.0 ** 19}]]
    assert overflow["finite"] and overflow["losses"][:6] == amp_run["losses"][:6]
