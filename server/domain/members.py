"""A session's people: its tenant, its members and their roles, its invites; and who may answer a
dialog addressed to a role or a person.

Kept in the session store beside the session's other state (so it works on SQLite and on Redis, and
goes with the session when it is deleted or evicted):

* `team/members` — `{"tenant": str, "members": {person: role}}`. `tenant` is the tenant of the
  person whose call created the session (""=unknown: a session made by a machine, or before roles);
* `team/key` — the session's invite-signing key (random, made on the first invite): any replica
  verifies an invite of the session with it, and deleting the session voids its invites;
* `team/invite/<id>` — one record per invite (role, expiry, who made it): accepting checks that it
  is still there, so deleting it revokes the invite.

A person's role on a session is the stronger of their tenant-wide role (their grant's: from the
provider's claims or a tokens-file `role=`), which holds where their grant's patterns allow the
session and the session's tenant is theirs (or unknown), and the role its members give them.

Reads are cached per process for CACHE_S: a call costs no store round trip in the common case. A
change made here shows here at once (the cache is updated with what was written); on another replica
within CACHE_S (its cached copy expires), which is the bound docs/security/roles.md states.

The domain knows nothing of tokens: callers hand in the person, their tenant and tenant-wide role.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from uibus.domain.dialogs import Dialogs
from uibus.infra.auth import OPERATOR
from uibus.infra.dialog_limits import PERSON
from uibus.infra.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from uibus.infra.roles import APPROVER, OWNER, PARTICIPANT, ROLES, at_least, is_role, stronger
from uibus.infra.store import Store
from uibus.pb.uibus.v1 import extension_ui_pb2 as ext_pb

MEMBERS = "team/members"
KEY = "team/key"
INVITE = "team/invite/"
CACHE_S = 1.0  # a role change shows on other replicas within this long (and here at once)
CACHE = 4096  # sessions whose record is remembered
INVITE_TTL_S = 7 * 24 * 3600.0  # an invite's default lifetime (--invite-ttl-seconds)
MAX_INVITE_TTL_S = 90 * 24 * 3600.0
MAX_MEMBERS = 1024  # members of one session
MAX_INVITES = 256  # open invites of one session
_PERSON_ID = re.compile(r"[^\s\x00-\x1f]{1,256}")
_INVITE_ID = re.compile(r"[A-Za-z0-9_-]{8,64}")


@dataclass(frozen=True)
class Record:
    tenant: str = ""
    members: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Invite:
    id: str
    session: str
    role: str
    expires: float  # Unix seconds
    by: str = ""
    created: float = 0.0
    token: str = ""  # only when just made: never stored


def check_person(person: str) -> str:
    if not _PERSON_ID.fullmatch(person):
        raise InvalidArgument(f"person {person[:40]!r} is not a person's id (1 to 256 characters, no spaces)")
    return person


def check_role(role: str) -> str:
    if not is_role(role):
        raise InvalidArgument(f"role {role[:40]!r} is not a role (one of: {', '.join(ROLES)})")
    return role


def _record(raw: Any) -> Record | None:
    if not isinstance(raw, dict):
        return None
    members = raw.get("members")
    return Record(str(raw.get("tenant", "")), {str(k): str(v) for k, v in members.items() if is_role(str(v))}
                  if isinstance(members, dict) else {})


def _raw(record: Record) -> dict[str, Any]:
    return {"tenant": record.tenant, "members": dict(record.members)}


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Members:
    """The members and invites of every session, over the store, with a short read cache."""

    def __init__(self, store: Store, exists: Callable[[str], Any] | None = None, *, cache_s: float = CACHE_S,
                 invite_ttl_s: float = INVITE_TTL_S) -> None:
        """`exists(session)` (awaitable): whether the session already holds anything (a creating call
        on such a session without a record makes no owner: it was not created by that call)."""
        self.store = store
        self.exists = exists
        self.cache_s = cache_s
        self.invite_ttl_s = invite_ttl_s
        self._cache: OrderedDict[str, tuple[float, Record | None]] = OrderedDict()

    # ---- reading ----

    async def record(self, session: str) -> Record | None:
        now = time.monotonic()
        cached = self._cache.get(session)
        if cached is not None and now - cached[0] < self.cache_s:
            return cached[1]
        record = _record(await self.store.get(session, MEMBERS))
        self._remember(session, record, now)
        return record

    def _remember(self, session: str, record: Record | None, now: float | None = None) -> None:
        self._cache[session] = (time.monotonic() if now is None else now, record)
        self._cache.move_to_end(session)
        while len(self._cache) > CACHE:
            self._cache.popitem(last=False)

    async def role_of(self, session: str, person: str, tenant: str, tenant_role: str, allowed: bool,
                      unrecorded: str = "") -> str | None:
        """The person's role on `session` (module docstring); None: none. A tenant-wide role holds only
        on the tenant's own sessions: the tenant the session's record names, or for a session without
        one (made by a machine, or before roles) `unrecorded`, whose it is by the tokens file — so a
        provider's person, whose grant allows every name, never reaches another tenant's session."""
        record = await self.record(session)
        base = tenant_role or None
        owner_tenant = record.tenant if record is not None and record.tenant else unrecorded
        if (record is None and owner_tenant in ("", OPERATOR) and base is not None and allowed
                and self.exists is not None and not await self.exists(session)):
            # A name nobody uses yet, in no tenant's namespace (the tokens file binds none to it):
            # the person's to create, and to own (`claim`).
            owner_tenant = tenant
        if not allowed or owner_tenant != tenant:
            base = None
        member = record.members.get(person) if record is not None and person else None
        return stronger(base, member)

    # ---- writing ----

    async def _change(self, session: str, change: Callable[[Record | None], Record | None]) -> Record | None:
        def apply(raw: Any) -> Any:
            changed = change(_record(raw))
            return None if changed is None else _raw(changed)
        record = _record(await self.store.update(session, MEMBERS, apply))
        self._remember(session, record)
        return record

    async def claim(self, session: str, person: str, tenant: str) -> bool:
        """A person's call that creates `session`: with no record and nothing stored yet, they become
        its owner and its tenant is theirs. True when this call made them owner."""
        if await self.record(session) is not None:
            return False
        if self.exists is not None and await self.exists(session):
            self._remember(session, None)
            return False
        made = False

        def change(record: Record | None) -> Record | None:
            nonlocal made
            if record is not None:
                return record
            made = True
            return Record(tenant, {person: OWNER})
        await self._change(session, change)
        return made

    async def set_role(self, session: str, person: str, role: str) -> Record:
        check_person(person)
        check_role(role)

        def change(record: Record | None) -> Record:
            record = record or Record()
            if person not in record.members and len(record.members) >= MAX_MEMBERS:
                raise FailedPrecondition(f"session {session!r} already has {MAX_MEMBERS} members")
            return Record(record.tenant, {**record.members, person: role})
        changed = await self._change(session, change)
        assert changed is not None
        return changed

    async def remove(self, session: str, person: str) -> bool:
        """Removes a member (their tenant-wide role, if any, still holds); False: not a member."""
        found = False

        def change(record: Record | None) -> Record | None:
            nonlocal found
            if record is None or person not in record.members:
                return record
            found = True
            return Record(record.tenant, {p: r for p, r in record.members.items() if p != person})
        await self._change(session, change)
        return found

    # ---- invites ----

    async def _key(self, session: str, make: bool) -> bytes | None:
        raw = await self.store.get(session, KEY)
        if raw is None and make:
            fresh = _b64(secrets.token_bytes(32))
            raw = await self.store.update(session, KEY, lambda current: current or fresh)
        return _unb64(raw) if isinstance(raw, str) else None

    async def create_invite(self, session: str, role: str, ttl_s: float = 0, by: str = "") -> Invite:
        """A signed invite to `session` with `role`, valid `ttl_s` (0: the default) or until revoked."""
        check_role(role)
        ttl = ttl_s or self.invite_ttl_s
        if not 0 < ttl <= MAX_INVITE_TTL_S:
            raise InvalidArgument(f"ttl_seconds must be between 1 and {int(MAX_INVITE_TTL_S)}, not {ttl_s}")
        if len(await self.store.scan(session, INVITE)) >= MAX_INVITES:
            raise FailedPrecondition(f"session {session!r} already has {MAX_INVITES} open invites; revoke some")
        key = await self._key(session, make=True)
        assert key is not None
        now = time.time()
        invite = Invite(secrets.token_urlsafe(12), session, role, now + ttl, by, now)
        await self.store.put(session, INVITE + invite.id, {"role": role, "expires": invite.expires, "by": by,
                                                           "created": now})
        payload = _b64(json.dumps({"s": session, "i": invite.id, "r": role, "e": int(invite.expires)},
                                  separators=(",", ":")).encode())
        signature = _b64(hmac.new(key, payload.encode(), hashlib.sha256).digest())
        return Invite(invite.id, session, role, invite.expires, by, now, f"{payload}.{signature}")

    async def invites(self, session: str) -> list[Invite]:
        """The session's open invites (expired ones are dropped as they are seen), oldest first."""
        found, now = [], time.time()
        for key, value in (await self.store.scan(session, INVITE)).items():
            if not isinstance(value, dict):
                continue
            if float(value.get("expires", 0)) <= now:
                await self.store.put(session, key, None)
                continue
            found.append(Invite(key[len(INVITE):], session, str(value.get("role", "")), float(value["expires"]),
                                str(value.get("by", "")), float(value.get("created", 0))))
        return sorted(found, key=lambda i: i.created)

    async def revoke(self, session: str, invite_id: str) -> None:
        if not _INVITE_ID.fullmatch(invite_id) or await self.store.get(session, INVITE + invite_id) is None:
            raise NotFound(f"no open invite {invite_id[:80]!r} in session {session!r}")
        await self.store.put(session, INVITE + invite_id, None)

    async def accept(self, token: str, person: str) -> Invite:
        """Makes `person` a member with the invite's role (never lowering a role they hold there);
        PERMISSION_DENIED for a token that is not one of ours, FAILED_PRECONDITION for one expired or
        revoked."""
        check_person(person)
        payload, _, signature = token.strip().partition(".")
        try:
            claims = json.loads(_unb64(payload))
            session, invite_id, role, expires = claims["s"], claims["i"], claims["r"], float(claims["e"])
            given = _unb64(signature)
        except (ValueError, KeyError, TypeError, binascii.Error):
            raise InvalidArgument("that is not an invite token (it is `<payload>.<signature>`, as CreateInvite "
                                  "or the invite link gives it)") from None
        if not (isinstance(session, str) and isinstance(invite_id, str) and is_role(str(role))) or not session:
            raise InvalidArgument("that is not an invite token")
        key = await self._key(session, make=False)
        if key is None or not hmac.compare_digest(hmac.new(key, payload.encode(), hashlib.sha256).digest(), given):
            raise PermissionDenied("this invite's signature does not verify: it was not made by this uibus for "
                                   "that session (or the session was deleted since)")
        if expires <= time.time():
            raise FailedPrecondition(f"this invite to session {session!r} expired at "
                                     f"{time.strftime('%Y-%m-%d %H:%M:%SZ', time.gmtime(expires))}; ask for a new one")
        if await self.store.get(session, INVITE + invite_id) is None:
            raise FailedPrecondition(f"this invite to session {session!r} was revoked")
        record = await self.record(session)
        held = record.members.get(person) if record is not None else None
        if not at_least(held, str(role)):
            await self.set_role(session, person, str(role))
        return Invite(invite_id, session, str(role), expires)


# ---- dialogs addressed to a role or a person ----

# Who answers the call being served, as the pipeline's role check found them: (person, role on the
# call's session). None: not checked (a machine's owner token, or no tokens): any dialog.
ANSWERER: ContextVar[tuple[str, str] | None] = ContextVar("uibus_answerer", default=None)
DEFAULT_ADDRESSEE = {"select": APPROVER, "confirm": APPROVER, "input": PARTICIPANT, "editor": PARTICIPANT}


def addressee_of(method: str, addressee: str) -> str:
    return addressee or DEFAULT_ADDRESSEE.get(method, APPROVER)


def answer_refusal(method: str, addressee: str, answerer: tuple[str, str] | None) -> str | None:
    """Why `answerer` may not answer a dialog of kind `method` addressed to `addressee`; None: may."""
    if answerer is None:
        return None
    person, role = answerer
    to = addressee_of(method, addressee)
    if to.startswith(PERSON):
        return None if person and person == to[len(PERSON):] else \
            f"it is addressed to {to[len(PERSON):]!r} alone, and this caller is {person or 'no person'!r}"
    return None if at_least(role, to) else \
        f"it is addressed to the role {to}; this caller holds {role or 'no role'} on the session"


async def may_answer(dialogs: Dialogs, session: str, request: ext_pb.RespondRequest) -> None:
    """Where an answer arrives (any replica: uibus.replicas.placement), before it is applied or
    carried to the dialog's holder: PERMISSION_DENIED when the dialog (held here, or shared by
    another replica: its shared record carries the addressee) is not the caller's to answer; the
    dialog stays open. An unknown dialog is left to the usual NOT_FOUND."""
    answerer = ANSWERER.get()
    if answerer is None or not request.id:
        return
    held = dialogs.pending.find(session, request.id)
    found = held.request if held is not None else next(
        (r for r in await dialogs.sharing.read_dialogs_elsewhere(session) if r.id == request.id), None)
    method = found.WhichOneof("method") if found is not None else None
    if found is None or method is None:
        return
    why = answer_refusal(method, getattr(getattr(found, method), "addressee", ""), answerer)
    if why is not None:
        raise PermissionDenied(f"dialog {request.id} is not this caller's to answer: {why}")
