"""One rank of a table of two-rank cases (tests/case_ranks.py); not a test itself.

``--module`` names a module beside this script whose ``CASES`` maps a case name to a function
of the rank (and whose ``warm_up()``, if it has one, runs once here before the forks, so that
what torch and amp import on first use is imported once). Each case named on the command line
runs in a child process forked from this one, at most ``--jobs`` at a time, in the order given:
the child joins a gloo group made for that case alone (over a prefix of one TCP store that a
process forked by rank 0's worker serves), runs the case, and saves its result to
``--out/<case>.rank<r>.pt``, its output to ``<case>.rank<r>.log``. A child still running
``--case-seconds`` after it started is killed (a hang); its gloo timeout ends a stuck collective
a little earlier, and faulthandler dumps its stack, so that its output says where it hung. What
each child did (0, its exit status, or the deadline) goes to ``--out/status.rank<r>.json``.
"""
import argparse
import datetime
import faulthandler
import importlib
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]     # the case modules; tests/ (amp_habits)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
# Before any group exists (tests/workers/ddp_skip_worker.py says why).
import torch.distributed.nn  # noqa: E402, F401

DONE = "every case of this rank is done"


def run_child(module, case: str, rank: int, world: int, port: int, out: Path,
              gloo_seconds: float) -> None:
    fd = os.open(out / f"{case}.rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    # A child stuck where no gloo timeout reaches says where before the deadline kills it.
    faulthandler.dump_traceback_later(gloo_seconds + 3)
    code = 1
    try:
        timeout = datetime.timedelta(seconds=gloo_seconds)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=dist.PrefixStore(case, store), rank=rank,
                                world_size=world, timeout=timeout)
        result = module.CASES[case](rank)
        torch.save(result, out / f"{case}.rank{rank}.pt")
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)       # no teardown: the group dies with the process


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--module", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--case-seconds", type=float, default=60)
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("cases", nargs="+")
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    port = int(os.environ["MASTER_PORT"])
    out = Path(args.out)
    # Rank 0's store serves every case's rendezvous from a process of its own, forked while
    # this one has no thread yet: a child forked while a store thread holds a lock would hang.
    server = os.fork() if rank == 0 else None
    if server == 0:
        serve_store(port, world)
    module = importlib.import_module(args.module)
    unknown = [case for case in args.cases if case not in module.CASES]
    if unknown:
        raise SystemExit(f"{args.module} has no cases {unknown}")
    torch.set_num_threads(1)     # a child forked after an OpenMP pool started would hang in it
    if hasattr(module, "warm_up"):
        module.warm_up()     # what torch and amp import on first use, once before the forks
    # Both workers ready before the first fork, so that the two children of a case start
    # together however long each worker took to start (a file each: no thread here).
    (out / f"ready.rank{rank}").touch()
    while not all((out / f"ready.rank{r}").exists() for r in range(world)):
        time.sleep(0.05)
    gloo_seconds = max(5.0, args.case_seconds - 10)
    pending, running, statuses = list(args.cases), {}, {}
    while pending or running:
        while pending and len(running) < args.jobs:
            case = pending.pop(0)
            pid = os.fork()
            if pid == 0:
                run_child(module, case, rank, world, port, out, gloo_seconds)
            running[case] = (pid, time.monotonic() + args.case_seconds)
        for case, (pid, deadline) in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                statuses[case] = os.waitstatus_to_exitcode(status)
            elif time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                statuses[case] = f"still running after {args.case_seconds:.0f} s: killed (a hang)"
            else:
                continue
            del running[case]
        time.sleep(0.02)
    (out / f"status.rank{rank}.json").write_text(json.dumps(statuses))
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                          timeout=datetime.timedelta(seconds=args.case_seconds))
    store.add(DONE, 1)
    if server:
        os.waitpid(server, 0)      # every rank's cases are done: the store may go


def serve_store(port: int, world: int) -> None:
    """The TCP store of every case, until every rank's worker is done (or the harness kills
    this process with its worker's process group)."""
    store = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False)
    while store.add(DONE, 0) < world:
        time.sleep(0.05)
    os._exit(0)


if __name__ == "__main__":
    main()
