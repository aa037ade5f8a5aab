"""Who may call, and on which sessions: the bearer tokens uibus accepts.

Two sources, usable together:

* `--auth-token`: one token that may use every session (the operator's);
* `--tokens-file`: tenant tokens, each bound to glob patterns of the session names it may use, so
  one tenant's webview cannot read or publish into another tenant's sessions. The file is read
  at start (a bad file stops the start with one line naming the line) and again on SIGHUP (a bad
  file then keeps the tokens in force and logs why).

  ```
  # token                       sessions it may use
  4f1c0e…a7   team-a-*  shared-demo
  9b22d1…04   *
  ```

A presented token is looked up by its SHA-256 digest, so the time a lookup takes says nothing
about how much of a stored token matched, and no token is ever kept where a log line, `repr` or
`--help` could print it: a grant is named by where it came from ("--tokens-file line 3").
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from fnmatch import translate
from pathlib import Path

from uibus.errors import ConfigError

log = logging.getLogger("uibus.auth")

ALL = "*"
_PATTERN = re.compile(r"[A-Za-z0-9._:@/+=\-*?\[\]!]{1,256}")


@dataclass(frozen=True)
class Grant:
    """What one token may do: the sessions matching any of its patterns."""

    name: str  # where the token came from, for logs (never the token)
    patterns: tuple[str, ...]
    _regex: re.Pattern[str] = field(repr=False, compare=False)

    @classmethod
    def of(cls, name: str, patterns: Iterable[str]) -> Grant:
        pats = tuple(patterns)
        # One compiled alternation: a call pays one regex match, however many patterns a token has.
        regex = re.compile("|".join(f"(?:{translate(p)})" for p in pats)) if pats else re.compile(r"(?!)")
        return cls(name, pats, regex)

    @property
    def all_sessions(self) -> bool:
        """May use every session: the operator's token, allowed process-wide calls and /metrics."""
        return ALL in self.patterns

    def allows(self, session: str) -> bool:
        return self.all_sessions or self._regex.fullmatch(session) is not None


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


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
        if not patterns:
            raise ConfigError("--tokens-file", f"{where}: a token needs at least one session pattern (`*` = all)")
        for pattern in patterns:
            if not _PATTERN.fullmatch(pattern):
                raise ConfigError("--tokens-file", f"{where}: {pattern[:40]!r} is not a session pattern (session "
                                                   "characters A-Z a-z 0-9 . _ : @ / + = - and glob * ? [ ])")
        key = _digest(token.encode())
        if key in grants:
            raise ConfigError("--tokens-file", f"{where}: the same token is already on {grants[key].name}")
        grants[key] = Grant.of(f"--tokens-file line {number}", patterns)
    return grants


class Tokens:
    """The tokens in force. `enabled` is False when none is configured: then every call is open,
    as before authentication was configured (loopback development)."""

    def __init__(self, auth_token: str = "", tokens_file: str = "", metrics_token: str = "") -> None:
        self.tokens_file = tokens_file
        self._fixed: dict[bytes, Grant] = {}
        if auth_token:
            self._fixed[_digest(auth_token.encode())] = Grant.of("--auth-token", [ALL])
        self._metrics = _digest(metrics_token.encode()) if metrics_token else None
        self._grants: dict[bytes, Grant] = dict(self._fixed)
        # Told after every reload that took effect: what holds a stream or connection open ends
        # those whose token is no longer one of ours (`revoked`), within the reload.
        self.on_reload: list[Callable[[], None]] = []
        if tokens_file:
            self._grants = {**self._read(), **self._fixed}

    @property
    def enabled(self) -> bool:
        return bool(self._grants) or self._metrics is not None or bool(self.tokens_file)

    def __len__(self) -> int:
        return len(self._grants)

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
        for hook in list(self.on_reload):
            try:
                hook()
            except Exception as exc:  # one holder's failure must not keep the others' revoked streams open
                log.error("ending revoked streams failed", extra={"fields": {"error": f"{type(exc).__name__}: {exc}"}})
        return True

    def revoked(self, authorization: str | bytes | None) -> bool:
        """Whether a stream opened with this `Authorization` value must end now: tokens are on and
        its token is no longer one of them."""
        return self.enabled and self.grant(bearer(authorization)) is None

    def grant(self, token: bytes | None) -> Grant | None:
        """The grant of a presented token, None when it is not one of ours."""
        if token is None:
            return None
        return self._grants.get(_digest(token))

    def may_read_metrics(self, token: bytes | None) -> bool:
        """/metrics shows every tenant's traffic: the metrics token or an all-sessions token."""
        if token is None:
            return False
        digest = _digest(token)
        if self._metrics is not None and hmac.compare_digest(digest, self._metrics):
            return True
        grant = self._grants.get(digest)
        return grant is not None and grant.all_sessions
