"""The fuzz suite: hostile input at every way into one real `uibus serve` process, bounded.

* schemathesis against the served `/api/v1/docs`, every check (the document must say what is
  accepted, 405s must carry Allow, responses must match their schemas, no 5xx);
* hypothesis, built from tests/fuzzgen.py, at `/mcp` (JSON-RPC messages with hostile ids, params
  and tool arguments), the ACP doors (`/acp` HTTP POSTs, `/acp` WebSocket frames, `uibus acp`'s
  stdin: hostile JSON, ids and versions, every ACP method with hostile params), the sessions API
  (its POSTs, and the watch by its bad inputs before the stream starts), the CodeBolt socket
  (frames of every served action with hostile values,
  large ones among them), gRPC-Web (every served method, framing that lies) and native gRPC
  (every served method, random typed messages and protobuf-shaped noise).

What holds for every case: never a 5xx; never UNKNOWN or INTERNAL (a handler that failed on bad
input); every JSON reply is RFC 8259 JSON (no NaN/Infinity, no unencodable strings); every
CodeBolt reply fits the frame limit; the next request is still answered. And after each surface:
the server still runs and is SERVING, its log holds no error (uvicorn's "Exception in ASGI
application", the pipeline's "handler failed"), its memory stayed bounded, and no subscription
is left behind. Each surface prints its cases, findings and time into the run's output.

Sizes: UIBUS_FUZZ_EXAMPLES per hypothesis surface (default 400; the cheap surfaces run 2 or 3
times that), UIBUS_FUZZ_ST_EXAMPLES per API operation for schemathesis (default 100). UIBUS_FUZZ_SEED
picks another seed (default: fixed, so a CI run is reproducible; a finding prints its case).
UIBUS_FUZZ_DEBUG=1 tallies the refusals by their messages, to see where the generators' cases end
up; UIBUS_FUZZ_COLLECT=1 records every finding and goes on (no shrinking), then lists them: a
survey of what a change broke. Each surface also runs the issue's findings first, as explicit
examples, so a regression of any of them is caught whatever the random seed.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import itertools
import json
import math
import os
import re
import struct
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.descriptor import MethodDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, example, given, seed, settings
from hypothesis import strategies as st
from websockets.sync.client import connect as ws_connect

from tests import fuzzgen
from tests.conftest import REPO, ServerProcess, free_port, run_reporter
from tests.fuzzgen import strict_json
from tests.webclient import FrameReader, parse_trailers
from uibus.edge.codebolt import protocol as codebolt
from uibus.edge.codebolt.gateway import MAX_MESSAGE_BYTES
from uibus.pb.cline import common_pb2
from uibus.pb.neuro_san.api.grpc import agent_pb2
from uibus.pb.uibus.v1 import host_pb2_grpc

pytestmark = pytest.mark.timeout(900)

EXAMPLES = int(os.environ.get("UIBUS_FUZZ_EXAMPLES", "400"))
ST_EXAMPLES = int(os.environ.get("UIBUS_FUZZ_ST_EXAMPLES", "100"))
SEED = int(os.environ.get("UIBUS_FUZZ_SEED", "20261202"))
DEBUG = bool(os.environ.get("UIBUS_FUZZ_DEBUG"))  # tally the refusals by their messages too
# Survey mode: a finding is recorded and the run goes on (no shrinking), to list every kind found.
COLLECT = bool(os.environ.get("UIBUS_FUZZ_COLLECT"))
FINDINGS: Counter[str] = Counter()  # of the surface running now
RSS_GROWTH_MIB = 150  # what the server may grow by over the whole suite (the issue saw +205 MiB from one session)
BAD_STATUSES = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
ERROR_LINE = re.compile(r'"level": "(error|critical)"|Exception in ASGI application|Traceback')




def _settings(scale: int = 1) -> Callable[[Any], Any]:
    """The hypothesis settings of a surface: `scale` × EXAMPLES cases (the cheap surfaces get more)."""
    n = scale * EXAMPLES
    def apply(fn: Any) -> Any:
        return seed(SEED)(settings(max_examples=n, deadline=None, database=None, print_blob=True,
                                   suppress_health_check=list(HealthCheck))(fn))
    return apply


@dataclass
class Server:
    proc: ServerProcess
    http_port: int
    rss0: int = 0
    log_seen: int = 0

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def check_healthy(self, surface: str) -> dict[str, Any]:
        """The server survived the surface: running, SERVING, no error logged, memory bounded, no
        subscription left behind."""
        assert self.proc.proc.poll() is None, f"the server died during {surface}: {self.proc.log.read_text()[-4000:]}"
        with grpc.insecure_channel(self.proc.target) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING, f"not SERVING after {surface}"
            deadline = time.monotonic() + 5
            while True:  # streams the suite cancelled unsubscribe at once; a moment for the last ones
                subs = host_pb2_grpc.HostServiceStub(channel).GetBusStats(common_pb2.Empty(), timeout=5).subscriptions
                if subs == 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        assert subs == 0, f"{subs} subscriptions left behind after {surface}"
        lines = self.proc.log.read_text(errors="replace").splitlines()
        errors = [line for line in lines[self.log_seen:] if ERROR_LINE.search(line)]
        self.log_seen = len(lines)
        assert not errors, f"the server logged errors during {surface}:\n" + "\n".join(errors[:20])
        growth = (self.rss_kib() - self.rss0) / 1024
        assert growth < RSS_GROWTH_MIB, f"the server grew by {growth:.0f} MiB during the suite (by {surface})"
        return {"rss_growth_mib": round(growth, 1)}


@pytest.fixture(scope="module")
def report(pytestconfig: pytest.Config) -> Callable[[str], None]:
    return run_reporter(pytestconfig, "fuzz")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    http_port = free_port()
    proc = ServerProcess(tmp_path_factory.mktemp("fuzz"), "--http-port", str(http_port))
    try:
        asyncio.run(proc.wait_ready())
        srv = Server(proc, http_port)
        deadline = time.monotonic() + 20
        while httpx.get(f"{srv.base}/readyz").status_code != 200:
            assert time.monotonic() < deadline, "the HTTP port never became ready"
            time.sleep(0.05)
        srv.rss0 = srv.rss_kib()
        yield srv
    finally:
        proc.stop()


def _run(server: Server, report: Callable[[str], None], surface: str, prop: Callable[[], None],
         counts: Counter[str]) -> None:
    """Runs the property (`counts`: what its cases got, tallied by the property), then checks the
    server and reports. Cases are counted by the wrapper below, once each."""
    started = time.monotonic()
    FINDINGS.clear()
    failure: BaseException | None = None
    try:
        prop()
    except AssertionError as exc:  # the first finding, shrunk by hypothesis (not in survey mode)
        failure = exc
    health: dict[str, Any] = {}
    try:  # also after a finding: what the surface did to the server belongs to it
        health = server.check_healthy(surface)
    except AssertionError as exc:
        FINDINGS[str(exc)[:300]] += 1
    cases = counts.pop(CASES, 0)
    if FINDINGS or failure is not None:
        listing = "\n".join(f"  {n} x {what}" for what, n in FINDINGS.most_common())
        report(f"{surface}: {cases} cases, {len(FINDINGS) + (failure is not None)} kinds of finding"
               + (f" (first: {str(failure).splitlines()[0][:200]})" if failure is not None else "") + f":\n{listing}")
        if failure is not None:
            raise failure
        raise AssertionError(f"{surface}: {sum(FINDINGS.values())} findings:\n{listing}")
    took = time.monotonic() - started
    kinds = ", ".join(f"{k} {v}" for k, v in counts.most_common(12 if not DEBUG else 200))
    report(f"{surface}: {cases} cases, 0 findings, {took:.1f} s (seed {SEED}; "
           f"server RSS +{health['rss_growth_mib']} MiB) [{kinds}]")


CASES = "\0cases"


def counted(counts: Counter[str]) -> Callable[[Any], Any]:
    """Counts each case a property runs (the generate phase's and the shrinker's alike)."""
    def wrap(fn: Any) -> Any:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            counts[CASES] += 1
            if not COLLECT:
                return fn(*args, **kwargs)
            try:
                return fn(*args, **kwargs)
            except (AssertionError, ValueError, OSError, httpx.HTTPError) as exc:  # by its first line, cut
                first = (str(exc).splitlines() or [type(exc).__name__])[0]
                FINDINGS[re.sub(r"\d{3,}", "N", first)[:160]] += 1
                return None
        return run
    return wrap


# ---- schemathesis: the HTTP API against its own document ----------------------------------------

def test_http_api_against_its_openapi_document(server: Server, report: Callable[[str], None],
                                               tmp_path: Path) -> None:
    scratch = tmp_path
    started = time.monotonic()
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.fuzz_hooks", "PYTHONPATH": str(REPO),
           "NO_COLOR": "1", "COLUMNS": "120"}
    out = subprocess.run(  # in a scratch directory: schemathesis leaves a .schemathesis/ folder behind
        [str(Path(sys.executable).with_name("st")), "run", f"{server.base}/api/v1/docs", "--checks", "all",
         "--max-examples", str(ST_EXAMPLES), "--seed", str(SEED), "-w", "1", "--request-timeout", "20",
         "--max-failures", "20",
         # an endless stream (json-lines until the client leaves) is no request/response: the
         # fuzzer would only time out reading it; its bad input is refused before it starts, and
         # tests/test_sessions_api.py drives it
         "--exclude-path", "/api/v1/sessions/watch"],
        capture_output=True, text=True, cwd=scratch, env=env, timeout=600)
    text = out.stdout + out.stderr
    cases = re.search(r"(\d+) generated", text)
    assert out.returncode == 0 and cases is not None, f"schemathesis found problems (exit {out.returncode}):\n{text}"
    health = server.check_healthy("schemathesis")
    operations = re.search(r"Tested: (\d+)", text)
    report(f"schemathesis (/api/v1/docs, all checks): {cases.group(1)} cases over "
           f"{operations.group(1) if operations else '?'} operations, 0 findings, {time.monotonic() - started:.1f} s "
           f"(seed {SEED}; server RSS +{health['rss_growth_mib']} MiB)")


# ---- /mcp ----------------------------------------------------------------------------------------

_TOOLS = ("ask_user", "notify_user", "set_status", "hello_world", "echo", "nope")


def _text(*values: str) -> st.SearchStrategy[str]:
    """A string argument: a plain one, any text, or one holding a lone surrogate."""
    return st.one_of(fuzzgen.quoted(*values), fuzzgen.quoted(*values), fuzzgen.TEXT.map(json.dumps),
                     fuzzgen.POISON_TEXT.map(json.dumps))


_ARGS = fuzzgen.envelope({
    "title": _text("Proceed?", ""), "kind": fuzzgen.quoted("select", "confirm", "input", "editor"),
    "options": st.one_of(st.just('["a","b"]'), _text("c").map(lambda t: f'["a",{t}]')), "message": _text("m"),
    "placeholder": _text("p"), "prefill": _text("x"),
    "timeout_seconds": st.sampled_from(("0.05", "0.2", "1e400", "1e30", "NaN", "-1")),
    "key": _text("build"), "text": _text("running"), "level": fuzzgen.quoted("info", "loud"),
    "user_message": st.sampled_from(('{"text":"hi"}', '{"type":"HUMAN","text":"hi"}', '{"type":2632}')),
    "sly_data": st.sampled_from(('{"a":1}', '{"a":1e400}', '{"chunks":2}')),
    "chat_filter": st.sampled_from(('{"chat_filter_type":"MAXIMAL"}', '{"chat_filter_type":2.5}')),
})
_PARAMS = st.one_of(
    fuzzgen.envelope({"name": st.sampled_from(_TOOLS).map(json.dumps), "arguments": _ARGS,
                      "_meta": fuzzgen.envelope({"progressToken": fuzzgen.scalar_text()})}),
    fuzzgen.envelope({"requestId": st.one_of(st.sampled_from(("[1]", "{}", "1.5", "7", '"a"')),
                                             fuzzgen.json_text()), "reason": fuzzgen.quoted("x")}),
    fuzzgen.envelope({"protocolVersion": fuzzgen.quoted("2025-06-18", "1999"), "capabilities": st.just("{}")}),
)
_MCP_MESSAGE = fuzzgen.envelope({
    "jsonrpc": fuzzgen.quoted("2.0"),
    "id": st.one_of(st.integers(-5, 10**6).map(str), fuzzgen.quoted("a", "b"), fuzzgen.scalar_text()),
    "method": st.sampled_from(("initialize", "ping", "tools/list", "tools/call", "tools/call", "tools/call",
                               "notifications/cancelled", "notifications/initialized", "resources/list",
                               "prompts/list", "nope/nope")).map(json.dumps),
    "params": _PARAMS,
}, required=("jsonrpc", "method"))
# A sound request of a tool call: the hostile part is in the arguments (one of them, mostly).
_TOOL_CALL = st.tuples(st.integers(0, 10**6), st.sampled_from(_TOOLS).map(json.dumps), _ARGS).map(
    lambda t: f'{{"jsonrpc":"2.0","id":{t[0]},"method":"tools/call","params":{{"name":{t[1]},"arguments":{t[2]}}}}}')
# A sound notification: notifications/cancelled naming any id (the server must not care what it is).
_CANCEL = st.one_of(st.sampled_from(("[1]", "{}", "null", "1.5", "true")), fuzzgen.json_text()).map(
    lambda rid: f'{{"jsonrpc":"2.0","method":"notifications/cancelled","params":{{"requestId":{rid}}}}}')


def _call(tool: str, arguments: str) -> str:
    return f'{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"{tool}","arguments":{arguments}}}}}'


def test_mcp(server: Server, report: Callable[[str], None]) -> None:
    counts: Counter[str] = Counter()
    client = httpx.Client(timeout=httpx.Timeout(5, read=1.5))

    @_settings(3)
    @given(body=st.one_of(_TOOL_CALL, _TOOL_CALL, _TOOL_CALL, _CANCEL, _MCP_MESSAGE, _MCP_MESSAGE,
                          fuzzgen.json_text(), st.binary(max_size=40)),
           session=st.sampled_from(("fz1", "fz2")), mcp_session=st.sampled_from((None, "abc")),
           accept=st.sampled_from(("application/json, text/event-stream", "application/json")))
    # The rows, first (hypothesis runs explicit examples before it generates any).
    @example(body='{"jsonrpc":"2.0","id":"\\ud800","method":"ping"}', session="fz1", mcp_session=None,
             accept="application/json")  # row 1
    @example(body='{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"set_status","arguments":{"key":"k"},'
                  '"_meta":{"progressToken":"\\ud800"}}}', session="fz1", mcp_session=None,
             accept="application/json, text/event-stream")  # row 1, on an event-stream call
    @example(body=_call("set_status", '{"key":"\\ud800"}'), session="fz1", mcp_session=None,
             accept="application/json")  # row 2
    @example(body=_call("ask_user", '{"title":"t","timeout_seconds":1e400}'), session="fz1", mcp_session=None,
             accept="application/json")  # row 3
    @example(body=_call("ask_user", '{"title":"t","timeout_seconds":1e30}'), session="fz1", mcp_session=None,
             accept="application/json")  # row 3
    @example(body='{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":[1]}}', session="fz1",
             mcp_session="abc", accept="application/json")  # row 4
    @example(body=_call("hello_world", '{"user_message":{"text":"hi"},"sly_data":{"a":1e400}}'), session="fz1",
             mcp_session=None, accept="application/json")  # row 5
    @example(body='{"jsonrpc":"2.0","id":"\\ud800","method":"initialize","params":{"requestId":[1e400]}}',
             session="fz1", mcp_session=None, accept="application/json")  # found here: a poisoned id and params
    @counted(counts)
    def prop(body: str | bytes, session: str, mcp_session: str | None, accept: str) -> None:
        headers = {"content-type": "application/json", "accept": accept, "x-uibus-session": session}
        if mcp_session:
            headers["mcp-session-id"] = mcp_session
        data = body.encode() if isinstance(body, str) else body
        waits = b'"tools/call"' in data
        try:
            with client.stream("POST", f"{server.base}/mcp", content=data, headers=headers) as r:
                raw = r.read()
        except httpx.ReadTimeout:  # a tool call that waits for a person, or an agent turn: legitimate
            assert waits, f"no answer to {data[:300]!r}"
            counts["waited"] += 1
            return
        assert r.status_code < 500, (r.status_code, raw[:500], data[:300])
        kind = r.headers.get("content-type", "")
        if r.status_code == 202:
            assert raw == b""
            counts["202"] += 1
            return
        if kind.startswith("text/event-stream"):
            # (`data: ` alone: the priming event, an id to resume from before anything is said)
            events = [strict_json(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: ") and line[6:]]
            assert events and ("result" in events[-1] or "error" in events[-1]), \
                f"the event stream ended without the response: {raw[:500]!r} for {data[:300]!r}"
            answer = events[-1]
            counts["stream"] += 1
        else:
            assert kind == "application/json", (kind, raw[:200])
            answer = strict_json(raw)
            counts["json"] += 1
        error = answer.get("error")
        if error is not None:
            assert error["code"] != -32603 and error.get("data", {}).get("status") not in ("INTERNAL", "UNKNOWN"), \
                f"{error} for {data[:300]!r}"
            counts[f"error {error['code']}"] += 1
            if DEBUG:
                counts[error["message"][:60]] += 1

    try:
        _run(server, report, "/mcp (hypothesis)", prop, counts)
    finally:
        client.close()


# ---- the CodeBolt socket -------------------------------------------------------------------------

_SERVED = [(family, action) for family, actions in codebolt.FAMILIES.items() for action in actions
           if family in codebolt.SERVED_FAMILIES]
_UNSERVED = [(family, action) for family, actions in codebolt.FAMILIES.items() for action in actions
             if family not in codebolt.SERVED_FAMILIES]
_LIBRARY = sorted({k for k, _ in codebolt.LIBRARY if isinstance(k, str)})
_VALUES = st.one_of(fuzzgen.quoted("v"), st.just('{"n":1,"list":[1,2]}'),
                    st.sampled_from(("1e400", "NaN", "-Infinity")), fuzzgen.TEXT.map(json.dumps),
                    fuzzgen.big_string(100_000, 300_000, 600_000))
_MESSAGE = fuzzgen.envelope({
    "key": _text("k1", "k2", "k3"), "value": _VALUES,
    "text": st.one_of(_text("hi"), fuzzgen.big_string(60_000)),
    "message": _text("hi", "a message"),
    "limit": st.sampled_from(("1", "1000", "0", "1e400", "2.5")), "buttons": st.just('["Yes","No"]'),
    "timeoutMs": st.sampled_from(("50", "1e30", "-1", "NaN")), "withFeedback": st.sampled_from(("true", "1")),
    "payload": fuzzgen.envelope({"key": fuzzgen.quoted("k1", "k4"), "value": _VALUES}),
    "agentId": _text("agent-1"),
})
_FRAME = st.one_of(
    st.tuples(st.one_of(st.sampled_from(_SERVED), st.sampled_from(_SERVED), st.sampled_from(_SERVED),
                        st.sampled_from(_UNSERVED)),
              st.one_of(fuzzgen.quoted("r1", "r2"), _text("r3"), fuzzgen.scalar_text()), _MESSAGE).map(
        lambda t: f'{{"type":{json.dumps(t[0][0])},"action":{json.dumps(t[0][1])},"requestId":{t[1]},'
                  f'"message":{t[2]}}}'),
    st.tuples(st.sampled_from(_LIBRARY), _MESSAGE).map(
        lambda t: f'{{"type":{json.dumps(t[0])}' + ("}" if t[1] == "{}" else "," + t[1][1:])),
    fuzzgen.json_text(["type", "action", "requestId", "message"]),
)


def _sound_json(text: str) -> bool:
    """Whether `text` is JSON uibus may keep: RFC 8259, no lone surrogate, finite numbers (the
    test's own check, written apart from uibus.infra.json_input)."""
    def bad(token: str) -> Any:
        raise ValueError(token)
    try:
        value = json.loads(text, parse_constant=bad, parse_float=lambda t: float(t) if abs(float(t)) < math.inf
                           else bad(t), parse_int=lambda t: int(t) if abs(int(t)) < 2**1024 else bad(t))
        json.dumps(value, allow_nan=False).encode("utf-8")
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except (ValueError, RecursionError):
        return False
    return True


def test_codebolt_socket(server: Server, report: Callable[[str], None]) -> None:
    counts: Counter[str] = Counter()
    url = f"ws://127.0.0.1:{server.http_port}/agent-to-app"
    n = 0

    @_settings(2)
    @given(frames=st.lists(_FRAME, min_size=1, max_size=3), session=st.sampled_from(("cb1", "cb2")))
    @example(frames=['{"type":"getChatHistory","requestId":"\\ud800"}'], session="cb1")  # row 6
    @example(frames=['{"type":"memoryEvent","action":"memorySet","requestId":"m","message":{"key":"k1",'
                     '"value":"\\ud800"}}',
                     '{"type":"chatEvent","action":"sendMessage","requestId":"s","message":{"text":"\\ud800"}}'],
             session="cb1")  # row 7: then the reads
    @example(frames=['{"type":"memoryEvent","action":"memorySet","requestId":"m","message":{"key":"k2","value":NaN}}',
                     '{"type":"stateEvent","action":"addToAgentState","requestId":"a","message":{"key":"k",'
                     '"value":1e400}}'], session="cb1")  # row 8
    @example(frames=[f'{{"type":"stateEvent","action":"addToAgentState","requestId":"a{i}","message":{{"key":"b{i}",'
                     f'"value":"{"x" * 700_000}"}}}}' for i in range(3)], session="cb2")  # row 10
    @counted(counts)
    def prop(frames: list[str], session: str) -> None:
        nonlocal n
        n += 1
        sentinel = f"sentinel-{n}"
        # Every frame that is no JSON uibus can keep must be refused (answered success:false), and
        # the reads after it must answer: the chat history, the state, the memory.
        poisoned = sum(1 for text in frames if not _sound_json(text))
        refused = 0
        reads = [{"type": "chatEvent", "action": "getChatHistory", "limit": 1},
                 {"type": "stateEvent", "action": "getApplicationState"},
                 {"type": "memoryEvent", "action": "memoryGet", "message": {"key": "k1"}}]
        with ws_connect(f"{url}?session={session}", max_size=None, open_timeout=5) as ws:
            for text in frames:
                ws.send(text)
            for i, read in enumerate(reads):
                ws.send(json.dumps({**read, "requestId": f"{sentinel}-{i}"}))
            pending = {f"{sentinel}-{i}" for i in range(len(reads))}
            while pending:
                try:
                    reply = ws.recv(timeout=5)
                except TimeoutError:
                    raise AssertionError(f"no answer to the reads after {[f[:200] for f in frames]}") from None
                size = len(reply.encode()) if isinstance(reply, str) else len(reply)
                assert size <= MAX_MESSAGE_BYTES, f"a {size}-byte reply, over the frame limit, to {frames[0][:200]}"
                obj = strict_json(reply)
                assert isinstance(obj, dict), reply[:200]
                if obj.get("requestId") in pending:
                    assert obj.get("success") is True, obj
                    assert refused >= poisoned, f"a frame that is not sound JSON got no answer: {frames}"
                    pending.discard(obj["requestId"])
                    continue
                if obj.get("success") is False:
                    assert obj.get("code") not in ("INTERNAL", "UNKNOWN"), f"{obj} for {[f[:200] for f in frames]}"
                    refused += 1
                    counts[f"refused {obj.get('code')}"] += 1
                    if DEBUG:
                        counts[str(obj.get("error"))[:70]] += 1
                else:
                    counts["answered"] += 1

    _run(server, report, "CodeBolt socket (hypothesis)", prop, counts)


# ---- gRPC: every served method, over gRPC-Web and native ----------------------------------------

_POOL: list[descriptor_pool.DescriptorPool] = []  # the server's own descriptors, as its reflection serves them


def _served_methods(target: str) -> list[MethodDescriptor]:
    """Every method the server's reflection lists, with its descriptors from the reflection too
    (as grpcurl sees the server: nothing of uibus's own code)."""
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    methods = []
    with grpc.insecure_channel(target) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        pool = descriptor_pool.DescriptorPool(database)
        for name in database.get_services():  # loaded now, with every file they need, while the channel is open
            methods.extend(pool.FindServiceByName(name).methods)
    _POOL[:] = [pool]
    assert len(methods) > 40, [m.full_name for m in methods]
    return methods


def _method(full_name: str) -> MethodDescriptor:
    return _POOL[0].FindMethodByName(full_name)


def _frame(payload: bytes) -> bytes:
    return struct.pack(">BI", 0, len(payload)) + payload


def _non_finite_chat() -> bytes:
    request = agent_pb2.ChatRequest(user_message={"text": "hi"})
    request.sly_data.update({"a": math.inf})
    return request.SerializeToString()


_NON_FINITE_CHAT = _non_finite_chat()


def _shape(method: MethodDescriptor) -> str:
    return ("stream" if method.client_streaming else "unary") + "-" + ("stream" if method.server_streaming else "unary")


@functools.cache
def _methods_by_shape(target: str) -> st.SearchStrategy[MethodDescriptor]:
    """A method, the shape first: the few client-streaming methods are drawn as often as the many
    unary ones; within a shape, a method whose request has more fields (nested ones too) more often:
    a ChatRequest has more to get wrong than the Empty of a subscription."""
    shapes: dict[str, list[MethodDescriptor]] = {}
    for method in _served_methods(target):
        shapes.setdefault(_shape(method), []).extend([method] * (1 + min(_richness(method.input_type), 20)))
    return st.sampled_from(sorted(shapes)).flatmap(lambda s: st.sampled_from(shapes[s]))


def _richness(message: Any, depth: int = 2) -> int:
    """How many fields a request has, nested ones to `depth` levels: what there is to get wrong."""
    total = 0
    for f in message.fields:
        total += 1
        if f.message_type is not None and depth > 0 and not f.message_type.full_name.startswith("google.protobuf."):
            total += _richness(f.message_type, depth - 1)
    return total


@functools.cache
def _payload(method: MethodDescriptor) -> st.SearchStrategy[bytes]:
    cls = message_factory.GetMessageClass(method.input_type)
    typed = fuzzgen.proto_message(method.input_type, cls).map(lambda m: m.SerializeToString())
    return st.one_of(typed, typed, typed, fuzzgen.proto_noise(), st.binary(max_size=48))


def _path(method: MethodDescriptor) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


def _trailer_status(body: bytes, text: bool) -> str | None:
    """grpc-status from the trailer frame of a gRPC-Web body (binary or text), if there is one."""
    for flag, chunk in FrameReader(text).feed(body):
        if flag & 0x80:
            return parse_trailers(chunk).get("grpc-status")
    return None


def test_grpc_web(server: Server, report: Callable[[str], None]) -> None:
    counts: Counter[str] = Counter()
    client = httpx.Client(timeout=10)

    methods = _methods_by_shape(server.proc.target)
    cases = methods.flatmap(lambda m: st.tuples(st.just(m), fuzzgen.grpc_web_body(_payload(m))))
    reflection = _method("grpc.reflection.v1alpha.ServerReflection.ServerReflectionInfo")

    @_settings(2)
    @given(case=cases, text=st.booleans())
    @example(case=(reflection, b"\x00\x00\x00"), text=False)  # issue row 9: a client stream cut short
    @example(case=(_method("grpc.reflection.v1.ServerReflection.ServerReflectionInfo"), b"\x00\x00\x00"), text=True)
    @example(case=(_method("dev.cognizant_ai.neuro_san.api.grpc.agent.AgentService.StreamingChat"),
                   _frame(_NON_FINITE_CHAT)), text=False)  # row 5
    @counted(counts)
    def prop(case: tuple[MethodDescriptor, bytes], text: bool) -> None:
        method, body = case
        kind = "application/grpc-web-text" if text else "application/grpc-web+proto"
        content = base64.b64encode(body) if text else body
        r = client.post(server.base + _path(method), content=content,
                        headers={"content-type": kind, "x-grpc-web": "1", "grpc-timeout": "300m",
                                 "x-uibus-session": "gw"})
        assert r.status_code < 500, (r.status_code, r.content[:300])
        status = r.headers.get("grpc-status") or _trailer_status(r.content, text and r.status_code == 200)
        assert status is not None, f"no grpc-status from {_path(method)}: {r.status_code} {r.content[:200]!r}"
        assert int(status) not in (2, 13), (f"{_path(method)} answered {status} "
                                            f"{r.headers.get('grpc-message')} to {body[:120]!r}")
        counts[_NAMES.get(int(status), status)] += 1

    try:
        _run(server, report, "gRPC-Web (hypothesis, every method)", prop, counts)
    finally:
        client.close()


_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


def test_native_grpc(server: Server, report: Callable[[str], None]) -> None:
    counts: Counter[str] = Counter()
    channel = grpc.insecure_channel(server.proc.target)
    metadata = (("x-uibus-session", "native"),)

    methods = _methods_by_shape(server.proc.target)
    cases = methods.flatmap(lambda m: st.tuples(st.just(m), st.lists(_payload(m), min_size=1, max_size=3)))

    @_settings(2)
    @given(case=cases)
    @example(case=(_method("dev.cognizant_ai.neuro_san.api.grpc.agent.AgentService.StreamingChat"),
                   [_NON_FINITE_CHAT]))  # issue row 5: a Struct number JSON cannot carry
    @counted(counts)
    def prop(case: tuple[MethodDescriptor, list[bytes]]) -> None:
        method, payloads = case
        path, shape = _path(method), _shape(method)
        if DEBUG:
            counts[path.rsplit(".", 1)[-1]] += 1
        timeout = 0.3 if method.server_streaming else 1.0
        try:
            if shape == "unary-unary":
                channel.unary_unary(path)(payloads[0], timeout=timeout, metadata=metadata)
            elif shape == "unary-stream":
                list(channel.unary_stream(path)(payloads[0], timeout=timeout, metadata=metadata))
            elif shape == "stream-unary":
                channel.stream_unary(path)(iter(payloads), timeout=timeout, metadata=metadata)
            else:
                list(channel.stream_stream(path)(iter(payloads), timeout=timeout, metadata=metadata))
            counts["OK"] += 1
        except grpc.RpcError as exc:
            code = exc.code()  # type: ignore[attr-defined]
            assert code not in BAD_STATUSES, f"{path} answered {code.name} {exc.details()} to {payloads[0][:120]!r}"  # type: ignore[attr-defined]
            counts[code.name] += 1
            if DEBUG:
                counts[f"{path.rsplit('.', 1)[-1]} {code.name}"] += 1

    try:
        _run(server, report, "native gRPC (hypothesis, every method)", prop, counts)
    finally:
        channel.close()


# ---- the ACP doors: /acp over HTTP, /acp WebSocket frames, `uibus acp` stdio (docs/security/quotas.md) ----------

_ACP_METHODS = ("initialize", "authenticate", "session/new", "session/load", "session/resume", "session/close",
                "session/prompt", "session/list", "session/set_mode", "session/cancel", "$/cancel_request",
                "nope/nope")
_ACP_IDS = st.one_of(st.integers(-5, 10**6).map(str), fuzzgen.quoted("a", "b"), fuzzgen.scalar_text(),
                     st.sampled_from(("1.5", "{}", "true", "[1]", "null")), fuzzgen.big_string(2000))
_ACP_PARAMS = fuzzgen.envelope({
    "protocolVersion": st.sampled_from(("1", "1.5", '"1"', "1e400", "null")),
    "sessionId": _text("acp-fz1", "acp-fz2", "nope"), "cwd": _text("/tmp", "relative"),
    "mcpServers": st.sampled_from(("[]", "{}", "[1]")),
    "prompt": st.one_of(st.just('[{"type":"text","text":"hi"}]'), fuzzgen.json_text(["type", "text", "data"]),
                        st.just('[{"type":"image","mimeType":"image/png","data":"not base64"}]')),
    "cursor": _text("0", "x"), "modeId": _text("plan"), "requestId": _ACP_IDS,
})
_ACP_MESSAGE = st.one_of(
    fuzzgen.envelope({"jsonrpc": st.sampled_from(('"2.0"', '"1.0"', "2", "null")), "id": _ACP_IDS,
                      "method": st.sampled_from(_ACP_METHODS).map(json.dumps), "params": _ACP_PARAMS}),
    fuzzgen.envelope({"jsonrpc": fuzzgen.quoted("2.0"), "id": _ACP_IDS, "result": fuzzgen.json_text()}),
    fuzzgen.json_text(), st.just("[" * 5000 + "]" * 5000), st.binary(max_size=40).map(lambda b: b.decode("latin-1")),
)
_ACP_ROWS = ("[" * 200000 + "]" * 200000, '{"jsonrpc":"2.0","id":1.5,"method":"initialize","params":{}}',
             '{"jsonrpc":"2.0","id":{},"method":"initialize","params":{}}',
             '{"jsonrpc":"1.0","id":1,"method":"initialize"}',
             '{"jsonrpc":"2.0","id":"' + "i" * 100_000 + '","method":"session/list","params":{}}')


def _acp_answer(raw: str | bytes, data: str, counts: Counter[str]) -> None:
    """An answer on an ACP door: RFC 8259 JSON, and never an internal error for bad input."""
    answer = strict_json(raw)
    error = answer.get("error") if isinstance(answer, dict) else None
    if error is not None:
        assert error["code"] != -32603, f"{error} for {data[:300]!r}"
        counts[f"error {error['code']}"] += 1
    else:
        counts["answered"] += 1


def test_acp_http(server: Server, report: Callable[[str], None]) -> None:
    counts: Counter[str] = Counter()
    client = httpx.Client(timeout=httpx.Timeout(5, read=3))
    headers = {"content-type": "application/json"}
    conn: dict[str, str] = {}

    def connection() -> dict[str, str]:
        if not conn:
            r = client.post(f"{server.base}/acp", headers=headers,
                            content=b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":1}}')
            assert r.status_code == 200, r.text
            conn["acp-connection-id"] = r.headers["acp-connection-id"]
        return conn

    @_settings(2)
    @given(body=_ACP_MESSAGE, named=st.booleans(), session=st.sampled_from(("", "acp-fz1")))
    @example(body=_ACP_ROWS[0], named=False, session="")  # the rows first
    @example(body=_ACP_ROWS[1], named=False, session="")
    @example(body=_ACP_ROWS[2], named=False, session="")
    @example(body=_ACP_ROWS[3], named=False, session="")
    @example(body=_ACP_ROWS[4], named=True, session="")
    @counted(counts)
    def prop(body: str, named: bool, session: str) -> None:
        extra = {**headers, **(connection() if named else {})}
        if session:
            extra["acp-session-id"] = session
        r = client.post(f"{server.base}/acp", content=body.encode("utf-8", "surrogatepass"), headers=extra)
        assert r.status_code < 500, (r.status_code, r.text[:500], body[:300])
        counts[str(r.status_code)] += 1
        if r.status_code == 410:  # cut for not reading its event streams: a fresh one
            conn.clear()
        if r.headers.get("content-type", "").startswith("application/json"):
            _acp_answer(r.content, body, counts)

    try:
        _run(server, report, "/acp HTTP (hypothesis)", prop, counts)
    finally:
        if conn:
            client.delete(f"{server.base}/acp", headers=conn)
        client.close()


def test_acp_websocket(server: Server, report: Callable[[str], None]) -> None:
    counts: Counter[str] = Counter()
    url = f"ws://127.0.0.1:{server.http_port}/acp"
    socket: list[Any] = []
    sentinels = itertools.count()

    def ws() -> Any:
        if not socket:
            socket.append(ws_connect(url, max_size=None, open_timeout=5))
        return socket[0]

    @_settings(2)
    @given(frame=_ACP_MESSAGE)
    @example(frame=_ACP_ROWS[0])
    @example(frame=_ACP_ROWS[1])
    @example(frame=_ACP_ROWS[3])
    @counted(counts)
    def prop(frame: str) -> None:
        sock = ws()
        sock.send(frame.encode("utf-8", "surrogatepass").decode("utf-8", "replace"))
        # A request of a method nobody serves follows each frame: its answer (-32601, at once) shows the
        # socket is still open and served, and bounds the wait for the frame's own answer without a
        # timeout per case (notifications and responses get none). A request the frame made that runs
        # longer may answer after it; that answer is checked in a later case or at the end.
        sentinel = f"fz-sentinel-{next(sentinels)}"
        sock.send(json.dumps({"jsonrpc": "2.0", "id": sentinel, "method": "fuzz/sentinel"}))
        answered = False
        while True:
            try:
                raw = sock.recv(timeout=5)
            except TimeoutError:
                raise AssertionError(f"no answer to the sentinel after {frame[:300]!r}") from None
            obj = strict_json(raw)
            if isinstance(obj, dict) and obj.get("id") == sentinel:
                assert obj.get("error", {}).get("code") == -32601, obj
                break
            _acp_answer(raw, frame, counts)
            answered = True
        if not answered:
            counts["no answer"] += 1

    try:
        _run(server, report, "/acp WebSocket (hypothesis)", prop, counts)
    finally:
        if socket:
            socket[0].close()


def test_acp_stdio(server: Server, report: Callable[[str], None]) -> None:
    counts: Counter[str] = Counter()
    uibus = str(Path(sys.executable).parent / "uibus")
    proc = subprocess.Popen([uibus, "acp", "--target", server.proc.target], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    pending = bytearray()

    def answers(wait: float) -> list[bytes]:
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            chunk = proc.stdout.read()  # type: ignore[union-attr]
            if chunk:
                pending.extend(chunk)
            if b"\n" in pending:
                break
            time.sleep(0.01)
        *lines, rest = bytes(pending).split(b"\n")
        pending[:] = rest
        return lines

    @_settings(2)
    @given(line=_ACP_MESSAGE)
    @example(line=_ACP_ROWS[0])
    @example(line=_ACP_ROWS[1])
    @example(line=_ACP_ROWS[4])
    @counted(counts)
    def prop(line: str) -> None:
        data = line.encode("utf-8", "surrogatepass").replace(b"\n", b" ")
        proc.stdin.write(data + b"\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        for raw in answers(0.3):
            _acp_answer(raw, line, counts)
        assert proc.poll() is None, f"uibus acp exited on {line[:300]!r}: {proc.stderr.read()[-2000:]!r}"  # type: ignore[union-attr]

    try:
        _run(server, report, "uibus acp stdio (hypothesis)", prop, counts)
    finally:
        proc.stdin.close()
        assert proc.wait(10) == 0
        stderr = proc.stderr.read().decode(errors="replace")  # type: ignore[union-attr]
        assert "Traceback" not in stderr, stderr[-3000:]


def test_sessions_api(server: Server, report: Callable[[str], None]) -> None:
    """The sessions API's POSTs with hostile bodies, and the watch by its bad inputs before the
    stream starts (a bad prefix must be refused, not streamed)."""
    counts: Counter[str] = Counter()
    client = httpx.Client(timeout=httpx.Timeout(5, read=1.5))

    @_settings(2)
    @given(method=st.sampled_from(("CreateSession", "DeleteSession", "StopTurn", "SetMode", "nope")),
           body=st.one_of(fuzzgen.json_text(["title", "agent", "mode_id"]),
                          fuzzgen.envelope({"title": st.one_of(_text("t"), fuzzgen.big_string(5000)),
                                            "agent": _text("pi", "a b", "../x")})),
           session=st.sampled_from(("fz-s1", "bad name", "")),
           prefix=st.one_of(st.sampled_from(("", "fz-", "a b", "x" * 300, "\ud800")), st.text(max_size=8)))
    @counted(counts)
    def prop(method: str, body: str, session: str, prefix: str) -> None:
        headers = {"content-type": "application/json", **({"x-uibus-session": session} if session else {})}
        r = client.post(f"{server.base}/api/v1/sessions/{method}", content=body.encode("utf-8", "surrogatepass"),
                        headers=headers)
        assert r.status_code < 500, (r.status_code, r.text[:500], body[:300])
        counts[f"post {r.status_code}"] += 1
        params = {"prefix": prefix.encode("utf-8", "surrogatepass").decode("utf-8", "replace")}
        with client.stream("GET", f"{server.base}/api/v1/sessions/watch", params=params) as watch:
            assert watch.status_code < 500, watch.status_code
            counts[f"watch {watch.status_code}"] += 1
            if watch.status_code == 200:
                strict_json(next(watch.iter_lines()))  # the first listing, then the stream is left

    try:
        _run(server, report, "sessions API (hypothesis)", prop, counts)
    finally:
        client.close()
