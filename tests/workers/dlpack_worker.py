"""DLPack export of an O2/O5 master's gradient (tests/test_amp_grad_lifetimes.py); not a test
itself.

Each case named on the command line (``<how>-<level>-<path>``: how ``to_dlpack``,
``to_dlpack_made`` (after ``amp.master_params``, which makes the fused step's lazy gradients),
``to_dlpack_bound`` (torch's own ``to_dlpack``, as code holds it that bound it before apex_lite
was imported) or ``from_dlpack``, level ``fp32``, ``O2`` or ``O5``, path ``fused`` or ``unfused``) runs in a child
process of its own, forked from this one (torch is imported once): a case that kills its process
(a segfault) is that case's failure only. Writes ``--out/results.json``: per case its exit code
(negative: the signal that ended it), the gradient exported through DLPack and the gradient
itself, as lists, or the error ``to_dlpack`` raised.
"""
import argparse
import json
import os
import resource
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # tests/: amp_habits

import torch  # noqa: E402
import torch.utils.dlpack  # noqa: E402

from amp_habits import backward, initialize, loss_of, mlp, params, warm_up  # noqa: E402
from apex_lite import amp  # noqa: E402

CASE_SECONDS = 60


def run_case(case: str) -> dict:
    how, level, path = case.split("-")
    level = None if level == "fp32" else level
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = initialize(model, optimizer, level, path)
    backward(loss_of(model, 0), optimizer, level)
    if how == "to_dlpack_made" and level is not None:
        list(amp.master_params(optimizer))
    grad = params(optimizer)[0].grad
    if how.startswith("to_dlpack"):
        # "to_dlpack_bound": the function as code that bound it before apex_lite was imported
        # holds it (torch's own, unwrapped).
        export = torch._C._to_dlpack if how == "to_dlpack_bound" else torch.utils.dlpack.to_dlpack
        try:
            capsule = export(grad)
        except RuntimeError as error:
            return {"refused": str(error), "grad": grad.tolist()}
        exported = torch.utils.dlpack.from_dlpack(capsule)
    else:
        exported = torch.from_dlpack(grad)
    return {"exported": exported.tolist(), "grad": grad.tolist()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("cases", nargs="+")
    args = parser.parse_args()
    out = Path(args.out)
    # One thread: a child forked after an OpenMP pool started would hang in it.
    torch.set_num_threads(1)
    warm_up(("O2",))       # what torch and amp import on first use, once before the forks
    children = {}
    for case in args.cases:
        log = out / f"{case}.log"
        pid = os.fork()
        if pid == 0:                                   # the case's own process
            code = 1
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))   # a crash writes no core file
            try:
                fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                result = run_case(case)
                (out / f"{case}.json").write_text(json.dumps(result))
                code = 0
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children[case] = pid
    codes = {}
    deadline = time.monotonic() + CASE_SECONDS
    while len(codes) < len(children):
        for case, pid in children.items():
            if case in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[case] = os.waitstatus_to_exitcode(status)
            elif time.monotonic() > deadline:          # stuck: a failure of its own
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                codes[case] = "killed after %d s" % CASE_SECONDS
        time.sleep(0.02)
    results = {}
    for case, code in codes.items():
        result = json.loads((out / f"{case}.json").read_text()) if code == 0 else {}
        log = out / f"{case}.log"
        result.update(exit=code, output=log.read_text()[-2000:] if log.exists() else "")
        results[case] = result
    (out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
