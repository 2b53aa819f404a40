"""Tables of two-rank cases, each case in a pair of processes of its own, each with a deadline:
a hang is the failure of its own case, never a stuck CI, and the other cases still run.

tests/workers/case_worker.py starts once per rank (gloo_ranks.start) and forks one child per case
(torch is imported once per rank, not once per case); the two children of a case make a gloo
group of their own and run the case. Each rank's worker kills a child that passes its deadline
(``case_seconds``); this harness kills both workers and every child (their process groups) when
the whole table passes its own. A test then asks for its case: its results per rank, or a
failure that says what each rank did (exit status, deadline, the end of its output).
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Sequence

import torch
import torch.distributed as dist

import gloo_ranks

WORKER = Path(__file__).parent / "workers" / "case_worker.py"
WORLD = 2

AVAILABLE = dist.is_available() and dist.is_gloo_available()
REASON = "torch.distributed with gloo is not available"


class Case:
    """What the two ranks of one case did."""

    def __init__(self, name: str, out: Path, statuses: List[dict]):
        self.name = name
        self.out = out
        self.statuses = [s.get(name, "never started (the worker of this rank stopped first)")
                         for s in statuses]

    def log(self, rank: int) -> str:
        path = self.out / f"{self.name}.rank{rank}.log"
        return path.read_text()[-3000:] if path.exists() else "(no output)"

    def failure(self) -> str:
        """Empty when both ranks finished; else what each rank did."""
        if all(status == 0 for status in self.statuses):
            return ""
        return "\n".join(f"rank {rank} of {self.name!r}: {status}\n{self.log(rank)}"
                         for rank, status in enumerate(self.statuses))

    def results(self) -> List[object]:
        """Each rank's result, rank 0 first; fails the test when a rank did not finish."""
        failure = self.failure()
        assert not failure, failure
        return [torch.load(self.out / f"{self.name}.rank{rank}.pt", weights_only=False)
                for rank in range(WORLD)]


def run(module: str, cases: Sequence[str], out: Path, case_seconds: float = 60,
        jobs: int = 8) -> Dict[str, Case]:
    """Run ``cases`` of tests/workers/``module``.py on 2 ranks, ``jobs`` at a time, in the order
    given (cases that may hang first: they share their deadline)."""
    procs = gloo_ranks.start(WORKER, ["--module", module, "--out", str(out), "--case-seconds",
                                      str(case_seconds), "--jobs", str(jobs), *cases], WORLD)
    # Every wave of cases within its deadline, and the start of the workers.
    deadline = time.monotonic() + case_seconds * math.ceil(len(cases) / jobs) + 120
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        outputs.append("(the table passed its deadline: every rank and case was killed)")
    finally:
        for proc in procs:
            _kill_group(proc)
    statuses = []
    for rank in range(WORLD):
        path = out / f"status.rank{rank}.json"
        statuses.append(json.loads(path.read_text()) if path.exists() else {})
    missing = [rank for rank in range(WORLD) if not statuses[rank]]
    assert not missing, f"the worker of rank(s) {missing} reported nothing:\n" + "\n".join(
        outputs)
    return {name: Case(name, out, statuses) for name in cases}


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill a worker and the case processes it forked (its session: gloo_ranks starts each
    rank in a new one), whether or not it is still running."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
