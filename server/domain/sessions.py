"""Sessions as a first-class thing: every session at a glance, created and deleted on purpose.

A session existed before only as a name some call carried. The control room (a page listing every
conversation, a phone stopping a turn a laptop started) needs them listed with what a person wants
to know first: what it is about (its title), when it last moved, which agents run a turn now, how
many dialogs wait for an answer, and the state of each hosted agent (modes, models, commands).

Where each part comes from, so nothing is stored twice:

* the sessions and their last activity: the store's own index (`Store.sessions`), which every
  write stamps, on every replica;
* the title: what was set for the session (pi's `setTitle`, i.e. the extension-UI title kept per
  session, else the title given at CreateSession, `META`), else the title a hosted ACP agent gave
  its conversation (`session_info_update`), else the first user message of the chat history; the
  stored parts are looked up once per change of the session's last activity (`_Static` cache);
* the agent a UI should open on: the newest history entry that names one, else CreateSession's;
* running turns, waiting dialogs and hosted agent state: this process's memory (AgentSessions,
  Dialogs), read on every listing; with replicas (Redis), the dialogs other replicas hold and the
  agents they host come from their shared store entries (uibus.replicas.dialog_sharing,
  uibus.replicas.agent_state_sharing), read with the stored parts.

Visibility is the caller's business: `list` takes a predicate (the token's grant), so the domain
knows nothing of tokens. A watch re-lists every `WATCH_S` and on every local change (`poke`), and
sends a list only when it differs from the last one sent.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from uibus.agents.workspaces import ExportError, GitError, Summary
from uibus.domain.agent_sessions import AgentSessions
from uibus.domain.changes import Changes
from uibus.domain.dialogs import TITLE, Dialogs
from uibus.domain.history import ChatHistory
from uibus.domain.recent import RecentMessages
from uibus.domain.steering import Steering, state_of
from uibus.infra.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from uibus.infra.quotas import Quotas
from uibus.infra.session import check_session
from uibus.infra.sharing import LocalSharing, Sharing
from uibus.pb.uibus.v1 import extension_ui_pb2 as ext_pb
from uibus.pb.uibus.v1 import sessions_pb2 as pb

META = "session/meta"  # {"title", "agent", "created"}: what CreateSession was given
TITLE_CHARS = 80  # a first user message longer than this is shortened to be a title
WATCH_S = 1.0  # a watch re-lists at least this often (other replicas' changes show within it)
CACHE = 4096  # sessions whose title and agent are remembered
REMOTE_S = 1.0  # other replicas' dialogs and agents of an unchanged session are re-read at most this often
RECENT_S = 60.0  # ... and only for sessions active this recently (or listing some)
RECENT = 20  # history entries read (newest) to find the agent a session last talked to
MAX_LISTED = 500  # sessions one listing shows (the most recently active): a UI's list, not an export
# Every field bounded, whichever door it came in by (docs/security/quotas.md): what CreateSession takes, and what a
# listing shows of each title (a stored title from before the bound, or an agent's, is cut to it),
# so MAX_LISTED entries fit any reply (500 x a few KiB, far under --max-message-bytes).
MAX_TITLE_CHARS = 1024  # a title CreateSession takes
LISTED_TITLE_CHARS = 256  # a title (the session's, an agent's, a waiting dialog's) as a listing shows it
MAX_AGENT_CHARS = 128  # an agent name CreateSession takes (the HTTP API's pattern: [A-Za-z0-9_.-]{1,128})
_AGENT = re.compile(r"[A-Za-z0-9_.-]{1,128}")
SNAPSHOT_S = 0.25  # the store's session index is read at most this often, however many watch it

log = logging.getLogger("uibus.domain.sessions")


async def shown(visible: Callable[[str], Any], session: str) -> bool:
    """`visible(session)`, which may be awaitable (a person's listing reads the session's members)."""
    seen = visible(session)
    return seen if isinstance(seen, bool) else bool(await seen)


def _listed(title: str) -> str:
    """A title as a listing shows it: at most LISTED_TITLE_CHARS characters."""
    return title if len(title) <= LISTED_TITLE_CHARS else title[: LISTED_TITLE_CHARS - 1] + "…"


def shorten(text: str, limit: int = TITLE_CHARS) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"


@dataclass(frozen=True)
class _Static:
    """What a session's stored state says, valid while its last activity stays the same."""

    stamp: float
    title: str  # set on purpose: pi's setTitle (the extension-UI title), else CreateSession's
    first: str  # the first user message, shortened
    agent: str
    remote: tuple[pb.WaitingDialog, ...] = ()  # dialogs other replicas hold (with Redis), oldest first
    agents: tuple[pb.AgentState, ...] = ()  # agents other replicas host (with Redis)
    read_at: float = 0.0  # time.monotonic() when `remote` and `agents` were read



class Sessions:
    """The sessions API over the store, the chat history, the dialogs and the hosted agents."""

    def __init__(self, store: Any, dialogs: Dialogs, agents: AgentSessions, history: ChatHistory,
                 sharing: Sharing | None = None, *,
                 changes: Changes | None = None, watch_s: float = WATCH_S,
                 recent: RecentMessages | None = None) -> None:
        """`recent`: the feed's write-behind recent messages, dropped first when a session is deleted;
        `sharing`: what other processes hold (their dialogs and agents are listed too; none: alone);
        `changes`: poked by whatever changes what is listed (every watch wakes)."""
        self.store = store
        self.recent = recent
        self.dialogs = dialogs
        self.agents = agents
        self.history = history
        self.watch_s = watch_s
        self.sharing: Sharing = sharing if sharing is not None else LocalSharing()
        self.audit = dialogs.audit  # the domain's one audit port (uibus.infra.audit), given to the dialogs
        self.steering = Steering(agents, self.sharing, self.audit)
        self._static: OrderedDict[str, _Static] = OrderedDict()
        self.changes = changes or Changes()
        self._snapshot: tuple[float, list[tuple[str, float]], asyncio.Event | None] = (0.0, [], None)

    def poke(self) -> None:
        """Something listed changed here (a turn started or ended, a mode changed): watches re-list."""
        self.changes.poke()

    # ---- reading ----

    async def _static_of(self, session: str, stamp: float) -> _Static:
        known = self._static.get(session)
        if known is not None and known.stamp == stamp:
            self._static.move_to_end(session)
            if not self._remote_stale(known):
                return known
            # Other replicas' parts are re-read, bounded: a stamp is a millisecond, and a dialog
            # closed (or first heard of) within the one its listing was read in moves no stamp.
            static = replace(known, remote=await self._remote_dialogs(session),
                             agents=await self._remote_agents(session), read_at=time.monotonic())
            self._static[session] = static
            return static
        meta = await self.store.get(session, META) or {}
        title = await self.store.get(session, TITLE) or meta.get("title") or ""
        agent = ""
        recent = await self.history.read(session, last=RECENT)
        for entry in reversed(recent):
            if entry.get("agent"):
                agent = str(entry["agent"])
                break
        first = known.first if known is not None and known.first else ""
        if not first:
            first = await self._first_user_message(session, recent)
        static = _Static(stamp, str(title), first, agent or str(meta.get("agent", "")),
                         await self._remote_dialogs(session), await self._remote_agents(session), time.monotonic())
        self._static[session] = static
        while len(self._static) > CACHE:
            self._static.popitem(last=False)
        return static

    def _remote_stale(self, known: _Static) -> bool:
        """Whether other replicas' parts of a cached entry are read again although its stamp did not
        move: at most every REMOTE_S, and only for an entry that lists some or a session active in
        the last RECENT_S (the few a person watches), so an idle listing of hundreds of sessions
        costs no store reads (alone, the sharing reads nothing at all)."""
        if time.monotonic() - known.read_at < REMOTE_S:
            return False
        return bool(known.remote or known.agents) or time.time() * 1000 - known.stamp < RECENT_S * 1000

    async def _remote_dialogs(self, session: str) -> tuple[pb.WaitingDialog, ...]:
        """With replicas (Redis), the dialogs other replicas hold: their shared store entries, whose
        writes stamp the session, so they are read again whenever one opens or closes anywhere."""
        return tuple(pb.WaitingDialog(id=r.id, kind=r.WhichOneof("method") or "",
                                      title=getattr(r, r.WhichOneof("method") or "select").title)
                     for r in await self.sharing.read_dialogs_elsewhere(session))

    async def _remote_agents(self, session: str) -> tuple[pb.AgentState, ...]:
        """With replicas, the state of the agents other replicas host (uibus.replicas.agent_state_sharing)."""
        return tuple(await self.sharing.agents_elsewhere(session))

    async def _first_user_message(self, session: str, recent: list[dict[str, Any]]) -> str:
        entries = recent
        if len(recent) >= RECENT:  # the first may be older than the newest few: read it all, once
            entries = await self.history.read(session)
        for entry in entries:
            if entry.get("role") == "user" and entry.get("text"):
                return shorten(str(entry["text"]))
        return ""

    # ---- workspaces (agents with option workspace = "worktree": uibus.agents.workspaces) ----

    @staticmethod
    def _workspace_pb(summary: Summary) -> pb.Workspace:
        w = summary.workspace
        return pb.Workspace(agent=w.agent, branch=w.branch, base=w.base, files_changed=summary.files_total,
                            lines_added=summary.added, lines_removed=summary.removed, commits=summary.commits,
                            error=summary.error)

    async def _workspaces(self, session: str) -> list[pb.Workspace]:
        """Each agent's workspace in `session` and what changed in it (each summary cached a moment)."""
        spaces = self.agents.workspaces
        if spaces is None or not spaces.enabled:
            return []
        return [self._workspace_pb(await spaces.summary(w)) for w in await spaces.workspaces(session)]

    async def workspace_diff(self, session: str, agent: str) -> pb.WorkspaceDiff:
        """The files and unified diff of `agent`'s workspace in `session` against its base (bounded)."""
        spaces = self.agents.workspaces
        found = [w for w in (await spaces.workspaces(session) if spaces is not None else []) if w.agent == agent]
        if spaces is None or not found:
            raise NotFound(f"agent {agent!r} has no workspace in session {session!r} (only agents with option "
                           "workspace = \"worktree\" have one, from their first turn on)")
        summary, text, cut = await spaces.diff(found[0])
        files = [pb.WorkspaceFile(path=f.path, lines_added=max(f.added, 0), lines_removed=max(f.removed, 0),
                                  binary=f.added < 0) for f in summary.files]
        return pb.WorkspaceDiff(workspace=self._workspace_pb(summary), files=files, diff=text, truncated=cut)

    async def export_workspace(self, session: str, agent: str, branch: str) -> pb.ExportWorkspaceReply:
        """Makes `agent`'s work in `session` branch `branch` of its base repository (empty: the
        workspace's own branch name); uibus.agents.workspaces.Workspaces.export says how."""
        spaces = self.agents.workspaces
        found = [w for w in (await spaces.workspaces(session) if spaces is not None else []) if w.agent == agent]
        if spaces is None or not found:
            raise NotFound(f"agent {agent!r} has no workspace in session {session!r} (only agents with option "
                           "workspace = \"worktree\" have one, from their first turn on)")
        name = branch or found[0].branch
        try:
            commit = await spaces.export(found[0], name)
        except ExportError as exc:
            if exc.kind == "taken":
                raise AlreadyExists(str(exc)) from exc
            raise (InvalidArgument if exc.kind == "name" else FailedPrecondition)(str(exc)) from exc
        except (GitError, OSError) as exc:
            log.warning("workspace export failed", extra={"fields": {"session": session, "agent": agent,
                                                                     "error": str(exc)}})
            raise FailedPrecondition("git could not export this workspace (the server log says why)") from exc
        await self.audit.record("workspace.export", session=session, agent=agent, branch=name, commit=commit)
        return pb.ExportWorkspaceReply(branch=name, commit=commit)

    async def entry(self, session: str, stamp: float) -> pb.SessionEntry:
        static = await self._static_of(session, stamp)
        agents = [state_of(name, agent, running) for name, agent, running in self.agents.live_agents(session)]
        agents += [a for a in static.agents if all(a.agent != b.agent for b in agents)]
        agents.sort(key=lambda a: a.agent)
        # what was set for the session, else what an agent titled its conversation, else the first message
        title = static.title or next((a.title for a in agents if a.title), "") or static.first
        waiting = [pb.WaitingDialog(id=d.id, kind=d.method, title=_listed(getattr(d.request, d.method).title))
                   for d in self.dialogs.pending.waiting(session)]
        waiting += [d for d in static.remote if all(d.id != w.id for w in waiting)]
        title = _listed(title)
        for a in agents:
            if len(a.title) > LISTED_TITLE_CHARS:
                a.title = _listed(a.title)
        return pb.SessionEntry(session=session, title=title, last_activity_ms=int(stamp),
                               running=[a.agent for a in agents if a.running],
                               waiting_dialogs=max(len(waiting), self.dialogs.count(session)), agents=agents,
                               agent=static.agent, waiting=waiting, workspaces=await self._workspaces(session))

    async def _stamps(self, shared: bool = False) -> list[tuple[str, float]]:
        """The store's sessions and last activity; `shared` (the watches): read at most once per
        SNAPSHOT_S however many watches ask (a poke makes the next read fresh)."""
        now = time.monotonic()
        taken, stamps, changed = self._snapshot
        if shared and now - taken < SNAPSHOT_S and changed is self.changes.event:
            return stamps
        stamps = await self.store.sessions()
        self._snapshot = (now, stamps, self.changes.event)
        return stamps

    async def list(self, visible: Callable[[str], bool], prefix: str = "", *, shared: bool = False) -> pb.SessionList:
        """The sessions `visible` allows (and starting with `prefix`), most recently active first, at
        most MAX_LISTED of them; `shared`: from the snapshot the watches share."""
        if prefix:
            check_session(prefix)  # every door (gRPC, HTTP API, MCP's list_sessions) the same bound
        listed = pb.SessionList()
        for session, stamp in await self._stamps(shared):
            # `!…`: uibus's own records (the page's sign-in key), never a session (check_session refuses `!`)
            if session.startswith(prefix) and not session.startswith("!") and await shown(visible, session):
                listed.sessions.append(await self.entry(session, stamp))
                if len(listed.sessions) >= MAX_LISTED:
                    break
        return listed

    async def get(self, session: str) -> pb.SessionEntry:
        for name, stamp in await self._stamps():
            if name == session:
                return await self.entry(session, stamp)
        raise NotFound(f"no session {session!r}")

    async def watch(self, visible: Callable[[str], bool], prefix: str = "") -> AsyncIterator[pb.SessionList]:
        """The list now, then again each time it differs (looked at every `watch_s` and on `poke`)."""
        last: pb.SessionList | None = None
        while True:
            changed = self.changes.event  # taken before listing: a poke during the listing is not missed
            current = await self.list(visible, prefix, shared=True)
            if current != last:
                last = current
                yield current
            try:
                await asyncio.wait_for(changed.wait(), self.watch_s)
            except TimeoutError:
                pass

    async def watch_held(self, visible: Callable[[str], bool], quotas: Quotas, tenant: str,
                         prefix: str = "") -> AsyncIterator[pb.SessionList]:
        """`watch`, counted against the tenant's `watches` quota while it is followed: the one way
        every stream of the listing (SessionService's watch, the page's multiplexed stream) follows
        it, so none of them can watch more, or more widely, than the caller's token allows."""
        with quotas.hold("watches", tenant):
            async for listed in self.watch(visible, prefix):
                yield listed

    # ---- writing ----

    async def create(self, session: str, title: str = "", agent: str = "") -> pb.SessionEntry:
        """Makes `session` exist (a META value), keeping what it had; sets the title / agent given
        (bounded: InvalidArgument for a title over MAX_TITLE_CHARS or an agent name that is none)."""
        if len(title) > MAX_TITLE_CHARS:
            raise InvalidArgument(f"title is {len(title)} characters long; the limit is {MAX_TITLE_CHARS}")
        if agent and not _AGENT.fullmatch(agent):
            raise InvalidArgument(f"agent {agent[:40]!r} is not an agent name: 1 to {MAX_AGENT_CHARS} characters "
                                  "from A-Z a-z 0-9 _ . -")
        def change(meta: Any | None) -> dict[str, Any]:
            value = dict(meta or {})
            if title:
                value["title"] = title
            if agent:
                value["agent"] = agent
            return value

        await self.store.update(session, META, change)
        self._static.pop(session, None)
        self.poke()
        await self.audit.record("session.create", session=session, title=title or None, agent=agent or None)
        return await self.get(session)

    async def delete(self, session: str) -> pb.DeleteSessionReply:
        """Deletes all of `session`: its hosted agents, its waiting dialogs, its stored state, then
        its agents' workspaces (a branch with commits beyond its base is kept, and named).

        Agents go first, so none writes into a workspace being removed: the ones hosted here are
        closed. (With replicas the edge first stops the turns other replicas' agents run, and those
        replicas close the agents at their next sweep, their live markers gone with the state.)"""
        closed = await self.agents.close_session(session)
        for dialog in self.dialogs.pending.waiting(session):
            self.dialogs.pending.close(dialog, ext_pb.DIALOG_OUTCOME_CANCELLED)
        # What would bring it back after the drop goes first: the feed's write-behind messages
        # (written a moment later, they listed the session again with its messages) and the caches.
        if self.recent is not None:
            await self.recent.forget(session)
        self._static.pop(session, None)
        existed = await self.store.drop_session(session)
        spaces = self.agents.workspaces
        removed = await spaces.remove_session(session) if spaces is not None else None
        self._static.pop(session, None)
        self.poke()
        if not existed and not closed and not (removed and removed.removed):
            raise NotFound(f"no session {session!r}")
        await self.audit.record("session.delete", session=session, agents_closed=closed,
                                branches_kept=", ".join(removed.kept_branches) if removed else None)
        return pb.DeleteSessionReply(
            agents_closed=closed, workspaces_removed=[w.agent for w in removed.removed] if removed else [],
            branches_kept=list(removed.kept_branches) if removed else [])
