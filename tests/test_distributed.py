"""Two real processes on gloo: one rank's overflow makes every rank skip the same step."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

WORKER = Path(__file__).parent / "workers" / "ddp_skip_worker.py"
pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(tmp_path, world_size=2, timeout=50, extra=()):
    port = free_port()
    procs = []
    try:
        for rank in range(world_size):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                       OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen(
                [sys.executable, str(WORKER), "--out", str(tmp_path), *extra], env=env,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True))
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:   # never leave a rank behind, whatever failed
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{out}"
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]


def test_one_ranks_overflow_skips_the_step_on_every_rank(tmp_path):
    steps, inject = 6, 2
    results = run_ranks(tmp_path, extra=("--steps", str(steps), "--inject-step", str(inject),
                                         "--inject-rank", "1"))
    expected = [step == inject for step in range(steps)]
    for r in results:
        assert r["skipped"] == expected, f"rank {r['rank']} skipped {r['skipped']}"
    assert results[0]["scales"] == results[1]["scales"]
    assert results[0]["scales"][inject] == results[0]["scales"][inject - 1] / 2
    for a, b in zip(results[0]["params"] + results[0]["masters"],
                    results[1]["params"] + results[1]["masters"]):
        assert torch.equal(a, b)
    assert results[0]["params"][0].dtype == torch.bfloat16   # O2 on CPU really ran in half


def test_without_injection_no_rank_skips(tmp_path):
    results = run_ranks(tmp_path, extra=("--steps", "3", "--inject-step", "-1"))
    for r in results:
        assert r["skipped"] == [False] * 3
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)
