"""The Python blocks of the documentation's pages (docs/index.md, docs/guides/*.md), and a
runner for them.

A page's Python blocks (fenced ```python) run in order in one namespace, with the page's hidden
code where it stands: ``<!-- test-setup ... -->`` comments, which readers do not see, build the
small model or data a block names, and ``<!-- test-check ... -->`` comments assert what a block
shows (the dtypes it prints, a step it skips), so that a page whose claims no longer hold fails
the test. A block that cannot run here (it needs torchrun, a GPU,
or a model the page only names) is preceded by ``<!-- not-run: why -->`` and is skipped; a
``not-run`` without a reason is an error. tests/test_docs.py runs every page in one fresh process
(``python doc_blocks.py PAGE...``), so that the pages' ``amp.initialize`` and apex alias touch
no other test.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import re
import sys
import traceback
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON_FENCES = ("python", "py")
_FENCE = re.compile(r"^(`{3,})\s*([\w{}-]*)")
_NOT_RUN = re.compile(r"^<!--\s*not-run:(.*?)-->\s*$")


@dataclasses.dataclass
class Block:
    page: str
    line: int           # 1-based line of the opening fence
    code: str
    not_run: Optional[str] = None   # the reason, for a block that is not run


@dataclasses.dataclass
class Page:
    path: str
    steps: List[Block]      # what runs, in order: hidden setup and checks, and the blocks
    blocks: List[Block]     # the Python blocks a reader sees


def pages() -> List[str]:
    """The documentation's Markdown pages, the front page first."""
    return [os.path.join(ROOT, "docs", "index.md")] + \
        sorted(glob.glob(os.path.join(ROOT, "docs", "guides", "*.md")))


def parse(path: str) -> Page:
    """The hidden code and the Python blocks of the Markdown page at ``path``."""
    lines = open(path, encoding="utf-8").read().splitlines()
    steps: List[Block] = []
    blocks: List[Block] = []
    pending_reason: Optional[str] = None
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.strip() in ("<!-- test-setup", "<!-- test-check"):
            end = next(j for j in range(i, len(lines)) if lines[j].strip().endswith("-->"))
            steps.append(Block(path, i + 1, "\n".join(lines[i + 1:end])))
            i = end + 1
            continue
        not_run = _NOT_RUN.match(line.strip())
        if not_run:
            pending_reason = not_run.group(1).strip()
            if not pending_reason:
                raise ValueError(f"{path}:{i + 1}: a not-run mark needs its reason: "
                                 f"<!-- not-run: why -->")
            i += 1
            continue
        fence = _FENCE.match(line)
        if fence:
            ticks, info = fence.groups()
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith(ticks))
            if info in PYTHON_FENCES:
                blocks.append(Block(path, i + 1, "\n".join(lines[i + 1:end]), pending_reason))
                steps.append(blocks[-1])
            elif pending_reason is not None:
                raise ValueError(f"{path}:{i + 1}: a not-run mark before a {info!r} block; only "
                                 f"Python blocks are run")
            pending_reason = None
            i = end + 1
            continue
        i += 1
    if pending_reason is not None:
        raise ValueError(f"{path}: a not-run mark that no Python block follows")
    return Page(path, steps, blocks)


def run_page(page: Page) -> None:
    """Run ``page``'s hidden code and runnable blocks in order in one namespace; an error names
    the page and the line of the block (or hidden comment) that raised."""
    namespace = {"__name__": "__doc_page__"}
    name = os.path.relpath(page.path, ROOT)
    for step in page.steps:
        if step.not_run is None:
            exec(compile(step.code, f"{name}:{step.line}", "exec"), namespace)


def main(paths: List[str]) -> int:
    """Run each page at ``paths``, the apex alias's page last (it lasts for the process);
    prints one line per page and returns the number of pages that failed."""
    failed = 0
    ordered = sorted(paths, key=lambda p: os.path.basename(p) == "apex-code.md")
    for path in ordered:
        try:
            run_page(parse(path))
            print(f"ok {os.path.relpath(path, ROOT)}", flush=True)
        except Exception:
            failed += 1
            print(f"FAILED {os.path.relpath(path, ROOT)}\n{traceback.format_exc()}", flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(1 if main(sys.argv[1:] or pages()) else 0)
