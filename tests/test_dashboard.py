"""deploy/grafana/uibus-dashboard.json asks only for what uibus really exports.

A panel whose query names a metric uibus does not export shows "No data" forever, which looks
like a quiet system. So a real app is driven (a subscription, a publish, a chat turn), its /metrics
scraped over HTTP and parsed, and every metric name in every panel's PromQL must be a series of
that scrape. The Redis replication metrics exist only on a ReplicatedBus, so the same check runs
against an app on a real redis-server, and without Redis for everything else.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import replace
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.chatkit import chat
from tests.conftest import REPO, start_app, wait_for
from tests.redisproc import RedisProcess, redis_server
from tests.support import ext
from uibus.clients.connection import Connection
from uibus.infra.config import Config
from uibus.pb.cline import common_pb2, ui_pb2
from uibus.pb.uibus.v1 import extension_ui_pb2

__all__ = ["redis_server"]

DASHBOARD = REPO / "deploy" / "grafana" / "uibus-dashboard.json"
DATASOURCE = "${DS_PROMETHEUS}"
# PromQL words that look like metric names: aggregation modifiers, set operators, constants.
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
             "offset", "atan2", "inf", "nan"}
_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")
# What the dashboard is for: each of these families must appear in some panel.
_REQUIRED = {"uibus_subscriptions", "uibus_events_published", "uibus_events_delivered", "uibus_events_dropped",
             "uibus_events_coalesced", "uibus_events_overflowed", "uibus_rpc_duration_seconds", "uibus_chat_turns",
             "uibus_extension_ui_pending_dialogs", "uibus_codebolt_connections", "uibus_replication_connected",
             "uibus_replication_sent", "uibus_replication_received", "uibus_replication_dropped", "uibus_store_up",
             "uibus_ready", "uibus_sessions_stored", "uibus_sessions_evicted", "uibus_http_refused",
             "uibus_dialog_wait_seconds"}

Families = dict[str, tuple[str, set[str]]]  # family name -> (type, sample names)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: not functions, keywords, label names (in
    matchers or by/without lists), strings, durations or Grafana variables."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', " ", expr)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range and subquery durations ([$__rate_interval], [5m:1m])
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for m in re.finditer(r"(?<![\w$.])[A-Za-z_:][\w:]*", text):
        if text[m.end():].lstrip().startswith("(") or m.group() in _KEYWORDS:
            continue
        names.add(m.group())
    return names


def test_metric_names_sees_through_promql() -> None:
    """The extraction the real check relies on: a wrong one could let any name pass unseen."""
    assert metric_names('histogram_quantile(0.99, sum by (le, method) (rate(a_bucket{code!="OK", m=~"$m"}'
                        '[$__rate_interval])))') == {"a_bucket"}
    assert metric_names("sum without (instance) (b_total) / on (kind) group_left (x) c offset 5m") == {"b_total", "c"}
    assert metric_names("max by (instance) (d) > bool 0 and e unless f") == {"d", "e", "f"}


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _exprs(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and of every query variable."""
    out = [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"] if isinstance(var["query"], str) else var["query"]["query"]
            m = re.fullmatch(r"label_values\((.+),\s*\w+\)", query)
            assert m, f"variable {var['name']}: {query}"
            out.append((f"variable {var['name']}", m.group(1)))
    return out


def test_dashboard_is_an_importable_model_on_a_prometheus_variable() -> None:
    dash = _dashboard()
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    ds = variables["DS_PROMETHEUS"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    assert dash["panels"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        assert p["datasource"] == {"type": "prometheus", "uid": DATASOURCE}, p["title"]
        assert p["targets"], f"{p['title']}: no query"
        for t in p["targets"]:
            assert t["expr"].strip() and t["refId"], p["title"]
            assert t.get("datasource", p["datasource"]) == p["datasource"], p["title"]
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
    for var in variables.values():
        if var["type"] == "query":
            assert var["datasource"] == {"type": "prometheus", "uid": DATASOURCE}, var["name"]
    used = {_family(n) for _, e in _exprs(dash) for n in metric_names(e)}
    assert not _REQUIRED - used, f"the dashboard shows none of {sorted(_REQUIRED - used)}"


def _family(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[:-len(suffix)]
    return name


async def _drive_and_scrape(config: Config) -> Families:
    """Starts an app, makes the calls that create every series, returns its parsed /metrics."""
    app = await start_app(config)
    try:
        async with Connection(f"127.0.0.1:{app.port}", session="dash") as conn, \
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.http_port}", timeout=10) as client:
            stream = conn.ui.subscribeToPartialMessage(common_pb2.EmptyRequest(),
                                                       metadata=(("x-uibus-session", "dash"),))
            first = asyncio.ensure_future(stream.read())
            await wait_for(lambda: app.bus.count(session="dash") == 1, what="the subscription")
            await conn.host.PublishPartialMessage(ui_pb2.ClineMessage(ts=1, type=ui_pb2.SAY, text="hi",
                                                                      partial=True))
            assert (await asyncio.wait_for(first, 5)).text == "hi"
            assert await chat(conn, "hello_world", "hello")  # a chat turn, and a session stored
            timed = await ext(conn).Confirm(extension_ui_pb2.ConfirmRequest(title="Sure?", timeout_ms=10))
            assert timed.outcome == extension_ui_pb2.DIALOG_OUTCOME_TIMED_OUT  # a dialog's wait observed
            r = await client.get("/metrics")
            stream.cancel()
        assert r.status_code == 200, r.text
    finally:
        await app.aclose(grace=1.0)
    families: Families = {}
    for fam in text_string_to_metric_families(r.text):
        families[fam.name] = (fam.type, {s.name for s in fam.samples})
    return families


def _check(families: Families, dash: dict[str, Any], *, skip: str = "") -> set[str]:
    """Asserts every metric the dashboard queries is a series of `families`; returns the families
    checked (names starting with `skip` are not)."""
    missing = []
    checked = set()
    for where, expr in _exprs(dash):
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        for name in names:
            if skip and name.startswith(skip):
                continue
            checked.add(_family(name))
            base = name if name in families else _family(name)
            kind, samples = families.get(base, ("", set()))
            if name.endswith(("_bucket", "_count", "_sum")) and base != name:
                ok = kind == "histogram" and name in samples
            else:
                ok = name in samples
            if not ok:
                missing.append(f"{where}: {name}")
    assert not missing, "queried but not exported: " + "; ".join(missing)
    return checked


@pytest.fixture
def web_config(web_config: Config) -> Config:
    return replace(web_config, grace_seconds=1.0)


async def test_dashboard_queries_only_exported_metrics(web_config: Config) -> None:
    dash = _dashboard()
    families = await _drive_and_scrape(web_config)
    assert not any(name.startswith("uibus_replication_") for name in families)  # no Redis here
    checked = _check(families, dash, skip="uibus_replication_")
    assert checked >= {f for f in _REQUIRED if not f.startswith("uibus_replication_")}


async def test_dashboard_replication_metrics_exist_on_redis(web_config: Config,
                                                            redis_server: RedisProcess) -> None:
    dash = _dashboard()
    families = await _drive_and_scrape(replace(web_config, redis_url=redis_server.url))
    assert _check(families, dash) >= _REQUIRED

