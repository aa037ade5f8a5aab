"""What an agent did in its workspace, read from outside without trusting anything in it, and how
its work gets out: the `Changes` half of uibus.agents.workspaces.Workspaces.

Why apart: making, reopening and removing a conversation's repository acts on folders uibus made
and the operator's base repository; everything here reads what the agent wrote, so every git
command runs in the box (uibus.agents.gitbox) and stages into uibus's own git directory (the
workspace's "shadow", in uibus's private folder), whose configuration is uibus's: no filter, diff
driver, hook or fsmonitor of the agent's can run. Errors that reach a UI say that git could not
read the workspace, never git's words (they may quote the agent's files, or name host paths):
those go to the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from uibus.agents.gitbox import Box, GitError, git
from uibus.agents.safe_files import is_dir, private_dir, write_bytes_new, write_new


class Workspace(Protocol):
    """What this half needs of a workspace (uibus.agents.workspaces.Workspace is one)."""

    @property
    def session(self) -> str: ...
    @property
    def agent(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def repo(self) -> str: ...
    @property
    def branch(self) -> str: ...
    @property
    def base(self) -> str: ...

log = logging.getLogger("uibus.agents.workspaces")

SHA = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")

DIFF_BYTES = 256 * 1024  # the unified diff a GetWorkspaceDiff carries at most
BUNDLE_BYTES = 1024 ** 3  # an export's bundle at most
MAX_FILES = 500  # changed files listed at most
TRUNCATED = "[… diff truncated at {limit} bytes; the rest is in the workspace's branch]\n"
STAGE_LIST_BYTES = 8 << 20  # the changed paths one staging lists at most (past it: `add -A` of all)
PRUNE_EVERY = 64  # stagings of a workspace between two prunes of uibus's git directory for it
ERROR_S = 30.0  # an unreadable workspace's summary is computed again at most this often
SUMMARY_S = 2.0  # a workspace's summary is computed again at most this often (listings re-read it)
EXPORTER = {"GIT_AUTHOR_NAME": "uibus", "GIT_AUTHOR_EMAIL": "uibus@localhost", "GIT_COMMITTER_NAME": "uibus",
            "GIT_COMMITTER_EMAIL": "uibus@localhost"}
UNREADABLE = "git could not read this workspace (the server log says why)"

@dataclass(frozen=True)
class FileChange:
    path: str
    added: int  # -1: binary
    removed: int


@dataclass(frozen=True)
class Summary:
    """What changed in a workspace against its base (uncommitted and untracked work included)."""

    workspace: Workspace
    files: tuple[FileChange, ...]
    added: int
    removed: int
    commits: int  # on the branch beyond the base
    files_total: int  # files changed; `files` lists at most MAX_FILES of them
    error: str = ""  # why it could not be read: never a file's bytes nor a host path (those go to the log)


class ExportError(Exception):
    """An export that cannot be done as asked (the message says why, for the caller); `kind`:
    "name" (no branch name), "taken" (the base repository has it), "empty" (no work to export)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


def _numstat(raw: bytes) -> list[FileChange]:
    """`git diff --numstat -z`: `added\\tremoved\\tpath\\0`, or for a rename `added\\tremoved\\t\\0old\\0new\\0`."""
    parts = raw.split(b"\0")
    changes: list[FileChange] = []
    i = 0
    while i < len(parts):
        head = parts[i]
        i += 1
        if not head:
            continue
        fields = head.split(b"\t", 2)
        if len(fields) < 3:
            continue
        added, removed, path = fields
        if not path:  # a rename: the old and new paths follow
            path = parts[i + 1] if i + 1 < len(parts) else b""
            i += 2
        binary = added == b"-"
        changes.append(FileChange(path.decode(errors="replace"), -1 if binary else int(added),
                                  -1 if binary else int(removed)))
    return changes


@dataclass
class _Cached:
    at: float
    summary: Summary


class Places(Protocol):
    """Where things are, as the workspaces say (uibus.agents.workspaces.Workspaces)."""

    def shadow(self, w: Workspace) -> Path:
        """uibus's own git directory for `w` (in its private folder)."""
        ...

    def box(self, w: Workspace, *, writable: bool = True) -> Box:
        """The box git runs in for `w`: its checkout read-only, its shadow writable."""
        ...

    def locked(self, repo: str) -> contextlib.AbstractAsyncContextManager[None]:
        """A lock by name, in this process and across the processes sharing the folder (the base
        repository's, for exports; a workspace's staging)."""
        ...

    async def objects(self, repo: str) -> tuple[str, ...]:
        """The base repository's object directories."""
        ...


class Changes:
    """Summaries, diffs and exports of workspaces: their own job (reading what an agent changed,
    boxed), apart from making and removing workspaces; handed where things are when built."""

    def __init__(self, places: Places) -> None:
        self.places = places
        self._locks: dict[str, asyncio.Lock] = {}  # a workspace's shadow being made, its summary being read
        self._cache: dict[tuple[str, str], _Cached] = {}  # (session, agent) -> its last summary
        self._staged_count: dict[str, int] = {}  # workspace path -> stagings (a prune every PRUNE_EVERY)

    def forget(self, session: str, agent: str) -> None:
        """Drops the summary kept of a removed workspace."""
        self._cache.pop((session, agent), None)

    # ---- what changed (in the box) ----

    async def _shadow_git(self, w: Workspace, *args: str, env: dict[str, str] | None = None, limit: int = 16 << 20,
                          out_fd: int | None = None, check: bool = True) -> tuple[int, bytes, bool]:
        """git on uibus's own git directory for `w`, with `w`'s checkout as its work tree, boxed."""
        shadow = await self._made_shadow(w)
        return await git(f"--git-dir={shadow}", f"--work-tree={w.path}", *args, cwd=w.path, env=env, limit=limit,
                         box=self.places.box(w), out_fd=out_fd, check=check)

    async def _made_shadow(self, w: Workspace) -> Path:
        """uibus's git directory for `w`, made at first need (in uibus's private folder, by uibus:
        nothing of the agent's in it but the objects it borrows); the base's object directories
        known, for the box to show (after a restart too)."""
        borrowed = await self.places.objects(w.repo)
        shadow = self.places.shadow(w)
        async with self._locks.setdefault("shadow:" + w.path, asyncio.Lock()):
            if not await asyncio.to_thread(is_dir, shadow / "objects"):
                await asyncio.to_thread(private_dir, shadow.parent)
                await git("init", "-q", "--bare", "--template=", str(shadow), cwd=str(shadow.parent))
                with contextlib.suppress(FileExistsError):  # made by another replica at the same moment
                    await asyncio.to_thread(write_new, shadow / "objects" / "info" / "alternates",
                                            "".join(o + "\n" for o in (*borrowed, os.path.join(w.path, ".git",
                                                                                               "objects"))))
                await git(f"--git-dir={shadow}", "config", "core.bare", "false", cwd=str(shadow.parent))
                # the index starts as the base's tree, refreshed against the checkout: `add -A` then
                # hashes only what differs. (Hashed from scratch, git writes a copy of every blob it
                # finds in the base's read-only objects, failing to touch them: 3 MiB a workspace.)
                await git(f"--git-dir={shadow}", f"--work-tree={w.path}", "read-tree", w.base, cwd=w.path,
                          box=self.places.box(w))
                await git(f"--git-dir={shadow}", f"--work-tree={w.path}", "update-index", "-q", "--refresh",
                          cwd=w.path, box=self.places.box(w), check=False)
        return shadow

    @contextlib.asynccontextmanager
    async def _staged(self, w: Workspace) -> Any:
        """uibus's git directory for `w` with everything in the checkout staged (untracked files
        too, ignored ones not): its index is uibus's and kept, so each summary hashes only what
        changed since the last. One at a time per workspace."""
        # one staging at a time per workspace, across the replicas sharing the folder too (git's
        # index.lock would fail the other, and a failure is not read again for ERROR_S)
        async with self.places.locked("stage:" + w.path):
            await self._stage(w)
            staged = self._staged_count[w.path] = self._staged_count.get(w.path, 0) + 1
            if staged % PRUNE_EVERY == 0:  # versions of files staged before and changed since
                await self._shadow_git(w, "prune", "--expire=now")
            yield

    async def _stage(self, w: Workspace) -> None:
        """`git add -A` of what differs from uibus's index only. Why not `add -A` alone: a file git
        cannot trust by its stat (one written in the same second as the index: "racily clean")
        would be hashed and written again, and a blob the base already has is then copied into
        uibus's git directory (the base's objects are read-only in the box, so git cannot touch
        them as it would): a copy of the whole checkout at a workspace's first summary."""
        await self._shadow_git(w, "update-index", "-q", "--refresh", check=False)
        _, out, cut = await self._shadow_git(w, "ls-files", "-z", "-m", "-o", "-d", "--exclude-standard",
                                             limit=STAGE_LIST_BYTES)
        paths = sorted({p for p in out.split(b"\0") if p})
        if cut:  # more than a listing should hold: everything, as plain `add -A` does
            await self._shadow_git(w, "add", "-A")
            return
        if not paths:
            return
        spec = self.places.shadow(w) / "uibus-pathspec"
        await asyncio.to_thread(spec.unlink, True)
        await asyncio.to_thread(write_bytes_new, spec, b"\0".join(paths) + b"\0")
        try:
            await self._shadow_git(w, "add", "-A", f"--pathspec-from-file={spec}", "--pathspec-file-nul",
                                   env={"GIT_LITERAL_PATHSPECS": "1"})
        finally:
            await asyncio.to_thread(spec.unlink, True)

    async def commits(self, w: Workspace) -> tuple[int, str]:
        """The commits on the workspace's branch beyond its base, and the branch's tip (the base
        when the agent deleted its branch): read from the agent's repository, in the box."""
        await self._made_shadow(w)
        code, out, _ = await git(f"--git-dir={os.path.join(w.path, '.git')}", "rev-parse", "--verify", "-q",
                                 f"refs/heads/{w.branch}^{{commit}}", cwd=w.path,
                                 box=self.places.box(w, writable=False), check=False)
        tip = out.decode().strip()
        if code != 0 or not SHA.fullmatch(tip):
            return 0, w.base
        _, out, _ = await self._shadow_git(w, "rev-list", "--count", f"{w.base}..{tip}")
        return int(out.decode().strip() or 0), tip

    async def summary(self, workspace: Workspace, *, fresh: bool = False) -> Summary:
        """Files changed and lines added/removed against the base, cached SUMMARY_S (every watch
        of the sessions list re-reads it each second); listings asking at once compute it once."""
        return (await self._read(workspace, fresh=fresh))[0]

    async def diff(self, workspace: Workspace, limit: int = DIFF_BYTES) -> tuple[Summary, str, bool]:
        """The summary and the unified diff against the base, cut at `limit` bytes (with a marker),
        read afresh from one staging."""
        return await self._read(workspace, fresh=True, diff_limit=limit)

    async def _read(self, w: Workspace, *, fresh: bool, diff_limit: int | None = None) -> tuple[Summary, str, bool]:
        """The summary (cached, or read afresh with the diff when `diff_limit` is set), the diff's
        text and whether it was cut. An unreadable workspace (a huge file git gave up hashing, a
        broken repository) is read again only after ERROR_S, fresh or not: one tenant's workspace
        cannot keep the host's git busy."""
        key = (w.session, w.agent)
        started = time.monotonic()
        async with self._locks.setdefault("summary:" + w.path, asyncio.Lock()):
            cached = self._cache.get(key)
            if cached is not None and cached.summary.workspace == w and (
                    cached.at >= started or (diff_limit is None and not fresh
                                             and time.monotonic() - cached.at < SUMMARY_S)):
                if diff_limit is None or cached.summary.error:  # what was just read (or a backed-off error)
                    return cached.summary, "", False
            try:
                summary, text, cut = await self._compute(w, diff_limit)
            except (GitError, OSError, ValueError) as exc:
                log.warning("workspace unreadable", extra={"fields": {
                    "session": w.session, "agent": w.agent, "error": str(exc)}})
                summary, text, cut = Summary(w, (), 0, 0, 0, 0, error=UNREADABLE), "", False
            self._cache[key] = _Cached(time.monotonic() + (ERROR_S - SUMMARY_S if summary.error else 0), summary)
            if len(self._cache) > 4096:
                self._cache.pop(next(iter(self._cache)))
            return summary, text, cut

    async def _compute(self, w: Workspace, diff_limit: int | None) -> tuple[Summary, str, bool]:
        if not await asyncio.to_thread(is_dir, Path(w.path)):
            raise GitError(f"the workspace {w.path} is gone")
        against = ("--cached", "--no-renames", "--no-ext-diff", "--no-textconv", w.base)
        text, cut = "", False
        async with self._staged(w):
            _, out, _ = await self._shadow_git(w, "diff", "--numstat", "-z", *against)
            if diff_limit is not None:
                _, raw, cut = await self._shadow_git(w, "diff", *against, limit=diff_limit)
                text = raw.decode(errors="replace")
                if cut:
                    text = text[: text.rfind("\n") + 1] + TRUNCATED.format(limit=diff_limit)  # at a line's end
        changes = _numstat(out)
        commits, _ = await self.commits(w)
        summary = Summary(w, tuple(changes[:MAX_FILES]), sum(max(c.added, 0) for c in changes),
                          sum(max(c.removed, 0) for c in changes), commits, len(changes))
        return summary, text, cut

    # ---- getting the work out ----

    async def uncommitted(self, w: Workspace) -> bool:
        """Whether the checkout holds work not committed on the workspace's branch (staged into
        uibus's own git directory, boxed, as `export` stages it)."""
        async with self._staged(w):
            _, tip = await self.commits(w)
            _, tree, _ = await self._shadow_git(w, "write-tree")
            _, head_tree, _ = await self._shadow_git(w, "rev-parse", f"{tip}^{{tree}}")
            return tree.strip() != head_tree.strip()

    async def export(self, w: Workspace, name: str, *, uncommitted: bool = True, into: str = "refs/heads/") -> str:
        """Makes branch `name` of the base repository hold the workspace's work: its branch and, with
        `uncommitted`, a commit of everything else in the checkout on top. Returns the commit.
        ExportError when `name` is no branch name, is taken, or there is nothing to export. `into`:
        the refs it is made under (a merge fetches the work under a ref of uibus's, not a branch)."""
        code, out, _ = await git("check-ref-format", "--branch", name, cwd=w.repo, operator=True, check=False)
        if code != 0 or out.decode().strip() != name or name.startswith("-"):
            raise ExportError(f"{name!r} is not a valid branch name", "name")
        async with self.places.locked(w.repo):
            code, _, _ = await git("rev-parse", "--verify", "-q", f"{into}{name}", cwd=w.repo, operator=True,
                                   check=False)
            if code == 0:
                raise ExportError(f"the base repository has a branch {name!r} already; choose another name", "taken")
            async with self._staged(w):
                _, tip = await self.commits(w)
                if uncommitted:
                    _, tree, _ = await self._shadow_git(w, "write-tree")
                    _, head_tree, _ = await self._shadow_git(w, "rev-parse", f"{tip}^{{tree}}")
                    if tree.strip() != head_tree.strip():
                        _, made, _ = await self._shadow_git(
                            w, "commit-tree", tree.decode().strip(), "-p", tip, "-m",
                            f"Uncommitted work of agent {w.agent} in session {w.session}", env=EXPORTER)
                        tip = made.decode().strip()
                if not SHA.fullmatch(tip) or tip == w.base:
                    raise ExportError("nothing to export: the workspace holds no work beyond its base", "empty")
                await self._shadow_git(w, "update-ref", "refs/heads/export", tip)
                bundle = self.places.shadow(w).with_name(f"{w.agent}.bundle")
                with contextlib.suppress(FileNotFoundError):
                    await asyncio.to_thread(bundle.unlink)
                fd = os.open(bundle, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                try:
                    _, _, cut = await self._shadow_git(w, "bundle", "create", "-q", "-", "refs/heads/export",
                                                       f"^{w.base}", limit=BUNDLE_BYTES, out_fd=fd)
                finally:
                    os.close(fd)
                try:
                    if cut:
                        raise ExportError(f"the export is larger than {BUNDLE_BYTES >> 20} MiB", "empty")
                    await git("-c", "transfer.fsckObjects=true", "fetch", "-q", "--no-tags", "--no-write-fetch-head",
                              str(bundle), f"refs/heads/export:{into}{name}", cwd=w.repo, operator=True)
                finally:
                    await asyncio.to_thread(bundle.unlink, True)
        log.info("workspace exported", extra={"fields": {"session": w.session, "agent": w.agent, "branch": name,
                                                         "commit": tip}})
        return tip

