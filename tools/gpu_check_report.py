"""What tools/gpu_check.py reads back and writes out: the JUnit XML of the test runs, the headline
ratios of the benchmarks' JSON, and summary.md / summary.json.

summary.json holds everything summary.md shows: ``verdict`` (passed, failed or dry run),
``host`` (the versions), ``parts`` (per part: name, title, status, seconds, summary, notes),
``headlines`` (the benchmarks' ratios, as lines), ``failed_tests``, ``skipped`` (reason ->
count), ``unchecked`` (what this host cannot check) and ``files`` (what OUTDIR holds).
"""
from __future__ import annotations

import collections
import json
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Dict, List, Optional

# A part's status, and whether it makes the check fail.
FAILING = ("failed", "timeout", "error")
# Skip reasons that name what a one-GPU host leaves unchecked (tests/test_*cuda*.py's).
TWO_GPUS = "two CUDA GPUs"
TWO_GPU_GUARDS = ("the device guards for tensors on a non-current device (each CUDA op runs on "
                  "its tensors' device, whatever the current device is), and amp with a param "
                  "group on a second GPU")


def read_junit(path: Path) -> dict:
    """Counts, failed test ids and skip reasons of one JUnit XML file (pytest's)."""
    result = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "failed": [],
              "skip_reasons": collections.Counter()}
    if not path.exists():
        result["missing"] = True
        return result
    root = ElementTree.parse(path).getroot()
    for case in root.iter("testcase"):
        result["tests"] += 1
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        for child in case:
            if child.tag in ("failure", "error"):
                result["failures" if child.tag == "failure" else "errors"] += 1
                message = (child.get("message") or "").splitlines()
                result["failed"].append(f"{name}: {message[0][:200] if message else child.tag}")
            elif child.tag == "skipped":
                result["skipped"] += 1
                reason = (child.get("message") or "skipped").strip()
                result["skip_reasons"][reason[:200]] += 1
    return result


def junit_summary(counts: dict) -> str:
    if counts.get("missing"):
        return "no JUnit XML was written"
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    parts = [f"{passed} passed"]
    for key in ("failures", "errors", "skipped"):
        if counts[key]:
            parts.append(f"{counts[key]} {'failed' if key == 'failures' else key}")
    return ", ".join(parts)


def _fmt(value: Optional[float], suffix: str = "x") -> str:
    return "n/a" if value is None else f"{value:.2f}{suffix}"


def kernel_headlines(record: dict) -> List[str]:
    lines = []
    if record.get("copy_gbps"):
        lines.append(f"device-to-device copy: {record['copy_gbps']:.0f} GB/s (read + write)")
    for title, rows in record.get("workloads", {}).items():
        native, torch_op = rows.get("native", {}), rows.get("torch", {})
        ratio = native["ms"] / torch_op["ms"] if native and torch_op else None
        lines.append(f"{title}: native {_fmt(native.get('x_copy'))} the copy time, "
                     f"{_fmt(ratio)} torch's op ({_fmt(torch_op.get('x_copy'))} the copy time)")
    return lines


def optimizer_headlines(record: dict) -> List[str]:
    lines = []
    for title, rows in record.get("workloads", {}).items():
        ms = rows.get("ms", {})
        adamw = ms["adamw ours"] / ms["adamw fused"] if "adamw ours" in ms and \
            "adamw fused" in ms else None
        o2 = rows.get("x_floor", {}).get("O2 adamw ours")
        lines.append(f"optimizers, {title}: AdamW ours {_fmt(adamw)} torch AdamW(fused); "
                     f"O2 AdamW ours {_fmt(o2)} its bandwidth floor")
    return lines


def o2_headlines(record: dict) -> List[str]:
    results = record.get("results", {})
    fp32, scaler = results.get("fp32 AdamW(fused)"), results.get("GradScaler AdamW(fused)")
    lines = []
    for name in ("O2 AdamW", "O2 AdamW pure", "O2 FusedAdam", "O2 FusedAdam pure",
                 "O2 AdamW unfused"):
        r = results.get(name)
        if not r:
            continue
        line = (f"O2 step, {name}: {_fmt(r['ms'] / fp32['ms'] if fp32 else None)} the time and "
                f"{_fmt(r['peak_mib'] / fp32['peak_mib'] if fp32 else None)} the peak of fp32 "
                f"AdamW(fused)")
        if scaler:
            line += (f"; {_fmt(r['ms'] / scaler['ms'])} the time and "
                     f"{_fmt(r['peak_mib'] / scaler['peak_mib'])} the peak of GradScaler + "
                     f"AdamW(fused)")
        lines.append(line)
    return lines


def train_headlines(record: dict) -> List[str]:
    lines = []
    for workload, results in record.get("results", {}).items():
        cells = [f"{variant} {_fmt(r.get('speedup_vs_autocast'))}"
                 for variant, r in results.items() if variant != "autocast"]
        lines.append(f"training step speed-up over autocast + GradScaler, {workload}: "
                     f"{', '.join(cells)}")
    return lines


def resnet_bn_headlines(record: dict) -> List[str]:
    results = record.get("results", {})
    fp32, autocast = results.get("fp32"), results.get("autocast")
    lines = []
    for mode in ("O2", "O2-casts", "O5"):
        r = results.get(mode)
        if not r or not fp32 or not autocast:
            continue
        lines.append(f"ResNet-18 + BatchNorm, {mode}: {_fmt(r['peak_mib'] / fp32['peak_mib'])} "
                     f"the peak of fp32, {_fmt(r['peak_mib'] / autocast['peak_mib'])} autocast's;"
                     f" {_fmt(r['ms'] / autocast['ms'])} autocast's time")
    return lines


def fp8_headlines(record: dict) -> List[str]:
    if record.get("skipped"):
        return [f"fp8: {record['skipped']}"]
    layers, decoder = record.get("layers", {}), record.get("decoder", {})
    lines = []
    if layers:
        extras = layers.get("extras", {})
        lines.append(f"fp8 Linear 16384 x 4096 x 4096 fwd+bwd: "
                     f"{_fmt(layers.get('target_speedup'))} bf16's speed (target >= 1.3x on an "
                     f"H100); slowest layer amp's default puts in fp8: "
                     f"{_fmt(layers.get('slowest_default_eligible'))} (target >= 1.0x)")
        lines.append(f"fp8 crossover: at least bf16's speed at every M from d = "
                     f"{layers.get('crossover')} (default min_features "
                     f"{layers.get('default_min_features')}, estimated before this); with its "
                     f"counts off fp8 takes {_fmt(extras.get('counts off', {}).get('x_fp8'))} "
                     f"its time, with eager casts "
                     f"{_fmt(extras.get('eager casts', {}).get('x_fp8'))}")
    if decoder:
        gap = decoder.get("loss_gap")
        lines.append(f"fp8 decoder ({decoder.get('parameters', 0) / 1e6:.0f}M): step "
                     f"{_fmt(decoder.get('step_speedup'))} bf16's speed, loss gap "
                     f"{'n/a' if gap is None else f'{100 * gap:+.2f}%'} after "
                     f"{decoder.get('spec', {}).get('steps')} steps (target within 1%)")
    return lines


HEADLINES = {"kernels": kernel_headlines, "optimizers": optimizer_headlines,
             "o2_step": o2_headlines, "train": train_headlines,
             "resnet_bn": resnet_bn_headlines, "fp8": fp8_headlines}


def headlines(bench: Dict[str, dict]) -> List[str]:
    """The headline lines of every benchmark record present (a record that lacks a key gives
    what it has)."""
    lines = []
    for name, make in HEADLINES.items():
        if name in bench:
            try:
                lines += make(bench[name])
            except (KeyError, TypeError, ZeroDivisionError) as exc:
                lines.append(f"{name}: its record could not be read ({exc!r})")
    return lines


def unchecked(skip_reasons: Dict[str, int], device_count: Optional[int]) -> List[str]:
    """What stays unchecked on this host."""
    lines = []
    two_gpu = sum(n for reason, n in skip_reasons.items() if TWO_GPUS in reason)
    if two_gpu or (device_count is not None and device_count < 2):
        lines.append(f"two GPUs ({two_gpu} tests skipped): {TWO_GPU_GUARDS}")
    return lines


def write(out: Path, verdict: str, host: dict, parts: List[dict], bench: Dict[str, dict],
          junits: List[dict]) -> dict:
    """Writes summary.json and summary.md into ``out``; returns the summary."""
    skipped: collections.Counter = collections.Counter()
    failed: List[str] = []
    for counts in junits:
        skipped.update(counts["skip_reasons"])
        failed += counts["failed"]
    summary = {"verdict": verdict, "host": host, "parts": parts, "headlines": headlines(bench),
               "failed_tests": failed, "skipped": dict(skipped.most_common()),
               "unchecked": unchecked(skipped, host.get("device_count"))}
    files = sorted(p.name for p in out.iterdir() if p.is_file())
    summary["files"] = sorted(set(files) | {"summary.json", "summary.md"})
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "summary.md").write_text(markdown(summary))
    return summary


def markdown(summary: dict) -> str:
    host = summary["host"]
    lines = [f"# apex_lite GPU check: {summary['verdict'].upper()}", "",
             f"{host.get('gpu', 'no GPU')}; driver {host.get('driver', '?')}; torch "
             f"{host.get('torch', '?')} (CUDA {host.get('torch_cuda', '?')}); nvcc "
             f"{host.get('nvcc', '?')}; Python {host.get('python', '?')}; "
             f"{host.get('cpus', '?')} CPUs; {host.get('date', '?')}; "
             f"{host.get('seconds', 0):.0f} s in all.", "",
             "| part | result | time | notes |", "|---|---|---|---|"]
    for part in summary["parts"]:
        result = part["status"] + (f": {part['summary']}" if part.get("summary") else "")
        notes = "; ".join(part.get("notes", []))
        lines.append(f"| {part['title']} | {result} | {part.get('seconds', 0):.0f} s | "
                     f"{notes} |".replace("\n", " "))
    for heading, items in (("Headline ratios (each measured in this run)", summary["headlines"]),
                           ("Failed tests", summary["failed_tests"][:40]),
                           ("Skipped tests, by reason",
                            [f"{n} x {reason}" for reason, n in summary["skipped"].items()][:20]),
                           ("Unchecked on this host", summary["unchecked"])):
        if items:
            lines += ["", f"## {heading}", ""] + [f"- {item}" for item in items]
    lines += ["", "Files: " + ", ".join(summary["files"]), ""]
    return "\n".join(lines)
