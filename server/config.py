"""Configuration: one frozen dataclass, filled from CLI flags over `UIBUS_*` env vars over defaults.

Everything the service reads at start-up is here so that `uibus serve --help` and the README table
stay the single list of knobs, and tests can build a config without touching the environment.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


def _default_store() -> str:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return str(Path(base) / "uibus" / "uibus.db")


@dataclass(frozen=True)
class Config:
    host: str = field(default="0.0.0.0", metadata={"help": "address the gRPC server binds"})
    port: int = field(default=26040, metadata={"help": "gRPC port (Cline's standalone core uses 26040)"})
    http_port: int = field(default=8080, metadata={"help": "HTTP port (gRPC-Web, neuro-san HTTP API, "
                                                           "webview, /metrics); 0 turns it off"})
    store: str = field(default_factory=_default_store,
                       metadata={"help": "SQLite file of the session store; ':memory:' keeps nothing"})
    redis_url: str = field(default="", metadata={"help": "redis://… to use Redis as store and bus"})
    queue_size: int = field(default=256, metadata={"help": "bound of each subscriber's queue"})
    max_streams_per_session: int = field(default=10_000,
                                         metadata={"help": "open subscriptions allowed per session"})
    max_message_bytes: int = field(default=4 * 1024 * 1024,
                                   metadata={"help": "largest request message accepted"})
    chat_context_bytes: int = field(default=1024 * 1024, metadata={
        "help": "byte budget of one (session, agent) ChatContext, stored and returned; oldest messages "
                "are dropped first, and a user message over it is refused"})
    mailbox_bytes: int = field(default=16 * 1024 * 1024, metadata={
        "help": "bytes one subscriber may have queued; a stream over it is ended RESOURCE_EXHAUSTED"})
    mailboxes_bytes: int = field(default=256 * 1024 * 1024, metadata={
        "help": "bytes all subscribers together may have queued; the fullest stream is ended beyond it"})
    session_ttl_seconds: float = field(default=30 * 24 * 3600.0, metadata={
        "help": "a session's stored state is deleted after this long without a write; 0 keeps it forever"})
    max_sessions: int = field(default=100_000, metadata={
        "help": "sessions kept in the store; beyond it the longest-idle ones are deleted"})
    history_bytes: int = field(default=8 * 1024 * 1024, metadata={
        "help": "bytes of chat history kept per session (oldest entries dropped first)"})
    keepalive_seconds: float = field(default=20.0, metadata={
        "help": "gRPC server pings an idle connection this often; 0 turns keepalive off"})
    keepalive_timeout_seconds: float = field(default=10.0, metadata={
        "help": "a connection whose ping is not answered within this is closed (its streams freed)"})
    grace_seconds: float = field(default=5.0, metadata={"help": "how long shutdown waits for RPCs"})
    drain_seconds: float = field(default=0.0, metadata={
        "help": "on SIGTERM, report NOT_SERVING this long before refusing calls (load balancers)"})
    auth_token: str = field(default="", metadata={"help": "require `authorization: Bearer <token>`"})
    tls_cert: str = field(default="", metadata={"help": "PEM certificate chain; enables TLS"})
    tls_key: str = field(default="", metadata={"help": "PEM private key for --tls-cert"})
    agents: str = field(default="", metadata={"help": "agents config file (.json or .toml); empty = built-in"})
    cors_origins: str = field(default="*", metadata={"help": "comma-separated origins allowed for "
                                                             "gRPC-Web and the HTTP API"})
    log_level: str = field(default="INFO", metadata={"help": "DEBUG, INFO, WARNING or ERROR"})

    def __post_init__(self) -> None:
        problems = []
        for name in ("port", "http_port"):
            if not 0 <= getattr(self, name) <= 65535:
                problems.append(f"{name} must be within 0..65535")
        if self.queue_size < 1:
            problems.append("queue_size must be at least 1")
        if self.max_streams_per_session < 1:
            problems.append("max_streams_per_session must be at least 1")
        for name in ("chat_context_bytes", "mailbox_bytes", "mailboxes_bytes", "max_sessions", "history_bytes"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be at least 1")
        if self.chat_context_bytes > self.max_message_bytes // 2:
            problems.append("chat_context_bytes must be at most half of max_message_bytes (a reply carries the "
                            "context and the answer)")
        if self.mailboxes_bytes < self.mailbox_bytes:
            problems.append("mailboxes_bytes must be at least mailbox_bytes")
        for name in ("session_ttl_seconds", "keepalive_seconds"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be 0 (off) or more")
        if self.keepalive_timeout_seconds <= 0:
            problems.append("keepalive_timeout_seconds must be more than 0")
        if bool(self.tls_cert) != bool(self.tls_key):
            problems.append("tls_cert and tls_key go together")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            problems.append("log_level must be DEBUG, INFO, WARNING or ERROR")
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Adds one `--flag` per field; defaults come from `UIBUS_<FIELD>` or the field default."""
        for f in fields(cls):
            default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
            env = os.environ.get("UIBUS_" + f.name.upper())
            kind = type(default)
            value: Any = kind(env) if env is not None else default
            parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, default=value,
                                help=f"{f.metadata.get('help', '')} (env UIBUS_{f.name.upper()}, "
                                     f"default {value!r})")

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> Config:
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})
