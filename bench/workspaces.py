"""python -m bench.workspaces: what a workspace per conversation (option `workspace = "worktree"`,
uibus.agents.workspaces) costs: the disk a conversation's repository takes, the time to make one
(an agent's first turn waits for it), to reopen one (a resumed conversation), to say what changed in
it (a session listing reads each workspace's summary, cached 2 s) and the diff (GetWorkspaceDiff),
to export its work to a branch of the base repository (`Workspaces.export`), and to remove one
(DeleteSession).

A conversation's repository is a `git init` of its own whose objects borrow the base repository's
(git alternates), checked out at the base's HEAD, under `<root>/sessions/<repo key>/<session key>/
<agent>`; summaries and diffs run git in a bwrap box (when bwrap is installed) into uibus's own
"shadow" git directory in `<root>/private/...` (the agent's config never applies). Disk: `du` of
the checkout including its own .git, of that .git alone, and of uibus's private folder of the
session (the record and the shadow git directory, measured after the diff: the shadow then holds
the blobs of the files written).

The repository is a fresh `git clone` of this one (default; --repo another) in a tmp dir, so the
bench never adds a branch to the repository it runs from. Each round makes the workspace of a new
session through the real `Workspaces.open` (real git), measures it with `du`, writes --files files
of 100 lines into it plus one edit of a tracked file, reads its summary and diff, exports it
(uncommitted work included) to a branch of the clone, reopens it, and removes it. Figures: median
and max of --rounds, in a table or --json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from uibus.agents.workspaces import Workspaces

ROOT = Path(__file__).resolve().parent.parent


def du_kib(path: Path) -> int:
    """Disk used under `path` in KiB (`du -sk`: blocks, so small files count what they take)."""
    return int(subprocess.run(["du", "-sk", str(path)], check=True, capture_output=True, text=True).stdout.split()[0])


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


async def timed(work: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    result = await work
    return (time.perf_counter() - start) * 1000, result


async def run(repo: Path, rounds: int, files: int, tmp: Path) -> dict[str, Any]:
    spaces = Workspaces(str(tmp / "spaces"))
    ms: dict[str, list[float]] = {k: [] for k in ("create", "reopen", "summary_clean", "summary_dirty", "diff",
                                                  "export", "remove")}
    disk: list[int] = []  # the checkout, its own .git included
    own_git: list[int] = []  # that .git alone (index, refs, alternates: objects are borrowed)
    private: list[int] = []  # uibus's private folder of the session (record + shadow git dir), after the diff
    tracked = git(repo, "ls-files").count("\n")
    some_file = next(p for p in git(repo, "ls-files").splitlines() if p.endswith(".py"))
    for i in range(rounds):
        session = f"bench-{i}"
        took, w = await timed(spaces.open(session, "pi", str(repo)))
        ms["create"].append(took)
        assert Path(w.path) == spaces.path_of(session, "pi", w.repo) and (Path(w.path) / ".git").is_dir(), w
        disk.append(du_kib(Path(w.path)))
        own_git.append(du_kib(Path(w.path) / ".git"))
        took, _ = await timed(spaces.summary(w, fresh=True))
        ms["summary_clean"].append(took)
        for n in range(files):
            (Path(w.path) / f"bench_note_{n}.txt").write_text("".join(f"line {k}\n" for k in range(100)))
        with open(Path(w.path) / some_file, "a") as f:
            f.write("# an edit\n")
        took, summary = await timed(spaces.summary(w, fresh=True))
        ms["summary_dirty"].append(took)
        assert summary.files_total == files + 1, summary
        took, (_, text, _) = await timed(spaces.diff(w))
        ms["diff"].append(took)
        assert "# an edit" in text
        private.append(du_kib(spaces.private_of(session, w.repo)))
        took, tip = await timed(spaces.export(w, f"bench/export-{i}"))
        ms["export"].append(took)
        assert git(repo, "rev-parse", f"refs/heads/bench/export-{i}").strip() == tip
        took, again = await timed(spaces.open(session, "pi", str(repo)))
        ms["reopen"].append(took)
        assert again == w
        took, removed = await timed(spaces.remove_session(session))
        ms["remove"].append(took)
        assert not removed.kept_branches and not Path(w.path).exists()
        assert not spaces.private_of(session, w.repo).exists()
    assert git(repo, "branch", "--list", "uibus/*") == ""
    return {
        "repo": str(repo), "tracked_files": tracked, "rounds": rounds, "files_written": files,
        "clone_kib": du_kib(repo), "git_dir_kib": du_kib(repo / ".git"),
        "git_boxed": bool(spaces.bwrap), "checkout_kib": int(statistics.median(disk)),
        "checkout_git_kib": int(statistics.median(own_git)), "private_kib": int(statistics.median(private)),
        "ms": {k: {"median": round(statistics.median(v), 1), "max": round(max(v), 1)} for k, v in ms.items()},
    }


def table(res: dict[str, Any]) -> str:
    lines = [f"repository: {res['repo']} ({res['tracked_files']} tracked files; clone {res['clone_kib']} KiB, of "
             f"which .git {res['git_dir_kib']} KiB)",
             f"a conversation's repository: {res['checkout_kib']} KiB checkout incl. its own .git "
             f"({res['checkout_git_kib']} KiB: index, refs; objects borrowed from the base) + "
             f"{res['private_kib']} KiB private (record, shadow git dir after a diff); "
             f"git {'in a bwrap box' if res['git_boxed'] else 'plain (no bwrap)'}",
             "", "step           | median ms | max ms", "---------------|-----------|-------"]
    for step, v in res["ms"].items():
        lines.append(f"{step:<14} | {v['median']:>9} | {v['max']:>6}")
    return "\n".join(lines)


def measure(source: str, rounds: int, files: int) -> dict[str, Any]:
    """The figures for a fresh clone of `source` (also what `python -m bench.agents --isolation` reports)."""
    with tempfile.TemporaryDirectory(prefix="uibus-bench-ws-") as tmp:
        repo = Path(tmp) / "repo"
        subprocess.run(["git", "clone", "-q", "--no-hardlinks", source, str(repo)], check=True,
                       env={**os.environ, "GIT_TERMINAL_PROMPT": "0"})
        res = asyncio.run(run(repo, max(1, rounds), max(0, files), Path(tmp)))
        res["repo"] = f"a clone of {source}"
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.workspaces", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--repo", default=str(ROOT), help="the repository cloned for the bench (default: this one)")
    p.add_argument("--rounds", type=int, default=5, help="workspaces made, measured and removed (default 5)")
    p.add_argument("--files", type=int, default=20, help="new files of 100 lines written into each (default 20)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    res = measure(args.repo, args.rounds, args.files)
    print(json.dumps(res, indent=2) if args.json else table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
