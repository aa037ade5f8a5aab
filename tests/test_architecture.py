"""The shape of the code, checked: dependencies point one way, no import circles, the UI stream
table matches Cline's proto, and every bus kind is one record in one module.

The import graph is read from the source (every `import` statement, lazy and type-only ones
too), so a circle or a wrong-way dependency fails here before it confuses a reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO
from uibus.domain.feed import UI_STREAMS
from uibus.infra import kinds
from uibus.pb.cline import common_pb2, ui_pb2

# Where each source folder is installed (see setup.py).
ROOTS = {"uibus": REPO / "server", "uibus.clients": REPO / "clients"}
# The layers are folders, lowest first: a module may import its own layer and the ones below it, never
# above. A module is placed by the folder it is in; one the table cannot place fails the test (nothing
# falls into a layer by default, and no module lies loose beside the folders).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # Stores, the bus and Redis, configuration, telemetry, the JSON-RPC peer: no domain meaning.
    ("infra", ("uibus.infra",)),
    # Hosted agents know processes, protocols and the limits of what they relay, never the domain
    # that drives them (the domain imports the agents' interface, not the other way round).
    ("agents", ("uibus.agents",)),
    # The replicas wing: where hosted agents run and what other replicas hear of (leases, forwarding,
    # sharing). The domain asks its placement; the wing uses the bus and the store, never the domain
    # (what it runs for other replicas, the domain objects hand it as they are built).
    ("replicas", ("uibus.replicas",)),
    ("domain", ("uibus.domain",)),
    # The edge: how the world reaches the domain. Policy and protocols first, then the editors' ACP
    # (a client of the public services through a channel, never their code), then the framings.
    ("edge: services", ("uibus.edge.calls", "uibus.edge.pipeline", "uibus.infra.proto_check", "uibus.edge.metrics",
                        "uibus.edge.reflection", "uibus.edge.wiring", "uibus.edge.services", "uibus.edge.codebolt",
                        "uibus.edge.mcp")),
    ("edge: editors", ("uibus.edge.editors",)),
    ("edge: transports", ("uibus.edge.transports",)),
    ("app", ("uibus.app",)),  # App: every part set up and torn down in order; `serve` runs it
    ("clients", ("uibus.clients", "uibus.__main__")),  # the `uibus` command
]
# The package itself holds only its version (read by every layer); the folders' own __init__ modules
# belong to no layer of their own and import nothing.
ROOT_MODULES = {"uibus", "uibus.infra", "uibus.edge"}


def modules() -> dict[str, Path]:
    """Every module of the package, by import name (generated code excluded)."""
    found: dict[str, Path] = {}
    for name, root in ROOTS.items():
        for path in root.rglob("*.py"):
            rel = path.relative_to(root)
            if rel.parts[0] in ("pb", "static") or (name == "uibus" and rel.parts[0] == "clients"):
                continue
            parts = [*name.split("."), *rel.with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports(path: Path, known: set[str]) -> set[str]:
    """The uibus modules a file imports (a `from pkg import name` of a submodule counts as it)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "uibus")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "uibus":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in known else node.module)
    return {m for m in out if not m.startswith("uibus.pb")}


def layer_of(module: str) -> int:
    """The layer of the folder a module is in (the root modules: below every layer)."""
    if module in ROOT_MODULES:
        return -1
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes):
            return i
    raise AssertionError(f"{module} is in no layer's folder: move it into one (or add its folder to LAYERS)")


GRAPH = {m: imports(p, set(modules())) for m, p in modules().items()}


def test_the_graph_is_read() -> None:
    assert "uibus.app" in GRAPH and "uibus.domain.feed" in GRAPH["uibus.edge.services.ui"]
    assert "uibus.clients.cli" in GRAPH and len(GRAPH) > 50


def test_every_module_is_placed_by_its_folder() -> None:
    """No module lies loose beside the folders, and every folder is some layer's."""
    loose = sorted(p.name for p in (REPO / "server").glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert loose == []
    unplaced = []
    for module in GRAPH:
        try:
            layer_of(module)
        except AssertionError as exc:
            unplaced.append(str(exc))
    assert unplaced == []
    for root in ROOT_MODULES - {"uibus"}:
        assert GRAPH[root] == set(), f"{root} is a folder's marker: it imports nothing"


def test_dependencies_point_one_way() -> None:
    wrong = sorted(f"{m} ({LAYERS[layer_of(m)][0]}) imports {dep} ({LAYERS[layer_of(dep)][0]})"
                   for m, deps in GRAPH.items() for dep in deps
                   if layer_of(dep) > layer_of(m))
    assert wrong == []


def test_no_import_circles() -> None:
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(GRAPH.get(module, ())):
            if state.get(dep) == 1:
                cycles.append([*path[path.index(dep):], dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_the_domain_knows_no_transport() -> None:
    """The domain core is plain async objects: no gRPC, no HTTP, no pipeline."""
    for module, path in modules().items():
        if module.startswith("uibus.domain"):
            tree = ast.parse(path.read_text())
            names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
            assert not names & {"grpc", "uvicorn", "websockets", "httpx"}, (module, names)


def test_the_domain_asks_its_placement_not_whether_it_is_replicated() -> None:
    """Replication is the replicas wing's business: the domain imports the wing's one interface
    (uibus.replicas.placement) and nothing else of it, reads no bus's `replicated` or `replica_id`,
    duck-types no bus (`getattr(bus, …)`) and names no particular placement: it asks the
    `Placement` it was built with. The wing duck-types no bus either (the bus answers)."""
    for module, path in modules().items():
        if module.startswith("uibus.domain"):
            wing = {dep for dep in GRAPH[module] if dep.startswith("uibus.replicas")}
            assert wing <= {"uibus.replicas.placement"}, (module, wing)
            source = path.read_text()
            for asked in (".replicated", "replica_id", "getattr(bus", "getattr(self.bus", "LocalPlacement",
                          "LeasedPlacement"):
                assert asked not in source, (module, asked)
        if module.startswith("uibus.replicas"):
            assert "getattr(bus" not in path.read_text() and "getattr(self.bus" not in path.read_text(), module


def test_services_call_each_other_by_no_path() -> None:
    """No service or gateway reaches another through a method path string or a registry lookup."""
    for module, path in modules().items():
        if module.startswith(("uibus.edge.services", "uibus.edge.codebolt", "uibus.domain")):
            source = path.read_text()
            assert ".lookup(" not in source, module
            for service in ("/cline.UiService/", "/uibus.v1.", "/dev.cognizant_ai."):
                assert f'"{service}' not in source, (module, service)


def test_ui_stream_table_matches_ui_proto() -> None:
    """One table drives UiService and WebviewService: it must list exactly the server-streaming
    methods of cline.UiService, each with the request and payload types the proto gives it."""
    service = ui_pb2.DESCRIPTOR.services_by_name["UiService"]
    streaming = {m.name: m for m in service.methods if m.server_streaming}
    assert sorted(s.rpc for s in UI_STREAMS) == sorted(streaming)
    request_of = {"": common_pb2.EmptyRequest, "provider": ui_pb2.WebviewProviderTypeRequest,
                  "client_id": common_pb2.StringRequest}
    for stream in UI_STREAMS:
        method = streaming[stream.rpc]
        assert method.input_type is request_of[stream.target].DESCRIPTOR, stream.rpc
        assert method.output_type is stream.kind.payload.DESCRIPTOR, stream.rpc


def test_bus_kinds_are_records_in_one_module() -> None:
    names = [k.name for k in kinds.ALL]
    assert len(names) == len(set(names))
    assert {v for v in vars(kinds).values() if isinstance(v, kinds.Kind)} == set(kinds.ALL)
    for module, path in modules().items():
        if module != "uibus.infra.kinds":
            assert "Kind(" not in path.read_text(), f"{module} defines a bus kind: they live in uibus.infra.kinds"



MAX_MODULE_LINES = 500


def test_no_module_does_several_jobs_by_size() -> None:
    """A module past ~500 lines has always turned out to hold two jobs (the bus's links, outbox,
    codec and presence; two store strategies): split it by job, not by line count."""
    long = {m: n for m, p in modules().items() if m.startswith("uibus.") and not m.startswith("uibus.clients")
            and (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}
