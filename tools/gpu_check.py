"""Everything a GPU can tell about apex_lite, in one call (tools/gpu_check.sh runs this).

    bash tools/gpu_check.sh OUTDIR              # on a CUDA host: about 8-11 minutes
    bash tools/gpu_check.sh --dry-run OUTDIR    # anywhere: checks this script's plumbing

Parts, in order (each with a time limit; a part that would start past --budget is skipped and
says so):
  versions     GPU, driver, CUDA, torch, nvcc, compute-sanitizer, timm
  build        apex_lite with its CPU and CUDA kernels for this GPU's architecture only
               (TORCH_CUDA_ARCH_LIST from torch.cuda.get_device_capability()), MAX_JOBS = the
               cores, no network (pip --no-build-isolation --no-deps --no-index), into a scratch
               --target; reused when the sources and torch are those of the last build there
  tests        the CUDA tests (``-k cuda`` over the suite) with the native kernels required, then those with a Python-backend form with the Python
               backend forced (a pure install's route on a GPU): JUnit XML each
  sanitizer    compute-sanitizer memcheck over tools/cuda_sanitizer_ops.py (every op, small and
               odd sizes, found_inf clear and set, channels_last and sliced tensors, fp16 and
               bf16 with fp32 masters), racecheck over its reduction groups (l2norm, LAMB,
               NovoGrad); beside the Python-backend tests, which do not time anything
  benches      bench/kernels.py, bench/optimizers.py, bench/o2_step.py, bench/train.py,
               bench/resnet_bn.py and bench/fp8.py (fp8 vs bf16 per layer, the crossover size
               that amp's default min_features was estimated for, a ~125M decoder's step and
               loss) in their short modes, alone on the GPU; every ratio measured in the same run
  timm         timm's ApexScaler at O1 and O2 through the apex alias (tools/gpu_timm_check.py)

OUTDIR receives at most 8 files: summary.md, summary.json, log.txt, junit_native.xml,
junit_python.xml, sanitizer.txt, bench.json. The exit status is 1 when a part failed (a test,
the build, a sanitizer error, a benchmark or timm run that broke), else 0. The dry run builds
nothing and needs no GPU: it collects the tests, runs tools/cuda_sanitizer_ops.py on the CPU,
checks that each benchmark accepts the flags used here, and writes the summary, saying what it
would run.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
sys.path.insert(0, str(ROOT / "tools"))
import gpu_check_report as report  # noqa: E402

MAX_FILES = 8
# (name, title, command after "python", seconds allowed)
BENCHES = [
    ("kernels", "bench: multi-tensor kernels vs torch's and the copy bandwidth",
     ["bench/kernels.py", "--device", "cuda", "--quick"], 120),
    ("optimizers", "bench: fused optimizer steps vs torch's",
     ["bench/optimizers.py", "--device", "cuda", "--quick"], 120),
    ("o2_step", "bench: O2's step vs fp32 AdamW(fused) and GradScaler, native and pure",
     ["bench/o2_step.py", "--device", "cuda", "--quick"], 150),
    ("train", "bench: whole training steps, fp32 / autocast / O1-O3",
     ["bench/train.py", "--device", "cuda", "--preset", "gpu-quick"], 200),
    ("resnet_bn", "bench: ResNet-18 with BatchNorm, fp32 / autocast / O1-O5 / O2-casts",
     ["bench/resnet_bn.py", "--device", "cuda", "--quick"], 150),
    ("fp8", "bench: fp8 Linears over a grid of shapes and a ~125M decoder vs bf16",
     ["bench/fp8.py", "--device", "cuda", "--quick"], 300),
]
SANITIZER_GROUPS_RACECHECK = "l2norm,lamb,novograd"
# The summary's order of the parts (some run side by side).
PART_ORDER = ["versions", "gpu", "build", "tests_native", "tests_python", "sanitizer",
              "memcheck", "racecheck"] + [f"bench_{name}" for name, *_ in BENCHES] + ["timm"]


class GpuCheck:
    """One run: the parts' records, the log, the deadline."""

    def __init__(self, out: Path, scratch: Path, dry_run: bool, budget: float, workers: int):
        self.out, self.scratch, self.dry_run, self.budget = out, scratch, dry_run, budget
        self.workers = workers
        self.start = time.monotonic()
        self.parts: List[dict] = []
        self.host: Dict[str, object] = {}
        self.bench: Dict[str, dict] = {}
        self.junits: List[dict] = []
        self.site = scratch / "site"
        self._collected = None   # the dry run's one collection of the tests
        self._log_lock = threading.Lock()
        out.mkdir(parents=True, exist_ok=True)
        scratch.mkdir(parents=True, exist_ok=True)
        self.log_path = out / "log.txt"
        self.log_path.write_text("")

    # ---- running commands ---------------------------------------------------------------

    def log(self, text: str) -> None:
        with self._log_lock, open(self.log_path, "a") as f:
            f.write(text if text.endswith("\n") else text + "\n")

    def run(self, command: List[str], timeout: float, cwd: Optional[Path] = None,
            env: Optional[Dict[str, str]] = None, keep: int = 200_000) -> dict:
        """Runs ``command``; returns rc (None on timeout), output (its last ``keep``
        characters, stdout and stderr together) and seconds. Everything goes to log.txt."""
        environment = dict(os.environ, **(env or {}))
        started = time.monotonic()
        self.log(f"\n$ {' '.join(command)}  (cwd {cwd or ROOT}; env {env or {}})")
        try:
            done = subprocess.run(command, cwd=cwd or ROOT, env=environment, timeout=timeout,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  errors="replace")
            rc, output = done.returncode, done.stdout
        except subprocess.TimeoutExpired as exc:
            rc, output = None, (exc.stdout or b"")
            output = output.decode(errors="replace") if isinstance(output, bytes) else output
        seconds = time.monotonic() - started
        output = output[-keep:]
        self.log(f"{output}\n[rc {rc}, {seconds:.1f} s]")
        return {"rc": rc, "output": output, "seconds": seconds}

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.start)

    def part(self, name: str, title: str, status: str, seconds: float = 0.0, summary: str = "",
             notes: Optional[List[str]] = None) -> dict:
        record = {"name": name, "title": title, "status": status, "seconds": round(seconds, 1),
                  "summary": summary, "notes": notes or []}
        self.parts.append(record)
        print(f"[{time.monotonic() - self.start:6.0f} s] {title}: {status}"
              f"{': ' + summary if summary else ''}", flush=True)
        return record

    def python(self, *args: str) -> List[str]:
        return [sys.executable, *args]

    def site_env(self, **extra: str) -> Dict[str, str]:
        """The environment of a part that uses the built apex_lite (the dry run: the tree's)."""
        path = str(ROOT) if self.dry_run else str(self.site)
        return dict(PYTHONPATH=path, PYTHONUNBUFFERED="1", **extra)

    # ---- versions ---------------------------------------------------------------------

    def versions(self) -> None:
        import torch
        host = self.host
        host.update(date=time.strftime("%Y-%m-%d %H:%M %Z"), python=platform.python_version(),
                    torch=torch.__version__, torch_cuda=torch.version.cuda,
                    cpus=os.cpu_count(), dry_run=self.dry_run)
        host["device_count"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if host["device_count"]:
            capability = torch.cuda.get_device_capability(0)
            props = torch.cuda.get_device_properties(0)
            host.update(gpu=f"{torch.cuda.get_device_name(0)} x{host['device_count']}, sm_"
                            f"{capability[0]}{capability[1]}, {props.multi_processor_count} "
                            f"SMs, {props.total_memory / 2 ** 30:.0f} GiB",
                        arch=f"{capability[0]}.{capability[1]}")
        smi = shutil.which("nvidia-smi")
        if smi:
            got = self.run([smi, "--query-gpu=name,driver_version,memory.total",
                            "--format=csv,noheader"], 30)
            host["driver"] = got["output"].strip().splitlines()[0].split(",")[1].strip() \
                if got["rc"] == 0 and got["output"].strip() else "?"
        for key, tool in (("nvcc", "nvcc"), ("compute_sanitizer", "compute-sanitizer")):
            path = find_cuda_tool(tool)
            if path:
                got = self.run([path, "--version"], 30)
                found = re.findall(r"(?:release|Version) ([\d.]+)", got["output"])
                host[key] = found[0] if found else got["output"].strip()[-80:]
            else:
                host[key] = "not found"
        timm = self.run(self.python("-c", "import timm; print(timm.__version__)"), 60)
        host["timm"] = timm["output"].strip().splitlines()[-1] if timm["rc"] == 0 else \
            "not importable"
        self.part("versions", "versions", "passed" if not self.dry_run else "dry run",
                  summary=", ".join(f"{k} {v}" for k, v in host.items()
                                    if k in ("gpu", "driver", "torch", "nvcc",
                                             "compute_sanitizer", "timm")))

    # ---- build ----------------------------------------------------------------------------

    def sources_stamp(self) -> str:
        digest = hashlib.sha256(str(self.host.get("torch")).encode())
        for path in sorted(ROOT.glob("csrc/**/*")) + [ROOT / "setup.py"]:
            if path.is_file():
                digest.update(path.read_bytes())
        return digest.hexdigest()

    def build(self) -> bool:
        title = "build (CPU and CUDA kernels)"
        arch = str(self.host.get("arch", "9.0"))
        jobs = str(os.cpu_count() or 1)
        env = dict(APEX_LITE_CUDA_EXT="1", TORCH_CUDA_ARCH_LIST=arch, MAX_JOBS=jobs)
        command = self.python("-m", "pip", "install", "-v", "--no-build-isolation", "--no-deps",
                              "--no-index", "--target", str(self.site), ".")
        notes = [f"TORCH_CUDA_ARCH_LIST={arch}, MAX_JOBS={jobs}", f"into {self.site}"]
        if self.dry_run:
            self.part("build", title, "dry run", notes=notes + [
                "would run: " + " ".join(f"{k}={v}" for k, v in env.items()) + " " +
                " ".join(command)])
            return True
        stamp_path = self.scratch / "build.stamp"
        stamp = self.sources_stamp()
        if stamp_path.exists() and stamp_path.read_text() == stamp and self.site.exists():
            self.part("build", title, "passed", summary="reused the build of the same sources "
                      "and torch from an earlier run", notes=notes)
            return True
        shutil.rmtree(self.site, ignore_errors=True)
        shutil.rmtree(ROOT / "build", ignore_errors=True)
        got = self.run(command, 420, env=env)
        probe = self.run(self.python("-c", "import torch, apex_lite._C; print(all("
                                     "torch._C._dispatch_has_kernel_for_dispatch_key("
                                     "f'apex_lite::{op}', 'CUDA') for op in ('scale_', "
                                     "'fused_adam_', 'l2norm')))"),
                         120, cwd=self.scratch, env=self.site_env())
        built = got["rc"] == 0 and probe["rc"] == 0 and probe["output"].strip().endswith("True")
        if built:
            stamp_path.write_text(stamp)
        tail = "" if built else got["output"].strip().splitlines()[-1:] or ["?"]
        self.part("build", title, "passed" if built else "failed", got["seconds"],
                  summary=f"{got['seconds']:.0f} s" if built else f"rc {got['rc']}: {tail[0]}",
                  notes=notes)
        return built

    # ---- tests ----------------------------------------------------------------------------

    def native_only_files(self) -> List[str]:
        """The test files of the native CUDA ops alone (they call
        native_cuda.require_cuda_kernels): the Python-backend run leaves them out."""
        return [path.name for path in sorted(TESTS.glob("test_*.py"))
                if "require_cuda_kernels(" in path.read_text()]

    def tests(self, python_backend: bool) -> None:
        name = "tests_python" if python_backend else "tests_native"
        title = ("CUDA tests, Python backend forced (a pure install's route)" if python_backend
                 else "CUDA tests, native kernels required")
        # Every CUDA test has "cuda" in its id (its name, a parameter, or its module's name:
        # tests/test_gpu_check.py checks the rule), so -k cuda over the suite finds them all.
        ignored = self.native_only_files() if python_backend else []
        files = [f"--ignore={name}" for name in ignored]
        env = self.site_env(**({"APEX_LITE_DISABLE_EXT": "1"} if python_backend
                               else {"APEX_LITE_REQUIRE_EXT": "1"}))
        base = self.python("-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-k", "cuda")
        if self.dry_run:
            # One collection serves both runs (the Python backend's files are a subset).
            if self._collected is None:
                got = self.run(base + ["--collect-only"], 300, cwd=TESTS, env=env,
                               keep=5_000_000)
                ids = [line.split("::")[0].split("/")[-1]
                       for line in got["output"].splitlines() if "::" in line]
                self._collected = (got, ids)
            got, ids = self._collected
            count = sum(file not in ignored for file in ids)
            gated = [name for name in self.native_only_files() if name not in ids]
            status = "dry run" if got["rc"] in (0, 5) and count else "failed"
            self.part(name, title, status, got["seconds"],
                      summary=f"{count} tests selected here in "
                              f"{len(set(ids) - set(ignored))} files"
                              + (f"; {', '.join(gated)} skip at collection without a GPU"
                                 if gated and not python_backend else ""),
                      notes=["would run: pytest -k cuda " + " ".join(files)])
            return
        junit = self.out / f"junit_{'python' if python_backend else 'native'}.xml"
        xdist = ["-n", str(self.workers)] if self.workers > 1 and has_module("xdist") else []
        timeout = ["--timeout", "300"] if has_module("pytest_timeout") else []
        got = self.run(base + xdist + timeout + [f"--junitxml={junit}"] + files,
                       max(60.0, min(300.0, self.left() - 60)), cwd=TESTS, env=env)
        counts = report.read_junit(junit)
        self.junits.append(counts)
        failed = got["rc"] not in (0, 5) or counts["failures"] or counts["errors"]
        status = "timeout" if got["rc"] is None else ("failed" if failed else "passed")
        self.part(name, title, status, got["seconds"], summary=report.junit_summary(counts),
                  notes=[junit.name] + [f"without {', '.join(ignored)}" if ignored else ""])

    # ---- compute-sanitizer ----------------------------------------------------------------

    def sanitizer(self) -> None:
        script = str(ROOT / "tools" / "cuda_sanitizer_ops.py")
        if self.dry_run:
            got = self.run(self.python(script, "--device", "cpu", "--dtypes", "float32"), 300,
                           cwd=self.scratch, env=self.site_env())
            ok = got["rc"] == 0 and got["output"].strip().endswith("ok")
            self.part("sanitizer", "compute-sanitizer memcheck and racecheck",
                      "dry run" if ok else "failed", got["seconds"],
                      summary="tools/cuda_sanitizer_ops.py ran every op on the CPU" if ok else
                      got["output"].strip().splitlines()[-1:][0] if got["output"] else "?",
                      notes=["would run compute-sanitizer --tool memcheck, then --tool "
                             f"racecheck --only {SANITIZER_GROUPS_RACECHECK}"])
            return
        tool = find_cuda_tool("compute-sanitizer")
        text = []
        for check, extra, timeout in (("memcheck", [], 180),
                                      ("racecheck", ["--only", SANITIZER_GROUPS_RACECHECK], 120)):
            title = f"compute-sanitizer {check}"
            if tool is None:
                self.part(check, title, "skipped", summary="compute-sanitizer was not found "
                          "(PATH, CUDA_HOME/bin, /usr/local/cuda/bin)")
                continue
            got = self.run([tool, "--tool", check, "--error-exitcode", "99", "--print-limit",
                            "50", sys.executable, script] + extra, timeout, cwd=self.scratch,
                           env=self.site_env(PYTORCH_NO_CUDA_MEMORY_CACHING="1"))
            text.append(f"===== {check} (rc {got['rc']}, {got['seconds']:.0f} s)\n"
                        f"{got['output']}")
            errors = re.search(r"ERROR SUMMARY: (\d+) error", got["output"])
            if got["rc"] is None:
                status, summary = "timeout", f"past {timeout} s"
            elif errors and int(errors.group(1)) > 0 or got["rc"] == 99:
                status, summary = "failed", f"{errors.group(1) if errors else '?'} errors"
            elif got["rc"] == 0:
                status, summary = "passed", "0 errors"
            else:   # the tool could not run here (an unsupported device, say): say why
                last = got["output"].strip().splitlines()[-3:]
                status, summary = "skipped", "could not run: " + " / ".join(last)
            self.part(check, title, status, got["seconds"], summary=summary,
                      notes=["sanitizer.txt"])
        if text:
            (self.out / "sanitizer.txt").write_text("\n".join(text))

    # ---- benchmarks -----------------------------------------------------------------------

    def benches(self) -> None:
        for name, title, args, timeout in BENCHES:
            if self.dry_run:
                # The flags this script passes, each an add_argument of the bench (read from
                # its source: --help would import torch once per bench); and the bench compiles.
                source = (ROOT / args[0]).read_text()
                declared = set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", source))
                flags = [a for a in args[1:] if a.startswith("--")] + ["--json"]
                missing = [flag for flag in flags if flag not in declared]
                try:
                    compile(source, args[0], "exec")
                    broken = ""
                except SyntaxError as exc:
                    broken = f"does not compile: {exc}"
                status = "dry run" if not missing and not broken else "failed"
                self.part(f"bench_{name}", title, status,
                          summary=broken or (f"missing flags {missing}" if missing else
                                             "takes " + " ".join(flags)),
                          notes=["would run: python " + " ".join(args)])
                continue
            if self.left() < 30:
                self.part(f"bench_{name}", title, "skipped", summary="the time budget was spent")
                continue
            record = self.scratch / f"bench_{name}.json"
            record.unlink(missing_ok=True)
            got = self.run(self.python(*args, "--json", str(record)),
                           min(timeout, max(30.0, self.left())), env=self.site_env())
            if record.exists():
                self.bench[name] = json.loads(record.read_text())
            status = "timeout" if got["rc"] is None else (
                "passed" if got["rc"] == 0 and record.exists() else "failed")
            self.part(f"bench_{name}", title, status, got["seconds"], notes=["bench.json"])
        if self.bench:
            (self.out / "bench.json").write_text(json.dumps(self.bench, indent=1))

    # ---- timm -----------------------------------------------------------------------------

    def timm(self) -> None:
        title = "timm's ApexScaler at O1 and O2 through the apex alias"
        command = self.python("-m", "apex_lite.apex_alias",
                              str(ROOT / "tools" / "gpu_timm_check.py"), "--steps", "20")
        if self.dry_run or self.host.get("timm") == "not importable":
            status = "dry run" if self.dry_run else "skipped"
            self.part("timm", title, status, summary=f"timm {self.host.get('timm')}",
                      notes=["would run: " + " ".join(command[1:])])
            return
        got = self.run(command, min(180.0, max(30.0, self.left())), cwd=self.scratch,
                       env=self.site_env())
        runs = [json.loads(line) for line in got["output"].splitlines()
                if line.startswith("{") and '"level"' in line]
        passed = sum(bool(r.get("ok")) for r in runs)
        status = "timeout" if got["rc"] is None else (
            "passed" if got["rc"] == 0 and runs and passed == len(runs) else "failed")
        self.part("timm", title, status, got["seconds"],
                  summary=f"{passed} of {len(runs)} runs trained",
                  notes=[f"{r['model']} {r['level']}: " + (
                      f"loss {r['first_loss']:.3f} -> {r['last_loss']:.3f}" if "last_loss" in r
                      else r.get("error", "?")) for r in runs])

    # ---- the whole run --------------------------------------------------------------------

    def main(self) -> int:
        self.versions()
        if not self.dry_run and not self.host.get("device_count"):
            self.part("gpu", "a CUDA GPU", "failed",
                      summary="torch sees no CUDA device; run with --dry-run without a GPU")
            return self.finish()
        if not self.build():
            for title in ("tests", "sanitizer", "benches", "timm"):
                self.part(title, title, "skipped", summary="the build failed")
            return self.finish()
        self.tests(python_backend=False)
        # The Python-backend tests and the sanitizer side by side: neither times anything.
        side = threading.Thread(target=self.sanitizer)
        side.start()
        self.tests(python_backend=True)
        side.join()
        self.benches()
        self.timm()
        return self.finish()

    def finish(self) -> int:
        failed = any(part["status"] in report.FAILING for part in self.parts)
        verdict = "dry run" if self.dry_run and not failed else ("failed" if failed else "passed")
        self.host["seconds"] = time.monotonic() - self.start
        self.parts.sort(key=lambda part: PART_ORDER.index(part["name"])
                        if part["name"] in PART_ORDER else len(PART_ORDER))
        summary = report.write(self.out, verdict, self.host, self.parts, self.bench, self.junits)
        files = [p for p in self.out.iterdir()]
        if len(files) > MAX_FILES:
            print(f"gpu_check: {len(files)} files in {self.out}, more than {MAX_FILES}")
            return 1
        print((self.out / "summary.md").read_text())
        return 1 if summary["verdict"] == "failed" else 0


def has_module(name: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(name) is not None


def find_cuda_tool(name: str) -> Optional[str]:
    """``name`` on PATH, in CUDA_HOME/bin or in /usr/local/cuda/bin; None when nowhere."""
    candidates = [shutil.which(name)]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(os.path.join(home, "bin", name))
    return next((c for c in candidates if c and os.path.exists(c)), None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--dry-run", action="store_true",
                        help="check this script's plumbing without a GPU; build nothing")
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/apex_lite_gpu_check"),
                        help="where the build and the benchmarks' records go (not OUTDIR)")
    parser.add_argument("--budget", type=float, default=660.0,
                        help="seconds; parts that would start later are skipped")
    parser.add_argument("--workers", type=int, default=min(8, max(1, (os.cpu_count() or 2) // 2)),
                        help="pytest-xdist workers for the test runs")
    args = parser.parse_args(argv)
    if args.outdir.exists() and any(args.outdir.iterdir()):
        parser.error(f"{args.outdir} is not empty: give an empty or new folder (at most "
                     f"{MAX_FILES} files are written there)")
    return GpuCheck(args.outdir, args.scratch, args.dry_run, args.budget, args.workers).main()


if __name__ == "__main__":
    sys.exit(main())
