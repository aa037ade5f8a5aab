"""Model Context Protocol: the agents and the people at the UIs as MCP tools (see uibus.edge.mcp.server)."""
