"""A person's identity provider, as configured: the `--oidc-*` settings checked at start, and the one
mapping from a verified token's claims to a `Grant` (who the person is, whose tenant, which role).

Kept apart from the verification (uibus.infra.oidc) and the key fetching (uibus.infra.oidc_keys) so
the config can check the flags without importing either, and so the page's sign-in (an ID token's
claims) and the bearer tokens (an access token's) map claims the one same way.

The mapping (docs/security/sign-in.md):

* person: the `--oidc-person-claim` (default `sub`; e.g. `email`), a non-empty string;
* tenant: the `--oidc-tenant-claim` (default `tenant`) when the token has it, else `--oidc-tenant`
  (default `people`); a tenant is a name fit for a directory and a label, not a reserved one;
* role: each value of the `--oidc-roles-claim` (default `groups`; a list or a space-separated string)
  that names a role grants it tenant-wide: `uibus-owner`, `uibus-approver`, `uibus-participant`,
  `uibus-observer`, and the values `--oidc-role-map` adds (`admins=owner,reviewers=observer`); the
  strongest wins; none: "" (only the roles a session's members give the person).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from uibus.infra.auth import ALL, Grant
from uibus.infra.errors import ConfigError, Unauthenticated
from uibus.infra.roles import ROLES, is_role, stronger

# What a claim value grants without any --oidc-role-map: `uibus-<role>`.
BUILT_IN_ROLES = {f"uibus-{role}": role for role in ROLES}
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_RESERVED = re.compile(r"operator|anonymous|t-.*")
_CLAIM = re.compile(r"[A-Za-z0-9_.:/-]{1,128}")


@dataclass(frozen=True)
class OidcSettings:
    """The `--oidc-*` flags, parsed (`settings_of`)."""

    issuer: str
    client_id: str = ""
    client_secret: str = field(default="", repr=False)
    audiences: tuple[str, ...] = ()
    person_claim: str = "sub"
    tenant_claim: str = "tenant"
    tenant: str = "people"
    roles_claim: str = "groups"
    role_map: Mapping[str, str] = field(default_factory=lambda: dict(BUILT_IN_ROLES))
    leeway_s: float = 30.0


def parse_role_map(text: str) -> dict[str, str]:
    """`value=role,…` as {value: role}, over the built-in `uibus-<role>` values; ValueError naming a
    pair that is not one."""
    mapping = dict(BUILT_IN_ROLES)
    for pair in (p.strip() for p in text.split(",")):
        if not pair:
            continue
        value, sep, role = (w.strip() for w in pair.partition("="))
        if not sep or not value or not is_role(role):
            raise ValueError(f"{pair[:60]!r} is not value=role (a role is one of {', '.join(ROLES)})")
        mapping[value] = role
    return mapping


def _secure_url(url: str) -> bool:
    """https, or http to a loopback host (a provider on this machine, the tests')."""
    parts = urlsplit(url)
    if parts.scheme == "https":
        return bool(parts.hostname)
    host = (parts.hostname or "").lower()
    return parts.scheme == "http" and (host in ("localhost", "::1") or host.startswith("127."))


def oidc_problems(config: Any) -> list[tuple[str, str]]:
    """What is wrong with the `--oidc-*` flags of `config` (a uibus.infra.config.Config), each as
    (flag, what): the config refuses to start with them."""
    problems: list[tuple[str, str]] = []
    if not config.oidc_issuer:
        for name in ("oidc_client_id", "oidc_client_secret", "oidc_client_secret_file", "oidc_audience"):
            if getattr(config, name):
                problems.append((_flag(name), "needs --oidc-issuer"))
        return problems
    if not _secure_url(config.oidc_issuer) or urlsplit(config.oidc_issuer).query or "#" in config.oidc_issuer:
        problems.append(("--oidc-issuer", f"{config.oidc_issuer[:80]!r} is not an https URL (http only to a "
                                          "loopback address) without query or fragment"))
    if not (config.oidc_audience or config.oidc_client_id):
        problems.append(("--oidc-audience", "is needed when --oidc-client-id is not set (the `aud` an access "
                                            "token must carry)"))
    if config.oidc_client_secret and config.oidc_client_secret_file:
        problems.append(("--oidc-client-secret-file", "give --oidc-client-secret or the file, not both"))
    for name in ("oidc_person_claim", "oidc_tenant_claim", "oidc_roles_claim"):
        if not _CLAIM.fullmatch(getattr(config, name)):
            problems.append((_flag(name), f"{getattr(config, name)[:40]!r} is not a claim name"))
    if not _TENANT.fullmatch(config.oidc_tenant) or _RESERVED.fullmatch(config.oidc_tenant):
        problems.append(("--oidc-tenant", f"{config.oidc_tenant[:40]!r} is not a tenant name (letters, digits "
                                          ". _ -, at most 64; not operator, anonymous, t-…)"))
    try:
        parse_role_map(config.oidc_role_map)
    except ValueError as exc:
        problems.append(("--oidc-role-map", str(exc)))
    if config.oidc_leeway_seconds < 0 or config.oidc_leeway_seconds > 600:
        problems.append(("--oidc-leeway-seconds", "must be within 0..600"))
    return problems


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def settings_of(config: Any) -> OidcSettings | None:
    """The provider settings of a checked config; None when --oidc-issuer is not set. Reads the
    client secret's file here (ConfigError naming it when it cannot be read)."""
    if not config.oidc_issuer:
        return None
    secret = config.oidc_client_secret
    if config.oidc_client_secret_file:
        try:
            secret = Path(config.oidc_client_secret_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError("--oidc-client-secret-file", f"cannot read {config.oidc_client_secret_file}: "
                                                           f"{getattr(exc, 'strerror', None) or exc}") from None
    audiences = tuple(a.strip() for a in config.oidc_audience.split(",") if a.strip()) or (config.oidc_client_id,)
    return OidcSettings(config.oidc_issuer, config.oidc_client_id, secret, audiences,
                        config.oidc_person_claim, config.oidc_tenant_claim, config.oidc_tenant,
                        config.oidc_roles_claim, parse_role_map(config.oidc_role_map), config.oidc_leeway_seconds)


def role_of(settings: OidcSettings, claims: Mapping[str, Any]) -> str:
    """The tenant-wide role the roles claim grants: the strongest mapped value's; "" for none."""
    values = claims.get(settings.roles_claim)
    if isinstance(values, str):
        values = values.split()
    if not isinstance(values, list):
        return ""
    role: str | None = None
    for value in values:
        if isinstance(value, str) and value in settings.role_map:
            role = stronger(role, settings.role_map[value])
    return role or ""


def grant_of(settings: OidcSettings, claims: Mapping[str, Any]) -> Grant:
    """The grant of a verified token's claims (the module docstring's mapping); Unauthenticated
    naming the claim when the person or tenant claim cannot be used."""
    person = claims.get(settings.person_claim)
    if not isinstance(person, str) or not person.strip() or len(person) > 256:
        raise Unauthenticated(f"the token has no usable {settings.person_claim!r} claim (--oidc-person-claim): "
                              "it names no person")
    tenant = claims.get(settings.tenant_claim, settings.tenant)
    if not isinstance(tenant, str) or not _TENANT.fullmatch(tenant) or _RESERVED.fullmatch(tenant):
        raise Unauthenticated(f"the token's {settings.tenant_claim!r} claim {str(tenant)[:40]!r} is not a tenant "
                              "name uibus accepts (letters, digits . _ -; not operator, anonymous, t-…)")
    sub = str(claims.get("sub", ""))[:128]
    grant = Grant.of(f"oidc {settings.issuer} sub {sub}", [ALL], tenant, named=True)
    return replace(grant, person=person, role=role_of(settings, claims))
