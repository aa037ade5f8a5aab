"""Prometheus metrics: bus counters read at scrape time, RPC counts/latencies, chat turns.

Nothing here runs per bus event: the bus already keeps plain per-kind counters, and a custom
collector turns them into metric families only when /metrics is scraped. Calls cost one histogram
observation each, made by the handler pipeline (uibus.edge.pipeline) for every transport alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from uibus import version
from uibus.infra.bus import Bus
from uibus.infra.store import Store

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
# People take seconds to minutes: up to the longest dialog timeouts (an hour).
_WAIT_BUCKETS = (0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600)
_CHAT_SUFFIX = ".AgentService/StreamingChat"
MAX_METHOD_LABELS = 1000  # distinct `method` label values; uibus serves ~120 methods
UNKNOWN_METHOD = "unknown"


class _BusCollector(Collector):
    def __init__(self, bus: Bus, chat_turns: dict[str, int],
                 gauges: dict[str, tuple[str, Callable[[], float]]],
                 counters: dict[str, tuple[str, Callable[[], float]]], store: Store | None = None,
                 worker: dict[str, str] | None = None,
                 labelled: dict[str, tuple[str, str, Callable[[], Mapping[str, float]]]] | None = None) -> None:
        self.bus = bus
        self.version = version()  # read once: the installed distribution does not change under a process
        self.labelled = labelled if labelled is not None else {}
        self.worker = worker
        self.store = store
        self.chat_turns = chat_turns
        self.gauges = gauges
        self.counters = counters

    def collect(self) -> Iterator[Metric]:
        # Which release answered: the same string as `uibus --version` and the image's OCI label, so a
        # rolling upgrade shows as two versions side by side (`count by (version) (uibus_build_info)`).
        build = GaugeMetricFamily("uibus_build_info", "1, labelled with the uibus version this process runs",
                                  labels=["version"])
        build.add_metric([self.version], 1)
        yield build
        subs = GaugeMetricFamily("uibus_subscriptions", "Live bus subscriptions (open UI streams) per event kind",
                                 labels=["kind"])
        fams = {name: CounterMetricFamily(f"uibus_events_{name}", help_, labels=["kind"]) for name, help_ in (
            ("published", "Events published to the bus"),
            ("delivered", "Event deliveries queued for subscribers"),
            ("dropped", "Events dropped at a full subscriber queue"),
            ("coalesced", "Queued events replaced by a newer state at a full subscriber queue"),
            ("overflowed", "Streams ended RESOURCE_EXHAUSTED because their queued events went over the mailbox "
                           "byte budget"))}
        for kind, c in sorted(self.bus.counters.items()):
            subs.add_metric([kind], c.subscriptions)
            for name, fam in fams.items():
                fam.add_metric([kind], getattr(c, name))
        total = GaugeMetricFamily("uibus_subscriptions_total_open", "Live bus subscriptions, all kinds",
                                  value=self.bus.count())
        queued = GaugeMetricFamily("uibus_mailbox_bytes", "Bytes of events queued in all subscriber mailboxes",
                                   value=self.bus.budget.total)
        turns = CounterMetricFamily("uibus_chat_turns", "StreamingChat calls per agent (all transports)",
                                    labels=["agent"])
        for agent, n in sorted(self.chat_turns.items()):
            turns.add_metric([agent], n)
        yield subs
        yield total
        yield queued
        yield from fams.values()
        yield turns
        if self.store is not None:  # session retention: what it deleted (counted by the store) and what is kept
            st = self.store.stats
            evicted = CounterMetricFamily("uibus_sessions_evicted", "Sessions deleted with all their stored state",
                                          labels=["reason"])
            evicted.add_metric(["idle"], st.evicted_idle)
            evicted.add_metric(["max_sessions"], st.evicted_over_max)
            yield evicted
            yield CounterMetricFamily("uibus_history_entries_dropped", "Chat history entries dropped to keep a "
                                      "session's history within its byte bound", value=st.history_dropped)
            if st.sessions >= 0:
                yield GaugeMetricFamily("uibus_sessions_stored", "Sessions in the store (as of the last write or "
                                        "sweep)", value=st.sessions)
        for name, (help_, read) in sorted(self.gauges.items()):
            yield GaugeMetricFamily(name, help_, value=read())
        if self.worker:  # which worker of `uibus serve --workers` answered this scrape
            info = GaugeMetricFamily("uibus_worker", "1, labelled with the worker process that answered this scrape "
                                     "(uibus serve --workers; each scrape shows one worker's figures)",
                                     labels=sorted(self.worker))
            info.add_metric([self.worker[k] for k in sorted(self.worker)], 1)
            yield info
        for name, (help_, read) in sorted(self.counters.items()):
            yield CounterMetricFamily(name, help_, value=read())
        for name, (help_, label, read_all) in sorted(self.labelled.items()):
            fam = CounterMetricFamily(name, help_, labels=[label])
            for value, n in sorted(read_all().items()):
                fam.add_metric([value], n)
            yield fam
        stats = getattr(self.bus, "stats", None)  # only a ReplicatedBus counts what crossed Redis
        if stats is not None:
            for name, (value, help_) in stats.counters().items():
                yield CounterMetricFamily(f"uibus_replication_{name}", help_, value=value)
            yield GaugeMetricFamily("uibus_replication_connected", "1 while this replica both receives from and "
                                    "writes to Redis, else 0", value=float(bool(getattr(self.bus, "connected", 0))))
            yield GaugeMetricFamily("uibus_replication_wire_version", "The wire protocol version this replica "
                                    "writes envelopes in now: the lowest of every live replica's (an older release "
                                    "beside it keeps it at that release's)",
                                    value=float(getattr(self.bus, "wire_version", 0)))
            yield GaugeMetricFamily("uibus_replication_shards_subscribed", "Bus shards this replica listens to "
                                    "now (those its subscribers are in; of --bus-shards)",
                                    value=float(getattr(self.bus, "shards_subscribed", 0)))


class Metrics:
    """One registry per App (tests run many Apps in one process)."""

    def __init__(self, bus: Bus, gauges: dict[str, tuple[str, Callable[[], float]]] | None = None,
                 counters: dict[str, tuple[str, Callable[[], float]]] | None = None, *,
                 store: Store | None = None, worker: dict[str, str] | None = None,
                 labelled: dict[str, tuple[str, str, Callable[[], Mapping[str, float]]]] | None = None) -> None:
        """`worker`: the labels of the `uibus_worker` gauge (index, pid), in a worker process only."""
        self.registry = CollectorRegistry(auto_describe=False)
        self.chat_turns: dict[str, int] = {}
        self.rpc = Histogram("uibus_rpc_duration_seconds", "RPC duration (whole stream for streaming calls); "
                             "its _count is the RPC count", ["method", "code", "transport"], buckets=_BUCKETS,
                             registry=self.registry)
        self._refused = Counter("uibus_http_refused_total", "browser requests the HTTP port refused: reason "
                                "host (a Host it does not answer to) or origin (a page not allowed)", ["reason"],
                                registry=self.registry)
        for reason in ("host", "origin"):  # exported at 0 from the start, so a rate() has a series
            self._refused.labels(reason)
        self._dialog_wait = Histogram(
            "uibus_dialog_wait_seconds", "How long a dialog (extension UI, pi's extension UI, an ACP permission, "
            "MCP ask_user) waited for a person: from the ask to its end, by kind (select, confirm, input, "
            "editor) and outcome (answered, timed_out, cancelled)", ["kind", "outcome"], buckets=_WAIT_BUCKETS,
            registry=self.registry)
        self._children: dict[tuple[str, str, str], Any] = {}
        self._methods: set[str] = set()
        self.registry.register(_BusCollector(bus, self.chat_turns, gauges if gauges is not None else {},
                                             counters if counters is not None else {}, store, worker, labelled))

    def observe(self, method: str, code: str, seconds: float, transport: str) -> None:
        key = (method, code, transport)
        child = self._children.get(key)
        if child is None:
            # Labels come from what uibus serves (unknown agents already share one name), but a
            # scrape must stay small whatever callers send: past a bound, new methods share one.
            self._methods.add(method)
            if len(self._methods) > MAX_METHOD_LABELS:
                self._methods.discard(method)
                method = UNKNOWN_METHOD
                key = (method, code, transport)
                child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.rpc.labels(method, code, transport)
        child.observe(seconds)
        if method.endswith(_CHAT_SUFFIX):
            agent = method[1:-len(_CHAT_SUFFIX)]
            self.chat_turns[agent] = self.chat_turns.get(agent, 0) + 1

    def dialog_wait(self, kind: str, outcome: str, seconds: float) -> None:
        self._dialog_wait.labels(kind, outcome).observe(seconds)

    def refused(self, reason: str) -> None:
        self._refused.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

