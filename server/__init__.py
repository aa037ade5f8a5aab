"""uibus: one gRPC service for coding-agent user interfaces."""

import os
from importlib import metadata

# gRPC core's fork handlers off, before anything imports grpc: uibus starts agent processes (the rpc
# backend) from a process whose gRPC threads are running, and uvloop spawns them with fork(), which
# runs those handlers in the child, where they can abort it before it execs ("Check failed:
# next_worker->state == KICKED", seen here). uibus never needs gRPC in a forked child: `--workers`
# forks before any gRPC object exists, and agents exec at once. An explicit setting wins.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")


def version() -> str:
    """The installed distribution's version, so what uibus says of itself (`uibus --version`, the MCP
    handshake, the OpenAPI document) names what pip installed; "unknown" for a tree imported without
    being installed."""
    try:
        return metadata.version("uibus")
    except metadata.PackageNotFoundError:
        return "unknown"
