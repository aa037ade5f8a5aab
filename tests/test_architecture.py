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
    # The domain: Chat, Dialogs, the UI feed, the sessions and the hosted agents' sessions, the
    # session log. It runs what it is given here.
    ("domain", ("uibus.domain",)),
    # Replication at the edge: where a turn, a steering call or an answer runs (here, or at its
    # agent's or dialog's replica over the bus), and what the domain tells other replicas through
    # its Sharing. It calls the domain; the domain never calls it (it knows nothing of replicas).
    ("replicas", ("uibus.replicas",)),
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


def test_the_domain_knows_nothing_of_replicas() -> None:
    """Replication is at the edge: the domain imports nothing of uibus.replicas, reads no bus's
    `replicated` or `replica_id`, duck-types no bus and registers nothing with anyone (no `serve_`
    callbacks, no placement): it runs what it is given here, and tells the store/bus layer's
    `Sharing` what other processes must see. The wing duck-types no bus either (the bus answers)."""
    for module, path in modules().items():
        if module.startswith("uibus.domain"):
            wing = {dep for dep in GRAPH[module] if dep.startswith("uibus.replicas")}
            assert wing == set(), (module, wing)
            source = path.read_text()
            for asked in (".replicated", "replica_id", "getattr(bus", "getattr(self.bus", "Placement",
                          "placement.", ".serve_", "serve_turns", "serve_answers", "serve_steering"):
                assert asked not in source, (module, asked)
        if module.startswith("uibus.replicas"):
            assert "getattr(bus" not in path.read_text() and "getattr(self.bus" not in path.read_text(), module


def test_only_the_edge_places_calls() -> None:
    """Every turn, steering call and answer a service takes goes through the placement: no service
    calls the domain's here-only `Chat.turn`, `Steering` calls or `Dialogs.respond` itself."""
    for module, path in modules().items():
        if module.startswith(("uibus.edge.services", "uibus.edge.mcp", "uibus.edge.codebolt")):
            source = path.read_text()
            for direct in ("chat.turn(", "steering.stop(", "steering.set_mode(", "steering.set_model(",
                           "steering.new_conversation(", "dialogs.respond(", "sessions.delete("):
                assert direct not in source, (module, direct)


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


JSONRPC_CORE = {"uibus.infra.jsonrpc", "uibus.infra.peer"}


def test_only_the_jsonrpc_core_builds_or_parses_frames() -> None:
    """JSON-RPC request/reply is written once (uibus.infra.peer on uibus.infra.jsonrpc): no other
    module builds a frame (a `"jsonrpc"` key in a dict, a `jsonrpc=` keyword) or reads one by hand
    (`["jsonrpc"]`, `.get("jsonrpc")`), and a module that speaks JSON-RPC (imports the core) hands
    text to the core's `read` rather than decoding frames itself with `json.loads`."""
    def is_key(node: ast.AST | None) -> bool:
        return isinstance(node, ast.Constant) and node.value == "jsonrpc"

    found: list[tuple[str, int, str]] = []
    for module, path in modules().items():
        if module in JSONRPC_CORE:
            continue
        tree = ast.parse(path.read_text())
        speaks = any(dep in JSONRPC_CORE for dep in GRAPH[module])
        loads_names = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                       and n.module in ("json", "orjson", "ujson") for a in n.names if a.name == "loads"}
        for node in ast.walk(tree):
            line = getattr(node, "lineno", 0)
            if isinstance(node, ast.Dict) and any(is_key(k) for k in node.keys):
                found.append((module, line, "builds a frame"))
            elif isinstance(node, ast.keyword) and node.arg == "jsonrpc":
                found.append((module, line, "builds a frame"))
            elif isinstance(node, ast.Subscript) and is_key(node.slice):
                found.append((module, line, "reads a frame's version"))
            elif isinstance(node, ast.Call):
                func = node.func
                if isinstance(func, ast.Attribute) and func.attr == "get" and node.args and is_key(node.args[0]):
                    found.append((module, line, "reads a frame's version"))
                decodes = ((isinstance(func, ast.Attribute) and func.attr == "loads"
                            and isinstance(func.value, ast.Name) and func.value.id in ("json", "orjson", "ujson"))
                           or (isinstance(func, ast.Name) and func.id in loads_names))
                if speaks and decodes:
                    found.append((module, line, "decodes JSON itself (give the text to uibus.infra.jsonrpc.read)"))
        if '"jsonrpc": "2.0"' in path.read_text() or "'jsonrpc': '2.0'" in path.read_text():
            found.append((module, 0, 'contains "jsonrpc": "2.0"'))
    assert found == [], found


def _request_path_names(tree: ast.AST) -> set[str]:
    """The names a module binds to the whole request path (`path = scope["path"]`)."""
    return {target.id for node in ast.walk(tree) if isinstance(node, ast.Assign | ast.AnnAssign)
            and node.value is not None and _is_request_path(node.value, set())
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(target, ast.Name)}


def _is_request_path(node: ast.AST, names: set[str]) -> bool:
    """`scope["path"]`, `scope.get("path", …)` or a name bound to one: the whole path, not a part below
    a route's prefix (an API's endpoint names are its framing, `scope["path"][len(PREFIX):]`)."""
    if isinstance(node, ast.Name):
        return node.id in names
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "path"
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
            and bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value == "path")


def test_the_http_port_routes_by_one_table() -> None:
    """Which door a request goes through (and so which token and browser policy it meets) is decided
    by one table, uibus.edge.transports.routes.TABLE: no other module tests the request's whole path
    (an if/elif chain, a `match`, a prefix loop, a `startswith`: a second router), builds `Route`s or
    puts the browser policy in front of anything."""
    table = "uibus.edge.transports.routes"
    found = []
    for module, path in modules().items():
        if module == table:
            continue
        tree = ast.parse(path.read_text())
        names = _request_path_names(tree)
        for node in ast.walk(tree):
            tested: list[ast.AST] = []
            if isinstance(node, ast.Compare):
                tested = [node.left, *node.comparators]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in ("startswith", "endswith", "removeprefix", "partition", "split"):
                tested = [node.func.value]
            elif isinstance(node, ast.Match):
                tested = [node.subject]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in ("Route", "BrowserGuard"):
                found.append(f"{module}:{node.lineno}: {node.func.id}(…) outside the route table's module")
            if any(_is_request_path(t, names) for t in tested):
                found.append(f"{module}:{node.lineno}: tests the request path (route it in {table}.TABLE)")
    assert found == []
    # And the table's module routes by its table: no path test of its own outside `Route.takes`.
    source = (REPO / "server/edge/transports/routes.py").read_text()
    assert source.count('scope["path"]') <= 3 and "TABLE" in source and "elif path" not in source


def test_one_place_reads_bearer_tokens() -> None:
    """Tokens are read in one place: uibus.edge.pipeline (`Pipeline.authorize` for every call) and
    uibus.edge.calls.access (`check_bearer` for the HTTP doors the route table sends it), over
    uibus.infra.auth's primitives. A transport (or anything else) that reads `Authorization: Bearer`
    itself is a second token check, which drifts from the first (a revoked or minted token treated
    differently on one door)."""
    allowed = {"uibus.edge.pipeline", "uibus.edge.calls.access", "uibus.infra.auth"}
    readers = ("bearer", "grant", "may_read_metrics")
    found = []
    for module, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in readers and module not in allowed:
                found.append(f"{module}:{node.lineno}: {name}(…) reads a bearer token")
            if name == "check_bearer" and module not in {*allowed, "uibus.edge.transports.routes"}:
                found.append(f"{module}:{node.lineno}: check_bearer(…) outside the route table's gate")
    assert found == []
