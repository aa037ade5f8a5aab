"""A repository per conversation: each (uibus session, agent) of an agent with option
`workspace = "worktree"` works in a git repository of its own, made from the repository at its `cwd`.

Why not a `git worktree` of the one repository (as before 0.x): worktrees share the repository's
`.git` — objects, refs, admin folders — so a hostile agent read another tenant's untracked files
out of the shared object store, planted the branch of another session's future conversation, and
left in its admin folder the links uibus then followed as itself. Now each conversation's repository
holds nothing of another's: its own refs, config, index and objects, borrowing only the base
repository's objects read-only (git alternates), so it costs the checked-out files, not a clone's
history. No ref is ever adopted: the repository is made new, with its one branch, by uibus.

* Where: `<workspaces_dir>/sessions/<repository key>/<session key>/<agent>` — keyed by the base
  repository (its real path), so a second project served by the same user with the same session
  names gets workspaces of its own; computed from those alone, so a resumed conversation (after an
  idle close, a restart, on another replica mounting the same volume) finds the same directory.
  Reopening checks that its record names this repository and that the base commit is still in it.
* uibus's own files about a workspace — its record (`<agent>.json`: repository, branch, base) and
  the git directory it stages the workspace into to say what changed (`<agent>.shadow`) — live in
  `<workspaces_dir>/private/...`, which no agent's sandbox shows.
* Every git command on a workspace runs in a box (uibus.agents.gitbox): uibus never acts, as
  itself, on anything an agent can write. Deleting a workspace removes its directory with
  `shutil.rmtree`, which never follows a link.
* Getting the work out is explicit (`export`): the branch, with any uncommitted work committed on
  top, becomes a branch of the base repository — a bundle written in the box, fetched by git into
  the base repository (data only: nothing of the agent's runs). A session deleted with commits
  beyond its base is exported so (`uibus/<session key>/<agent>`), and said; otherwise its work goes.
* Made at the agent's first turn (uibus.domain.agent_sessions), under a lock per base repository
  (an asyncio lock here and an advisory file lock for other processes sharing the volume).
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
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from uibus.agents.gitbox import GIT_TIMEOUT_S, Box, GitError, git
from uibus.agents.safe_files import is_dir, private_dir, read_private, remove_tree, write_new
from uibus.agents.workspace_changes import (
    BUNDLE_BYTES,
    DIFF_BYTES,
    SHA,
    SUMMARY_S,
    TRUNCATED,
    UNREADABLE,
    Changes,
    ExportError,
    FileChange,
    Summary,
)

log = logging.getLogger("uibus.agents.workspaces")

__all__ = ["BUNDLE_BYTES", "DIFF_BYTES", "TRUNCATED", "UNREADABLE", "ExportError", "FileChange", "GitError", "Summary",
           "Workspace", "Workspaces", "borrowed_objects", "repository_of", "session_key"]

SHARED = "shared"
WORKTREE = "worktree"
MODES = (SHARED, WORKTREE)
BRANCH_PREFIX = "uibus/"
KEY_CHARS = 48  # of a session's name kept readable in its key (the hash makes it unique)
LOCK_TIMEOUT_S = 120.0  # waiting for another process making a workspace of the same repository
AGENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")  # an agent's name (uibus.agents.config)


def default_workspaces_dir() -> str:
    """Beside the default store (`$XDG_STATE_HOME/uibus`, else `~/.local/state/uibus`): uibus's state directory."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return str(Path(base) / "uibus" / "workspaces")


def _key(name: str, readable: str = "") -> str:
    """`name` as one path component and ref component: letters, digits, `_` and `-` kept (the rest
    `-`), at most KEY_CHARS of them, then 10 hex digits of its hash, so it is deterministic, unique,
    and a valid ref whatever the name is (`.`, `..`, `.lock`, `@{`, spaces…)."""
    kept = re.sub(r"[^A-Za-z0-9_-]+", "-", readable or name)[:KEY_CHARS].strip("-") or "session"
    return f"{kept}-{hashlib.sha256(name.encode()).hexdigest()[:10]}"


def session_key(session: str) -> str:
    """`session` as one path component and ref component (see `_key`)."""
    return _key(session)


def repository_key(repo: str) -> str:
    """A base repository, by its real path, as one path component (its folder's name, readable)."""
    real = os.path.realpath(repo)
    return _key(real, os.path.basename(real) or "repository")


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


def borrowed_objects(cwd: str) -> tuple[str, ...]:
    """The object directories a conversation's repository of the repository at `cwd` reads (its
    common `objects`, and those its alternates name, transitively): shown read-only to the agent
    and to uibus's box. The operator's repository, read at start-up (blocking is fine)."""
    done = subprocess.run(["git", "rev-parse", "--path-format=absolute", "--git-common-dir"], cwd=cwd,
                          capture_output=True, text=True, timeout=GIT_TIMEOUT_S, check=False, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        return ()
    found: list[str] = []
    todo = [os.path.join(done.stdout.strip(), "objects")]
    while todo and len(found) < 16:
        objects = os.path.realpath(todo.pop())
        if objects in found or not os.path.isdir(objects):
            continue
        found.append(objects)
        with contextlib.suppress(OSError):
            for line in Path(objects, "info", "alternates").read_text().splitlines():
                if line.strip() and not line.startswith("#"):
                    todo.append(os.path.join(objects, line.strip()))
    return tuple(found)


@dataclass(frozen=True)
class Workspace:
    """One (session, agent)'s repository."""

    session: str
    agent: str
    path: str  # the checkout: the agent's cwd
    repo: str  # the base repository's top level (the configured cwd's)
    branch: str
    base: str  # the commit it started from

    def cwd_for(self, cwd: str) -> str:
        """Where in the workspace an agent configured with `cwd` (the repository or a folder in it) works."""
        inner = os.path.relpath(os.path.realpath(cwd), os.path.realpath(self.repo))
        return self.path if inner == "." or inner.startswith("..") else os.path.join(self.path, inner)


@dataclass(frozen=True)
class Removed:
    """What deleting a session's workspaces did."""

    removed: tuple[Workspace, ...]
    kept_branches: tuple[str, ...]  # exported to the base repository: they had commits beyond their base


@dataclass
class Workspaces:
    """The workspaces of every (session, agent) under `root` (the workspaces directory)."""

    root: str
    enabled: bool = False  # some agent has option workspace = "worktree" (else listings look for none)
    bwrap: str = field(default_factory=lambda: shutil.which("bwrap") or "")  # the box; "": git runs plain
    _locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    _listed: dict[str, tuple[float, list[Workspace]]] = field(default_factory=dict)  # session -> its workspaces
    _borrowed: dict[str, tuple[str, ...]] = field(default_factory=dict)  # repo -> its object directories
    created = 0  # workspaces made by this process
    reused = 0  # workspaces found and reopened (a resumed conversation)

    def __post_init__(self) -> None:
        # what an agent changed: summaries, diffs, exports (read in the box, told where things are here)
        self.changes = Changes(self)

    async def summary(self, workspace: Workspace, *, fresh: bool = False) -> Summary:
        """What the agent changed in `workspace` (see Changes.summary)."""
        return await self.changes.summary(workspace, fresh=fresh)

    async def diff(self, workspace: Workspace, limit: int = DIFF_BYTES) -> tuple[Summary, str, bool]:
        """The summary and the unified diff of `workspace`, cut at `limit` bytes (see Changes.diff)."""
        return await self.changes.diff(workspace, limit)

    async def export(self, workspace: Workspace, name: str, *, uncommitted: bool = True) -> str:
        """`workspace` as a new branch `name` of its base repository (see Changes.export)."""
        return await self.changes.export(workspace, name, uncommitted=uncommitted)

    # ---- where things are ----

    def path_of(self, session: str, agent: str, repo: str) -> Path:
        """The agent's checkout (its cwd)."""
        return Path(self.root) / "sessions" / repository_key(repo) / session_key(session) / agent

    def private_of(self, session: str, repo: str) -> Path:
        """uibus's own folder for a session's workspaces of `repo` (records, staging git directories)."""
        return Path(self.root) / "private" / repository_key(repo) / session_key(session)

    def branch_of(self, session: str, agent: str) -> str:
        return f"{BRANCH_PREFIX}{session_key(session)}/{agent}"

    def _record(self, session: str, agent: str, repo: str) -> Path:
        return self.private_of(session, repo) / f"{agent}.json"

    def shadow(self, w: Workspace) -> Path:
        return self.private_of(w.session, w.repo) / f"{w.agent}.shadow"

    def box(self, w: Workspace, *, writable: bool = True) -> Box:
        if not is_dir(Path(w.path)):  # replaced by a link: the box would show what it points at
            raise GitError("the workspace is not a directory any more")
        return Box(self.bwrap, read_only=(w.path, *self._borrowed.get(w.repo, ())),
                   writable=(str(self.shadow(w)),) if writable else ())

    async def objects(self, repo: str) -> tuple[str, ...]:
        found = self._borrowed.get(repo)
        if found is None:
            found = self._borrowed[repo] = await asyncio.to_thread(borrowed_objects, repo)
        return found

    # ---- the lock per repository ----

    @contextlib.asynccontextmanager
    async def locked(self, repo: str) -> Any:
        """This process's lock on `repo`, then a file lock every process sharing the volume takes
        (`flock`, polled without blocking the loop, bounded by LOCK_TIMEOUT_S)."""
        lock = self._locks.setdefault(repo, asyncio.Lock())
        async with lock:
            folder = Path(self.root) / "locks"
            await asyncio.to_thread(private_dir, folder)
            name = hashlib.sha256(repo.encode()).hexdigest()[:16] + ".lock"
            fd = os.open(folder / name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
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

    async def open(self, session: str, agent: str, cwd: str, *, base_branch: str = "") -> Workspace:
        """The repository of (`session`, `agent`) made from the repository at `cwd`: reopened when it
        exists (a resumed conversation), else made new on its own branch from the base's HEAD (or
        from its branch `base_branch`, for cline.WorktreeService's createWorktree)."""
        _, top, _ = await git("rev-parse", "--show-toplevel", cwd=cwd, operator=True)
        repo = top.decode().strip()
        objects = await self.objects(repo)
        path = self.path_of(session, agent, repo)
        record = self._record(session, agent, repo)
        async with self.locked(repo):
            known = await asyncio.to_thread(self._read_record, record)
            # reopened whatever its `.git` now is (the agent's to break): never remade over its work
            if known is not None and await asyncio.to_thread(is_dir, path):
                code, _, _ = await git("cat-file", "-e", f"{known.base}^{{commit}}", cwd=repo, operator=True,
                                       check=False)
                if code != 0:
                    raise GitError(f"the workspace of agent {agent!r} in session {session!r} was made from a "
                                   "commit this repository no longer has; delete the session to start anew")
                self.reused += 1
                log.info("workspace reopened", extra={"fields": {"session": session, "agent": agent,
                                                                 "path": str(path), "branch": known.branch}})
                return known
            branch = self.branch_of(session, agent)
            start = f"refs/heads/{base_branch}^{{commit}}" if base_branch else "HEAD^{commit}"
            _, out, _ = await git("rev-parse", "--verify", "--end-of-options", start, cwd=repo, operator=True)
            base = out.decode().strip()
            await asyncio.to_thread(self._make, path, record.parent, objects)
            await git("init", "-q", "--template=", "-b", branch, str(path), cwd=str(path.parent))
            await asyncio.to_thread(write_new, path / ".git" / "objects" / "info" / "alternates",
                                    "".join(o + "\n" for o in objects))
            await git("update-ref", f"refs/heads/{branch}", base, cwd=str(path))
            await git("reset", "-q", "--hard", cwd=str(path))
            workspace = Workspace(session=session, agent=agent, path=str(path), repo=repo, branch=branch, base=base)
            await asyncio.to_thread(self._write_record, record, workspace)
            self._listed.pop(session, None)
            self.created += 1
            log.info("workspace created", extra={"fields": {"session": session, "agent": agent, "path": str(path),
                                                            "branch": branch, "base": base}})
            return workspace

    @staticmethod
    def _make(path: Path, private: Path, objects: tuple[str, ...]) -> None:
        """A fresh directory for the checkout (anything half made there before is removed, never
        followed) and uibus's private folder beside the others."""
        if not objects:
            raise GitError("the base repository's objects cannot be found")
        if os.path.lexists(path):
            remove_tree(path)
        private_dir(path.parent)
        private_dir(private)
        os.mkdir(path, 0o700)

    def _read_record(self, record: Path) -> Workspace | None:
        """The workspace a record describes, if it is one this directory would make: its path and
        branch are computed again, never taken from the file, so an edited record cannot point a
        delete (which removes the path) anywhere else."""
        try:
            data = json.loads(read_private(record))
            found = Workspace(**{k: str(data[k]) for k in ("session", "agent", "path", "repo", "branch", "base")})
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if not AGENT.fullmatch(found.agent) or record != self._record(found.session, found.agent, found.repo) \
                or found.path != str(self.path_of(found.session, found.agent, found.repo)) \
                or found.branch != self.branch_of(found.session, found.agent) or not SHA.fullmatch(found.base):
            log.warning("workspace record ignored: it does not describe its own place", extra={"fields": {
                "file": str(record)}})
            return None
        return found

    @staticmethod
    def _write_record(record: Path, workspace: Workspace) -> None:
        tmp = record.with_name(record.name + ".tmp")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        write_new(tmp, json.dumps(workspace.__dict__))
        tmp.replace(record)

    def of_session(self, session: str) -> list[Workspace]:
        """The workspaces `session` has (any agent's, of any repository), as their records say
        (blocking: directory reads)."""
        found: list[Workspace] = []
        with contextlib.suppress(OSError):
            for repo_dir in sorted(Path(self.root, "private").iterdir()):
                folder = repo_dir / session_key(session)
                with contextlib.suppress(OSError):
                    for record in sorted(p for p in folder.iterdir() if p.suffix == ".json"):
                        w = self._read_record(record)
                        if w is not None and w.session == session:
                            found.append(w)
        return found

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

    # ---- removing ----

    async def remove(self, w: Workspace, *, keep_commits: bool = True) -> str:
        """Removes one workspace as deleting its session does (cline.WorktreeService's deleteWorktree
        and mergeWorktree): its commits beyond the base are exported first unless `keep_commits` is
        False (they are merged already); returns the base repository's branch they went to, or ""."""
        self._listed.pop(w.session, None)
        branch = await self._remove(w, keep_commits=keep_commits)
        self.changes.forget(w.session, w.agent)
        self._listed.pop(w.session, None)
        log.info("workspace removed", extra={"fields": {"session": w.session, "agent": w.agent,
                                                        "exported_as": branch}})
        return branch

    async def _remove(self, w: Workspace, *, keep_commits: bool = True) -> str:
        """Removes one workspace and uibus's files of it; exports its branch first when it has
        commits beyond the base (returns the base repository's branch then, else "")."""
        kept = ""
        try:
            if keep_commits and await asyncio.to_thread(is_dir, Path(w.path)):
                commits, _ = await self.changes.commits(w)
                if commits:
                    kept = w.branch
                    for n in range(2, 100):
                        try:
                            await self.export(w, kept, uncommitted=False)
                            break
                        except ExportError:
                            kept = f"{w.branch}-{n}"
        except (GitError, OSError, ExportError) as exc:
            kept = ""
            log.warning("workspace removed without exporting its commits: git could not", extra={"fields": {
                "session": w.session, "agent": w.agent, "error": str(exc)}})
        finally:
            await asyncio.to_thread(remove_tree, Path(w.path))
            await asyncio.to_thread(remove_tree, self.shadow(w))
            await asyncio.to_thread(self._record(w.session, w.agent, w.repo).unlink, True)
            private = self.private_of(w.session, w.repo)
            for folder in (Path(w.path).parent, Path(w.path).parent.parent, private, private.parent):
                with contextlib.suppress(OSError):
                    await asyncio.to_thread(folder.rmdir)
        return kept

    async def remove_session(self, session: str) -> Removed:
        """Removes every workspace of `session` (its uncommitted work goes with it; its commits are
        exported to the base repository, and said)."""
        removed: list[Workspace] = []
        kept: list[str] = []
        self._listed.pop(session, None)
        for w in await asyncio.to_thread(self.of_session, session):
            branch = await self.remove(w)
            if branch:
                kept.append(branch)
            removed.append(w)
        self._listed.pop(session, None)
        return Removed(tuple(removed), tuple(kept))


def iter_records(root: str) -> Iterator[Path]:
    """Every workspace record under `root` (for tools and tests)."""
    yield from Path(root, "private").glob("*/*/*.json")
