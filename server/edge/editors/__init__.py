"""uibus served to editors over the Agent Client Protocol: Zed, the JetBrains IDEs, CodeCompanion
and every other ACP client attach to a uibus session as if it were a local ACP agent.

uibus is an ACP *client* of the agents it hosts (uibus.agents.acp); here it is the ACP *agent* of
editors. One implementation (`Editor`, uibus.edge.editors.agent) serves both ways in: `uibus acp`
(stdio, a grpc channel to a uibus, uibus.clients.acp_cli) and `/acp` on the HTTP port (a
WebSocket, the app's in-process channel, uibus.edge.transports.acp_ws). Either way the editor is one
more UI of the session, calling the same public services every other UI calls (StreamingChat,
WebviewService, ExtensionUiService), so every call passes the one pipeline.
"""
