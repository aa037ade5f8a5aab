"""cline.WorktreeService: Cline's worktree panel (upstream `apps/vscode/proto/cline/worktree.proto`,
served unmodified) over uibus's workspaces (uibus.agents.workspaces; docs/protocols/cline.md).

Cline lists and makes `git worktree`s of the folder its editor has open. In uibus the worktrees of a
session are its conversations' workspaces: each agent with option `workspace = "worktree"` gets a
repository of its own per session, made from its base repository (its configured `cwd`), so:

* the call's session comes from its metadata (`x-uibus-session`, as every Cline service); the
  conversation it is about ("the current worktree") is the agent the metadata key `x-uibus-agent`
  names, else the session's only workspace's agent, else the only agent configured with a
  workspace, else the default agent;
* the base repository is listed as the main worktree, the session's workspaces of it after it;
* uibus owns where a workspace lives and what its branch is called (`uibus/<session key>/<agent>`):
  createWorktree refuses another path or branch (INVALID_ARGUMENT saying which one it takes) rather
  than make the workspace somewhere the webview did not ask for;
* deleting a worktree removes its workspace as DeleteSession does (its commits kept as a branch of
  the base repository, unless they are merged and the branch is asked to go);
* merging runs nothing the agent wrote (uibus.agents.worktree_ops says how); conflicts are answered
  in the reply, as Cline answers them; switching asks the session's host to open the folder (a
  host request, as openUrl); `.worktreeinclude` is read and written in the base repository;
* a wrong call gets a status saying what was wrong (NOT_FOUND for a worktree the session does not
  have, FAILED_PRECONDITION for an agent without option workspace = "worktree", …).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import grpc

from uibus.agents import worktree_ops as ops
from uibus.agents.workspaces import GitError, Workspace, Workspaces
from uibus.domain.agent_sessions import AgentSessions
from uibus.domain.feed import UiFeed
from uibus.infra import telemetry
from uibus.infra.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from uibus.infra.session import session_of
from uibus.pb.cline import common_pb2, worktree_pb2, worktree_pb2_grpc

log = logging.getLogger("uibus.edge.services.worktree")

AGENT_KEY = "x-uibus-agent"  # the metadata key naming the conversation's agent a call is about
NO_WORKTREE = ("only agents with option workspace = \"worktree\" have worktrees (a git repository of their own per "
               "session)")


def _norm(path: str) -> str:
    """A path as the webview wrote it, normalised (no file system access: a worktree is matched by name)."""
    return os.path.normpath(path)


def _named_agent(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == AGENT_KEY:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return ""


class WorktreeService(worktree_pb2_grpc.WorktreeServiceServicer):
    def __init__(self, agents: AgentSessions, feed: UiFeed, repos: Mapping[str, str | None], default: str) -> None:
        """`repos`: every configured agent and its configured cwd when it has option workspace =
        "worktree" (else None); `default`: the default agent."""
        self.agents = agents
        self.feed = feed
        self.repos = dict(repos)
        self.default = default
        self._tops: dict[str, str] = {}  # configured cwd -> its repository's top level

    # ---- whose worktree, which repository ----

    @property
    def spaces(self) -> Workspaces:
        spaces = self.agents.workspaces
        if spaces is None or not any(self.repos.values()):
            raise FailedPrecondition(f"no agent served here has worktrees: {NO_WORKTREE}")
        return spaces

    def _worktree_agent(self, agent: str) -> tuple[str, str]:
        if agent not in self.repos:
            raise NotFound(f"agent {agent[:64]!r} is not served here; known agents: {', '.join(self.repos)}")
        cwd = self.repos[agent]
        if not cwd:
            raise FailedPrecondition(f"agent {agent!r} has no worktrees: {NO_WORKTREE}")
        return agent, cwd

    async def _agent(self, context: grpc.aio.ServicerContext, session: str) -> tuple[str, str]:
        """The agent the call is about and its configured cwd (see the module docstring)."""
        spaces = self.spaces
        named = _named_agent(context)
        if named:
            return self._worktree_agent(named)
        candidates = [name for name, cwd in self.repos.items() if cwd]
        having = {w.agent for w in await spaces.workspaces(session) if w.agent in candidates}
        if len(having) == 1:
            return self._worktree_agent(having.pop())
        if len(candidates) == 1:
            return self._worktree_agent(candidates[0])
        if self.default in candidates:
            return self._worktree_agent(self.default)
        raise FailedPrecondition(f"several agents have worktrees here ({', '.join(candidates)}): name the one "
                                 f"this call is about with the metadata key {AGENT_KEY}")

    async def _top(self, cwd: str) -> str:
        top = self._tops.get(cwd)
        if top is None:
            try:
                top = self._tops[cwd] = await ops.toplevel(cwd)
            except GitError as exc:
                raise FailedPrecondition(f"the base repository at {cwd} cannot be read: {exc}") from exc
        return top

    async def _bases(self) -> set[str]:
        """Every base repository's top level (the main worktrees)."""
        return {await self._top(cwd) for cwd in self.repos.values() if cwd}

    async def _workspace_at(self, session: str, path: str, what: str = "path") -> Workspace:
        """The session's workspace at `path`; NOT_FOUND when the session has none there."""
        if not path:
            raise InvalidArgument(f"{what} is required: a worktree listWorktrees gave")
        wanted = _norm(path)
        spaces = self.spaces
        for w in await spaces.workspaces(session):
            if _norm(w.path) == wanted:
                return w
        if wanted in await self._bases():
            raise FailedPrecondition(f"{wanted} is the base repository (the main worktree): it is the operator's, "
                                     "not a conversation's, and cannot be deleted, merged or checked out from here")
        raise NotFound(f"session {session!r} has no worktree at {path[:256]!r} (listWorktrees lists its worktrees)")

    def _idle(self, session: str, w: Workspace) -> None:
        if self.agents.running(session, w.agent):
            raise FailedPrecondition(f"agent {w.agent!r} runs a turn in this worktree now: stop it first "
                                     "(SessionService StopTurn), then try again")

    async def _branch_arg(self, repo: str, name: str, what: str) -> str:
        if not name:
            raise InvalidArgument(f"{what} is required")
        if not await ops.is_branch_name(repo, name):
            raise InvalidArgument(f"{what} {name[:128]!r} is not a valid branch name")
        return name

    # ---- listing ----

    @staticmethod
    def _pb(path: str, head: ops.Head, current: bool) -> worktree_pb2.Worktree:
        return worktree_pb2.Worktree(path=path, branch=head.branch, commit_hash=head.commit, is_current=current,
                                     is_detached=not head.branch)

    async def _listed(self, spaces: Workspaces, w: Workspace, current: bool) -> worktree_pb2.Worktree:
        try:
            return self._pb(w.path, await ops.head_of(spaces, w), current)
        except (GitError, OSError) as exc:
            log.warning("worktree unreadable", extra={"fields": {"session": w.session, "agent": w.agent,
                                                                 "error": str(exc)}})
            found = self._pb(w.path, ops.Head(w.branch, ""), current)
            found.is_locked, found.lock_reason = True, "git could not read this workspace (the server log says why)"
            return found

    async def listWorktrees(self, request: common_pb2.EmptyRequest,
                            context: grpc.aio.ServicerContext) -> worktree_pb2.WorktreeList:
        session = session_of(context)
        agent, cwd = await self._agent(context, session)
        repo = await self._top(cwd)
        spaces = self.spaces
        mine = [w for w in await spaces.workspaces(session) if w.repo == repo]
        current = next((w for w in mine if w.agent == agent), None)
        try:
            head = await ops.base_head(repo)
        except GitError as exc:
            raise FailedPrecondition(f"the base repository {repo} cannot be read: {exc}") from exc
        listed = worktree_pb2.WorktreeList(is_git_repo=True, git_root_path=repo)
        listed.worktrees.append(self._pb(repo, head, current is None))
        for w in mine:
            listed.worktrees.append(await self._listed(spaces, w, w is current))
        return listed

    async def getAvailableBranches(self, request: common_pb2.EmptyRequest,
                                   context: grpc.aio.ServicerContext) -> worktree_pb2.BranchList:
        _, cwd = await self._agent(context, session_of(context))
        repo = await self._top(cwd)
        try:
            found = await ops.branches(repo)
        except GitError as exc:
            raise FailedPrecondition(f"the base repository {repo} cannot be read: {exc}") from exc
        return worktree_pb2.BranchList(local_branches=found.local, remote_branches=found.remote,
                                       current_branch=found.current)

    async def getWorktreeDefaults(self, request: common_pb2.EmptyRequest,
                                  context: grpc.aio.ServicerContext) -> worktree_pb2.WorktreeDefaults:
        session = session_of(context)
        agent, cwd = await self._agent(context, session)
        spaces = self.spaces
        return worktree_pb2.WorktreeDefaults(suggested_branch=spaces.branch_of(session, agent),
                                             suggested_path=str(spaces.path_of(session, agent, await self._top(cwd))))

    # ---- making, removing, switching ----

    async def _agent_of_branch(self, context: grpc.aio.ServicerContext, session: str,
                               branch: str) -> tuple[str, str]:
        """createWorktree's agent: the one its branch names (uibus's branch name for it, or the
        agent's own name), else the call's."""
        spaces = self.spaces
        for name, cwd in self.repos.items():
            if cwd and branch in (name, spaces.branch_of(session, name)):
                return name, cwd
        agent, cwd = await self._agent(context, session)
        if branch:
            raise InvalidArgument(f"uibus names a conversation's branch itself: {spaces.branch_of(session, agent)!r} "
                                  f"for agent {agent!r} (getWorktreeDefaults suggests it); pass that, the agent's "
                                  f"name or no branch, not {branch[:128]!r}")
        return agent, cwd

    async def createWorktree(self, request: worktree_pb2.CreateWorktreeRequest,
                             context: grpc.aio.ServicerContext) -> worktree_pb2.WorktreeResult:
        session = session_of(context)
        agent, cwd = await self._agent_of_branch(context, session, request.branch)
        repo = await self._top(cwd)
        spaces = self.spaces
        where = str(spaces.path_of(session, agent, repo))
        if request.path and _norm(request.path) != where:
            raise InvalidArgument(f"uibus chooses where a conversation's worktree lives (in its workspaces "
                                  f"directory): {where} for agent {agent!r} "
                                  "(getWorktreeDefaults suggests it); pass that path or none")
        have = [w for w in await spaces.workspaces(session) if w.agent == agent and w.repo == repo]
        if have:
            raise AlreadyExists(f"agent {agent!r} has its worktree in session {session!r} already: {have[0].path}")
        base = request.base_branch
        if base:
            await self._branch_arg(repo, base, "base_branch")
            if not await ops.branch_commit(repo, base):
                raise NotFound(f"the base repository has no branch {base!r}")
        try:
            w = await spaces.open(session, agent, cwd, base_branch=base)
        except (GitError, OSError) as exc:
            raise FailedPrecondition(f"cannot make the worktree of agent {agent!r}: {exc}") from exc
        made = await self._listed(spaces, w, True)
        return worktree_pb2.WorktreeResult(success=True, message=f"Worktree created at {w.path}", worktree=made)

    async def deleteWorktree(self, request: worktree_pb2.DeleteWorktreeRequest,
                             context: grpc.aio.ServicerContext) -> worktree_pb2.WorktreeResult:
        session = session_of(context)
        w = await self._workspace_at(session, request.path)
        spaces = self.spaces
        self._idle(session, w)
        if request.delete_branch and request.branch_name and request.branch_name != w.branch:
            raise InvalidArgument(f"the worktree at {w.path} is on branch {w.branch!r}, not {request.branch_name!r}")
        try:
            if not request.force and await spaces.changes.uncommitted(w):
                raise FailedPrecondition(f"the worktree at {w.path} has uncommitted changes: commit them, or "
                                         "delete with force (they are lost)")
            # its commits are kept (exported as DeleteSession keeps them) unless they are merged
            # already and the branch is asked to go, as `git branch -d` deletes merged branches only
            merged = request.delete_branch and await ops.merged_in_base(w.repo, (await spaces.changes.commits(w))[1])
        except GitError as exc:
            if not request.force:
                log.warning("worktree unreadable", extra={"fields": {"session": session, "agent": w.agent,
                                                                     "error": str(exc)}})
                raise FailedPrecondition("git could not read this worktree (the server log says why); delete it "
                                         "with force") from exc
            merged = False
        await self.agents.close_agent(session, w.agent, "its worktree was deleted")
        kept = await spaces.remove(w, keep_commits=not merged)
        message = f"Worktree at {w.path} has been removed"
        if kept:
            message += f"; its commits are kept as branch '{kept}' of the base repository"
        elif request.delete_branch:
            message += f" and deleted branch '{w.branch}'"
        await self.agents.dialogs.audit.record("workspace.delete", session=session, agent=w.agent, branch=w.branch,
                                               kept=kept or None)
        return worktree_pb2.WorktreeResult(success=True, message=message)

    async def switchWorktree(self, request: worktree_pb2.SwitchWorktreeRequest,
                             context: grpc.aio.ServicerContext) -> worktree_pb2.WorktreeResult:
        session = session_of(context)
        path = _norm(request.path) if request.path else ""
        if path not in await self._bases():
            path = (await self._workspace_at(session, request.path)).path
        await self.feed.open_folder(session, path, request.new_window)
        return worktree_pb2.WorktreeResult(success=True, message=f"Asked the host to open the worktree at {path}")

    # ---- .worktreeinclude ----

    async def getWorktreeIncludeStatus(self, request: common_pb2.EmptyRequest,
                                       context: grpc.aio.ServicerContext) -> worktree_pb2.WorktreeIncludeStatus:
        _, cwd = await self._agent(context, session_of(context))
        exists, has_gitignore, text = await ops.read_include(await self._top(cwd))
        return worktree_pb2.WorktreeIncludeStatus(exists=exists, has_gitignore=has_gitignore, gitignore_content=text)

    async def createWorktreeInclude(self, request: worktree_pb2.CreateWorktreeIncludeRequest,
                                    context: grpc.aio.ServicerContext) -> worktree_pb2.WorktreeResult:
        size = len(request.content.encode())
        if size > ops.MAX_INCLUDE_BYTES:
            raise InvalidArgument(f"content is {size} bytes; a {ops.INCLUDE} takes at most {ops.MAX_INCLUDE_BYTES}")
        _, cwd = await self._agent(context, session_of(context))
        repo = await self._top(cwd)
        try:
            await ops.save_include(repo, request.content)
        except OSError as exc:
            raise FailedPrecondition(f"cannot write {ops.INCLUDE} in {repo}: {exc.strerror}") from exc
        return worktree_pb2.WorktreeResult(success=True, message=f"Created {ops.INCLUDE} file (uibus does not copy "
                                                                 "the files it names into conversations' worktrees)")

    # ---- git in a worktree ----

    async def checkoutBranch(self, request: worktree_pb2.CheckoutBranchRequest,
                             context: grpc.aio.ServicerContext) -> worktree_pb2.WorktreeResult:
        session = session_of(context)
        agent, cwd = await self._agent(context, session)
        repo = await self._top(cwd)
        branch = await self._branch_arg(repo, request.branch, "branch")
        spaces = self.spaces
        w = next((w for w in await spaces.workspaces(session) if w.agent == agent and w.repo == repo), None)
        if w is None:
            raise FailedPrecondition(f"agent {agent!r} has no worktree in session {session!r} yet: createWorktree "
                                     "makes it (or the agent's first turn does)")
        self._idle(session, w)
        try:
            await ops.checkout(spaces, w, branch)
        except ops.NoBranch as exc:
            raise NotFound(str(exc)) from exc
        except (GitError, OSError) as exc:
            log.warning("checkout failed", extra={"fields": {"session": session, "agent": agent, "error": str(exc)}})
            raise FailedPrecondition(f"git could not check out {branch!r} in the worktree of agent {agent!r} (local "
                                     "changes in the way? the server log says why)") from exc
        return worktree_pb2.WorktreeResult(success=True, message=f"Switched to branch '{branch}'")

    async def mergeWorktree(self, request: worktree_pb2.MergeWorktreeRequest,
                            context: grpc.aio.ServicerContext) -> worktree_pb2.MergeWorktreeResult:
        session = session_of(context)
        w = await self._workspace_at(session, request.worktree_path, "worktree_path")
        target = await self._branch_arg(w.repo, request.target_branch, "target_branch")
        self._idle(session, w)
        spaces = self.spaces
        try:
            merged = await ops.merge(spaces, w, target)
        except ops.MergeRefused as exc:
            raise NotFound(str(exc)) from exc
        except (GitError, OSError) as exc:
            log.warning("merge failed", extra={"fields": {"session": session, "agent": w.agent, "target": target,
                                                          "error": str(exc)}})
            raise FailedPrecondition("git could not merge this worktree (the server log says why)") from exc
        message = merged.message
        if merged.ok and request.delete_after_merge:
            await self.agents.close_agent(session, w.agent, "its worktree was merged and deleted")
            await spaces.remove(w, keep_commits=False)
            message += " and removed worktree"
        await self.agents.dialogs.audit.record("workspace.merge", session=session, agent=w.agent, branch=w.branch,
                                               target=target, merged=merged.ok, conflicts=len(merged.conflicts))
        return worktree_pb2.MergeWorktreeResult(success=merged.ok, message=message,
                                                has_conflicts=bool(merged.conflicts),
                                                conflicting_files=merged.conflicts, source_branch=w.branch,
                                                target_branch=target)

    async def trackWorktreeViewOpened(self, request: worktree_pb2.TrackWorktreeViewOpenedRequest,
                                      context: grpc.aio.ServicerContext) -> common_pb2.Empty:
        # Cline's telemetry: nothing is stored; the source (as Cline reduces it) marks the call's span
        telemetry.annotate({"uibus.worktree_view.source": "home_page" if request.source == "home_page"
                            else "menu_bar"})
        return common_pb2.Empty()


SERVICE = worktree_pb2.DESCRIPTOR.services_by_name["WorktreeService"].full_name


def add_to(registry: Any, agents: AgentSessions, feed: UiFeed, repos: Mapping[str, str | None], default: str) -> str:
    """Registers the service; returns its name."""
    worktree_pb2_grpc.add_WorktreeServiceServicer_to_server(WorktreeService(agents, feed, repos, default), registry)
    return SERVICE
