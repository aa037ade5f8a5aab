"""The edge: how the world reaches the domain. The call driver and the one pipeline of policy, the
services (gRPC servicers, CodeBolt, MCP), the editors' ACP, and the transports that only translate
framing. Replication is decided here too: the edge asks where a conversation lives and calls the
local domain object or a proxy of it (tests/test_architecture.py reads the folders)."""
