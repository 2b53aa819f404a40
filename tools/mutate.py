#!/usr/bin/env python3
"""Can the suite fail? Break the library on purpose, one mutation at a time, and see.

Each mutation in MUTATIONS replaces one piece of text in apex_lite/ (found by searching every
.py file under apex_lite/, so a mutation survives the file it lives in being moved or split;
the text must occur exactly once) and names the tests that claim to cover that code. For each
mutation this script copies the working tree (the built extension included) to a scratch
directory once, applies the change there, runs the named tests from tests/ against the scratch
copy (as tools/test.sh runs them against the installed package), and restores the file. A
mutation is

  killed     when at least one named test fails (pytest exit status 1),
  SURVIVED   when all of them pass: the tests do not check what they claim,
  ERROR      when the text is not found (or not unique), the tests are not collected, or pytest
             stops otherwise (the list needs updating, not the library).

Before the mutations, the named tests are run once unmutated: they must pass, or a kill means
nothing. Not part of CI (each mutation costs a pytest start, several seconds); run it after
changing tests or the code they cover. CI checks only that the list still applies
(tests/test_mutation_list.py: each text found once, each named test present):

    python tools/mutate.py                  # all mutations, the backends each one names
    python tools/mutate.py -k lamb          # only those whose name contains "lamb"
    python tools/mutate.py --list
    python tools/mutate.py --check          # are the texts still found once? (no tests run)

The exit status is 1 when a mutation survived or errored. Never commit a mutation: the working
tree is not touched.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = {"native": {"APEX_LITE_REQUIRE_EXT": "1"}, "python": {"APEX_LITE_DISABLE_EXT": "1"}}


@dataclass
class Mutation:
    name: str
    find: str                   # text in some apex_lite/**/*.py, exactly once
    replace: str
    tests: Sequence[str]        # pytest node ids or files, relative to tests/
    k: str = ""                 # an optional pytest -k expression
    backends: Tuple[str, ...] = ("native",)


M = Mutation
MUTATIONS: List[Mutation] = [
    # issue 34, row 1: O1 always under autocast, whatever patch_torch_functions says.
    M("o1-ignores-patch_torch_functions",
      "patch_torch_functions_type=half_dtype if resolved_patch else None,",
      "patch_torch_functions_type=half_dtype if level.autocasts else None,",
      ["test_amp_initialize.py::test_overrides_take_effect"]),
    M("cast_model_outputs-ignored-at-o1",
      "output_dtype=props.cast_model_outputs or torch.float32)\n"
      "    elif props.cast_model_outputs",
      "output_dtype=torch.float32)\n    elif props.cast_model_outputs",
      ["test_amp_initialize.py::test_overrides_take_effect"]),
    M("patch_torch_functions-override-dropped",
      "resolved_patch = level.patch_torch_functions if patch_torch_functions is None \\\n"
      "        else patch_torch_functions",
      "resolved_patch = level.patch_torch_functions",
      ["test_amp_initialize.py::test_overrides_take_effect"]),
    M("o1-autocast-ignores-half_dtype",
      "    autocast_dtype = props.patch_torch_functions_type\n",
      "    autocast_dtype = props.patch_torch_functions_type and torch.bfloat16\n",
      ["test_amp_initialize.py::test_dtypes_per_level"]),
    # row 2: FusedLAMB ignoring GradScaler's scale (the unscaled gradients' norm still clips).
    M("lamb-ignores-grad-scaler-scale",
      "update(state, inv_scale, found_inf, self._hyper(group), norm, grads=update_grads)",
      "update(state, torch.ones_like(inv_scale), found_inf, self._hyper(group), norm, "
      "grads=update_grads)",
      ["test_fused_optimizers.py::test_grad_scaler_hands_scale_and_found_inf_to_the_op"],
      k="lamb and not clipped", backends=("native", "python")),
    # row 3: apex's amp_C.multi_tensor_adam mapped wrongly, seen by the half cases alone.
    M('adam-weight-decay-mode-swapped-bf16',
      'float(weight_decay), mode == 1,\n            bool(bias_correction))',
      'float(weight_decay), mode == 0,\n            bool(bias_correction))',
      ["test_apex_multi_tensor.py::test_adam"], k="cpu and bf16"),
    M('adam-weight-decay-mode-swapped-fp16',
      'float(weight_decay), mode == 1,\n            bool(bias_correction))',
      'float(weight_decay), mode == 0,\n            bool(bias_correction))',
      ["test_apex_multi_tensor.py::test_adam"], k="cpu and fp16"),
    M('adam-weight-decay-ignored-bf16',
      'float(eps), float(weight_decay), mode == 1,\n            bool(bias_correction))',
      'float(eps), 0.0, mode == 1,\n            bool(bias_correction))',
      ["test_apex_multi_tensor.py::test_adam"], k="cpu and bf16"),
    M('adam-weight-decay-ignored-fp16',
      'float(eps), float(weight_decay), mode == 1,\n            bool(bias_correction))',
      'float(eps), 0.0, mode == 1,\n            bool(bias_correction))',
      ["test_apex_multi_tensor.py::test_adam"], k="cpu and fp16"),
    M('adam-eps-1e-3-bf16',
      'float(eps), float(weight_decay), mode == 1,\n            bool(bias_correction))',
      '1e-3, float(weight_decay), mode == 1,\n            bool(bias_correction))',
      ["test_apex_multi_tensor.py::test_adam"], k="cpu and bf16"),
    M('adam-eps-1e-3-fp16',
      'float(eps), float(weight_decay), mode == 1,\n            bool(bias_correction))',
      '1e-3, float(weight_decay), mode == 1,\n            bool(bias_correction))',
      ["test_apex_multi_tensor.py::test_adam"], k="cpu and fp16"),
    M('adam-lr-x1.5-bf16',
      'inv_scale, found_inf,\n            call.lr, float(beta1)',
      'inv_scale, found_inf,\n            call.lr * 1.5, float(beta1)',
      ["test_apex_multi_tensor.py::test_adam"], k="cpu and bf16"),
    M('adam-lr-x1.5-fp16',
      'inv_scale, found_inf,\n            call.lr, float(beta1)',
      'inv_scale, found_inf,\n            call.lr * 1.5, float(beta1)',
      ["test_apex_multi_tensor.py::test_adam"], k="cpu and fp16"),
    M('adam-step-off-by-one-bf16',
      'self.steps = step_counts(op, step, len(self.params), self.device)',
      'self.steps = step_counts(op, step + 1, len(self.params), self.device)',
      ["test_apex_multi_tensor.py::test_adam"], k="cpu and bf16"),
    M('adam-step-off-by-one-fp16',
      'self.steps = step_counts(op, step, len(self.params), self.device)',
      'self.steps = step_counts(op, step + 1, len(self.params), self.device)',
      ["test_apex_multi_tensor.py::test_adam"], k="cpu and fp16"),
    # row 4: the ported apex tests' "option" cases use their options.
    M("adam-betas-ignored",
      'beta1, beta2 = group["betas"]\n        adam_w_mode =',
      'beta1, beta2 = 0.9, 0.999\n        adam_w_mode =',
      ["test_fused_optimizers.py::test_apex_fused_optimizer_against_torch"], k="adam and option"),
    M("sgd-dampening-and-weight-decay-ignored",
      'float(group["dampening"]),\n                   float(group["weight_decay"])',
      '0.0,\n                   0.0',
      ["test_fused_optimizers.py::test_apex_fused_optimizer_against_torch"], k="sgd and option"),
    M("lamb-betas-0-eps-10",
      "return cls(*AdamHyper.from_group(group), bool(group[\"grad_averaging\"]),",
      "return cls(*AdamHyper.from_group(dict(group, betas=(0.0, 0.0), eps=10.0)), "
      "bool(group[\"grad_averaging\"]),",
      ["test_fused_optimizers.py::test_apex_lamb_against_apex_reference"], k="option"),
    # row 5: zero_grad(set_to_none=False) must zero what the step applies (O2: the masters').
    M("zero_grad-keeps-stale-gradients-when-not-set-to-none",
      "    def zero_grad(self, amp_opt, set_to_none: bool, original) -> None:\n"
      "        original(set_to_none=set_to_none)",
      "    def zero_grad(self, amp_opt, set_to_none: bool, original) -> None:\n"
      "        original(set_to_none=True) if set_to_none else None",
      ["test_amp_misuse.py::test_zeroed_gradients_of_an_unused_optimizer_step_as_in_torch"]),
    # row 6: an unfused step that does nothing.
    M("unfused-step-does-nothing",
      "                result = self.path.apply(self, None, replayed)",
      "                result = None",
      ["test_amp_misuse.py::test_one_handle_per_thread_trains_independently"]),
    # row 7: the JIT path, tested against the checkout's csrc/ (no longer skipped in CI).
    M("jit-error-reported-without-the-compiler-message",
      'compiling the kernels failed: {type(exc).__name__}: {exc}"',
      'compiling the kernels failed: {type(exc).__name__}"',
      ["test_multi_tensor.py::test_jit_compiler_error_is_reported_whole"]),
    M("jit-build-without-the-cpu-sources",
      'sources += sorted(glob.glob(os.path.join(CSRC, "cpu", "*.cpp")))',
      'sources += []',
      ["test_multi_tensor.py::test_jit_build_compiles_every_source_with_setup_py_flags"]),
    M("jit-build-without-setup-py-flags",
      "extra_cflags=flags.cxx_flags(flags.cpu_arch())", "extra_cflags=[\"-O2\"]",
      ["test_multi_tensor.py::test_jit_build_compiles_every_source_with_setup_py_flags"]),
    # row 9: gradient accumulation against plain torch (O2 with delay_unscale exact, not 2e-2).
    M("unscale-off-by-0.4-percent",
      "self.weights.unscale(stash, scale.inv, history_clean,",
      "self.weights.unscale(stash, scale.inv * 1.004, history_clean,",
      ["test_amp_scaling.py::test_gradient_accumulation"], k="True-O2-unfused"),
    M("accumulation-keeps-only-the-last-micro-batch",
      "                elif master.grad is not None:\n                    acc_new.append(grad)\n                    acc_into.append(resolve(master.grad))\n",
      "                elif False:\n                    pass\n",
      ["test_amp_scaling.py::test_gradient_accumulation"], k="False-O2-unfused"),
    M("accumulated-gradients-not-unscaled",
      "fused_accumulate(acc_new, acc_into, inv_scale, flag)",
      "fused_accumulate(acc_new, acc_into, 1.0, flag)",
      ["test_amp_scaling.py::test_gradient_accumulation"], k="O1"),
    # row 10: what was untested.
    M("register_promote_function-registers-half",
      '    _register("promote", module, name)',
      '    _register("half", module, name)',
      ["test_amp_initialize.py::test_register_functions_and_disable_casts"]),
    M("promote-casts-to-fp32-always",
      "            dtype = _widest(args, kwargs)", "            dtype = torch.float32",
      ["test_amp_initialize.py::test_register_functions_and_disable_casts"]),
    M("explicit-process_group-dropped",
      "hysteresis=hysteresis, scale_window=scale_window, process_group=process_group,",
      "hysteresis=hysteresis, scale_window=scale_window, process_group=None,",
      ["test_distributed.py::"
       "test_an_explicit_process_group_is_the_one_the_overflow_flag_is_reduced_over"]),
    M("scale_loss-model-taken-for-delay_unscale",
      "loss_id=loss_id, model=model,\n"
      "                                      delay_unscale=delay_unscale,",
      "loss_id=loss_id, model=None,\n"
      "                                      delay_unscale=delay_unscale or model is not None,",
      ["test_amp_scaling.py::test_scale_loss_takes_apex_model_argument_and_trains_as_without_it"]),
    M("apex_alias-module-gets-the-wrong-argv",
      "        sys.argv = argv[1:]\n        runpy.run_module(",
      "        sys.argv = argv\n        runpy.run_module(",
      ["test_apex_alias.py::test_the_command_runs_a_module_with_the_alias"]),
    M("o2-masters-ignore-half-loads",
      "                if value is None and torch.equal(values.tensor.to(param.dtype), param):",
      "                if value is None:",
      ["test_amp_checkpoint.py::"
       "test_loading_half_weights_into_an_o2_model_moves_the_masters_to_them"]),
    M("o2-masters-replaced-by-their-own-rounding",
      "                if value is None and torch.equal(values.tensor.to(param.dtype), param):",
      "                if value is None and False:",
      ["test_amp_checkpoint.py::"
       "test_loading_half_weights_into_an_o2_model_moves_the_masters_to_them"]),
    # issue 29: O2's step on torch's fused kernels (multi_tensor/_torch_fused.py).
    M("torch-route-counts-skipped-steps",
      "torch._foreach_add_(list(steps), (1.0 - flag).reshape(()))",
      "torch._foreach_add_(list(steps), 1.0)",
      ["test_torch_fused_route.py::test_a_set_found_inf_writes_nothing"]),
    M("torch-route-no-copy-into-the-model",
      "            torch._foreach_copy_(self.models, self.params)\n",
      "            pass\n",
      ["test_torch_fused_route.py::test_adam_matches_the_reference_across_chunks"]),
    M("torch-route-scale-not-inverted",
      "    grad_scale = torch.reciprocal(inv_scale.reshape(1).to(torch.float32))\n",
      "    grad_scale = inv_scale.reshape(1).to(torch.float32)\n",
      ["test_torch_fused_route.py::test_adam_matches_the_reference_across_chunks"]),
    M("torch-route-slices-off-by-one",
      "    return t.view(-1)[part]\n",
      "    return t.view(-1)[part.start:max(part.start, part.stop - 1)]\n",
      ["test_torch_fused_route.py::test_adam_matches_the_reference_across_chunks"]),
    M("torch-route-state-layout-not-staged",
      "if dense(p) and all(state[i].stride() == p.stride() for state in states):",
      "if True:",
      ["test_torch_fused_route.py::"
       "test_state_laid_out_unlike_its_parameter_is_paired_element_for_element"]),
    M("torch-route-adam-without-bias-correction",
      "    return bool(bias_correction)\n",
      "    return True\n",
      ["test_torch_fused_route.py::test_what_torch_does_not_compute_is_the_reference_bit_for_bit"]),
    M("torch-route-first-momentum-step",
      "is_first_step=first_run,",
      "is_first_step=False,",
      ["test_torch_fused_route.py::test_sgd_matches_the_reference_across_chunks"]),
    M("torch-route-adam-l2-as-adamw",
      "torch._fused_adamw_ if adam_w_mode else torch._fused_adam_",
      "torch._fused_adamw_",
      ["test_torch_fused_route.py::test_adam_matches_the_reference_across_chunks"]),
    M("torch-route-not-the-default-without-native-kernels",
      "            if not torch_why:\n                return \"\"\n",
      "            if False:\n                return \"\"\n",
      ["test_torch_fused_route.py"], backends=("python",)),
    M("standalone-optimizers-not-on-torch-kernels",
      "ops = _torch_fused if self._torch_kernels() and",
      "ops = None if self._torch_kernels() and",
      ["test_torch_fused_route.py::"
       "test_standalone_optimizers_step_fp32_parameters_on_torchs_kernels"]),
    M("torch-route-takes-adagrad-w-mode",
      "        if not _torch_fused.serves_adagrad(hyper.weight_decay, hyper.adagrad_w_mode):\n",
      "        if False:\n",
      ["test_amp_fused_step.py::"
       "test_the_default_takes_the_fused_step_where_kernels_serve_the_device"],
      backends=("python",)),
    # issue 43: ROCm apex's O4 and O5, patch_torch_functions_type, bfloat16_function.
    M("levels-o4-not-bf16",
      "half_dtype=torch.bfloat16, like=\"O1\"),",
      "half_dtype=None, like=\"O1\"),",
      ["test_amp_opt_levels.py::test_defaults"]),
    M("levels-o5-dynamic-scale",
      "patch_torch_functions=None, loss_scale=1.0, half_dtype=torch.bfloat16, like=\"O2\"),",
      "patch_torch_functions=None, loss_scale=\"dynamic\", half_dtype=torch.bfloat16, "
      "like=\"O2\"),",
      ["test_amp_rocm_levels.py::test_o4_and_o5_train_as_o1_and_o2_in_bf16_with_a_static_scale"]),
    M("levels-fused-step-at-o2-only",
      "return bool(self.master_weights) and bool(OPT_LEVELS[self.opt_level].master_weights)",
      "return bool(self.master_weights) and self.opt_level == \"O2\"",
      ["test_amp_fused_step.py::test_o2_and_o5_take_the_fused_step"]),
    M("levels-fused-step-ignores-master-weights-false",
      "return bool(self.master_weights) and bool(OPT_LEVELS[self.opt_level].master_weights)",
      "return bool(OPT_LEVELS[self.opt_level].master_weights)",
      ["test_amp_fused_step.py::test_other_levels_take_the_unfused_step_and_say_why"]),
    M("levels-o4-master-weights-false-accepted",
      "        if master_weights is not None:\n            raise OptLevelError(",
      "        if master_weights:\n            raise OptLevelError(",
      ["test_amp_opt_levels.py::test_contradictory_overrides_raise_with_the_reason"]),
    M("levels-o4-cast-to-half-accepted",
      "        if cast_model_type not in (None, torch.float32):\n",
      "        if cast_model_type == torch.float16:\n",
      ["test_amp_opt_levels.py::test_contradictory_overrides_raise_with_the_reason"]),
    M("levels-patch-type-any-at-o1-and-o4",
      "if patch_type is not None and patch_type != level.patch_type:",
      "if patch_type is not None and patch_type not in HALF_DTYPES:",
      ["test_amp_opt_levels.py::test_contradictory_overrides_raise_with_the_reason"]),
    M("levels-patch-type-accepted-without-autocast",
      "    if patch_type is not None:\n        raise OptLevelError(",
      "    if False:\n        raise OptLevelError(",
      ["test_amp_opt_levels.py::test_contradictory_overrides_raise_with_the_reason"]),
    M("levels-patching-accepted-without-autocast",
      "    if patch_torch_functions:\n        raise OptLevelError(",
      "    if False:\n        raise OptLevelError(",
      ["test_amp_opt_levels.py::test_contradictory_overrides_raise_with_the_reason"]),
    M("levels-patching-message-names-o1-only",
      "for name, level in OPT_LEVELS.items() if level.autocasts)",
      "for name, level in OPT_LEVELS.items() if name == \"O1\")",
      ["test_amp_opt_levels.py::test_contradictory_overrides_raise_with_the_reason"]),
    M("levels-half-dtype-fp16-at-o5-accepted",
      "if half_dtype is not None and level.half_dtype is not None and half_dtype != "
      "level.half_dtype:",
      "if False:",
      ["test_amp_opt_levels.py::test_contradictory_overrides_raise_with_the_reason"]),
    M("levels-cast-fp32-turns-autocast-off",
      "casting.wrap_forward(model, input_dtype=cast_type, autocast_dtype=autocast_dtype,",
      "casting.wrap_forward(model, input_dtype=cast_type, autocast_dtype=None if cast_type "
      "else autocast_dtype,",
      ["test_amp_rocm_levels.py::test_cast_model_type_fp32_or_false_keeps_autocast_on"]),
    M("levels-bfloat16-function-casts-to-autocast-dtype",
      "        elif kind == \"bfloat16\":\n            dtype = torch.bfloat16\n",
      "        elif kind == \"bfloat16\":\n            dtype = autocast_dtype\n",
      ["test_amp_rocm_levels.py::test_bfloat16_function_casts_to_bf16_under_autocast"]),
    M("levels-report-without-patch-type",
      "patch_torch_functions_type=run.properties.patch_torch_functions_type,",
      "patch_torch_functions_type=None,",
      ["test_amp_rocm_levels.py::"
       "test_patch_torch_functions_type_is_in_amp_state_and_the_report"]),
    M("levels-fp16-o5-not-warned",
      "    if level.half_dtype is None or properties.half_dtype == level.half_dtype \\\n",
      "    if True or properties.half_dtype == level.half_dtype \\\n",
      ["test_amp_rocm_levels.py::test_an_fp16_o5_keeps_the_static_scale_and_warns"]),
    M("levels-saved-state-of-o4-o5-refused",
      "extra[\"opt_level\"] not in OPT_LEVELS:",
      "extra[\"opt_level\"] not in (\"O0\", \"O1\", \"O2\", \"O3\"):",
      ["test_amp_resume_levels.py::test_a_checkpoint_resumes_at_another_level"], k="O4 or O5"),
    M("levels-unknown-message-lists-o0-o3",
      "names = \", \".join(f\"'{name}'\" for name in OPT_LEVELS)",
      "names = \"'O0', 'O1', 'O2', 'O3'\"",
      ["test_amp_opt_levels.py::test_unknown_opt_level_lists_the_valid_ones"]),
    M("python-nonfinite-check-misses-minus-inf",
      "    spans = torch.stack(highs).double() - torch.stack(lows).double()\n",
      "    spans = torch.stack(highs).double()\n",
      ["test_torch_fused_route.py::test_a_skipped_step_changes_nothing"], backends=("python",)),
    # issue 40: O2's masters behave as plain torch parameters on the fused step.
    M("fused-step-drops-writes-to-master-grads",
      "        if amp_opt.grad_state == CHECKED and any(\n",
      "        if False and any(\n",
      ["test_amp_master_grads.py::test_writes_to_master_grads_are_applied_as_torch_applies_them"],
      backends=("native", "python")),
    M("materialize-overwrites-writes",
      "            if not self.live and self.masters[i].grad is lazy:",
      "            if not self.live:",
      ["test_amp_master_grads.py::test_writes_to_master_grads_are_applied_as_torch_applies_them"],
      k="between or after"),
    M("cleared-half-gradient-applied",
      "        if self.grad_state != UNSCALED:\n            return\n        for device, indices",
      "        if True:\n            return\n        for device, indices",
      ["test_amp_master_grads.py::test_a_cleared_half_gradient_is_not_applied_read_or_not"]),
    M("fused-step-fires-no-step-hooks",
      "                result = self._own_step(args, lambda: self.path.apply(self, found_inf))",
      "                result = self.path.apply(self, found_inf)",
      ["test_amp_master_grads.py::test_step_hooks_fire_once_per_step_with_torchs_arguments"]),
    M("failed-step-forgets-its-checks",
      "        except BaseException:\n            self.checks = checks\n            raise\n",
      "        except BaseException:\n            self.stepped_since_backward = True\n"
      "            raise\n",
      ["test_amp_master_grads.py::test_a_step_that_fails_part_way_can_be_taken_again"]),
    M("master-grad-buffer-kept-forever",
      "        if not self.used:\n            self.values = [None] * len(self.pairs)",
      "        if False:\n            self.values = [None] * len(self.pairs)",
      ["test_amp_master_grads.py::test_the_fp32_gradient_buffer_goes_back_after_a_step_with_no_read"]),
    M("master-grad-buffer-made-under-inference-mode",
      "        with torch.inference_mode(False):\n            for i in indices:",
      "        if True:\n            for i in indices:",
      ["test_amp_master_grads.py::test_a_first_read_under_inference_mode_makes_no_inference_tensor"]),
    M("closure-later-evaluations-see-stale-weights",
      "        amp_opt.copy_masters_to_model()\n        with torch.enable_grad():",
      "        with torch.enable_grad():",
      ["test_amp_master_grads.py::test_lbfgs_steps_with_a_closure_that_runs_scale_loss"]),
    M("lbfgs-keeps-the-model-parameters",
      "            group[\"params\"][:] = masters\n",
      "            group[\"params\"] = masters\n",
      ["test_amp_master_grads.py::test_lbfgs_steps_with_a_closure_that_runs_scale_loss"]),
    # issue 41: O2's masters and the model never disagree silently.
    M("writes-to-the-half-model-reverted",
      "                if to_master:\n                    _take_model_writes(to_master, whole=not in_forward)",
      "                if False:\n                    _take_model_writes(to_master, whole=not in_forward)",
      ["test_amp_model_writes.py::test_embedding_max_norm_trains_at_o2_as_in_fp32",
       "test_amp_model_writes.py::test_a_write_after_initialize_reaches_the_masters_as_in_fp32"]),
    M("data-pointer-not-watched",
      "            if _version(t) != version or t.data_ptr() != data:\n",
      "            if _version(t) != version:\n",
      ["test_amp_model_writes.py::test_a_write_after_initialize_reaches_the_masters_as_in_fp32"],
      k="data", backends=("python",)),
    M("masters-ignore-requires_grad",
      "                    pair.master.requires_grad_(pair.model.requires_grad)\n",
      "                    pass\n",
      ["test_amp_model_writes.py::test_masters_follow_requires_grad_both_ways"]),
    M("ddp-broadcast-misses-the-masters",
      "            broadcast_masters(ddp.module, getattr(ddp, \"process_group\", None), 0)\n",
      "            pass\n",
      ["test_amp_model_writes.py::test_ddp_ranks_seeded_differently_train_the_same_model"]),
    M("frozen-weights-get-masters",
      "            if held is not None and id(p) not in held and run.pairs.of_model(p) is None:",
      "            if False:",
      ["test_amp_model_writes.py::test_frozen_weights_no_optimizer_holds_keep_no_master"]),
    M("state-dict-misses-writes-through-data",
      "run.copies.sync(\"model.state_dict()\", compare_all=True)",
      "run.copies.sync(\"model.state_dict()\")",
      ["test_amp_model_writes.py::test_a_checkpoint_holds_an_in_place_write_through_data"]),
    # issue 44: chunks by device, one shared-count rule, NovoGrad's NaN, one layout per parameter.
    M("i44-gpu-chunks-sized-for-the-cpu",
      'return CHUNK_ELEMENTS if torch.device(device).type == "cpu" else GPU_CHUNK_ELEMENTS',
      "return CHUNK_ELEMENTS", ["test_torch_fused_chunks.py"]),
    M("i44-python-novograd-shares-counts",
      '    _checks.check_own_step_counts("fused_novograd_", steps)\n', "",
      ["test_step_count_and_nan_rules.py::test_a_shared_step_count_is_refused"],
      k="novograd", backends=("python",)),
    M("i44-python-adagrad-shares-counts",
      '_checks.check_own_step_counts("fused_adagrad_", steps)\n    if not params:\n        return\n'
      '    g = _true_grads(grads, inv_scale)',
      'pass\n    if not params:\n        return\n    g = _true_grads(grads, inv_scale)',
      ["test_step_count_and_nan_rules.py::test_a_shared_step_count_is_refused"],
      k="adagrad", backends=("python",)),
    M("i44-torch-route-adagrad-shares-counts",
      '_checks.check_own_step_counts("fused_adagrad_", steps)\n    if not params:\n        return\n'
      '    if not serves_adagrad(',
      'pass\n    if not params:\n        return\n    if not serves_adagrad(',
      ["test_step_count_and_nan_rules.py::test_torch_kernels_route_refuses_a_shared_adagrad_count"]),
    M("i44-shared-count-fix-names-no-device",
      "dtype=torch.float32, device='{steps[j].device}') per parameter, or a clone() \"\n",
      "dtype=torch.float32) per parameter, or a clone() \"\n",
      ["test_step_count_and_nan_rules.py"], k="shared", backends=("python",)),
    M("i44-python-novograd-inf-norm-propagates-nan",
      '            torch.nan_to_num_(t, nan=0.0, posinf=float("inf"))', "            pass",
      ["test_step_count_and_nan_rules.py::test_novograd_inf_norm_passes_nan_over"],
      backends=("python",)),
    M("i44-channels-last-staged-on-the-cuda-path",
      "return laid_out_as(t, p) or (t.numel() == 1 and t.shape != p.shape)",
      "return t.is_contiguous() and (laid_out_as(t, p) or (t.numel() == 1 "
      "and t.shape != p.shape))", ["test_layouts.py"]),
    # issue 42: apex.parallel (DistributedDataParallel's formula, SyncBatchNorm's group
    # statistics, LARC's rule).
    M("parallel-ddp-average-ignores-predivide",
      "flat.mul_(ddp.gradient_predivide_factor / ddp.world_size)",
      "flat.mul_(1.0 / ddp.world_size)",
      ["test_parallel_ddp.py"], k="follow_apex_formula"),
    M("parallel-ddp-no-predivide",
      "flat.mul_(1.0 / ddp.gradient_predivide_factor)", "flat.mul_(1.0)",
      ["test_parallel_ddp.py"], k="follow_apex_formula or fp16"),
    M("parallel-ddp-sums-without-averaging",
      "            if ddp.gradient_average:\n", "            if False:\n",
      ["test_parallel_ddp.py"], k="follow_apex_formula"),
    M("parallel-ddp-always-fp32-ignored",
      "dtype = torch.float32 if ddp.allreduce_always_fp32 else bucket[0].dtype",
      "dtype = bucket[0].dtype",
      ["test_parallel_ddp.py"], k="follow_apex_formula or fp16"),
    M("parallel-ddp-broadcasts-nothing",
      "flat_dist_call([p.detach() for p in module.parameters()], dist.broadcast, (0,))",
      "pass",
      ["test_parallel_ddp.py::test_parameters_not_buffers_are_broadcast_from_rank_0"]),
    M("parallel-syncbn-ranks-weighted-alike",
      "weights = counts / total.clamp(min=1.0)",
      "weights = torch.full_like(counts, 1.0 / group_size)",
      ["test_parallel_syncbn.py"], k="concatenated"),
    M("parallel-syncbn-variance-ignores-the-means-spread",
      "var64 = ((variances + (means - mean64) ** 2) * weights).sum(0)",
      "var64 = (variances * weights).sum(0)",
      ["test_parallel_syncbn.py"], k="concatenated"),
    M("parallel-syncbn-running-var-biased",
      "unbiased = var * (count / (count - 1).clamp(min=1.0)).to(var.dtype)",
      "unbiased = var",
      ["test_parallel_syncbn.py"], k="concatenated or single_process"),
    M("parallel-syncbn-backward-sums-not-reduced",
      "                    dist.all_reduce(both, group=ctx.process_group)\n", "",
      ["test_parallel_syncbn.py"], k="concatenated"),
    M("parallel-syncbn-statistics-in-half",
      "    dtype = stat_dtype(input.dtype)\n    count = input.numel()",
      "    dtype = input.dtype\n    count = input.numel()",
      ["test_parallel_syncbn.py::test_half_input_statistics_in_fp32"]),
    M("parallel-larc-never-clips",
      "adaptive_lr = torch.clamp(adaptive_lr / lr, max=1)", "adaptive_lr = adaptive_lr / lr",
      ["test_parallel_larc.py"]),
    M("parallel-larc-rescales-zero-norms",
      "applies = (param_norm != 0) & (grad_norm != 0)", "applies = param_norm == param_norm",
      ["test_parallel_larc.py"]),
    M("parallel-larc-weight-decay-not-hidden",
      "                        group[\"weight_decay\"] = 0\n", "",
      ["test_parallel_larc.py"]),

    # issue 42: apex.fp16_utils' FP16_Optimizer and loss scalers.
    M("fp16-optimizer-applies-an-overflowing-step",
      "        self._masters_fresh = False\n        if self.overflow:\n            self._log_skip()\n"
      "            return None\n",
      "        self._masters_fresh = False\n",
      ["test_fp16_utils.py::test_a_non_finite_step_is_never_applied"]),
    M("fp16-optimizer-static-scale-never-skips",
      "        if self._has_overflow:\n            if self.dynamic:",
      "        if self._has_overflow and self.dynamic:\n            if self.dynamic:",
      ["test_fp16_utils.py::test_a_non_finite_step_is_never_applied"], k="static"),
    M("fp16-optimizer-unscale-forgotten",
      "        scale_by_device(model_grads, master_grads, 1.0 / float(scale), self._found_inf)",
      "        scale_by_device(model_grads, master_grads, 1.0, self._found_inf)",
      ["test_fp16_utils.py::test_steps_equal_an_fp32_master_reference"]),
    M("fp16-optimizer-scale_factor-ignored",
      "self._loss_scale = max(floor, self._loss_scale / self._scale_factor)",
      "self._loss_scale = max(floor, self._loss_scale / 2.0)",
      ["test_fp16_utils.py::test_dynamic_scale_rule_and_its_arguments"]),
    M("fp16-optimizer-min_loss_scale-ignored",
      "                floor = SMALLEST_LOSS_SCALE if self._min_loss_scale is None \\\n",
      "                floor = SMALLEST_LOSS_SCALE if True \\\n",
      ["test_fp16_utils.py::test_dynamic_scale_rule_and_its_arguments"]),
    M("fp16-optimizer-backwards-at-two-scales",
      "                    scale_by_device(grads, grads, scale / held, {})",
      "                    scale_by_device(grads, grads, 1.0, {})",
      ["test_fp16_utils.py::test_several_backwards_add_up"]),
    M("fp16-optimizer-stale-master-gradient",
      "        if model.grad is None:\n            master.grad = None\n",
      "        if model.grad is None:\n",
      ["test_fp16_utils.py::test_a_master_whose_parameter_got_no_gradient_gets_none"]),
    M("fp16-optimizer-steps-without-fresh-gradients",
      "        if not self._masters_fresh:\n            raise",
      "        if False:\n            raise",
      ["test_fp16_utils.py::test_misuse_is_refused"]),
    M("fp16-optimizer-loads-masters-without-copying-them",
      "        self._copies.load([(self._pairs.of_master(master), value)",
      "        self._copies.load([(self._pairs.of_master(master), master)",
      ["test_fp16_utils.py::test_state_dict_round_trip_resumes_exactly"]),
    # issue 49: the two copies (two_copies.py), the masters' gradients (master_grads.py), the
    # optimizer's step as code set it, optimizers that wrap another, FP16_Optimizer's copies.
    M("master-writes-never-reach-the-model",
      "                if to_model:\n                    self._round_into_model(to_model)",
      "                if False:\n                    self._round_into_model(to_model)",
      ["test_amp_master_writes.py::test_a_write_to_a_master_reaches_the_next_forward",
       "test_amp_master_writes.py::test_a_write_to_a_master_is_what_state_dict_saves"],
      backends=("native", "python")),
    M("both-copies-written-not-refused",
      "                        _refuse_both(caller, pairs[i - n])",
      "                        pass",
      ["test_amp_master_writes.py::test_both_copies_written_is_refused_naming_the_parameter"]),
    M("a-write-outside-a-forward-keeps-the-masters-bits",
      "                    _take_model_writes(to_master, whole=not in_forward)",
      "                    _take_model_writes(to_master, whole=False)",
      ["test_amp_model_writes.py::test_a_write_outside_a_forward_is_taken_whole"]),
    M("kept-lazy-gradients-reused",
      "        held = ops_for(self.device).referenced_elsewhere(self.lazies, self._own)\n"
      "        unmade",
      "        held = []\n        unmade",
      ["test_amp_grad_lifetimes.py::"
       "test_a_kept_gradient_keeps_its_values_across_zero_grad_and_the_next_backward",
       "test_amp_grad_lifetimes.py::test_a_kept_unread_gradient_reads_as_torchs"],
      k="fused", backends=("native", "python")),
    M("made-gradients-reused-while-held",
      "                if value is None or i in held or value.shape",
      "                if value is None or value.shape",
      ["test_amp_grad_lifetimes.py::"
       "test_a_kept_gradient_keeps_its_values_across_zero_grad_and_the_next_backward",
       "test_amp_grad_lifetimes.py::"
       "test_multi_task_gradient_surgery_combines_both_tasks_as_in_fp32"],
      backends=("native", "python")),
    M("hand-set-gradients-ignored-on-the-fused-step",
      "        from_masters = amp_opt.grad_state != CHECKED",
      "        from_masters = amp_opt.grad_state == UNSCALED",
      ["test_amp_grad_lifetimes.py::test_hand_set_master_gradients_are_applied"], k="fused"),
    M("step-wrapper-bypassed",
      "        with replacement.armed(update):\n            return self._original_step(*args)",
      "        update()\n        return None",
      ["test_amp_optimizer_wrappers.py::test_a_step_wrapper_set_before_initialize_runs_every_step"]),
    M("wrapped-optimizer-not-taken-over",
      "        if value is not optimizer and isinstance(value, torch.optim.Optimizer) \\\n",
      "        if False and isinstance(value, torch.optim.Optimizer) \\\n",
      ["test_amp_optimizer_wrappers.py::test_sam_trains_as_in_fp32",
       "test_amp_optimizer_wrappers.py::test_lookahead_trains_as_in_fp32_and_checkpoints_the_"
       "synced_weights"]),
    M("wrapper-step-leaves-its-writes-in-the-masters",
      "        result = original(*args, **kwargs)\n"
      "        optimizer._apex_lite_amp.run.copies.sync(",
      "        return original(*args, **kwargs)\n"
      "        optimizer._apex_lite_amp.run.copies.sync(",
      ["test_amp_optimizer_wrappers.py::test_lookahead_trains_as_in_fp32_and_checkpoints_the_"
       "synced_weights"], k="initialize"),
    M("legacy-dlpack-export-reads-a-lazy-gradient",
      "        if type(tensor) is LazyGrad:\n            tensor = tensor._make()\n",
      "        pass\n",
      ["test_amp_grad_lifetimes.py"], k="dlpack"),
    M("fp16-optimizer-takes-no-model-writes",
      "        self._copies.sync(\"FP16_Optimizer.step()\")",
      "        pass",
      ["test_fp16_optimizer_copies.py::test_a_model_write_between_backward_and_step_is_the_step_s_start"]),
    M("fp16-optimizer-frozen-parameters-get-no-master",
      "                master.requires_grad = param.requires_grad\n",
      "                master.requires_grad = param.requires_grad\n"
      "                if not param.requires_grad:\n                    continue\n",
      ["test_fp16_optimizer_copies.py::"
       "test_a_parameter_unfrozen_after_wrapping_steps_with_its_true_gradient"]),
    # issue 50: data parallel without hangs or drift (ddp.py).
    M("no_sync-backwards-unscaled-apart",
      "        if reduces is False:\n            delay_unscale = True",
      "        if False:\n            delay_unscale = True",
      ["test_parallel_accumulation.py::"
       "test_accumulation_keeps_the_ranks_equal_and_trains_as_torch_amp"], k="no_sync-O2"),
    M("a-collective-after-an-all-reduced-backward",
      "        if distributed_active() and not self.reduced:\n"
      "            # Every rank must reach the same decisions",
      "        if distributed_active():\n"
      "            # Every rank must reach the same decisions",
      ["test_parallel_accumulation.py::test_join_with_uneven_inputs_finishes"], k="O1"),
    M("the-master-broadcast-in-the-forward",
      "        first_in_ddp = run.ddp.forward_started(sharded=run.sharding is not None)\n",
      "        first_in_ddp = run.ddp.forward_started(sharded=run.sharding is not None)\n"
      "        run.ddp.broadcast_pending()\n",
      ["test_parallel_accumulation.py::test_a_forward_on_rank_0_alone_then_training_finishes"],
      k="O2"),
    M("fp16-static-loss-scaler-never-sees-overflow",
      "        \"\"\"Whether a gradient of ``params`` holds an inf or NaN (apex's said False always).\"\"\"\n"
      "        return grads_have_inf_or_nan(params)",
      "        return False",
      ["test_fp16_utils.py::test_loss_scalers"]),
    M("fp16-dynamic-loss-scaler-floor-dropped",
      "            self.cur_scale = max(self.cur_scale / self.scale_factor, 1)",
      "            self.cur_scale = self.cur_scale / self.scale_factor",
      ["test_fp16_utils.py::test_loss_scalers"]),
    M("prep_param_lists-flattens-mixed-dtypes",
      "        if len(dtypes) > 1:\n            raise TypeError(f\"prep_param_lists",
      "        if False:\n            raise TypeError(f\"prep_param_lists",
      ["test_fp16_utils.py::test_prep_param_lists_and_copies"]),
    M("convert_network-converts-batchnorm",
      "        if _is_affine_batchnorm(module):\n            continue\n",
      "",
      ["test_fp16_utils.py::test_apex_fp16_model_params_buffers_and_output"]),
    # issue 42: apex.normalization.
    M("mixed-norm-output-in-the-input-dtype",
      "        return out.to(weight.dtype if mixed and weight is not None else input.dtype), mean, rstd",
      "        return out.to(input.dtype), mean, rstd",
      ["test_normalization.py::test_fp32_parameters_with_a_half_input"]),
    M("memory-efficient-keeps-the-input",
      "        ctx.memory_efficient = bool(memory_efficient)",
      "        ctx.memory_efficient = False",
      ["test_normalization.py::test_memory_efficient_keeps_the_output_not_the_input"]),
    M("memory-efficient-divides-by-unclamped-weights",
      "    return torch.where(weight >= 0, weight.clamp(min=eps), weight.clamp(max=-eps))",
      "    return weight",
      ["test_normalization.py::test_memory_efficient_with_weights_near_zero"]),
    M("rms-norm-backward-as-layer-norm",
      "        grad_input = torch.addcmul(mean_gw.reshape(rstd.shape) * rstd, grad_input, rstd)",
      "        grad_input = grad_input * rstd",
      ["test_normalization.py::test_norms_against_float64"], k="rms"),
    M("norms-ignore-autocast",
      "@half_function\ndef fused_layer_norm_affine(",
      "def fused_layer_norm_affine(",
      ["test_normalization.py::test_under_autocast_the_norms_run_in_autocasts_dtype"]),
    M("mixed-norm-takes-elementwise_affine-false",
      "    if not affine:\n        raise RuntimeError(",
      "    if False:\n        raise RuntimeError(",
      ["test_normalization.py::test_mixed_norms_refuse_no_parameters"]),
    M("layer-norm-eps-ignored-in-the-function",
      "            out, mean, rstd = torch.native_layer_norm(x, list(shape), w, _cast(bias, dtype), eps)",
      "            out, mean, rstd = torch.native_layer_norm(x, list(shape), w, _cast(bias, dtype), 1e-5)",
      ["test_normalization.py::test_functional_forms_and_apex_functions"]),
    # issue 51: the norms to second order and under torch.func / TorchScript.
    M("norm-double-backward-through-the-fused-statistics",
      "        elif torch.is_grad_enabled() or grad_output is None or grad_rstd is not None:",
      "        elif grad_output is None or grad_rstd is not None:",
      ["test_normalization_autograd.py::test_gradient_penalty_and_hvp_match_torchs_norms"]),
    M("memory-efficient-rstd-held-constant-in-the-double-backward",
      "    if grad_rstd is not None and ctx.needs_input_grad[0]:",
      "    if False:",
      ["test_normalization_autograd.py::test_gradient_penalty_and_hvp_match_torchs_norms"],
      k="memory_efficient"),
    M("norm-jvp-drops-the-projection",
      "        out_t = rstd * (dx - x_hat * projection)",
      "        out_t = rstd * dx",
      ["test_normalization_autograd.py::test_torch_func_transforms_match_torchs_norms"]),
    M("scripted-mixed-norm-in-the-input-dtype",
      "    if mixed and weight is not None:\n        return out.to(weight.dtype)",
      "    if False:\n        return out.to(weight.dtype)",
      ["test_normalization_autograd.py::test_scripted_norms_give_apexs_dtypes"]),
    # issue 51: what amp's casts reach, and scale_loss's shape.
    M("batch-cast-skips-mappings-that-are-not-dicts",
      "    if isinstance(value, collections.abc.Mapping):",
      "    if isinstance(value, dict):",
      ["test_amp_batches.py::test_inputs_are_cast_inside_batches"]),
    M("batch-cast-makes-plain-dicts",
      "    if isinstance(value, collections.abc.MutableMapping):",
      "    if False:",
      ["test_amp_batches.py::test_outputs_leave_in_fp32_as_their_type"]),
    M("batch-cast-skips-dataclasses",
      "    if dataclasses.is_dataclass(value) and not isinstance(value, type):",
      "    if False:",
      ["test_amp_batches.py::test_inputs_are_cast_inside_batches"]),
    M("batch-cast-casts-modules-through-their-to",
      "(str, bytes, int, float, bool, torch.nn.Module)",
      "(str, bytes, int, float, bool)",
      ["test_amp_batches.py::test_what_is_not_a_floating_tensor_is_left_alone"]),
    M("batch-cast-casts-token-ids",
      "        return fn(value) if value.is_floating_point() else value",
      "        return fn(value)",
      ["test_amp_batches.py::test_inputs_are_cast_inside_batches"]),
    M("batch-cast-rebuilds-namedtuples-from-one-list",
      "        return type(value)(*items)",
      "        return type(value)(items)",
      ["test_amp_batches.py::test_inputs_are_cast_inside_batches"]),
    M("decorators-ignore-tensors-in-lists",
      "        tensor = first_tensor((args, kwargs))",
      "        tensor = None",
      ["test_amp_batches.py::test_decorators_cast_tensors_inside_lists_and_tuples"]),
    M("scale_loss-yields-shape-1-on-the-fused-step",
      "            multiplier = multiplier.reshape(()).to(loss.device)",
      "            multiplier = multiplier.to(loss.device)",
      ["test_amp_batches.py::test_scale_loss_yields_a_tensor_of_the_losss_shape"]),
    # issue 42: every apex subpackage apex_lite provides reaches apex's importers.
    M("alias-drops-fp16_utils",
      'SUBPACKAGES = ("amp", "optimizers", "parallel", "normalization", "fp16_utils")',
      'SUBPACKAGES = ("amp", "optimizers", "parallel", "normalization")',
      ["test_apex_alias.py::test_apex_modules_that_scripts_import_through_the_alias"]),
    # issue 53: O2's kept norm layers on the half activations, only where torch's mix is as exact.
    M("kept-bn-casts-its-input-again",
      "    return dict(layouts) if holds_fp32 else {}",
      "    return {}",
      ["test_amp_kept_norms.py::test_cnn_at_O2_saves_only_half_activations",
       "test_amp_kept_norms.py::test_kept_norm_saves_no_fp32_copy_of_its_input"]),
    M("kept-norm-without-fp32-tensor-runs-in-half",
      "    return dict(layouts) if holds_fp32 else {}",
      "    return dict(layouts)",
      ["test_amp_kept_norms.py::test_other_kept_modules_keep_the_round_trip"]),
    M("kept-layernorm-takes-the-mix",
      "    torch.nn.GroupNorm.forward: {\"cpu\": ANY_LAYOUT},\n",
      "    torch.nn.GroupNorm.forward: {\"cpu\": ANY_LAYOUT},\n"
      "    torch.nn.LayerNorm.forward: {\"cpu\": ANY_LAYOUT},\n",
      ["test_amp_kept_norms.py::test_other_kept_modules_keep_the_round_trip"]),
    M("kept-bn-channels-last-on-the-cpu-mix",
      "_BATCH_NORM = {\"cpu\": CONTIGUOUS, \"cuda\": ANY_LAYOUT}",
      "_BATCH_NORM = {\"cpu\": ANY_LAYOUT, \"cuda\": ANY_LAYOUT}",
      ["test_amp_kept_norms.py::test_channels_last_input"]),
    M("kept-norm-takes-any-float-input-as-is",
      "        found.append(t.dtype == dtype and layout is not None",
      "        found.append(layout is not None",
      ["test_amp_kept_norms.py::test_fp32_input_and_other_devices_take_the_round_trip"]),
    M("kept-norm-output-left-in-its-dtype",
      "        return apply_to_floats(self.forward(*args, **kwargs), _caster(self.half_dtype))",
      "        return self.forward(*args, **kwargs)",
      ["test_amp_kept_norms.py::test_fp32_input_and_other_devices_take_the_round_trip",
       "test_amp_kept_norms.py::test_other_kept_modules_keep_the_round_trip"]),
    M("parallel-syncbn-statistics-keep-a-graph",
      "            with torch.no_grad():\n                mean, var, count = batch_stats(",
      "            if True:\n                mean, var, count = batch_stats(",
      ["test_parallel_syncbn.py", "test_amp_kept_norms.py"], k="concatenated or saves_no_fp32"),
    # The documentation (issue 45): a guide's checked example, and the docstring check.
    M("docs-o2-casts-batchnorm",
      "is_bn = isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.affine",
      "is_bn = False",
      ["test_docs.py::test_every_python_block_of_the_pages_runs"], backends=("python",)),
    M("docs-initialize-docstring-loses-an-argument",
      "        frozen_master_weights: keyword-only. At O2, keep an exact fp32 master",
      "        frozen master weights: keyword-only. At O2, keep an exact fp32 master",
      ["test_docs.py::test_every_public_function_and_class_documents_its_arguments"],
      backends=("python",)),
    # issue 51: apex's internals that apex-era scripts write, amp_C's LAMB stages, the
    # optimizers' apex attributes, import apex.amp._amp_state, no import circles.
    M("update-scale-ignores-the-overflow-buf-on-the-device",
      "                torch.maximum(flag, extra, out=flag)\n", "",
      ["test_amp_apex_internals.py"], k="overflow_buf or delayed_step or once"),
    M("update-scale-ignores-the-overflow-buf-on-the-host",
      "                flag.fill_(1.0)\n", "",
      ["test_amp_apex_internals.py"], k="delayed_step or once"),
    M("update-scale-counts-an-accumulated-overflow-twice",
      "            if not skipped and bool(buffer.reshape(()).item()):",
      "            if bool(buffer.reshape(()).item()):",
      ["test_amp_apex_internals.py"], k="once"),
    M("loss-scale-write-ignored",
      "            self._scaler.loss_scale = _checked_scale(self._scaler, value)",
      "            _checked_scale(self._scaler, value)",
      ["test_amp_apex_internals.py"], k="first_step or above_max"),
    M("scale-seq-len-write-ignored",
      "            self._scaler.scale_window = value\n", "            pass\n",
      ["test_amp_apex_internals.py"], k="scale_seq_len"),
    M("amp-stash-lists-the-masters-as-model-params",
      "                    fp16.append(model_param)\n                    from_fp16.append(p)",
      "                    fp16.append(p)\n                    from_fp16.append(model_param)",
      ["test_amp_apex_internals.py"], k="stash_lists"),
    M("lamb-stage1-bias-correction-for-the-step-given",
      "corrections = (1.0 - beta1 ** (step + 1), 1.0 - beta2 ** (step + 1))",
      "corrections = (1.0 - beta1 ** step, 1.0 - beta2 ** max(step, 1))",
      ["test_apex_lamb_stages.py"], k="cpu and (stage1 or two_stages)"),
    M("lamb-stage2-trust-ratio-everywhere",
      "    adaptive = weight_decay is None or bool(use_nvlamb) or \\",
      "    adaptive = True or \\",
      ["test_apex_lamb_stages.py"], k="cpu and stage2"),
    M("fused-adam-adam-w-mode-fixed",
      '    adam_w_mode = ApexMode("adam_w_mode")\n\n    def _hyper(self, group: dict) -> AdamHyper:',
      '    adam_w_mode = 1\n\n    def _hyper(self, group: dict) -> AdamHyper:',
      ["test_apex_era_scripts.py::test_fairseq_fused_adam_steps_adamw_through_apexs_attributes"]),
    M("import-apex-amp-amp-state-is-a-module-again",
      'SHADOWED_MODULES = {"apex.amp._amp_state": ("apex_lite.amp", "_amp_state")}',
      "SHADOWED_MODULES = {}",
      ["test_apex_compat.py::test_every_name_forwards_to_apex_lite"]),
    M("multi-tensor-import-circle-back",
      "from ._env import env_flag\n\n# Environment variables that ask",
      "from ._env import env_flag\n\n\ndef _circle():\n    from ._backend import ops_for\n\n\n"
      "# Environment variables that ask",
      ["test_import_circles.py::test_apex_lite_has_no_import_circles"]),
    # fp8 matmuls under amp (issue 52).
    M("fp8-scale-one-power-too-large",
      "k = top_exponent - margin - exponent - (mantissa > top_mantissa).to(torch.int32)",
      "k = top_exponent - margin - exponent",
      ["test_amp_fp8.py::test_scales_are_the_largest_power_of_two_within_range"]),
    M("fp8-gradients-in-e4m3",
      "FORMATS = (torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float8_e5m2)",
      "FORMATS = (torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float8_e4m3fn)",
      ["test_amp_fp8.py::test_eligible_layers_run_all_three_matmuls_in_fp8"]),
    M("fp8-overflow-clipped-not-nan",
      "inverse = torch.where(torch.isfinite(amax), inverse_pow2(scale),",
      "inverse = torch.where(torch.isfinite(amax) | True, inverse_pow2(scale),",
      ["test_amp_fp8.py::test_an_infinite_input_gives_nan_not_a_clipped_value",
       "test_amp_fp8.py::test_an_overflow_inside_an_fp8_backward_skips_the_step"]),
    M("fp8-delayed-ignores-its-history",
      "scale = torch.where(has_history, history_scale, scale)", "scale = scale",
      ["test_amp_fp8.py::test_delayed_scaling_scales_by_the_history_and_counts_saturation"]),
    M("fp8-saturation-not-counted",
      "counts.add_(torch.stack([saturated, underflow]))", "counts[1].add_(underflow)",
      ["test_amp_fp8.py::test_delayed_scaling_scales_by_the_history_and_counts_saturation"]),
    M("fp8-negative-flushes-not-counted",
      "torch.count_nonzero(t8.view(torch.uint8) & 0x7F)",
      "torch.count_nonzero(t8.view(torch.uint8))",
      ["test_amp_fp8.py::test_current_scaling_never_clips_and_counts_what_it_flushes"]),
    M("fp8-inf-amax-enters-the-history",
      "amax = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))", "pass",
      ["test_amp_fp8.py::test_an_overflow_inside_an_fp8_backward_skips_the_step"]),
    M("fp8-grad-weight-contraction-unpadded",
      "pad = -g8.shape[0] % MULTIPLE", "pad = 0",
      ["test_amp_fp8.py::test_eligible_layers_run_all_three_matmuls_in_fp8"]),
    M("fp8-grad-weight-scaled-by-the-weight",
      "inv_g, inv_x, out_dtype=ctx.weight_dtype", "inv_g, inv_w, out_dtype=ctx.weight_dtype",
      ["test_amp_fp8.py::test_a_layer_equals_the_reference_forward_and_backward"]),
    M("fp8-min_features-ignored",
      "small = [f\"{k}={v}\" for k, v in dims.items() if v < config.min_features]",
      "small = []",
      ["test_amp_fp8.py::test_min_features_exclude_subclasses_and_kept_modules_stay_in_half"]),
    M("fp8-no-all-reduce-of-the-amaxes",
      "reduce = (torch.distributed.is_available() and torch.distributed.is_initialized()",
      "reduce = False and (torch.distributed.is_available()",
      ["test_amp_fp8_runs.py::test_two_ranks_train_in_fp8_and_keep_one_state"]),
    M("fp8-pending-amax-not-loaded",
      "group.pending[row].copy_(entry[\"pending_amax\"])", "pass",
      ["test_amp_fp8.py::test_the_fp8_state_is_plain_tensors_and_loads_with_weights_only"]),
    M("fp8-fold-once-per-forward",
      "        dirty = [group for group in self.groups if group.dirty]",
      "        dirty = [group for group in self.groups]",
      ["test_amp_fp8.py::test_two_optimizers_stepping_one_model_fold_once_per_step"]),
]


def _sources(tree: Path) -> List[Path]:
    return sorted(p for p in (tree / "apex_lite").rglob("*.py") if "__pycache__" not in p.parts)


def locate(tree: Path, text: str) -> Tuple[Path, str]:
    """The one file under ``tree``/apex_lite holding ``text`` once, and its contents."""
    hits = []
    for path in _sources(tree):
        content = path.read_text()
        count = content.count(text)
        if count:
            hits.append((path, content, count))
    if len(hits) != 1 or hits[0][2] != 1:
        where = ", ".join(f"{p.relative_to(tree)} x{c}" for p, _, c in hits) or "nowhere"
        raise LookupError(f"text found {where}; it must occur exactly once")
    return hits[0][0], hits[0][1]


def run_tests(tree: Path, tests: Sequence[str], k: str, backend: str, timeout: float):
    env = {key: value for key, value in os.environ.items()
           if key not in ("APEX_LITE_REQUIRE_EXT", "APEX_LITE_DISABLE_EXT")}
    env.update(BACKENDS[backend], PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    if k:
        cmd += ["-k", k]
    try:
        proc = subprocess.run(cmd, cwd=tree / "tests", env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", ""
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return proc.returncode, (lines[-1] if lines else proc.stderr.strip()[-300:])


def copy_tree(scratch: Path) -> Path:
    tree = scratch / "tree"
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(
        ".git", "__pycache__", "*.pyc", "build", "_build", ".pytest_cache", "bench"))
    return tree


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-k", default="", help="only mutations whose name contains this")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--check", action="store_true",
                        help="only check that each mutation's text is found once (after code "
                             "moved), run no tests")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per pytest run")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copy")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if args.k in m.name]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {' '.join(m.tests)}{' -k ' + m.k if m.k else ''} "
                  f"[{', '.join(m.backends)}]")
        return 0
    if args.check:
        missing = 0
        for m in chosen:
            try:
                path, _ = locate(ROOT, m.find)
                print(f"{m.name}: {path.relative_to(ROOT)}")
            except LookupError as exc:
                missing += 1
                print(f"{m.name}: ERROR {exc}")
        return 1 if missing else 0
    scratch = Path(tempfile.mkdtemp(prefix="apex_lite_mutate_"))
    results = []
    try:
        tree = copy_tree(scratch)
        # The named tests must pass unmutated, per backend.
        for backend in BACKENDS:
            groups = {}
            for m in chosen:
                if backend in m.backends:
                    groups.setdefault(m.k, set()).update(m.tests)
            for k, tests in groups.items():
                status, last = run_tests(tree, sorted(tests), k, backend, args.timeout)
                print(f"baseline [{backend}{' -k ' + k if k else ''}]: {last}", flush=True)
                if status != 0:
                    print("the named tests fail unmutated: fix them first", file=sys.stderr)
                    return 1
        for m in chosen:
            try:
                path, original = locate(tree, m.find)
            except LookupError as exc:
                results.append((m.name, "-", "ERROR", str(exc)))
                print(f"{m.name}: ERROR {exc}", flush=True)
                continue
            path.write_text(original.replace(m.find, m.replace))
            try:
                for backend in m.backends:
                    start = time.monotonic()
                    status, last = run_tests(tree, m.tests, m.k, backend, args.timeout)
                    verdict = {0: "SURVIVED", 1: "killed"}.get(status, "ERROR")
                    rel = path.relative_to(tree)
                    results.append((m.name, backend, verdict, f"{rel}: {last}"))
                    print(f"{m.name} [{backend}] {verdict} ({time.monotonic() - start:.0f}s) "
                          f"{rel}: {last}", flush=True)
            finally:
                path.write_text(original)
    finally:
        if args.keep:
            print(f"scratch copy kept at {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    bad = [r for r in results if r[2] != "killed"]
    print(f"\n{len(results) - len(bad)} of {len(results)} mutation runs killed"
          + ("".join(f"\n  {name} [{backend}]: {verdict} {detail}"
                     for name, backend, verdict, detail in bad)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
