"""ExtensionUiService over real gRPC on loopback: dialogs, fire-and-forget, late UIs, limits."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from tests.conftest import wait_for
from tests.ext_ui_helpers import ext, open_uis, read
from uibus.pb.uibus.v1 import extension_ui_pb2 as pb

ANSWERED = pb.DIALOG_OUTCOME_ANSWERED
CANCELLED = pb.DIALOG_OUTCOME_CANCELLED
TIMED_OUT = pb.DIALOG_OUTCOME_TIMED_OUT
CALLER_CANCELLED = pb.DIALOG_OUTCOME_CALLER_CANCELLED

# method -> (stub method name, request, the answer a UI gives, the expected result fields)
DIALOGS = {
    "select": ("Select", pb.SelectRequest(title="Allow dangerous command?", options=["Allow", "Block"]),
               pb.RespondRequest(value="Block"), {"value": "Block", "confirmed": False}),
    "confirm": ("Confirm", pb.ConfirmRequest(title="Clear session?", message="All messages will be lost."),
                pb.RespondRequest(confirmed=True), {"value": None, "confirmed": True}),
    "input": ("Input", pb.InputRequest(title="Enter a value", placeholder="type something..."),
              pb.RespondRequest(value=""), {"value": "", "confirmed": False}),
    "editor": ("Editor", pb.EditorRequest(title="Edit some text", prefill="Line 1\nLine 2"),
               pb.RespondRequest(value="Line 1\u2028edited\n"), {"value": "Line 1\u2028edited\n", "confirmed": False}),
}


def result_fields(result: pb.DialogResult) -> dict[str, object]:
    return {"value": result.value if result.HasField("value") else None, "confirmed": result.confirmed}


@pytest.mark.parametrize("method", list(DIALOGS))
async def test_dialog_first_answer_wins_and_other_ui_is_told(app, connect, method):
    rpc, request, answer, expected = DIALOGS[method]
    agent, ui_conn = ext(connect()), connect()
    ui_a, ui_b = await open_uis(app, ui_conn, 2)

    call = asyncio.ensure_future(getattr(agent, rpc)(request))
    seen_a, seen_b = await read(ui_a), await read(ui_b)
    assert seen_a.request == seen_b.request
    req = seen_a.request
    assert req.WhichOneof("method") == method and getattr(req, method) == request
    assert req.id and req.ts > 0 and req.expires_at_ms == 0 and not req.replayed
    assert app.core.dialogs.count() == 1

    answer.id = req.id
    await ext(ui_conn).Respond(answer)
    result = await asyncio.wait_for(call, 2)
    assert result.id == req.id and result.outcome == ANSWERED
    assert result_fields(result) == expected

    # the slower UI: told the dialog closed, and its own answer is refused
    for ui in (ui_a, ui_b):
        closed = (await read(ui)).closed
        assert (closed.id, closed.reason) == (req.id, ANSWERED)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ext(ui_conn).Respond(pb.RespondRequest(id=req.id, cancelled=True))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "already answered" in err.value.details()
    assert app.core.dialogs.count() == 0


@pytest.mark.parametrize("method", list(DIALOGS))
async def test_cancelled_answer_gives_the_seed_default(app, connect, method):
    rpc, request, _, _ = DIALOGS[method]
    agent, ui_conn = ext(connect()), connect()
    ui_a, ui_b = await open_uis(app, ui_conn, 2)
    call = asyncio.ensure_future(getattr(agent, rpc)(request))
    dialog_id = (await read(ui_b)).request.id
    await ext(ui_conn).Respond(pb.RespondRequest(id=dialog_id, cancelled=True))
    result = await asyncio.wait_for(call, 2)
    assert (result.outcome, result.HasField("value"), result.confirmed) == (CANCELLED, False, False)
    await read(ui_a)  # the request
    for ui in (ui_a, ui_b):
        assert (await read(ui)).closed == pb.DialogClosed(id=dialog_id, reason=CANCELLED)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ext(ui_conn).Respond(pb.RespondRequest(id=dialog_id, value="x"))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "dismissed" in err.value.details()


async def test_timeouts_resolve_to_defaults_on_time(app, connect):
    agent, ui_conn = ext(connect()), connect()
    uis = await open_uis(app, ui_conn, 2)
    timeout_ms = 300

    async def timed(rpc: str, request: object) -> tuple[pb.DialogResult, float]:
        request.timeout_ms = timeout_ms  # type: ignore[attr-defined]
        start = time.monotonic()
        result = await getattr(agent, rpc)(request)
        return result, (time.monotonic() - start) * 1000

    runs = await asyncio.gather(*(timed(rpc, req) for rpc, req, _, _ in DIALOGS.values()))
    for result, elapsed_ms in runs:
        assert result.outcome == TIMED_OUT
        assert not result.HasField("value") and result.confirmed is False
        assert timeout_ms - 1 <= elapsed_ms <= timeout_ms + 50, elapsed_ms
    ids = {r.id for r, _ in runs}
    for ui in uis:
        events = [await read(ui) for _ in range(8)]
        requests = [e.request for e in events if e.HasField("request")]
        assert {r.id for r in requests} == ids
        assert all(0 < r.expires_at_ms - r.ts <= timeout_ms + 1 for r in requests)
        assert {(e.closed.id, e.closed.reason) for e in events if e.HasField("closed")} == {
            (i, TIMED_OUT) for i in ids}
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ext(ui_conn).Respond(pb.RespondRequest(id=next(iter(ids)), cancelled=True))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "timed out" in err.value.details()
    assert app.core.dialogs.count() == 0


async def test_agent_cancel_closes_the_dialog_on_every_ui(app, connect):
    agent, ui_conn = ext(connect()), connect()
    uis = await open_uis(app, ui_conn, 2)
    call = agent.Confirm(pb.ConfirmRequest(title="Proceed?", message="m", timeout_ms=60_000))
    dialog_id = (await read(uis[0])).request.id
    await read(uis[1])
    call.cancel()
    for ui in uis:
        assert (await read(ui)).closed == pb.DialogClosed(id=dialog_id, reason=CALLER_CANCELLED)
    assert app.core.dialogs.count() == 0
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ext(ui_conn).Respond(pb.RespondRequest(id=dialog_id, confirmed=True))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "cancelled by the agent" in err.value.details()

    # a gRPC deadline is the caller going away too
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await agent.Input(pb.InputRequest(title="Name?"), timeout=0.2)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    dialog_id = (await read(uis[0])).request.id
    assert (await read(uis[0])).closed == pb.DialogClosed(id=dialog_id, reason=CALLER_CANCELLED)
    await wait_for(lambda: app.core.dialogs.count() == 0, what="pending dialogs to drain")


async def test_fire_and_forget_reach_every_ui(app, connect):
    agent, ui_conn = ext(connect()), connect()
    uis = await open_uis(app, ui_conn, 2)
    sent = [
        ("Notify", "notify", pb.NotifyRequest(message="Command blocked by user", notify_type=pb.NOTIFY_TYPE_WARNING)),
        ("Notify", "notify", pb.NotifyRequest(message="default type")),
        ("SetStatus", "set_status", pb.SetStatusRequest(key="my-ext", text="Turn 3 running...")),
        ("SetStatus", "set_status", pb.SetStatusRequest(key="my-ext")),
        ("SetWidget", "set_widget", pb.SetWidgetRequest(key="w", lines=["--- My Widget ---", "Line 1"],
                                                        placement=pb.WIDGET_PLACEMENT_BELOW_EDITOR)),
        ("SetWidget", "set_widget", pb.SetWidgetRequest(key="w")),
        ("SetTitle", "set_title", pb.SetTitleRequest(title="atomic - my project")),
        ("SetEditorText", "set_editor_text", pb.SetEditorTextRequest(text="prefilled text")),
    ]
    ids = []
    for rpc, _, request in sent:
        reply = await getattr(agent, rpc)(request)
        assert reply.subscribers == 2 and reply.id
        ids.append(reply.id)
    for ui in uis:
        for (_, field, request), fire_id in zip(sent, ids, strict=True):
            got = (await read(ui)).request
            assert (got.id, got.WhichOneof("method"), getattr(got, field)) == (fire_id, field, request)
    # "no text" and "empty text" are different: the proto3 optional survives the wire
    got_clear = sent[3][2]
    assert not got_clear.HasField("text")


async def test_late_ui_gets_state_then_pending_dialogs_then_live(app, connect):
    agent, late_conn = ext(connect()), connect()
    await agent.SetTitle(pb.SetTitleRequest(title="atomic - my project"))
    await agent.SetStatus(pb.SetStatusRequest(key="a", text="one"))
    await agent.SetStatus(pb.SetStatusRequest(key="b", text="two"))
    await agent.SetStatus(pb.SetStatusRequest(key="b"))  # cleared: not replayed
    await agent.SetStatus(pb.SetStatusRequest(key="c", text=""))  # empty but set: replayed
    await agent.SetWidget(pb.SetWidgetRequest(key="w", lines=["x", "y"], placement=pb.WIDGET_PLACEMENT_BELOW_EDITOR))
    await agent.Notify(pb.NotifyRequest(message="gone"))  # not state: nobody hears it
    # a dialog asked while no UI is connected waits for the first one
    call = asyncio.ensure_future(agent.Select(pb.SelectRequest(title="pick", options=["p", "q"],
                                                               timeout_ms=30_000)))
    await wait_for(lambda: app.core.dialogs.count() == 1, what="the dialog to open")

    (ui,) = await open_uis(app, late_conn, 1)
    first = [(await read(ui)).request for _ in range(5)]
    assert all(r.replayed for r in first)
    assert [r.WhichOneof("method") for r in first] == ["set_title", "set_status", "set_status", "set_widget",
                                                       "select"]
    assert first[0].set_title.title == "atomic - my project"
    assert [(r.set_status.key, r.set_status.text) for r in first[1:3]] == [("a", "one"), ("c", "")]
    assert first[3].set_widget == pb.SetWidgetRequest(key="w", lines=["x", "y"],
                                                      placement=pb.WIDGET_PLACEMENT_BELOW_EDITOR)
    assert first[4].select.title == "pick" and first[4].expires_at_ms > first[4].ts

    await agent.SetStatus(pb.SetStatusRequest(key="a", text="live"))
    live = (await read(ui)).request
    assert not live.replayed and live.set_status.text == "live"
    await ext(late_conn).Respond(pb.RespondRequest(id=first[4].id, value="q"))
    assert (await call).value == "q"

    # another session sees none of it
    (other,) = await open_uis(app, connect("other"), 1, session="other")
    await agent.Notify(pb.NotifyRequest(message="only default"))
    assert (await read(ui)).closed.id == first[4].id
    assert (await read(ui)).request.notify.message == "only default"
    with pytest.raises(asyncio.TimeoutError):
        await read(other, timeout=0.2)


async def test_bad_requests_are_invalid_argument(app, connect):
    agent = ext(connect())
    bad = [
        ("Select", pb.SelectRequest(title="", options=["a"]), "title is required"),
        ("Select", pb.SelectRequest(title="t"), "at least one option"),
        ("Select", pb.SelectRequest(title="t", options=["a"] * 1001), "limit is 1000"),
        ("Select", pb.SelectRequest(title="t", options=["a"], timeout_ms=-1), "negative"),
        ("Confirm", pb.ConfirmRequest(title="  "), "title is required"),
        ("Confirm", pb.ConfirmRequest(title="t", timeout_ms=10**12), "more than a day"),
        ("Input", pb.InputRequest(title="x" * 5000), "title is 5000 characters"),
        ("Editor", pb.EditorRequest(title="t", prefill="x" * (1024 * 1024 + 1)), "prefill is"),
        ("Notify", pb.NotifyRequest(message=""), "message is required"),
        ("Notify", pb.NotifyRequest(message="m", notify_type=7), "notify_type=7"),
        ("SetStatus", pb.SetStatusRequest(text="t"), "key is required"),
        ("SetWidget", pb.SetWidgetRequest(key="k", lines=["l"], placement=9), "placement=9"),
        ("SetWidget", pb.SetWidgetRequest(key="k", lines=["l"] * 1001), "1001 lines"),
        ("SetTitle", pb.SetTitleRequest(title="t" * 5000), "title is 5000"),
    ]
    for rpc, request, message in bad:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await getattr(agent, rpc)(request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, rpc
        assert message in err.value.details(), (rpc, err.value.details())

    ui_conn = connect()
    (ui,) = await open_uis(app, ui_conn, 1)
    select = asyncio.ensure_future(agent.Select(pb.SelectRequest(title="t", options=["a", "b"])))
    confirm = asyncio.ensure_future(agent.Confirm(pb.ConfirmRequest(title="t")))
    ids = {}
    for _ in range(2):
        r = (await read(ui)).request
        ids[r.WhichOneof("method")] = r.id
    responder = ext(ui_conn)
    wrong = [
        (pb.RespondRequest(value="a"), grpc.StatusCode.INVALID_ARGUMENT, "id is required"),
        (pb.RespondRequest(id=ids["select"]), grpc.StatusCode.INVALID_ARGUMENT, "answer with value"),
        (pb.RespondRequest(id=ids["select"], value="c"), grpc.StatusCode.INVALID_ARGUMENT, "not one of its options"),
        (pb.RespondRequest(id=ids["select"], confirmed=True), grpc.StatusCode.INVALID_ARGUMENT, "is a select"),
        (pb.RespondRequest(id=ids["confirm"], value="yes"), grpc.StatusCode.INVALID_ARGUMENT, "is a confirm"),
        (pb.RespondRequest(id=ids["confirm"], cancelled=False), grpc.StatusCode.INVALID_ARGUMENT,
         "cancelled must be true"),
        (pb.RespondRequest(id="no-such-id", cancelled=True), grpc.StatusCode.NOT_FOUND, "no open dialog"),
    ]
    for request, code, message in wrong:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await responder.Respond(request)
        assert (err.value.code(), message in err.value.details()) == (code, True), err.value.details()
    # a dialog of another session is invisible from here
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ext(connect("other")).Respond(pb.RespondRequest(id=ids["select"], value="a"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    # and after all that the dialogs still work
    await responder.Respond(pb.RespondRequest(id=ids["select"], value="b"))
    await responder.Respond(pb.RespondRequest(id=ids["confirm"], confirmed=False))
    assert (await select).value == "b"
    assert (await confirm).outcome == ANSWERED
    assert app.core.dialogs.count() == 0


async def test_pending_dialogs_per_session_are_bounded(app, connect):
    agent = ext(connect("busy"))
    limit = app.core.dialogs.pending.max_per_session
    calls = [agent.Input(pb.InputRequest(title=f"q{i}")) for i in range(limit)]
    await wait_for(lambda: app.core.dialogs.count("busy") == limit, what="dialogs to open")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await agent.Input(pb.InputRequest(title="one too many"))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit" in err.value.details()
    # other sessions are not affected
    quick = await ext(connect("calm")).Confirm(pb.ConfirmRequest(title="t", timeout_ms=10))
    assert quick.outcome == TIMED_OUT
    stats = await agent.GetStats(pb.StatsRequest())
    assert (stats.pending_dialogs, stats.session_pending_dialogs) == (limit, limit)
    for c in calls:
        c.cancel()
    await wait_for(lambda: app.core.dialogs.count() == 0, what="cancelled dialogs to close")


async def test_shutdown_releases_waiting_agents(app, connect):
    agent = ext(connect())
    call = agent.Editor(pb.EditorRequest(title="t", prefill="p"))
    await wait_for(lambda: app.core.dialogs.count() == 1, what="the dialog to open")
    started = time.monotonic()
    await app.aclose(grace=1.0)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.value.details()
    assert time.monotonic() - started < 1.0  # released at once, not at the end of the grace period
    assert app.core.dialogs.count() == 0


async def test_thousand_dialogs_across_fifty_sessions(app, connect):
    sessions, per_session = 50, 20
    registry = app.core.dialogs
    uis = {}
    for s in range(sessions):
        conn = connect(f"s{s}")
        (uis[s],) = await open_uis(app, conn, 1, session=f"s{s}")

    async def agent(s: int) -> list[tuple[int, pb.DialogResult]]:
        stub = ext(connect(f"s{s}"))
        calls = []
        for i in range(per_session):
            kind = i % 4
            if kind == 0:
                calls.append(stub.Select(pb.SelectRequest(title=f"{s}/{i}", options=["x", f"{s}-{i}"])))
            elif kind == 1:
                calls.append(stub.Confirm(pb.ConfirmRequest(title=f"{s}/{i}")))
            elif kind == 2:
                calls.append(stub.Input(pb.InputRequest(title=f"{s}/{i}")))
            else:
                calls.append(stub.Editor(pb.EditorRequest(title=f"{s}/{i}")))
        return list(enumerate(await asyncio.gather(*calls)))

    async def ui(s: int) -> None:
        stream, responder = uis[s], ext(connect(f"s{s}"))
        requests = [(await read(stream, 10)).request for _ in range(per_session)]
        await all_open.wait()
        answers = []
        for r in requests:
            method = r.WhichOneof("method")
            assert method in ("select", "confirm", "input", "editor")
            i = int(getattr(r, method).title.split("/")[1])
            if i % 5 == 4:
                answers.append(pb.RespondRequest(id=r.id, cancelled=True))
            elif r.HasField("confirm"):
                answers.append(pb.RespondRequest(id=r.id, confirmed=i % 2 == 1))
            else:
                answers.append(pb.RespondRequest(id=r.id, value=f"{s}-{i}"))
        await asyncio.gather(*(responder.Respond(a) for a in answers))

    async def every_dialog_open() -> None:
        await wait_for(lambda: registry.count() == sessions * per_session, timeout=20, what="1,000 open dialogs")
        all_open.set()  # the UIs answer only once every dialog is in flight at the same time

    all_open = asyncio.Event()
    results = await asyncio.wait_for(asyncio.gather(
        *(agent(s) for s in range(sessions)), *(ui(s) for s in range(sessions)), every_dialog_open()), 60)
    for s, per in enumerate(results[:sessions]):
        for i, result in per:
            if i % 5 == 4:
                assert (result.outcome, result.HasField("value"), result.confirmed) == (CANCELLED, False, False)
            elif i % 4 == 1:
                assert (result.outcome, result.confirmed) == (ANSWERED, i % 2 == 1)
            else:
                assert (result.outcome, result.value) == (ANSWERED, f"{s}-{i}")
    assert registry.count() == 0
    assert (await ext(connect("s0")).GetStats(pb.StatsRequest())).pending_dialogs == 0
