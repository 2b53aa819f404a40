"""Real ranks for the distributed tests: a worker script (tests/workers/) started once per rank
of a gloo group on this machine, and waited for."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import List, Sequence


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(worker: Path, argv: Sequence[str], world: int) -> List[subprocess.Popen]:
    """``worker argv`` once per rank, with MASTER_ADDR/PORT, RANK, WORLD_SIZE and LOCAL_RANK
    set, one thread each, stdout and stderr together."""
    port = free_port()
    procs = []
    try:
        for rank in range(world):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                       OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen(
                [sys.executable, str(worker), *argv], env=env, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True, start_new_session=True))
    except BaseException:
        _stop(procs)
        raise
    return procs


def finish(procs: List[subprocess.Popen], label: str, timeout: float) -> List[str]:
    """Wait for every rank; their outputs. Fails naming the first rank that exited with an
    error, and never leaves a rank behind, whatever failed."""
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        _stop(procs)
    for rank, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"{label} rank {rank} failed (exit {p.returncode}):\n{text}"
    return outputs


def _stop(procs: List[subprocess.Popen]) -> None:
    """Kill the ranks still running (one that failed must not leave its peers waiting)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
