"""The parts an app is assembled from, one installer each (see uibus.edge.wiring).

Each pairs its setup with its teardown: it registers services (so every handler passes the
pipeline), mounts what it serves on the HTTP port, and undoes what it started after its `yield`.
`INSTALLERS` is what `App` installs by default; tests and embedders pass their own list.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from uibus import version
from uibus.domain.members import Members
from uibus.edge.codebolt.gateway import Gateway
from uibus.edge.mcp.server import McpServer
from uibus.edge.services import agent, audit, codebolt, extension_ui, host, sessions, team, ui, webview, worktree
from uibus.edge.transports.acp_ws import PATH as ACP_PATH
from uibus.edge.transports.acp_ws import AcpWebSocket
from uibus.edge.transports.audit_http import PATH as AUDIT_PATH
from uibus.edge.transports.audit_http import AuditHttp
from uibus.edge.transports.codebolt_ws import CODEBOLTJS_PATH, PATH, AgentToApp
from uibus.edge.transports.mcp_http import PATH as MCP_PATH
from uibus.edge.transports.mcp_http import McpHttp
from uibus.edge.transports.sessions_http import PATH as SESSIONS_PATH
from uibus.edge.transports.sessions_http import SessionsHttp
from uibus.edge.transports.team_http import INVITES_PATH, TeamHttp
from uibus.edge.transports.team_http import SESSIONS_PATH as TEAM_PATH
from uibus.edge.wiring import AppKey, Installer, Setup
from uibus.infra.audit import AuditLog

CODEBOLT = AppKey("codebolt", Gateway)  # the CodeBolt gateway: `app[CODEBOLT]`
MCP = AppKey("mcp", McpHttp)  # the MCP endpoint (and its server, `.server`): `app[MCP]`


@asynccontextmanager
async def ui_feed(setup: Setup) -> AsyncIterator[None]:
    """cline.UiService (the webviews' side) and uibus.v1.HostService (the host's side)."""
    core = setup.core
    setup.serve(ui.add_to(setup.registry, core.feed), host.add_to(setup.registry, core.feed, core.bus))
    intents = core.feed.intents
    setup.labelled_counter("uibus_cline_intents_total", "cline.UiService trackIntent calls by action "
                           "(new_task_clicked, prompt_submitted, other)", "action", lambda: intents)
    yield


@asynccontextmanager
async def worktrees(setup: Setup) -> AsyncIterator[None]:
    """cline.WorktreeService: Cline's worktree panel over the conversations' workspaces."""
    core = setup.core
    repos = {name: getattr(backend, "workspace_repo", None) for name, backend in core.chat.agents.backends.items()}
    setup.serve(worktree.add_to(setup.registry, core.agent_sessions, core.feed, repos, core.chat.default_agent))
    yield


@asynccontextmanager
async def extension_ui_dialogs(setup: Setup) -> AsyncIterator[None]:
    dialogs = setup.core.dialogs
    setup.serve(extension_ui.add_to(setup.registry, dialogs, setup.placement, setup.pipeline.quotas,
                                      setup.pipeline.tenant_of))
    setup.gauge("uibus_extension_ui_pending_dialogs", "Extension-UI dialogs waiting for an answer", dialogs.count)
    yield
    await dialogs.aclose()  # before the bus and the store close: the last closed events go out


@asynccontextmanager
async def agents(setup: Setup) -> AsyncIterator[None]:
    """neuro-san's AgentService (per agent and canonical) and ConciergeService."""
    chat = setup.core.chat
    servicer = agent.AgentServicer(chat, setup.placement)
    setup.serve(*agent.add_to(setup.registry, chat, servicer))
    setup.counter("uibus_chat_context_dropped_messages_total",
                  "ChatContext messages dropped (oldest first) to keep a context within --chat-context-bytes",
                  lambda: chat.context_dropped)
    yield
    # The servers have stopped: no turn is parked any more after this; the closes under way finish.
    await servicer.closing.aclose(grace=setup.config.grace_seconds)


@asynccontextmanager
async def session_api(setup: Setup) -> AsyncIterator[None]:
    """uibus.v1.SessionService: the sessions of the caller's tenant, and steering their agents."""
    setup.serve(sessions.add_to(setup.registry, setup.core.sessions, setup.placement, setup.pipeline.visible_sessions,
                                setup.pipeline.tenant_of, setup.pipeline.quotas))
    setup.mount(SESSIONS_PATH, SessionsHttp(setup.registry.lookup, setup.config.max_message_bytes))
    yield


@asynccontextmanager
async def webview_mux(setup: Setup) -> AsyncIterator[None]:
    """uibus.v1.WebviewService: a webview's UI streams, and on request its session's extension UI
    and the sessions listing (scoped by the caller's token as SessionService's), over one stream."""
    core, pipeline = setup.core, setup.pipeline
    setup.serve(webview.add_to(setup.registry, core.feed, core.dialogs, core.sessions, pipeline.visible_sessions,
                               pipeline.tenant_of, pipeline.quotas))
    yield


@asynccontextmanager
async def codebolt_gateway(setup: Setup) -> AsyncIterator[None]:
    """CodeBoltService, and the agents' WebSocket on the HTTP port (both of its paths)."""
    gateway = Gateway(setup.core, setup.pipeline.wrap, quotas=setup.pipeline.quotas,
                      tenant_of=setup.pipeline.tenant_of)
    setup.serve(codebolt.add_to(setup.registry, gateway))
    tokens = setup.pipeline.tokens
    tokens.on_reload.append(lambda: gateway.revoke(tokens.revoked))  # a revoked token's sockets close
    endpoint = AgentToApp(gateway)
    setup.mount(PATH, endpoint)
    setup.mount(CODEBOLTJS_PATH, endpoint)
    setup.gauge("uibus_codebolt_connections", "Open CodeBolt agent WebSocket connections", gateway.count)
    setup.gauge("uibus_codebolt_pending_waits", "CodeBolt waitforReply / confirmation calls in flight",
                gateway.pending)
    setup.on_shutdown(gateway.shutdown)
    setup.provide(CODEBOLT, gateway)
    yield
    await gateway.aclose()  # joins the closings its shutdown hook started


@asynccontextmanager
async def mcp_endpoint(setup: Setup) -> AsyncIterator[None]:
    """`/mcp` on the HTTP port: the agents and the session's UIs as Model Context Protocol tools."""
    server = McpServer(setup.core, setup.placement, setup.pipeline.wrap, version(),
                       visible=setup.pipeline.visible_sessions, quotas=setup.pipeline.quotas,
                       tenant_of=setup.pipeline.tenant_of, tools_for=setup.pipeline.tools_for)
    endpoint = McpHttp(server, setup.config.max_message_bytes)
    setup.mount(MCP_PATH, endpoint)
    setup.gauge("uibus_mcp_calls_in_flight", "MCP requests running that a client may cancel",
                lambda: len(server.inflight))
    setup.gauge("uibus_mcp_tasks_running", "MCP tasks (tasks extension) whose turn runs here",
                lambda: len(server.tasks))
    setup.provide(MCP, endpoint)
    try:
        yield
    finally:
        await server.tasks.aclose()  # a task's turn ends with the app; its record says cancelled


@asynccontextmanager
async def acp_endpoint(setup: Setup) -> AsyncIterator[None]:
    """`/acp` on the HTTP port: uibus as a remote ACP agent for editors (WebSocket), whose calls
    run through the pipeline on the in-process channel."""
    endpoint = AcpWebSocket(setup.registry.lookup, setup.pipeline.tokens, setup.config.max_message_bytes,
                            setup.pipeline.quotas)
    setup.mount(ACP_PATH, endpoint)
    setup.gauge("uibus_acp_editor_connections", "Editors attached over /acp", endpoint.count)
    try:
        yield
    finally:
        await endpoint.http.aclose()  # HTTP connections outlive their requests: closed with the app


@asynccontextmanager
async def audit_api(setup: Setup) -> AsyncIterator[None]:
    """uibus.v1.AuditService and `/api/audit`: reading the audit log (uibus.infra.audit)."""
    log, pipeline = setup.core.audit, setup.pipeline
    if isinstance(log, AuditLog):  # a core built without one records nothing: nothing to read
        tokens = pipeline.tokens
        setup.serve(audit.add_to(setup.registry, log, lambda md: not tokens.enabled or
                                 pipeline.authenticate(md).all_sessions))
        setup.mount(AUDIT_PATH, AuditHttp(setup.registry.lookup))
        setup.gauge("uibus_audit_waiting_entries", "audit entries recorded but not yet written (the store refused "
                    "them; answers to dialogs are refused meanwhile)", lambda: log.waiting)
        setup.counter("uibus_audit_entries_total", "audit entries written by this process", lambda: log.written)
    yield


@asynccontextmanager
async def team_api(setup: Setup) -> AsyncIterator[None]:
    """uibus.v1.TeamService and `/api/sessions/<name>/{whoami,members,invites}`, `/api/invites/accept`:
    roles per session. Installed first: the pipeline's role check reads the sessions' members from here on."""
    core, pipeline = setup.core, setup.pipeline
    members = Members(core.store, team.session_exists(core.store, core.history),
                      invite_ttl_s=setup.config.invite_ttl_seconds)
    pipeline.roles = team.install(members, pipeline.tokens.tenant)
    tokens = pipeline.tokens
    setup.serve(team.add_to(setup.registry, members, lambda: pipeline.roles,
                            lambda md: pipeline.authenticate(md) if tokens.enabled else None, core.audit))
    for prefix in (TEAM_PATH, INVITES_PATH):
        setup.mount(prefix, TeamHttp(setup.registry.lookup, prefix, setup.config.max_message_bytes))
    yield


INSTALLERS: tuple[Installer, ...] = (team_api, ui_feed,
                                     worktrees, extension_ui_dialogs, agents, webview_mux, codebolt_gateway,
                                     mcp_endpoint, session_api, acp_endpoint, audit_api)
