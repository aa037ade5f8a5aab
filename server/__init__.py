"""uibus: one gRPC service for coding-agent user interfaces."""

from importlib import metadata


def version() -> str:
    """The installed distribution's version, so what uibus says of itself (`uibus --version`, the MCP
    handshake, the OpenAPI document) names what pip installed; "unknown" for a tree imported without
    being installed."""
    try:
        return metadata.version("uibus")
    except metadata.PackageNotFoundError:
        return "unknown"
