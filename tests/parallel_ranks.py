"""Runs a suite of tests/workers/parallel_worker.py on 2 gloo ranks once and hands every rank's
results to the tests of one module (tests/test_parallel_*.py)."""
from __future__ import annotations

from pathlib import Path
from typing import List

import torch
import torch.distributed as dist

import gloo_ranks

WORKER = Path(__file__).parent / "workers" / "parallel_worker.py"
WORLD = 2

AVAILABLE = dist.is_available() and dist.is_gloo_available()
REASON = "torch.distributed with gloo is not available"


def run_suite(suite: str, tmp_dir: Path, timeout: float = 120) -> List[dict]:
    """The results of ``--suite suite`` on each of 2 ranks, rank 0 first."""
    procs = gloo_ranks.start(WORKER, ["--out", str(tmp_dir), "--suite", suite], WORLD)
    gloo_ranks.finish(procs, f"parallel {suite}", timeout)
    return [torch.load(tmp_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
