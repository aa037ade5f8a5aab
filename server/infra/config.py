"""Configuration: one frozen dataclass, filled from CLI flags over `UIBUS_*` env vars over defaults.

Everything the service reads at start-up is here so that `uibus serve --help` and docs/configuration.md's table
stay the single list of knobs, and tests can build a config without touching the environment.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import math
import os
import re
from collections.abc import Sequence
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any

from uibus.infra.errors import ConfigError
from uibus.infra.oidc_config import oidc_problems
from uibus.infra.quotas import QUOTAS


def _default_store() -> str:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return str(Path(base) / "uibus" / "uibus.db")


class InvalidConfig(ConfigError, ValueError):
    """A ConfigError that is also a ValueError, because embedders and tests that build `Config` directly
    (or call the agents loader) catch ValueError. It may carry several problems, each naming its own
    flag, so one start-up shows every mistake at once; `str()` joins them on one line."""

    def __init__(self, source: str, what: str, more: Sequence[tuple[str, str]] = ()) -> None:
        self.problems = [(source, what), *more]
        super().__init__(source, "; ".join([what, *(f"{s}: {w}" for s, w in more)]))


# argparse's default for every flag: tells "not on the command line" apart from any value, so the
# env var is read (and parsed) only when the flag is absent, and only in `from_args`, never for --help.
_UNSET: Any = type("Unset", (), {"__repr__": lambda self: "<unset>"})()
_REDIS_SCHEMES = ("redis://", "rediss://", "redis+sentinel://", "unix://")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _env(name: str) -> str:
    return "UIBUS_" + name.upper()


def _field_default(f: Field[Any]) -> Any:
    return f.default_factory() if callable(f.default_factory) else f.default


def _parse(kind: type, raw: str) -> Any:
    """The typed value of a flag or env string; ValueError says what is wrong without a traceback's help."""
    if kind is int:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{raw!r} is not an integer") from None
    if kind is float:
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{raw!r} is not a number") from None
        if not math.isfinite(value):  # nan passes every `<` check and inf breaks timers later
            raise ValueError(f"{raw!r} is not a finite number")
        return value
    if kind is bool:
        word = raw.strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
        raise ValueError(f"{raw!r} is not a switch value: 1, true, yes, on (or none) or 0, false, no, off")
    return raw


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def is_loopback(host: str) -> bool:
    """Whether `host` (a bind address or a Host header's name, without port or brackets) can only be
    reached from this machine: `localhost`, a `*.localhost` name (RFC 6761; browsers resolve them to
    loopback themselves) or an address in 127.0.0.0/8 or ::1. Any other name may resolve elsewhere,
    and "" / 0.0.0.0 / :: mean every interface."""
    name = host.strip().strip("[]").lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def redacted(text: str) -> str:
    """`text` with a URL password replaced: --help must not print `redis://:password@host`."""
    return re.sub(r"(://[^/@:]*:)[^/@]*@", r"\1***@", text)


def source_of(ns: argparse.Namespace, source: str) -> str:
    """The name the user set a flag's value under: `UIBUS_<NAME>` when `--name` was not on the command
    line but its env var is set, else `source` unchanged — so an error points at what to fix."""
    name = source[2:].replace("-", "_") if source.startswith("--") else ""
    if name in Config.__dataclass_fields__ and getattr(ns, name, _UNSET) is _UNSET \
            and os.environ.get(_env(name)) is not None:
        return _env(name)
    return source


def describe(exc: ConfigError, ns: argparse.Namespace | None = None) -> str:
    """One line `<source>: <what>[; <source>: <what>…]`, sources renamed by `source_of` when `ns` is given;
    newlines are folded because `uibus serve` promises a single line per start-up error."""
    problems = getattr(exc, "problems", None) or [(exc.source, exc.what)]
    text = "; ".join(f"{source_of(ns, s) if ns is not None else s}: {w}" for s, w in problems)
    return " ".join(line.strip() for line in text.splitlines())


LOOPS = ("auto", "asyncio", "uvloop")  # --loop


@dataclass(frozen=True)
class Config:
    host: str = field(default="127.0.0.1", metadata={
        "help": "address both ports bind: loopback by default, so only this machine can connect; any other "
                "address needs --auth-token or --tokens-file (or --trust-network)"})
    port: int = field(default=26040, metadata={"help": "gRPC port (Cline's standalone core uses 26040)"})
    http_port: int = field(default=8080, metadata={"help": "HTTP port (gRPC-Web, neuro-san HTTP API, "
                                                           "webview, /metrics); 0 turns it off"})
    store: str = field(default_factory=_default_store,
                       metadata={"help": "SQLite file of the session store; ':memory:' keeps nothing"})
    redis_url: str = field(default="", metadata={
        "help": "redis://… to use Redis as store and bus; with --redis-cluster any node of the cluster; "
                "redis+sentinel://[:password@]host:port[,host:port…]/MASTER[/db] to follow a master set "
                "through its sentinels"})
    redis_cluster: bool = field(default=False, metadata={
        "help": "--redis-url names a node of a Redis Cluster (>= 7): sharded pub/sub, keys hash-tagged by session"})
    bus_shards: int = field(default=256, metadata={
        "help": "channels the bus spreads sessions over; a replica hears only the shards its subscribers are in"})
    workers: int = field(default=1, metadata={
        "help": "worker processes serving the same ports (one per core); more than 1 needs --redis-url"})
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
    invite_ttl_seconds: float = field(default=7 * 24 * 3600.0, metadata={
        "help": "how long an invite to a session (TeamService/CreateInvite without ttl_seconds) stays valid"})
    max_sessions: int = field(default=100_000, metadata={
        "help": "sessions kept in the store; beyond it the longest-idle ones are deleted"})
    history_bytes: int = field(default=8 * 1024 * 1024, metadata={
        "help": "bytes of chat history kept per session (oldest entries dropped first)"})
    log_max_events: int = field(default=10_000, metadata={
        "help": "entries kept in each session's log (the latest state of each message, dialog, request); "
                "a cursor older than what is kept gets a gap and the snapshot; 0: no count bound"})
    log_max_bytes: int = field(default=8 * 1024 * 1024, metadata={
        "help": "bytes of events kept in each session's log (oldest dropped first); 0: no byte bound"})
    log_max_age_seconds: float = field(default=7 * 24 * 3600.0, metadata={
        "help": "entries of a session's log older than this are dropped (at its next write); 0: no age bound"})
    audit_retention_days: float = field(default=365.0, metadata={
        "help": "audit log entries older than this many days are removed (the chain stays verifiable from an "
                "anchor); 0 keeps them forever"})
    keepalive_seconds: float = field(default=20.0, metadata={
        "help": "gRPC server pings an idle connection this often; 0 turns keepalive off"})
    keepalive_timeout_seconds: float = field(default=10.0, metadata={
        "help": "a connection whose ping is not answered within this is closed (its streams freed)"})
    grace_seconds: float = field(default=5.0, metadata={"help": "how long shutdown waits for RPCs"})
    drain_seconds: float = field(default=0.0, metadata={
        "help": "on SIGTERM, report NOT_SERVING this long before refusing calls (load balancers)"})
    auth_token: str = field(default="", repr=False, metadata={
        "help": "require `authorization: Bearer <token>`; this token may use every session", "secret": True})
    tokens_file: str = field(default="", metadata={
        "help": "file of tenant tokens, one `TOKEN PATTERN…` per line (glob patterns of the sessions that token "
                "may use; `*` = all; `#` comments); reloaded on SIGHUP"})
    metrics_token: str = field(default="", repr=False, metadata={
        "help": "a token that may read /metrics (besides --auth-token and all-sessions tokens)", "secret": True})
    # A person's identity provider (uibus.infra.oidc; docs/security/sign-in.md): its access tokens are
    # bearer tokens on every door, and /mcp names it to MCP clients (RFC 9728).
    oidc_issuer: str = field(default="", metadata={
        "help": "OpenID Connect issuer URL (https, or http on loopback): its JWT access tokens are accepted on "
                "every door; empty turns sign-in off"})
    oidc_client_id: str = field(default="", metadata={"help": "uibus's client id at --oidc-issuer"})
    oidc_client_secret: str = field(default="", repr=False, metadata={
        "help": "the client's secret (set it by env, or use --oidc-client-secret-file)", "secret": True})
    oidc_client_secret_file: str = field(default="", metadata={"help": "a file holding --oidc-client-secret"})
    oidc_audience: str = field(default="", metadata={
        "help": "comma-separated `aud` values an access token must name one of (e.g. https://uibus.example/mcp); "
                "default: --oidc-client-id"})
    oidc_person_claim: str = field(default="sub", metadata={"help": "the claim naming the person (e.g. email)"})
    oidc_tenant_claim: str = field(default="tenant", metadata={"help": "the claim naming the person's tenant"})
    oidc_tenant: str = field(default="people", metadata={"help": "the tenant of a token without --oidc-tenant-claim"})
    oidc_roles_claim: str = field(default="groups", metadata={
        "help": "the claim (a list or a space-separated string) whose values grant a tenant-wide role"})
    oidc_role_map: str = field(default="", metadata={
        "help": "more claim values that grant a role: `admins=owner,reviewers=observer` (uibus-owner, "
                "uibus-approver, uibus-participant, uibus-observer always do; the strongest wins)"})
    oidc_leeway_seconds: float = field(default=30.0, metadata={
        "help": "clock skew allowed on a token's exp, nbf and iat"})
    # The page's sign-in session (uibus.infra.web_sessions): a cookie uibus signs, never the provider's tokens.
    session_secret_file: str = field(default="", metadata={
        "help": "file of the key (>= 32 bytes) that signs the page's sign-in cookies; empty: a random key kept "
                "in the store, shared by every replica"})
    session_max_age_seconds: float = field(default=8 * 3600.0, metadata={
        "help": "a page's sign-in lasts at most this long (and never past the provider's ID token)"})
    tls_cert: str = field(default="", metadata={"help": "PEM certificate chain; enables TLS on both ports"})
    tls_key: str = field(default="", metadata={"help": "PEM private key for --tls-cert"})
    http_tls_cert: str = field(default="", metadata={
        "help": "PEM certificate chain for the HTTP port only (default: --tls-cert)"})
    http_tls_key: str = field(default="", metadata={"help": "PEM private key for --http-tls-cert"})
    tls_client_ca: str = field(default="", metadata={
        "help": "PEM CA bundle: clients must present a certificate it signed (mTLS) on both ports"})
    http_header_timeout_seconds: float = field(default=5.0, metadata={
        "help": "an HTTP request's headers must arrive within this (from connect, or from its first byte)"})
    http_body_timeout_seconds: float = field(default=30.0, metadata={
        "help": "a request body must arrive whole within this of its request (a body sent a byte at a time "
                "holds a connection: 408 past it)"})
    http_idle_seconds: float = field(default=15.0, metadata={
        "help": "an idle keep-alive HTTP connection is closed after this"})
    http_max_connections: int = field(default=4096, metadata={
        "help": "open HTTP connections (WebSockets and streams included); beyond it new ones are refused"})
    # Per-tenant quotas (uibus.infra.quotas; a tenant is its token's name): 0 turns one off.
    quota_acp_connections: int = field(default=QUOTAS["acp_connections"].default, metadata={
        "help": "ACP connections (/acp WebSocket and HTTP) one tenant may hold open"})
    quota_codebolt_connections: int = field(default=QUOTAS["codebolt_connections"].default, metadata={
        "help": "CodeBolt agent connections one tenant may hold open"})
    quota_streams: int = field(default=QUOTAS["streams"].default, metadata={
        "help": "gRPC server streams (UI feeds, dialog streams, chats) one tenant may hold open"})
    quota_watches: int = field(default=QUOTAS["watches"].default, metadata={
        "help": "WatchSessions streams one tenant may hold open"})
    quota_sessions_per_minute: int = field(default=QUOTAS["sessions_per_minute"].default, metadata={
        "help": "sessions one tenant may create (CreateSession, ACP session/new) per minute"})
    quota_dialogs: int = field(default=QUOTAS["dialogs"].default, metadata={
        "help": "dialogs one tenant may have open (waiting for an answer)"})
    quota_mcp_tasks: int = field(default=QUOTAS["mcp_tasks"].default, metadata={
        "help": "MCP tasks (tasks extension: a hosted agent's turn each) one tenant may have running"})
    quota_agent_processes: int = field(default=QUOTAS["agent_processes"].default, metadata={
        "help": "processes of one hosted agent one tenant may hold (running or kept idle); at it, the "
                "tenant's own least recently used idle one is closed first (the agent's max_processes "
                "still caps them all)"})
    quota_tenant_memory_mb: int = field(default=QUOTAS["tenant_memory_mb"].default, metadata={
        "help": "MB of memory one tenant's hosted agents may use together (a cgroup per tenant, enforced by the "
                "kernel: past it one of them is stopped, \"stopped: the tenant's memory limit\")"})
    quota_tenant_pids: int = field(default=QUOTAS["tenant_pids"].default, metadata={
        "help": "processes one tenant's hosted agents may run together (a cgroup per tenant: a fork past it fails)"})
    quota_calls_per_second: int = field(default=QUOTAS["calls_per_second"].default, metadata={
        "help": "unary calls one tenant may make per second on each replica (a token bucket holding a tenth of a "
                "second of it); a call over it waits for its token (up to 1 s), then RESOURCE_EXHAUSTED; only "
                "with tokens configured; 0 turns it off"})
    tenant_concurrency: int = field(default=16, metadata={
        "help": "unary calls one tenant may have running at once; more wait their turn (16 per call, then "
                "RESOURCE_EXHAUSTED), so a busy tenant cannot slow the others' calls; 0 turns it off"})
    ws_ping_seconds: float = field(default=20.0, metadata={
        "help": "WebSocket ping interval; 0 turns pings off"})
    ws_ping_timeout_seconds: float = field(default=20.0, metadata={
        "help": "a WebSocket whose ping is not answered within this is closed"})
    agents: str = field(default="", metadata={"help": "agents config file (.json or .toml); empty = built-in"})
    workspaces_dir: str = field(default="", metadata={
        "help": "where hosted agents with workspace = \"worktree\" get their git worktrees (a shared volume "
                "across replicas); empty: the agents file's workspaces_dir, else <state dir>/workspaces"})
    agent_lease_seconds: float = field(default=10.0, metadata={
        "help": "with --redis-url: a hosted agent's owner lease expires this long after its replica stops "
                "renewing it; then another replica takes the agent over"})
    cors_origins: str = field(default="", metadata={
        "help": "comma-separated browser origins allowed on the HTTP port besides the page's own, loopback pages "
                "on this port and IDE webviews (`https://*.example.com` patterns work; `*` allows any page)"})
    allowed_hosts: str = field(default="", metadata={
        "help": "comma-separated Host names the HTTP port answers besides loopback names and the bound address "
                "(the names an ingress or proxy forwards; `*.example.com` works; `*` turns the check off)"})
    trust_network: bool = field(default=False, metadata={
        "help": "serve a non-loopback --host without tokens: only where every host that can reach it is trusted"})
    log_level: str = field(default="INFO", metadata={"help": "DEBUG, INFO, WARNING or ERROR"})
    loop: str = field(default="auto", metadata={
        "help": "the event loop: uvloop (libuv's: 10-17% less CPU per delivery, bench/README.md), asyncio "
                "(Python's own), or auto: uvloop where it is installed (a dependency on Linux and macOS)"})

    def __post_init__(self) -> None:
        """Refuses a config that cannot work, naming each bad flag, before anything starts: a typo must
        stop the server at once with a line the operator can act on, not fail later inside a call."""
        problems: list[tuple[str, str]] = []

        def check(ok: bool, name: str, what: str) -> None:
            if not ok:
                problems.append((_flag(name), what))

        for name in ("port", "http_port"):
            check(0 <= getattr(self, name) <= 65535, name, "must be within 0..65535")
        check(not (self.port and self.port == self.http_port), "http_port", "must differ from --port")
        for name in ("queue_size", "max_streams_per_session", "max_message_bytes", "chat_context_bytes",
                     "mailbox_bytes", "mailboxes_bytes", "max_sessions", "history_bytes", "http_max_connections"):
            check(getattr(self, name) >= 1, name, "must be at least 1")
        check(self.max_message_bytes <= 2**31 - 1, "max_message_bytes", "must be at most 2147483647 (gRPC's limit)")
        if self.max_message_bytes >= 1 and self.chat_context_bytes >= 1:
            check(self.chat_context_bytes <= self.max_message_bytes // 2, "chat_context_bytes",
                  f"must be at most half of --max-message-bytes ({self.max_message_bytes // 2}), as a reply "
                  "carries the context and the answer")
        check(self.mailboxes_bytes >= self.mailbox_bytes, "mailboxes_bytes", "must be at least --mailbox-bytes")
        for name in QUOTAS:
            check(getattr(self, f"quota_{name}") >= 0, f"quota_{name}", "must be 0 (off) or more")
        check(self.tenant_concurrency >= 0, "tenant_concurrency", "must be 0 (off) or more")
        check(not self.workspaces_dir or Path(self.workspaces_dir).expanduser().is_absolute(), "workspaces_dir",
              "must be an absolute path (every replica must name the same directory)")
        # The log's bounds may each be off (0), as LogRetention's; the newest entry is always kept.
        for name in ("log_max_events", "log_max_bytes"):
            check(getattr(self, name) >= 0, name, "must be 0 (off) or more")
        for name in ("session_ttl_seconds", "log_max_age_seconds", "keepalive_seconds", "grace_seconds",
                     "drain_seconds", "ws_ping_seconds", "audit_retention_days"):
            check(getattr(self, name) >= 0, name, "must be 0 (off) or more")
        check(self.session_max_age_seconds > 0, "session_max_age_seconds", "must be more than 0")
        check(0 < self.invite_ttl_seconds <= 90 * 24 * 3600, "invite_ttl_seconds",
              "must be within 1..7776000 (90 days)")
        for name in ("keepalive_timeout_seconds", "http_header_timeout_seconds", "http_body_timeout_seconds",
                     "http_idle_seconds",
                     "ws_ping_timeout_seconds", "agent_lease_seconds"):
            check(getattr(self, name) > 0, name, "must be more than 0")
        for cert, key in (("tls_cert", "tls_key"), ("http_tls_cert", "http_tls_key")):
            check(bool(getattr(self, key)) or not getattr(self, cert), cert, f"needs {_flag(key)} as well")
            check(bool(getattr(self, cert)) or not getattr(self, key), key, f"needs {_flag(cert)} as well")
        # Client certificates on both ports need TLS on both: mTLS on HTTP alone would leave gRPC open.
        check(not self.tls_client_ca or bool(self.tls_cert), "tls_client_ca",
              "needs TLS on both ports (--tls-cert and --tls-key)")
        if self.redis_url and not self.redis_url.startswith(_REDIS_SCHEMES):
            scheme = self.redis_url.partition("://")[0] if "://" in self.redis_url else "no scheme"
            problems.append(("--redis-url", f"must start with {', '.join(_REDIS_SCHEMES[:-1])} or "
                                            f"{_REDIS_SCHEMES[-1]} (got {scheme[:20]!r})"))
        check(1 <= self.bus_shards <= 16384, "bus_shards", "must be within 1..16384")
        check(not self.redis_cluster or bool(self.redis_url), "redis_cluster",
              "needs --redis-url (any node of the cluster)")
        check(not (self.redis_cluster and self.redis_url.startswith("redis+sentinel://")), "redis_cluster",
              "a Redis Cluster has no sentinels: name one of its nodes with redis:// or rediss://")
        # Workers share sessions and events only through Redis: each has its own store and bus otherwise.
        check(1 <= self.workers <= 64, "workers", "must be within 1..64")
        check(not 1 < self.workers <= 64 or bool(self.redis_url), "workers",
              "more than 1 needs --redis-url (the workers share sessions and events through Redis)")
        # A bind other machines can reach must not serve without tokens by accident (docs/security.md).
        check(self.trust_network or bool(self.auth_token or self.tokens_file or self.oidc_issuer)
              or is_loopback(self.host), "host",
              f"{self.host or '(every interface)'} is not a loopback address and neither --auth-token nor "
              "--tokens-file is set, so anyone who can reach this machine could drive every API: set a token, "
              "or add --trust-network if every host on this network is trusted")
        problems += oidc_problems(self)
        check(self.log_level.upper() in ("DEBUG", "INFO", "WARNING", "ERROR"), "log_level",
              f"{self.log_level[:20]!r} is not one of DEBUG, INFO, WARNING, ERROR")
        check(self.loop in LOOPS, "loop", f"{self.loop[:20]!r} is not one of {', '.join(LOOPS)}")
        if problems:
            raise InvalidConfig(*problems[0], problems[1:])

    def own_paths(self) -> tuple[str, ...]:
        """uibus's own files, which no sandboxed agent may see (uibus.agents.bubblewrap masks them):
        the store (and its SQLite side files), the tokens file, every TLS file."""
        paths = [self.tokens_file, self.session_secret_file, self.tls_cert, self.tls_key, self.http_tls_cert,
                 self.http_tls_key, self.tls_client_ca]
        if self.store and self.store != ":memory:" and not self.redis_url:
            paths += [self.store, self.store + "-wal", self.store + "-shm", self.store + "-journal"]
        return tuple(p for p in paths if p)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Adds one `--flag` per field. Values stay strings here and env vars are not read for the value:
        `from_args` parses both, so a bad `UIBUS_*` cannot break `--help` and every error is one line
        naming the flag or env var (argparse's own type errors would dump the usage)."""
        for f in fields(cls):
            env_name, env = _env(f.name), os.environ.get(_env(f.name))
            if f.metadata.get("secret"):  # --help is often pasted into tickets: never show a token
                shown = "set" if env else "not set"
            elif env is not None:
                shown = f"{redacted(env)!r} from the env"
            elif isinstance(_field_default(f), bool):
                shown = "on" if _field_default(f) else "off"
            else:
                shown = repr(_field_default(f))
            text = f"{f.metadata.get('help', '')} (env {env_name}, default: {shown})"
            # A switch takes no value on the command line (`--trust-network`); `=no` still turns it off.
            switch = {"nargs": "?", "const": "true", "metavar": "yes|no"} if isinstance(_field_default(f), bool) else {}
            parser.add_argument(_flag(f.name), dest=f.name, default=_UNSET, help=text.replace("%", "%%"), **switch)

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> Config:
        """The config from parsed flags over `UIBUS_*` env vars over defaults. Raises InvalidConfig naming
        the flag, or the env var when the value came from there; an env var shadowed by its flag is never
        read, so a stale bad one does not matter. An explicit `--store` must be in an existing directory
        (a typo must not silently create a tree and an empty store); the default location is created."""
        values: dict[str, Any] = {}
        problems: list[tuple[str, str]] = []
        for f in fields(cls):
            raw = getattr(ns, f.name, _UNSET)
            source = _flag(f.name)
            if raw is _UNSET:
                raw, source = os.environ.get(_env(f.name)), _env(f.name)
                if raw is None:
                    continue
            try:
                values[f.name] = _parse(type(_field_default(f)), raw)
            except ValueError as exc:
                problems.append((source, str(exc)))
        if problems:
            raise InvalidConfig(*problems[0], problems[1:])
        try:
            config = cls(**values)
        except InvalidConfig as exc:
            renamed = [(source_of(ns, s), w) for s, w in exc.problems]
            raise InvalidConfig(*renamed[0], renamed[1:]) from None
        if "store" in values and config.store != ":memory:" and not config.redis_url:
            folder = Path(config.store).expanduser().parent
            if not folder.is_dir():
                raise InvalidConfig(source_of(ns, "--store"), f"directory {folder} "
                                    f"{'is not a directory' if folder.exists() else 'does not exist'}")
        return config


def address(host: str, port: int) -> str:
    """`host:port` as a start-up line names it (`[::1]:26040` for IPv6)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def why_not(exc: OSError) -> str:
    """An OSError in words, without `[Errno 98]`: what the operator can check (one wording for
    `uibus serve` and for the parent of `--workers`)."""
    reasons = {errno.EADDRINUSE: "address in use", errno.EADDRNOTAVAIL: "address not available on this machine",
               errno.EACCES: "permission denied (ports below 1024 need privileges)"}
    return reasons.get(exc.errno or 0) or (exc.strerror or str(exc)).lower()
