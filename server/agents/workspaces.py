"""A workspace per conversation: each (uibus session, agent) of an agent with option
`workspace = "worktree"` works in its own `git worktree` of the repository at its `cwd`.

Why: two conversations editing one checkout trample each other's edits, read each other's notes and
land their files in the operator's own checkout. A worktree is the usual answer (Conductor, Cline's
WorktreeService): a directory of its own on a branch of its own, sharing the repository's objects,
so it costs the checked-out files and not a clone.

* Where: `<workspaces_dir>/sessions/<session key>/<agent>`, a path computed from the session and
  agent alone (the session key is the session name made safe for a path and a ref, plus a hash of
  the exact name so two names never share one), so a resumed conversation — after an idle close, a
  restart, on another replica mounting the same volume — finds the same directory and reuses it.
* The branch: `uibus/<session key>/<agent>`: named after the session, one per agent, so two agents
  of one session never share a tree (git allows a branch in one worktree only).
* The base: the commit the repository's HEAD named when the workspace was made, kept beside it in
  `<agent>.json` (with the repository and the branch), so every replica can say what changed
  against it, and a delete knows whether the branch holds commits worth keeping.
* Made at the agent's first turn (uibus.domain.agent_sessions), under a lock per repository (an
  asyncio lock in this process and an advisory file lock beside the workspaces, for the other
  processes sharing the volume): two first turns at once never both run `git worktree add`.
* Gone with its session (uibus.domain.sessions): `git worktree remove --force`, `git worktree
  prune`, and the branch deleted unless it has commits beyond the base (then kept, and said).

Every git command is the real `git`, run without a shell, with arguments made here from the
configured repository and the session's key, never from a request's text; their output is read
bounded. What changed includes uncommitted and untracked work: it is computed through a copy of the
worktree's index (`GIT_INDEX_FILE`), into which `git add -A` stages everything, so the agent's own
index is never touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("uibus.agents.workspaces")

SHARED = "shared"
WORKTREE = "worktree"
MODES = (SHARED, WORKTREE)
BRANCH_PREFIX = "uibus/"
KEY_CHARS = 48  # of a session's name kept readable in its key (the hash makes it unique)
GIT_TIMEOUT_S = 60.0  # one git command; a worktree of a big repository takes seconds to check out
LOCK_TIMEOUT_S = 120.0  # waiting for another process's `git worktree add` in the same repository
DIFF_BYTES = 256 * 1024  # the unified diff a GetWorkspaceDiff carries at most
MAX_FILES = 500  # changed files listed at most
TRUNCATED = "[… diff truncated at {limit} bytes; the rest is in the workspace's branch]\n"
AGENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")  # an agent's name (uibus.agents.config)
SUMMARY_S = 2.0  # a workspace's summary is computed again at most this often (listings re-read it)


def default_workspaces_dir() -> str:
    """Beside the default store (`$XDG_STATE_HOME/uibus`, else `~/.local/state/uibus`): uibus's state directory."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return str(Path(base) / "uibus" / "workspaces")


def session_key(session: str) -> str:
    """`session` as one path component and ref component: letters, digits, `_` and `-` kept (the
    rest `-`), at most KEY_CHARS of them, then 10 hex digits of its hash, so it is deterministic,
    unique, and a valid ref whatever the session's name is (`.`, `..`, `.lock`, `@{`, spaces…)."""
    readable = re.sub(r"[^A-Za-z0-9_-]+", "-", session)[:KEY_CHARS].strip("-") or "session"
    return f"{readable}-{hashlib.sha256(session.encode()).hexdigest()[:10]}"


class GitError(Exception):
    """A git command failed; the message names the command and says git's own words."""


@dataclass(frozen=True)
class Workspace:
    """One (session, agent)'s worktree."""

    session: str
    agent: str
    path: str  # the worktree: the agent's cwd
    repo: str  # the repository's top level (the configured cwd's)
    branch: str
    base: str  # the commit it started from

    def cwd_for(self, cwd: str) -> str:
        """Where in the worktree an agent configured with `cwd` (the repository or a folder in it) works."""
        inner = os.path.relpath(os.path.realpath(cwd), os.path.realpath(self.repo))
        return self.path if inner == "." or inner.startswith("..") else os.path.join(self.path, inner)


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
    error: str = ""  # why it could not be read (the worktree is gone, git failed)


@dataclass(frozen=True)
class Removed:
    """What deleting a session's workspaces did."""

    removed: tuple[Workspace, ...]
    kept_branches: tuple[str, ...]  # branches with commits beyond their base: kept, and said


async def git(*args: str, cwd: str, env: dict[str, str] | None = None, limit: int = 16 * 1024 * 1024,
              check: bool = True) -> tuple[int, bytes, bool]:
    """Runs `git args` in `cwd` (no shell; never a pager, a prompt or an editor); returns (exit code,
    stdout cut at `limit` bytes, whether it was cut). Bounded by GIT_TIMEOUT_S; a cancel kills it."""
    full = {**os.environ, **(env or {}), "GIT_TERMINAL_PROMPT": "0", "GIT_PAGER": "cat", "GIT_EDITOR": "true",
            "LC_ALL": "C"}
    proc = await asyncio.create_subprocess_exec(
        "git", "-c", "core.quotepath=off", "-c", "color.ui=never", *args, cwd=cwd, env=full,
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    cut = False
    try:
        async with asyncio.timeout(GIT_TIMEOUT_S):
            assert proc.stdout is not None and proc.stderr is not None
            err_task = asyncio.ensure_future(proc.stderr.read(64 * 1024))
            out = await proc.stdout.read(limit + 1)
            if len(out) > limit:  # the rest is not wanted: stop it rather than read it
                out, cut = out[:limit], True
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            err = await err_task
            code = await proc.wait()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await asyncio.shield(proc.wait())
        raise
    if check and code != 0 and not cut:
        words = err.decode(errors="replace").strip().splitlines()
        raise GitError(f"git {args[0]} failed (exit {code}): {words[-1] if words else 'no message'}")
    return code, out, cut


def repository_of(cwd: str) -> str:
    """The top level of the git repository at `cwd` (start-up: blocking is fine); ValueError if none."""
    try:
        done = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=cwd, capture_output=True, text=True,
                              timeout=GIT_TIMEOUT_S, check=False, stdin=subprocess.DEVNULL)
    except FileNotFoundError as exc:
        raise ValueError("git is not installed (apt-get install git)") from exc
    if done.returncode != 0:
        raise ValueError(f"{cwd} is not in a git repository ({done.stderr.strip() or 'git rev-parse failed'})")
    return done.stdout.strip()


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


@dataclass
class Workspaces:
    """The workspaces of every (session, agent) under `root` (the workspaces directory)."""

    root: str
    enabled: bool = False  # some agent has option workspace = "worktree" (else listings look for none)
    _locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    _cache: dict[tuple[str, str], _Cached] = field(default_factory=dict)
    _listed: dict[str, tuple[float, list[Workspace]]] = field(default_factory=dict)  # session -> its workspaces
    created = 0  # worktrees made by this process
    reused = 0  # worktrees found and reopened (a resumed conversation)

    def dir_of(self, session: str) -> Path:
        return Path(self.root) / "sessions" / session_key(session)

    def path_of(self, session: str, agent: str) -> Path:
        return self.dir_of(session) / agent

    def branch_of(self, session: str, agent: str) -> str:
        return f"{BRANCH_PREFIX}{session_key(session)}/{agent}"

    # ---- the lock per repository ----

    @contextlib.asynccontextmanager
    async def _locked(self, repo: str) -> Any:
        """This process's lock on `repo`, then a file lock every process sharing the volume takes
        (`flock`, polled without blocking the loop, bounded by LOCK_TIMEOUT_S)."""
        lock = self._locks.setdefault(repo, asyncio.Lock())
        async with lock:
            folder = Path(self.root) / "locks"
            await asyncio.to_thread(folder.mkdir, parents=True, exist_ok=True)
            name = hashlib.sha256(repo.encode()).hexdigest()[:16] + ".lock"
            fd = os.open(folder / name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                deadline = time.monotonic() + LOCK_TIMEOUT_S
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() > deadline:
                            raise GitError(f"the workspaces of {repo} stayed locked for {LOCK_TIMEOUT_S:g} s "
                                           f"({folder / name})") from None
                        await asyncio.sleep(0.05)
                yield
            finally:
                os.close(fd)  # releases the flock

    # ---- making and reopening ----

    async def open(self, session: str, agent: str, cwd: str) -> Workspace:
        """The worktree of (`session`, `agent`) of the repository at `cwd`: reused when it exists
        (a resumed conversation), else made on a new branch from the repository's HEAD."""
        path = self.path_of(session, agent)
        meta = path.with_name(agent + ".json")
        _, top, _ = await git("rev-parse", "--show-toplevel", cwd=cwd)
        repo = top.decode().strip()
        async with self._locked(repo):
            known = await asyncio.to_thread(self._read_meta, meta)
            if known is not None and await asyncio.to_thread((path / ".git").exists):
                self.reused += 1
                log.info("workspace reopened", extra={"fields": {"session": session, "agent": agent,
                                                                 "path": str(path), "branch": known.branch}})
                return known
            branch = self.branch_of(session, agent)
            if await asyncio.to_thread(path.exists):  # half made (a crash mid-add), or not a worktree any more
                await asyncio.to_thread(shutil.rmtree, path, True)
            await git("worktree", "prune", cwd=repo)  # a worktree removed by hand is forgotten first
            await asyncio.to_thread(path.parent.mkdir, parents=True, exist_ok=True)
            code, _, _ = await git("rev-parse", "--verify", "--quiet", f"refs/heads/{branch}", cwd=repo, check=False)
            if code == 0:  # the branch outlived its worktree: its work is picked up again
                base = known.base if known is not None else ""
                if not base:
                    _, out, _ = await git("merge-base", branch, "HEAD", cwd=repo)
                    base = out.decode().strip()
                await git("worktree", "add", str(path), branch, cwd=repo)
            else:
                _, out, _ = await git("rev-parse", "--verify", "HEAD^{commit}", cwd=repo)
                base = out.decode().strip()
                await git("worktree", "add", "-b", branch, str(path), base, cwd=repo)
            workspace = Workspace(session=session, agent=agent, path=str(path), repo=repo, branch=branch, base=base)
            await asyncio.to_thread(self._write_meta, meta, workspace)
            self._listed.pop(session, None)
            self.created += 1
            log.info("workspace created", extra={"fields": {"session": session, "agent": agent, "path": str(path),
                                                            "branch": branch, "base": base}})
            return workspace

    def _read_meta(self, meta: Path) -> Workspace | None:
        """The workspace a `<agent>.json` describes, if it is one this directory would make: its
        session's key, path and branch are computed again, never taken from the file, so an edited
        file cannot point a delete (which removes the path) anywhere else."""
        try:
            data = json.loads(meta.read_text())
            found = Workspace(**{k: str(data[k]) for k in ("session", "agent", "path", "repo", "branch", "base")})
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if not AGENT.fullmatch(found.agent) or meta.name != found.agent + ".json" \
                or meta.parent != self.dir_of(found.session) \
                or found.path != str(self.path_of(found.session, found.agent)) \
                or found.branch != self.branch_of(found.session, found.agent) \
                or not re.fullmatch(r"[0-9a-f]{40,64}", found.base):
            log.warning("workspace file ignored: it does not describe its own place", extra={"fields": {
                "file": str(meta)}})
            return None
        return found

    @staticmethod
    def _write_meta(meta: Path, workspace: Workspace) -> None:
        tmp = meta.with_name(meta.name + ".tmp")
        tmp.write_text(json.dumps(workspace.__dict__))
        tmp.replace(meta)

    def of_session(self, session: str) -> list[Workspace]:
        """The workspaces `session` has (any agent's), as their files say (blocking: a directory read)."""
        folder = self.dir_of(session)
        try:
            metas = sorted(p for p in folder.iterdir() if p.suffix == ".json")
        except OSError:
            return []
        return [w for w in (self._read_meta(m) for m in metas) if w is not None and w.session == session]

    async def workspaces(self, session: str) -> list[Workspace]:
        """`of_session`, cached SUMMARY_S (a listing asks for every session it shows, every second)."""
        cached = self._listed.get(session)
        if cached is not None and time.monotonic() - cached[0] < SUMMARY_S:
            return cached[1]
        found = await asyncio.to_thread(self.of_session, session)
        self._listed[session] = (time.monotonic(), found)
        if len(self._listed) > 4096:
            self._listed.pop(next(iter(self._listed)))
        return found

    # ---- what changed ----

    @contextlib.asynccontextmanager
    async def _staged(self, workspace: Workspace) -> Any:
        """An index holding everything in the worktree (untracked files too, ignored ones not), for
        `git diff --cached <base>`: uibus's own index beside the worktree's in its git directory
        (`uibus-index`, gone with the worktree), made from a copy of the worktree's index and kept,
        so each summary hashes only what changed since the last; the agent's own index is never
        touched. One at a time per workspace here; if another process holds it, a throwaway copy."""
        lock = self._locks.setdefault("index:" + workspace.path, asyncio.Lock())
        async with lock:
            _, out, _ = await git("rev-parse", "--path-format=absolute", "--git-dir", "--git-path", "index",
                                  cwd=workspace.path)
            gitdir, own = [*out.decode().splitlines(), "", ""][:2]
            index = os.path.join(gitdir, "uibus-index")
            folder = ""
            try:
                if not await asyncio.to_thread(os.path.exists, index):
                    with contextlib.suppress(FileNotFoundError):
                        await asyncio.to_thread(shutil.copyfile, own, index)
                code, _, _ = await git("add", "-A", cwd=workspace.path, env={"GIT_INDEX_FILE": index}, check=False)
                if code != 0:  # held by another replica (its lock file), or damaged: a copy of our own
                    folder = await asyncio.to_thread(tempfile.mkdtemp, prefix="uibus-diff-")
                    index = os.path.join(folder, "index")
                    with contextlib.suppress(FileNotFoundError):
                        await asyncio.to_thread(shutil.copyfile, own, index)
                    await git("add", "-A", cwd=workspace.path, env={"GIT_INDEX_FILE": index})
                yield index
            finally:
                if folder:
                    await asyncio.to_thread(shutil.rmtree, folder, True)

    async def summary(self, workspace: Workspace, *, fresh: bool = False) -> Summary:
        """Files changed and lines added/removed against the base, cached SUMMARY_S (every watch
        of the sessions list re-reads it each second); listings asking at once compute it once."""
        key = (workspace.session, workspace.agent)
        started = time.monotonic()
        async with self._locks.setdefault("summary:" + workspace.path, asyncio.Lock()):
            cached = self._cache.get(key)
            if cached is not None and cached.summary.workspace == workspace and \
                    (cached.at >= started or (not fresh and time.monotonic() - cached.at < SUMMARY_S)):
                return cached.summary
            try:
                summary = await self._summary(workspace)
            except (GitError, OSError) as exc:
                summary = Summary(workspace, (), 0, 0, 0, 0, error=str(exc))
            self._cache[key] = _Cached(time.monotonic(), summary)
            if len(self._cache) > 4096:
                self._cache.pop(next(iter(self._cache)))
            return summary

    async def _summary(self, workspace: Workspace) -> Summary:
        if not await asyncio.to_thread(os.path.isdir, workspace.path):
            raise GitError(f"the worktree {workspace.path} is gone")
        async with self._staged(workspace) as index:
            _, out, _ = await git("diff", "--cached", "--numstat", "-z", "--no-renames", "--no-ext-diff",
                                  "--no-textconv", workspace.base, cwd=workspace.path, env={"GIT_INDEX_FILE": index})
        changes = _numstat(out)
        commits = await self._commits(workspace, cwd=workspace.path)
        return Summary(workspace, tuple(changes[:MAX_FILES]), sum(max(c.added, 0) for c in changes),
                       sum(max(c.removed, 0) for c in changes), commits, len(changes))

    async def _commits(self, workspace: Workspace, cwd: str) -> int:
        _, out, _ = await git("rev-list", "--count", f"{workspace.base}..refs/heads/{workspace.branch}", cwd=cwd)
        return int(out.decode().strip() or 0)

    async def diff(self, workspace: Workspace, limit: int = DIFF_BYTES) -> tuple[Summary, str, bool]:
        """The summary and the unified diff against the base, cut at `limit` bytes (with a marker)."""
        summary = await self.summary(workspace, fresh=True)
        if summary.error:
            return summary, "", False
        async with self._staged(workspace) as index:
            _, out, cut = await git("diff", "--cached", "--no-renames", "--no-ext-diff", "--no-textconv",
                                    workspace.base, cwd=workspace.path, env={"GIT_INDEX_FILE": index}, limit=limit)
        text = out.decode(errors="replace")
        if cut:
            text = text[: text.rfind("\n") + 1] + TRUNCATED.format(limit=limit)  # cut at a line's end
        return summary, text, cut

    # ---- removing ----

    async def _remove(self, workspace: Workspace) -> bool:
        """Removes one worktree and its file; False when its branch is kept: it has commits beyond
        the base, or git could not say (the repository moved or broke: kept, to be safe). The
        directory goes whatever git says, so a delete always frees the disk."""
        deleted = False
        try:
            if await asyncio.to_thread(os.path.isdir, workspace.path):
                await git("worktree", "remove", "--force", "--force", workspace.path, cwd=workspace.repo,
                          check=False)
            await git("worktree", "prune", cwd=workspace.repo, check=False)
            code, _, _ = await git("rev-parse", "--verify", "--quiet", f"refs/heads/{workspace.branch}",
                                   cwd=workspace.repo, check=False)
            if code != 0:
                deleted = True  # no branch (deleted by hand): nothing to keep
            elif await self._commits(workspace, cwd=workspace.repo) == 0:
                await git("branch", "-D", workspace.branch, cwd=workspace.repo)
                deleted = True
        except (GitError, OSError) as exc:
            log.warning("workspace branch kept: git could not say whether it has commits", extra={"fields": {
                "session": workspace.session, "agent": workspace.agent, "branch": workspace.branch,
                "error": str(exc)}})
        finally:
            await asyncio.to_thread(shutil.rmtree, workspace.path, True)  # not a worktree any more, half made…
            meta = Path(workspace.path).with_name(workspace.agent + ".json")
            await asyncio.to_thread(meta.unlink, True)
        return deleted

    async def remove_session(self, session: str) -> Removed:
        """Removes every workspace of `session`: the worktree (`--force`: its uncommitted work goes
        with the session), then the branch unless it has commits beyond the base (kept, and said)."""
        removed: list[Workspace] = []
        kept: list[str] = []
        self._listed.pop(session, None)
        for workspace in await asyncio.to_thread(self.of_session, session):
            async with self._locked(workspace.repo):
                if not await self._remove(workspace):
                    kept.append(workspace.branch)
            self._cache.pop((session, workspace.agent), None)
            removed.append(workspace)
            log.info("workspace removed", extra={"fields": {"session": session, "agent": workspace.agent,
                                                            "branch": workspace.branch,
                                                            "branch_kept": workspace.branch in kept}})
        with contextlib.suppress(OSError):
            await asyncio.to_thread(self.dir_of(session).rmdir)
        self._listed.pop(session, None)
        return Removed(tuple(removed), tuple(kept))
