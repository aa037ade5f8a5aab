"""Who may call, and on which sessions: the bearer tokens uibus accepts.

Two sources, usable together:

* `--auth-token`: one token that may use every session (the operator's);
* `--tokens-file`: tenant tokens, each bound to glob patterns of the session names it may use, so
  one tenant's webview cannot read or publish into another tenant's sessions. The file is read
  at start (a bad file stops the start with one line naming the line) and again on SIGHUP (a bad
  file then keeps the tokens in force and logs why).

  ```
  # token                       (tenant)   sessions it may use
  4f1c0e…a7   (team-a)  team-a-*  shared-demo
  77d0a3…5e   (team-a)  team-a-*             # team-a's next token, while the old one is rotated out
  9b22d1…04             *
  ```

  A word in parentheses names the token's tenant (letters, digits, `.`, `_`, `-`; at most one per
  line; `operator`, `anonymous` and names starting `t-` are reserved). It is optional: a line
  without one is as before. Parentheses cannot be in a session pattern, so no file that loaded
  before means anything else now.

A third kind lives in memory only: tokens *minted* for one hosted agent (`mint`), each allowed
exactly one session (no pattern: the session's name matched as it is), revoked when that agent
session closes (`revoke`). They are what an ACP agent is handed for uibus's own /mcp, so an agent
never holds a key of uibus's (docs/hosting/isolation.md); a replica mints for the agents it hosts, which call the
/mcp of that same replica. A minted token is the *agent's*, not the session's: the pipeline lets it
ask and notify the user, list its own session and stop its own turn, nothing else
(`uibus.edge.calls.scope`) — never chat with, steer or start an agent, nor create or delete
sessions, nor publish as a UI (a sandboxed agent must not make an unsandboxed one run commands).

Tenants — the one seam for everything keyed by whose it is (a sandboxed agent's home, docs/hosting/isolation.md;
per-tenant quotas, docs/security/quotas.md) — are strings fit for a directory name and a metrics label:

* `Grant.tenant`, whose a *caller* is: the token's `(name)` when its line gives one; else
  `t-<20 hex>`, a digest of the token (its line number moves with edits, the token does not);
  `operator` for the `--auth-token`; for a minted token, the tenant of the session it was minted
  for (an agent's calls are its session's tenant's).
* `Tokens.tenant(session)`, whose a *session* is: the tenants of the tokens-file grants, other
  than all-sessions (`*`) ones, that may use it, sorted and joined by `+` (in practice the one
  team whose patterns match the name); `operator` when none does, or when no tokens are
  configured. Unnamed tokens keep the digest they had before names existed (their homes stay).

A presented token is looked up by its SHA-256 digest, so the time a lookup takes says nothing
about how much of a stored token matched, and no token is ever kept where a log line, `repr` or
`--help` could print it: a grant is named by where it came from ("--tokens-file line 3").
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from fnmatch import translate
from pathlib import Path

from uibus.infra.errors import ConfigError, UibusError
from uibus.infra.roles import ROLES, is_role

log = logging.getLogger("uibus.infra.auth")

ALL = "*"
OPERATOR = "operator"  # the tenant of the --auth-token, and of sessions no tenant's token may use
_TENANT = re.compile(r"\(([A-Za-z0-9][A-Za-z0-9._-]{0,63})\)")
_RESERVED = re.compile(r"operator|anonymous|t-.*")
_PERSON = re.compile(r"[^\s\x00-\x1f]{1,256}")
OWNER_ROLE = "owner"
_PATTERN = re.compile(r"[A-Za-z0-9._:@/+=\-*?\[\]!]{1,256}")


@dataclass(frozen=True)
class Grant:
    """What one token may do: the sessions matching any of its patterns."""

    name: str  # where the token came from, for logs (never the token)
    patterns: tuple[str, ...]
    _regex: re.Pattern[str] = field(repr=False, compare=False)
    minted: bool = False  # minted for one agent session: exactly its one session, never all
    tenant: str = OPERATOR  # whose the caller is (module docstring, "Tenants")
    named: bool = False  # its tenant is the `(name)` its tokens-file line gives
    agent: str = ""  # minted: the hosted agent it was minted for (what it may do: uibus.edge.calls.scope)
    # A person's grant (a provider's token, the page's sign-in, a tokens-file `person=`): who, for the
    # audit log and session membership. "" for a machine's token.
    person: str = ""
    # The role this grant holds on every session it may use (uibus.infra.roles); "" = only the roles
    # the session's members give the person. A machine's tokens-file token is `owner` of its sessions,
    # as every token was before roles; a minted agent token has none (its scope decides).
    role: str = "owner"

    @classmethod
    def exactly(cls, name: str, session: str, tenant: str = OPERATOR, agent: str = "") -> Grant:
        """Exactly `session` (its name is no pattern here: `*` in it matches only `*`), for the hosted
        agent `agent`: an agent's token, whose calls the pipeline limits to what an agent needs."""
        return cls(name, (session,), re.compile(re.escape(session)), minted=True, tenant=tenant, agent=agent,
                   role="")

    @classmethod
    def of(cls, name: str, patterns: Iterable[str], tenant: str = OPERATOR, *, named: bool = False) -> Grant:
        pats = tuple(patterns)
        # One compiled alternation: a call pays one regex match, however many patterns a token has.
        regex = re.compile("|".join(f"(?:{translate(p)})" for p in pats)) if pats else re.compile(r"(?!)")
        return cls(name, pats, regex, tenant=tenant, named=named)

    @property
    def all_sessions(self) -> bool:
        """May use every session: the operator's token, allowed process-wide calls and /metrics."""
        return not self.minted and not self.person and ALL in self.patterns

    def allows(self, session: str) -> bool:
        return self.all_sessions or self._regex.fullmatch(session) is not None


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


def _unnamed(digests: Iterable[bytes]) -> str:
    """The tenant of unnamed tokens: a digest of their digests (sorted), as before names existed."""
    return "t-" + hashlib.sha256(b"".join(sorted(digests))).hexdigest()[:20]


def bearer(value: str | bytes | None) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` value (scheme case-insensitive, RFC 7235)."""
    if not value:
        return None
    raw = value.encode("latin-1", errors="replace") if isinstance(value, str) else value
    scheme, _, token = raw.strip().partition(b" ")
    token = token.strip()
    if scheme.lower() != b"bearer" or not token:
        return None
    return token


def parse_tokens_file(text: str, source: str) -> dict[bytes, Grant]:
    """Grants by token digest from the text of a tokens file; ConfigError naming the line when a
    line cannot be a grant (so a typo never silently locks a tenant out or opens everything)."""
    grants: dict[bytes, Grant] = {}
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        token, patterns = words[0], words[1:]
        where = f"{source}: line {number}"
        names = [w for w in patterns if w.startswith("(")]
        patterns = [w for w in patterns if not w.startswith("(")]
        if len(names) > 1:
            raise ConfigError("--tokens-file", f"{where}: one (tenant) per token, not {' '.join(names)[:80]}")
        name = ""
        if names:
            found = _TENANT.fullmatch(names[0])
            if found is None:
                raise ConfigError("--tokens-file", f"{where}: {names[0][:40]!r} is not a tenant name (letters, "
                                                   "digits . _ -, at most 64, in parentheses)")
            name = found.group(1)
            if _RESERVED.fullmatch(name):
                raise ConfigError("--tokens-file", f"{where}: tenant name {name!r} is reserved (operator, "
                                                   "anonymous, t-…)")
        person, role, patterns = _person_and_role(patterns, where)
        if not patterns:
            raise ConfigError("--tokens-file", f"{where}: a token needs at least one session pattern (`*` = all)")
        for pattern in patterns:
            if not _PATTERN.fullmatch(pattern):
                raise ConfigError("--tokens-file", f"{where}: {pattern[:40]!r} is not a session pattern (session "
                                                   "characters A-Z a-z 0-9 . _ : @ / + = - and glob * ? [ ])")
        key = _digest(token.encode())
        if key in grants:
            raise ConfigError("--tokens-file", f"{where}: the same token is already on {grants[key].name}")
        grants[key] = replace(Grant.of(f"--tokens-file line {number}", patterns, name or _unnamed((key,)),
                                       named=bool(name)), person=person, role=role)
    return grants


def _person_and_role(words: list[str], where: str) -> tuple[str, str, list[str]]:
    """The words `person=<id>` (the token is that person's: session membership, the audit log) and
    `role=<role>` (the role it holds on every session its patterns allow; default owner), at most
    one each, and the other words (the session patterns)."""
    found: dict[str, str] = {}
    rest = []
    for word in words:
        key, eq, value = word.partition("=")
        if eq and key in ("person", "role"):
            if key in found:
                raise ConfigError("--tokens-file", f"{where}: one {key}= per token")
            found[key] = value
        else:
            rest.append(word)
    person, role = found.get("person", ""), found.get("role", OWNER_ROLE)
    if "person" in found and not _PERSON.fullmatch(person):
        raise ConfigError("--tokens-file", f"{where}: person={person[:40]!r} is not a person's id (1 to 256 "
                                           "characters, no spaces)")
    if not is_role(role):
        raise ConfigError("--tokens-file", f"{where}: role={role[:40]!r} is not a role (one of: {', '.join(ROLES)})")
    return person, role, rest


class Tokens:
    """The tokens in force. `enabled` is False when none is configured: then every call is open,
    as before authentication was configured (loopback development)."""

    def __init__(self, auth_token: str = "", tokens_file: str = "", metrics_token: str = "") -> None:
        self.tokens_file = tokens_file
        self._fixed: dict[bytes, Grant] = {}
        if auth_token:
            self._fixed[_digest(auth_token.encode())] = Grant.of("--auth-token", [ALL], OPERATOR)
        self._metrics = _digest(metrics_token.encode()) if metrics_token else None
        self._grants: dict[bytes, Grant] = dict(self._fixed)
        # Told after every reload that took effect: what holds a stream or connection open ends
        # those whose token is no longer one of ours (`revoked`), within the reload.
        self.on_reload: list[Callable[[], None]] = []
        self._minted: dict[bytes, Grant] = {}
        # Tokens that are not in the file but carry their own proof (a provider's JWT, the page's
        # sign-in session): each verifier returns the grant of a token it recognises and accepts,
        # None for a token that is not its kind, and raises Unauthenticated for one of its kind it
        # refuses (expired, foreign issuer), so the caller hears why. Asked in order, after the file.
        self.verifiers: list[Callable[[bytes], Grant | None]] = []
        if tokens_file:
            self._grants = {**self._read(), **self._fixed}

    @property
    def enabled(self) -> bool:
        return bool(self._grants) or self._metrics is not None or bool(self.tokens_file) or bool(self.verifiers)

    def __len__(self) -> int:
        return len(self._grants)

    def __bool__(self) -> bool:
        """Always true, whatever `len` says: `tokens or Tokens()` (the pipeline's, the routes') must
        keep a Tokens whose only tokens are verifiers' (a provider's) or the metrics token."""
        return True

    def _read(self) -> dict[bytes, Grant]:
        path = Path(self.tokens_file)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError("--tokens-file", f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
        return parse_tokens_file(text, str(path))

    def reload(self) -> bool:
        """Re-reads the tokens file (SIGHUP). A file that cannot be read or parsed leaves the tokens
        in force unchanged and is logged; True when the new tokens took effect."""
        if not self.tokens_file:
            return False
        try:
            grants = self._read()
        except ConfigError as exc:
            log.error("tokens file not reloaded; the previous tokens stay in force",
                      extra={"fields": {"error": exc.what}})
            return False
        self._grants = {**grants, **self._fixed}
        log.info("tokens reloaded", extra={"fields": {"file": self.tokens_file, "tokens": len(grants)}})
        self.tell_revoked()
        return True

    def tell_revoked(self) -> None:
        """Runs the `on_reload` hooks: what holds streams open ends those whose token no longer counts
        (after a reload, and after a page's sign-out revoked its session token)."""
        for hook in list(self.on_reload):
            try:
                hook()
            except Exception as exc:  # one holder's failure must not keep the others' revoked streams open
                log.error("ending revoked streams failed", extra={"fields": {"error": f"{type(exc).__name__}: {exc}"}})

    def revoked(self, authorization: str | bytes | None) -> bool:
        """Whether a stream opened with this `Authorization` value must end now: tokens are on and
        its token is no longer one of them."""
        if not self.enabled:
            return False
        try:
            return self.grant(bearer(authorization)) is None
        except UibusError:  # a verifier's refusal: expired, or its issuer no longer trusted
            return True

    def grant(self, token: bytes | None) -> Grant | None:
        """The grant of a presented token, None when it is not one of ours."""
        if token is None:
            return None
        digest = _digest(token)
        found = self._grants.get(digest) or self._minted.get(digest)
        if found is None:
            for verify in self.verifiers:
                if (found := verify(token)) is not None:
                    break
        return found

    # ---- tokens minted for hosted agents ----

    def mint(self, session: str, agent: str) -> str:
        """A new token that may use `session` alone, for the agent `agent` hosted in it; valid until
        `revoke`. Only its digest is kept."""
        token = secrets.token_urlsafe(32)
        self._minted[_digest(token.encode())] = Grant.exactly(f"agent {agent} in session {session}", session,
                                                              self.tenant(session), agent)
        return token

    def revoke(self, token: str) -> None:
        self._minted.pop(_digest(token.encode()), None)

    @property
    def minted(self) -> int:
        """Minted tokens valid now (tests: they go with their agent sessions)."""
        return len(self._minted)

    def tenant(self, session: str) -> str:
        """Whose session `session` is (module docstring, "Tenants"): the names of the tenants whose
        tokens may use it, sorted, `+`-joined; `operator` when none. Fit for a directory name."""
        owners = [(key, grant) for key, grant in self._grants.items()
                  if not grant.all_sessions and grant.allows(session)]
        names = {grant.tenant for _, grant in owners if grant.named}
        unnamed = [key for key, grant in owners if not grant.named]
        if unnamed:  # together, as one digest: what these sessions' homes were named before names
            names.add(_unnamed(unnamed))
        return "+".join(sorted(names)) or OPERATOR

    def may_read_metrics(self, token: bytes | None) -> bool:
        """/metrics shows every tenant's traffic: the metrics token or an all-sessions token."""
        if token is None:
            return False
        digest = _digest(token)
        if self._metrics is not None and hmac.compare_digest(digest, self._metrics):
            return True
        grant = self._grants.get(digest)
        return grant is not None and grant.all_sessions
