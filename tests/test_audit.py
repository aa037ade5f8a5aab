"""The audit log (uibus.infra.audit, docs/security/audit.md) on a real server: a scripted day of
approvals, denials, a stop, a delete — by people named in the tokens file, through gRPC, gRPC-Web and
the HTTP API — then the log lists every act with its person and door; the HTTP and gRPC APIs filter
by session, person and time; the export is JSON lines whose hashes check; no token value is in the
store; `uibus audit verify` (a subprocess, reading the SQLite file) passes, and fails naming the
entry after one row is edited, deleted or two are swapped with sqlite3; retention keeps the chain
verifiable."""

from __future__ import annotations

import asyncio
import hashlib
import json
import sqlite3
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.conftest import start_app, wait_for
from tests.support import http_client
from tests.webclient import call
from uibus.app import App
from uibus.infra.audit import AuditLog, Query, canonical
from uibus.infra.config import Config
from uibus.pb.uibus.v1 import audit_pb2, audit_pb2_grpc, sessions_pb2, sessions_pb2_grpc
from uibus.pb.uibus.v1 import extension_ui_pb2 as ext
from uibus.pb.uibus.v1 import extension_ui_pb2_grpc as ext_grpc

pytestmark = pytest.mark.timeout(60)

TOKENS = {"alice": "alice-token-5f1e0c9d2b", "bob": "bob-token-77a3e1c0d4", "agent": "agent-token-0c4ab7e21f",
          "admin": "admin-token-9d8e7f6a5b", "carol": "carol-token-31b2c4d5e6"}
TOKENS_FILE = f"""\
{TOKENS['alice']}  (team)  day-*  person=alice
{TOKENS['bob']}    (team)  day-*  person=bob
{TOKENS['carol']}  (team)  other-*  person=carol
{TOKENS['agent']}  (team)  day-*
{TOKENS['admin']}  *
"""
SESSION = "day-1"


def md(who: str, session: str | None = SESSION) -> tuple[tuple[str, str], ...]:
    meta = (("authorization", f"Bearer {TOKENS[who]}"),)
    return (*meta, ("x-uibus-session", session)) if session else meta


def verify(store: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "uibus", "audit", "verify", "--store", store],
                          capture_output=True, text=True, timeout=30)


@pytest.fixture
async def team(web_config: Config, tmp_path: Path) -> AsyncIterator[App]:
    path = tmp_path / "tokens"
    path.write_text(TOKENS_FILE)
    app = await start_app(replace(web_config, tokens_file=str(path)))
    try:
        yield app
    finally:
        await app.aclose(grace=0.5)


async def _dialog(ch: grpc.aio.Channel, ask: Any, request: Any) -> tuple[asyncio.Task[Any], str]:
    """An agent's dialog, asked with the agent's token; its id, seen by a UI's Subscribe."""
    ui = ext_grpc.ExtensionUiServiceStub(ch).Subscribe(ext.SubscribeRequest(), metadata=md("alice"))
    asked = asyncio.ensure_future(ask(request, metadata=md("agent")))
    try:
        async for event in ui:
            if event.WhichOneof("event") == "request" and event.request.WhichOneof("method") in (
                    "confirm", "select", "input"):
                return asked, event.request.id
    finally:
        ui.cancel()
    raise AssertionError("no dialog seen")


async def scripted_day(app: App) -> float:
    """The day's acts; returns the time (s) between the first half (create, approve) and the rest."""
    target = f"127.0.0.1:{app.port}"
    async with grpc.aio.insecure_channel(target) as ch, http_client(app) as web:
        sessions = sessions_pb2_grpc.SessionServiceStub(ch)
        ui = ext_grpc.ExtensionUiServiceStub(ch)
        await sessions.CreateSession(sessions_pb2.CreateSessionRequest(title="the day"), metadata=md("alice"))
        # alice approves over gRPC-Web: the agent's confirm
        asked, dialog = await _dialog(ch, ui.Confirm, ext.ConfirmRequest(title="Run rm -rf build?",
                                                                         message="the agent wants to clean"))
        answer = ext.RespondRequest(id=dialog, confirmed=True).SerializeToString()
        reply = await call(web, "/uibus.v1.ExtensionUiService/Respond", answer,
                           headers={"authorization": f"Bearer {TOKENS['alice']}", "x-uibus-session": SESSION,
                                    "user-agent": "audit-test-page/1.0"})
        assert reply.http_status == 200 and reply.status == 0, reply
        assert (await asyncio.wait_for(asked, 10)).confirmed is True
        await asyncio.sleep(0.05)
        middle = time.time()
        await asyncio.sleep(0.05)
        # bob denies over gRPC; then picks an option of a select
        asked, dialog = await _dialog(ch, ui.Confirm, ext.ConfirmRequest(title="git push --force?"))
        await ui.Respond(ext.RespondRequest(id=dialog, confirmed=False), metadata=md("bob"))
        assert (await asyncio.wait_for(asked, 10)).confirmed is False
        asked, dialog = await _dialog(ch, ui.Select, ext.SelectRequest(title="Which branch?", options=["main", "dev"]))
        await ui.Respond(ext.RespondRequest(id=dialog, value="dev"), metadata=md("bob"))
        assert (await asyncio.wait_for(asked, 10)).value == "dev"
        # a second answer to an answered dialog is refused, and not recorded
        with pytest.raises(grpc.aio.AioRpcError):
            await ui.Respond(ext.RespondRequest(id=dialog, value="main"), metadata=md("alice"))
        # bob stops the agent's turn over the HTTP API (none ran: recorded as asked)
        stop = await web.post("/api/v1/sessions/StopTurn", json={"agent": "pi"},
                              headers={"authorization": f"Bearer {TOKENS['bob']}", "x-uibus-session": SESSION})
        assert stop.status_code == 200, stop.text
        # alice deletes the session
        await sessions.DeleteSession(sessions_pb2.DeleteSessionRequest(), metadata=md("alice"))
    return middle


async def test_a_scripted_day_lists_every_act_with_its_person_and_door(team: App, tmp_path: Path) -> None:
    middle = await scripted_day(team)
    async with http_client(team) as web:
        got = await web.get("/api/audit", params={"session": SESSION},
                            headers={"authorization": f"Bearer {TOKENS['alice']}"})
        assert got.status_code == 200, got.text
        entries = got.json()["entries"]
    acts = [(e["act"], e["who"], e.get("person", ""), e["door"]) for e in entries]
    assert acts == [
        ("session.create", "alice", "alice", "grpc"),
        ("dialog.approve", "alice", "alice", "grpc-web"),
        ("dialog.deny", "bob", "bob", "grpc"),
        ("dialog.answer", "bob", "bob", "grpc"),
        ("steer.stop", "bob", "bob", "http"),
        ("session.delete", "alice", "alice", "grpc"),
    ], acts
    approve, deny, pick = entries[1:4]
    assert approve["detail"]["title"] == "Run rm -rf build?" and approve["detail"]["answer"] == "approved"
    assert approve["detail"]["kind"] == "confirm" and approve["client"] == "audit-test-page/1.0"
    assert approve["tenant"] == "team"
    assert deny["detail"]["answer"] == "denied" and deny["detail"]["title"] == "git push --force?"
    assert pick["detail"]["value"] == "dev" and pick["detail"]["options"] == "main, dev"
    assert entries[0]["client"].startswith("grpc-python")

    # gRPC: filtered by person, by time; the admin sees every session, alice only hers
    async with grpc.aio.insecure_channel(f"127.0.0.1:{team.port}") as ch:
        audit = audit_pb2_grpc.AuditServiceStub(ch)
        bobs = await audit.List(audit_pb2.ListAuditRequest(person="bob"), metadata=md("alice"))
        assert [e.act for e in bobs.entries] == ["dialog.deny", "dialog.answer", "steer.stop"]
        later = await audit.List(audit_pb2.ListAuditRequest(since_ms=int(middle * 1000)), metadata=md("alice"))
        assert [e.act for e in later.entries] == ["dialog.deny", "dialog.answer", "steer.stop", "session.delete"]
        earlier = await audit.List(audit_pb2.ListAuditRequest(until_ms=int(middle * 1000)), metadata=md("alice"))
        assert [e.act for e in earlier.entries] == ["session.create", "dialog.approve"]
        paged = await audit.List(audit_pb2.ListAuditRequest(limit=2), metadata=md("alice"))
        assert len(paged.entries) == 2 and paged.next_after == paged.entries[-1].seq
        assert paged.entries[1].detail["answer"] == "approved"
        everything = await audit.List(audit_pb2.ListAuditRequest(all_sessions=True), metadata=md("admin", None))
        assert len(everything.entries) == 6
        for refused, who, code in ((audit_pb2.ListAuditRequest(all_sessions=True), "alice",
                                    grpc.StatusCode.PERMISSION_DENIED),
                                   (audit_pb2.ListAuditRequest(session="other-1"), "alice",
                                    grpc.StatusCode.INVALID_ARGUMENT)):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await audit.List(refused, metadata=md(who))
            assert err.value.code() == code, err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:  # carol's token may not use day-1
            await audit.List(audit_pb2.ListAuditRequest(), metadata=md("carol"))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.aio.AioRpcError) as err:  # the whole chain: an all-sessions token only
            await audit.Verify(audit_pb2.VerifyAuditRequest(), metadata=md("alice"))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        verified = await audit.Verify(audit_pb2.VerifyAuditRequest(), metadata=md("admin", None))
        assert verified.ok and verified.entries == 6

    # HTTP: the filters, the refusals, and the export as JSON lines whose hashes check
    async with http_client(team) as web:
        admin = {"authorization": f"Bearer {TOKENS['admin']}"}
        got = await web.get("/api/audit", params={"person": "alice", "since": "0"}, headers=admin)
        assert [e["act"] for e in got.json()["entries"]] == ["session.create", "dialog.approve", "session.delete"]
        iso = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(middle)) + f".{int(middle * 1000) % 1000:03d}Z"
        got = await web.get("/api/audit", params={"until": iso, "act": "dialog."}, headers=admin)
        assert [e["act"] for e in got.json()["entries"]] == ["dialog.approve"]
        assert (await web.get("/api/audit", headers={"authorization": f"Bearer {TOKENS['bob']}"})).status_code == 403
        assert (await web.get("/api/audit", params={"session": SESSION})).status_code == 401
        bad = await web.get("/api/audit", params={"since": "yesterday"}, headers=admin)
        assert bad.status_code == 400 and "since" in bad.json()["error"]
        exported = await web.get("/api/audit/export", headers=admin)
        assert exported.status_code == 200 and exported.headers["content-type"].startswith("application/json-lines")
        lines = [json.loads(line) for line in exported.text.splitlines()]
        assert [e["seq"] for e in lines] == [1, 2, 3, 4, 5, 6]
        prev = "0" * 64
        for entry in lines:
            body = {k: v for k, v in entry.items() if k != "hash"}
            assert entry["prev"] == prev and hashlib.sha256(canonical(body)).hexdigest() == entry["hash"]
            prev = entry["hash"]

    # nothing secret in the store: no token value anywhere in the file
    await team.aclose(grace=0.5)
    raw = b"".join(p.read_bytes() for p in tmp_path.glob("uibus.db*"))
    assert b"dialog.approve" in raw
    for token in TOKENS.values():
        assert token.encode() not in raw


async def test_verify_names_an_edited_a_deleted_and_a_swapped_entry(team: App, tmp_path: Path) -> None:
    await scripted_day(team)
    await team.aclose(grace=0.5)
    store = str(tmp_path / "uibus.db")
    ok = verify(store)
    assert ok.returncode == 0 and ok.stdout.strip() == "chain of 6 entries verified", ok.stdout + ok.stderr

    db = sqlite3.connect(store)
    entry = json.loads(db.execute("SELECT entry FROM audit WHERE seq=3").fetchone()[0])
    entry["who"] = "mallory"
    db.execute("UPDATE audit SET entry=? WHERE seq=3", (json.dumps(entry),))
    db.commit()
    bad = verify(store)
    assert bad.returncode == 1 and "broken at seq 3" in bad.stderr and "changed" in bad.stderr, bad.stderr

    db.execute("UPDATE audit SET who='mallory' WHERE seq=3")  # the column alone, the entry put back
    entry["who"] = "bob"
    db.execute("UPDATE audit SET entry=? WHERE seq=3", (json.dumps(entry, sort_keys=True),))
    db.commit()
    bad = verify(store)
    assert bad.returncode == 1 and "seq 3" in bad.stderr and "who" in bad.stderr, bad.stderr
    db.execute("UPDATE audit SET who='bob' WHERE seq=3")
    db.commit()
    assert verify(store).returncode == 0

    db.execute("DELETE FROM audit WHERE seq=4")
    db.commit()
    bad = verify(store)
    assert bad.returncode == 1 and "broken at seq 4" in bad.stderr and "removed" in bad.stderr, bad.stderr

    db.execute("DELETE FROM audit WHERE seq=6")  # the newest too: the head still names it
    db.execute("UPDATE audit SET seq=4 WHERE seq=5")
    db.commit()
    bad = verify(store)
    assert bad.returncode == 1 and "seq 4" in bad.stderr and "reordered" in bad.stderr, bad.stderr
    db.close()

    exported = subprocess.run([sys.executable, "-m", "uibus", "audit", "export", "--store", store, "--person", "alice"],
                              capture_output=True, text=True, timeout=30)
    assert exported.returncode == 0
    assert [json.loads(line)["act"] for line in exported.stdout.splitlines()] == ["session.create", "dialog.approve"]


async def test_retention_removes_the_oldest_and_the_rest_still_verifies(config: Config, tmp_path: Path) -> None:
    app = await start_app(replace(config, audit_retention_days=1))
    try:
        audit = app.audit
        assert isinstance(audit, AuditLog)
        for i in range(5):
            await audit.record("test.act", session="s", n=i)
        db = sqlite3.connect(str(tmp_path / "uibus.db"))
        old = int((time.time() - 3 * 86400) * 1000)
        # the first three are made old, as retention sees them (their time column); their hashes stay
        db.execute("UPDATE audit SET at_ms=? WHERE seq<=3", (old,))
        db.commit()
        assert await audit.sweep() == 3
        assert [e["seq"] for e in await audit.list(Query(session="s"))] == [4, 5]
        count, broken = await audit.verify()
        assert broken is None and count == 2
        await audit.record("test.act", session="s", n=5)
        count, broken = await audit.verify()
        assert broken is None and count == 3
        db.close()
    finally:
        await app.aclose(grace=0.5)
    done = verify(str(tmp_path / "uibus.db"))
    assert done.returncode == 0 and "chain of 3 entries verified" in done.stdout


async def test_a_record_the_store_refuses_waits_and_answers_are_refused_meanwhile(config: Config,
                                                                                    tmp_path: Path) -> None:
    app = await start_app(config)
    db = sqlite3.connect(str(tmp_path / "uibus.db"), isolation_level=None)
    try:
        audit = app.audit
        assert isinstance(audit, AuditLog)
        await audit.record("test.act", session="s", n=0)
        # the store refuses the audit's writes (SQLite itself, through a trigger another connection made)
        db.execute("CREATE TRIGGER refuse_audit BEFORE INSERT ON audit BEGIN SELECT RAISE(ABORT, 'refused'); END")
        await audit.record("test.act", session="s", n=1)  # does not raise: the act happened
        assert audit.waiting == 1
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await ext_grpc.ExtensionUiServiceStub(ch).Respond(ext.RespondRequest(id="x", confirmed=True))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "audit log" in (err.value.details() or "")
        db.execute("DROP TRIGGER refuse_audit")
        await wait_for(lambda: audit.waiting == 0, timeout=5, what="the backlog written")
        count, broken = await audit.verify()
        assert broken is None and count == 2
        assert [e["detail"]["n"] for e in await audit.list(Query(session="s"))] == [0, 1]
    finally:
        db.close()
        await app.aclose(grace=0.5)



async def test_retention_keeps_an_entry_within_it_and_an_unencodable_text_is_written(config: Config,
                                                                                     tmp_path: Path) -> None:
    """Retention removes only the run of old entries the chain starts with (an old-looking entry after
    a newer one — a clock stepped back — stays, and so does everything after the newer one); a lone
    surrogate (JSON lets one through) is written as "?", never left to block the backlog."""
    app = await start_app(replace(config, audit_retention_days=1))
    db = sqlite3.connect(str(tmp_path / "uibus.db"))
    try:
        audit = app.audit
        assert isinstance(audit, AuditLog)
        for i in range(5):
            await audit.record("test.act", session="s", n=i)
        old = int((time.time() - 3 * 86400) * 1000)
        (fourth,) = db.execute("SELECT at_ms FROM audit WHERE seq=4").fetchone()
        db.execute("UPDATE audit SET at_ms=? WHERE seq IN (1, 2, 4)", (old,))
        db.commit()
        assert await audit.sweep() == 2
        assert [e["seq"] for e in await audit.list(Query(session="s"))] == [3, 4, 5]
        db.execute("UPDATE audit SET at_ms=? WHERE seq=4", (fourth,))  # its column as the entry has it again
        db.commit()
        await audit.record("test.act", session="s", title="half a pair: \ud800 here")
        assert audit.waiting == 0
        (last,) = await audit.list(Query(session="s", after=5))
        assert last["detail"]["title"] == "half a pair: ? here"
        count, broken = await audit.verify()
        assert broken is None and count == 4
    finally:
        db.close()
        await app.aclose(grace=0.5)
