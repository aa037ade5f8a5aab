"""The git behind Cline's worktree panel (cline.WorktreeService) over uibus's workspaces: reading a
workspace's HEAD, the base repository's branches, checking a branch out in a workspace, merging a
workspace's work into a branch of the base repository, and Cline's `.worktreeinclude` file.

Why here and not in the service: like uibus.agents.workspaces, this is git on two kinds of
repository that must never be confused.

* A conversation's workspace is the agent's: everything in it (config, hooks, attributes, links)
  may have been planted. Every command on it runs in the box (uibus.agents.gitbox), read-only but
  for a checkout, which writes only the workspace itself (the agent's own files, as its own `git
  checkout` would).
* The base repository is the operator's: its commands run unboxed, as uibus's other commands on
  it do, always with hooks off (gitbox's `_SAFE`).

A merge brings the agent's work into the base repository, so it runs nothing the agent wrote: the
work arrives as data (Changes.export: a bundle written in the box, fetched under a ref of uibus's),
the merge is computed by `git merge-tree --write-tree` (no index, no working tree) in a scratch
folder of uibus's, with no configuration but the base repository's own (no global or system file:
nothing an agent's `.gitattributes` could name is defined there), `merge.renormalize=false` (the
only way merge-ort reads the merged trees' `.gitattributes`) and no attributes file; the target
branch moves only when the merge is clean. When the target is checked out in a working tree of the
base repository, that checkout is fast-forwarded to the merge (it must be clean, as Cline asks),
with the same configuration.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from uibus.agents.gitbox import Box, GitError, git
from uibus.agents.safe_files import is_dir
from uibus.agents.workspace_changes import EXPORTER, SHA, ExportError
from uibus.agents.workspaces import Workspace, Workspaces, session_key

log = logging.getLogger("uibus.agents.worktree_ops")

INCLUDE = ".worktreeinclude"  # Cline's list of ignored files copied into new worktrees
MAX_INCLUDE_BYTES = 64 * 1024  # a .worktreeinclude createWorktreeInclude writes at most
MAX_GITIGNORE_BYTES = 256 * 1024  # of .gitignore getWorktreeIncludeStatus returns at most
MAX_BRANCHES = 1000  # branches getAvailableBranches lists at most (of each kind)
MERGE_REFS = "refs/uibus/merge/"  # where a merge fetches a workspace's work (never a branch)
# A merge's git (besides gitbox's: hooks off, no global or system configuration): no attributes
# file, no renormalization (which would read the merged trees' .gitattributes), no rerere, and no
# `gc --auto` started by it.
_MERGE = ("-c", "merge.renormalize=false", "-c", "core.attributesFile=/dev/null", "-c", "rerere.enabled=false",
          "-c", "merge.conflictStyle=merge", "-c", "gc.auto=0", "-c", "maintenance.auto=false")


@dataclass(frozen=True)
class Head:
    """Where a repository's HEAD is."""

    branch: str  # "" when detached
    commit: str  # "" when it has none


@dataclass(frozen=True)
class Branches:
    local: tuple[str, ...]
    remote: tuple[str, ...]
    current: str


@dataclass(frozen=True)
class Merged:
    """What a merge did: `ok` (the target moved, or already had the work), else why not, and the
    conflicting files when that is why."""

    ok: bool
    message: str
    conflicts: tuple[str, ...] = ()
    commit: str = ""


class NoBranch(GitError):
    """Neither the workspace nor its base repository has the branch asked for."""


class MergeRefused(Exception):
    """A merge that cannot be attempted as asked; `kind`: "target" (no such branch)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


# ---- the base repository (the operator's: unboxed, hooks off) ----


async def toplevel(cwd: str) -> str:
    """The top level of the base repository at `cwd` (an agent's configured cwd may be a folder in it)."""
    _, out, _ = await git("rev-parse", "--show-toplevel", cwd=cwd, operator=True)
    return out.decode().strip()


async def base_head(repo: str) -> Head:
    code, out, _ = await git("symbolic-ref", "-q", "--short", "HEAD", cwd=repo, operator=True, check=False)
    branch = out.decode().strip() if code == 0 else ""
    code, out, _ = await git("rev-parse", "--verify", "-q", "HEAD^{commit}", cwd=repo, operator=True, check=False)
    return Head(branch, out.decode().strip() if code == 0 else "")


async def is_branch_name(repo: str, name: str) -> bool:
    """Whether `name` is a valid branch name (as git says; never an option)."""
    if not name or name.startswith("-"):
        return False
    code, out, _ = await git("check-ref-format", "--branch", name, cwd=repo, operator=True, check=False)
    return code == 0 and out.decode().strip() == name


async def branch_commit(repo: str, name: str) -> str:
    """The commit branch `name` of `repo` points at, "" when it has no such branch."""
    code, out, _ = await git("rev-parse", "--verify", "-q", "--end-of-options", f"refs/heads/{name}^{{commit}}",
                             cwd=repo, operator=True, check=False)
    sha = out.decode().strip()
    return sha if code == 0 and SHA.fullmatch(sha) else ""


async def branches(repo: str) -> Branches:
    """The base repository's local and remote-tracking branches (remote HEAD links left out) and
    the branch its checkout is on."""
    _, out, _ = await git("for-each-ref", f"--count={MAX_BRANCHES}", "--format=%(refname:short)", "refs/heads",
                          cwd=repo, operator=True)
    local = tuple(line for line in out.decode(errors="replace").splitlines() if line)
    _, out, _ = await git("for-each-ref", f"--count={MAX_BRANCHES}", "--format=%(refname:short)", "refs/remotes",
                          cwd=repo, operator=True)
    remote = tuple(line for line in out.decode(errors="replace").splitlines()
                   if line and not line.endswith("/HEAD"))
    return Branches(local, remote, (await base_head(repo)).branch)


async def merged_in_base(repo: str, commit: str) -> bool:
    """Whether some branch of the base repository contains `commit` (its work is merged)."""
    if not SHA.fullmatch(commit):
        return False
    code, out, _ = await git("for-each-ref", "--count=1", f"--contains={commit}", "--format=%(refname)", "refs/heads",
                             cwd=repo, operator=True, check=False)
    return code == 0 and bool(out.strip())


async def checked_out_at(repo: str, branch: str) -> str:
    """The working tree of the base repository that has `branch` checked out, "" when none has."""
    _, out, _ = await git("worktree", "list", "--porcelain", cwd=repo, operator=True)
    path = ""
    for line in out.decode(errors="replace").splitlines():
        if line.startswith("worktree "):
            path = line[len("worktree "):]
        elif line == f"branch refs/heads/{branch}":
            return path
    return ""


# ---- a conversation's workspace (the agent's: boxed) ----


async def head_of(spaces: Workspaces, w: Workspace) -> Head:
    """The workspace's HEAD as its repository says, read in the box (read-only)."""
    box = spaces.box(w, writable=False)
    gitdir = f"--git-dir={os.path.join(w.path, '.git')}"
    code, out, _ = await git(gitdir, "symbolic-ref", "-q", "HEAD", cwd=w.path, box=box, check=False)
    ref = out.decode(errors="replace").strip()
    branch = ref[len("refs/heads/"):] if code == 0 and ref.startswith("refs/heads/") else ""
    code, out, _ = await git(gitdir, "rev-parse", "--verify", "-q", "HEAD^{commit}", cwd=w.path, box=box, check=False)
    commit = out.decode().strip()
    return Head(branch, commit if code == 0 and SHA.fullmatch(commit) else "")


async def checkout(spaces: Workspaces, w: Workspace, branch: str) -> str:
    """Checks out `branch` (a valid branch name, checked by the caller) in the workspace, in the box
    with the workspace writable: the workspace's own branch, or else a branch of the base repository,
    made in the workspace at the base's commit (the workspace borrows the base's objects). Returns
    the commit checked out; GitError when git could not (local changes in the way, no such branch)."""
    if not is_dir(Path(w.path)):
        raise GitError("the workspace is not a directory any more")
    box = Box(spaces.bwrap, read_only=await spaces.objects(w.repo), writable=(w.path,))
    code, _, _ = await git("rev-parse", "--verify", "-q", "--end-of-options", f"refs/heads/{branch}^{{commit}}",
                           cwd=w.path, box=box, check=False)
    if code == 0:
        await git("switch", "-q", "--no-guess", branch, cwd=w.path, box=box)
    else:
        start = await branch_commit(w.repo, branch)
        if not start:
            raise NoBranch(f"no branch {branch!r} in the worktree or its base repository")
        await git("switch", "-q", "--no-guess", "-c", branch, start, cwd=w.path, box=box)
    return (await head_of(spaces, w)).commit


# ---- merging a workspace into the base repository ----


async def merge(spaces: Workspaces, w: Workspace, target: str) -> Merged:
    """Merges the workspace's branch into branch `target` of the base repository without running
    anything of the agent's (see the module docstring). MergeRefused when there is no such target."""
    old = await branch_commit(w.repo, target)
    if not old:
        raise MergeRefused(f"the base repository has no branch {target!r}", "target")
    if await spaces.changes.uncommitted(w):
        return Merged(False, "Worktree has uncommitted changes. Please commit them first "
                             "(uibus merges the workspace's branch, commits only).")
    name = f"{session_key(w.session)}/{w.agent}-{uuid.uuid4().hex[:12]}"
    try:
        source = await spaces.changes.export(w, name, uncommitted=False, into=MERGE_REFS)
    except ExportError as exc:
        if exc.kind == "empty":
            return Merged(False, f"Nothing to merge: '{w.branch}' has no commits beyond the commit it started from.")
        raise GitError(str(exc)) from exc
    try:
        async with spaces.locked(w.repo):
            old = await branch_commit(w.repo, target)  # again, now that nothing else moves it
            if not old:
                raise MergeRefused(f"the base repository has no branch {target!r}", "target")
            return await _merge_into(w, target, old, source)
    finally:
        await git("update-ref", "-d", f"{MERGE_REFS}{name}", cwd=w.repo, operator=True, check=False)


async def _is_ancestor(repo: str, a: str, b: str) -> bool:
    code, _, _ = await git("merge-base", "--is-ancestor", a, b, cwd=repo, check=False)
    return code == 0


async def _merge_into(w: Workspace, target: str, old: str, source: str) -> Merged:
    """The merge itself, under the base repository's lock: computed apart from any working tree,
    then the target moved (or its checkout fast-forwarded) only when clean."""
    repo = w.repo
    if await _is_ancestor(repo, source, old):
        return Merged(True, f"'{target}' already contains '{w.branch}'", commit=old)
    if await _is_ancestor(repo, old, source):
        new = source  # a fast-forward, as `git merge` does
    else:
        _, out, _ = await git("rev-parse", "--path-format=absolute", "--git-common-dir", cwd=repo, operator=True)
        gitdir = out.decode().strip()
        with tempfile.TemporaryDirectory(prefix="uibus-merge-") as scratch:  # no attributes, no checkout here
            code, out, _ = await git(f"--git-dir={gitdir}", f"--work-tree={scratch}", *_MERGE, "merge-tree",
                                     "--write-tree", "-z", "--name-only", "--no-messages", old, source,
                                     cwd=scratch, check=False)
        fields = [f.decode(errors="replace") for f in out.split(b"\0") if f]
        if code == 1:
            conflicts = tuple(dict.fromkeys(fields[1:]))
            return Merged(False, f"Merge conflict detected. {len(conflicts)} file(s) have conflicts.", conflicts)
        if code != 0 or not fields or not SHA.fullmatch(fields[0]):
            raise GitError(f"git merge-tree failed (exit {code})")
        _, made, _ = await git("commit-tree", fields[0], "-p", old, "-p", source, "-m",
                               f"Merge branch '{w.branch}' into {target}", cwd=repo, env=EXPORTER)
        new = made.decode().strip()
    at = await checked_out_at(repo, target)
    if at:
        _, dirty, _ = await git("status", "--porcelain", "--untracked-files=no", cwd=at)
        if dirty.strip():
            return Merged(False, f"Target worktree ({target}) has uncommitted changes. Please commit or stash "
                                 "them first.")
        await git(*_MERGE, "merge", "-q", "--ff-only", new, cwd=at)
    else:
        await git("update-ref", "-m", f"uibus: merge {w.branch}", f"refs/heads/{target}", new, old, cwd=repo)
    log.info("workspace merged", extra={"fields": {"session": w.session, "agent": w.agent, "target": target,
                                                   "commit": new, "checkout": at}})
    return Merged(True, f"Successfully merged '{w.branch}' into '{target}'", commit=new)


# ---- Cline's .worktreeinclude (in the base repository) ----


def _read_nofollow(path: Path, limit: int) -> str | None:
    """A regular file's text (its first `limit` bytes), None when there is none (or it is a link,
    a folder, a FIFO)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return f.read(limit).decode(errors="replace")


def include_status(repo: str) -> tuple[bool, bool, str]:
    """(`.worktreeinclude` exists, `.gitignore` exists, its text) at the base repository's top
    level, as Cline's getWorktreeIncludeStatus reads them (blocking: file reads)."""
    exists = os.path.lexists(os.path.join(repo, INCLUDE))
    ignored = _read_nofollow(Path(repo, ".gitignore"), MAX_GITIGNORE_BYTES)
    return exists, ignored is not None, ignored or ""


def write_include(repo: str, content: str) -> None:
    """Writes `.worktreeinclude` at the base repository's top level (replacing it, as Cline does;
    never through a link). The caller bounds `content` (blocking: a file write)."""
    fd = os.open(os.path.join(repo, INCLUDE), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(content)


async def read_include(repo: str) -> tuple[bool, bool, str]:
    return await asyncio.to_thread(include_status, repo)


async def save_include(repo: str, content: str) -> None:
    await asyncio.to_thread(write_include, repo, content)
