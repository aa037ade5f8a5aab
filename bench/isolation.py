"""python -m bench.agents --isolation: what agents' isolation costs a hosted agent, in one run —
what `sandbox = true` adds to an agent's start and to a turn (bench.sandbox: bubblewrap around the
real pi on a scripted model, plain against sandboxed) and the disk and time a workspace per
conversation costs (bench.workspaces: a git worktree of a fresh clone of this repository).

It only runs the two benches' own measurements and prints them together (each also runs alone:
`python -m bench.sandbox`, `python -m bench.workspaces`), so the figures mean exactly what those
modules' docstrings say. Targets: at most 100 ms more to start, turns unchanged within
noise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from bench import sandbox, workspaces


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.agents --isolation", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--isolation", action="store_true", help="(this bench)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 2 sessions a side, 1 later turn, 1 worktree")
    p.add_argument("--n", type=int, help="pi sessions per side for the sandbox figures (default 8)")
    p.add_argument("--turns", type=int, help="later turns per session (default 3)")
    p.add_argument("--rounds", type=int, help="worktrees made, measured and removed (default 5)")
    p.add_argument("--repo", default=str(workspaces.ROOT), help="the repository cloned for the worktrees")
    p.add_argument("--json", metavar="PATH", help="write every figure to PATH")
    a = p.parse_args(argv)
    n = a.n or (2 if a.quick else 8)
    turns = a.turns if a.turns is not None else (1 if a.quick else 3)
    rounds = a.rounds or (1 if a.quick else 5)
    out: dict[str, Any] = {}
    print("== sandbox = true (bubblewrap): what it adds to an agent's start and to a turn ==")
    if shutil.which("bwrap") is None:
        print("skipped: bwrap is not installed (apt-get install bubblewrap, or .ci/setup --system)")
    else:
        res = asyncio.run(sandbox.run(max(1, min(n, 50)), max(0, min(turns, 20))))
        print(sandbox.report(res))
        out["sandbox"] = sandbox.figures(res)
    print("\n== workspace = \"worktree\": the disk and time of a worktree per conversation ==")
    ws = workspaces.measure(a.repo, rounds, 20)
    print(workspaces.table(ws))
    out["workspaces"] = ws
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
