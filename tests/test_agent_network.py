"""A sandboxed agent's network (option `network`, uibus.agents.network, docs/hosting/isolation.md):
"outbound" (the default) reaches other hosts but not the host's loopback nor its abstract Unix
sockets, save the `loopback_ports` the operator lists and uibus's own /mcp; "host" shares the
host's network; false has none.

Real servers over real connections: a stand-in ACP agent (tests/scripts/acp_shell.py: it runs its
prompt in a shell, as a hostile model steering an agent would) hosted by uibus in bubblewrap, with
pasta. "Other hosts" are a test host the test makes: a network namespace (`ip netns`) joined to this
one by a veth pair on a /30 of 10.231.0.0/16, running a stand-in model API (an HTTP server) — only
addresses in that namespace are ever contacted. The host's loopback holds a real redis-server, two
plain TCP listeners (one listed in `loopback_ports`) and an abstract Unix socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from tests.chatkit import Agent, local, request, write_agents
from tests.conftest import free_port, require, require_binary, start_app
from tests.redisproc import RedisProcess
from uibus.app import App
from uibus.clients.connection import Connection
from uibus.infra.config import Config, InvalidConfig

OPERATOR = "tokOP-network-7c2b"
SESSION = "s1"
SHELL_AGENT = Path(__file__).resolve().parent / "scripts" / "acp_shell.py"
# Run inside the sandbox by the agent's own interpreter: connects to each target, says what it got.
PROBE = r'''
import json, socket, sys
out = {}
for name, kind, where in json.loads(sys.argv[1]):
    try:
        if kind == "tcp":
            s = socket.create_connection(tuple(where), timeout=3)
            s.sendall(b"GET / HTTP/1.0\r\nHost: probe\r\n\r\n")
        else:
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(3)
            s.connect("\0" + where)
        data = s.recv(64).decode(errors="replace").strip()
        out[name] = "ok " + data
    except OSError as exc:
        out[name] = "no " + type(exc).__name__
print("PROBE " + json.dumps(out))
'''


def pastas() -> list[int]:
    """pasta processes this test process started (uibus runs in it: pasta is its child)."""
    mine = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            comm, ppid = stat[stat.index("(") + 1:stat.rindex(")")], int(stat[stat.rindex(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if comm.startswith("passt") and ppid == os.getpid():  # pasta is passt, which runs passt.avx2 here
            mine.append(int(entry.name))
    return mine


@dataclass
class ModelHost:
    """A network namespace the test made, joined by a veth pair, serving HTTP on `address`:`port`."""

    name: str
    address: str
    port: int = 8080


@pytest.fixture
def test_host(tmp_path: Path) -> Iterator[ModelHost]:
    require("root (the test host is a network namespace: ip netns)", os.getuid() == 0)
    ip = require_binary("ip")
    tag = f"{os.getpid() % 10000:04d}{random.randrange(100):02d}"
    name, outer, inner = f"uibus-t{tag}", f"ut{tag}h", f"ut{tag}n"
    block = random.randrange(256) * 256 + random.randrange(64) * 4  # a /30 of 10.231.0.0/16
    host_side, far_side = (f"10.231.{(block + k) // 256}.{(block + k) % 256}" for k in (1, 2))
    site = tmp_path / "site"
    site.mkdir()
    (site / "index.html").write_text("stand-in model API\n")

    def run(*args: str) -> None:
        subprocess.run([ip, *args], check=True, capture_output=True, timeout=30)

    server: subprocess.Popen[bytes] | None = None
    try:
        run("netns", "add", name)
        run("link", "add", outer, "type", "veth", "peer", "name", inner)
        run("link", "set", inner, "netns", name)
        run("addr", "add", f"{host_side}/30", "dev", outer)
        run("link", "set", outer, "up")
        run("-n", name, "addr", "add", f"{far_side}/30", "dev", inner)
        run("-n", name, "link", "set", inner, "up")
        run("-n", name, "link", "set", "lo", "up")
        server = subprocess.Popen([ip, "netns", "exec", name, sys.executable, "-m", "http.server", "--bind", far_side,
                                   "--directory", str(site), "8080"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while subprocess.run(["curl", "-s", "-m", "1", f"http://{far_side}:8080/"], capture_output=True,
                             check=False).stdout != b"stand-in model API\n":
            assert server.poll() is None and time.monotonic() < deadline, "the test host's server did not start"
            time.sleep(0.05)
        yield ModelHost(name, far_side)
    finally:
        if server is not None:
            server.kill()
            server.wait(10)
        subprocess.run([ip, "link", "del", outer], capture_output=True, check=False, timeout=30)
        subprocess.run([ip, "netns", "del", name], capture_output=True, check=False, timeout=30)


@contextlib.asynccontextmanager
async def listener(name: str) -> AsyncIterator[int]:
    """A plain TCP server on the host's loopback that greets with its name."""
    async def greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")  # the probe's request, read (an unread one would reset the reply)
        writer.write(f"hello from {name}\n".encode())
        await writer.drain()
        writer.close()

    port = free_port()
    server = await asyncio.start_server(greet, "127.0.0.1", port)
    try:
        yield port
    finally:
        server.close()
        await server.wait_closed()


@contextlib.asynccontextmanager
async def abstract_socket() -> AsyncIterator[str]:
    """A listening abstract Unix socket of the host's network namespace; yields its name (no NUL)."""
    name = f"uibus-test-{os.getpid()}-{random.randrange(1 << 30)}"

    async def greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"hello from the abstract socket\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(greet, "\0" + name)
    try:
        yield name
    finally:
        server.close()
        await server.wait_closed()


def shell_agent(work: Path, **options: Any) -> dict[str, Any]:
    return {"name": "shell", "backend": "acp", "options": {
        "command": [sys.executable, str(SHELL_AGENT)], "cwd": str(work), "sandbox": True,
        "bwrap": require_binary("bwrap"), "read_only": [str(SHELL_AGENT.parent)], **options}}


async def hosted(tmp_path: Path, config: Config, **options: Any) -> tuple[App, Path]:
    require("pasta (Debian's passt package: .ci/setup --system installs it)", shutil.which("pasta") is not None)
    work = tmp_path / "work"
    work.mkdir(parents=True, exist_ok=True)
    (work / "probe.py").write_text(PROBE)
    agents = write_agents(tmp_path, [shell_agent(work, **options), local("hello_world")], default="hello_world")
    app = await start_app(replace(config, agents=agents, auth_token=OPERATOR, http_port=free_port()))
    return app, work


async def turn(app: App, command: str) -> str:
    async with Connection(f"127.0.0.1:{app.port}", session=SESSION, token=OPERATOR) as conn:
        replies = [r async for r in Agent(conn, "shell").StreamingChat(request(command))]
    return replies[-1].response.text


async def probe(app: App, targets: list[tuple[str, str, Any]]) -> dict[str, str]:
    said = await turn(app, f"{sys.executable} probe.py '{json.dumps(targets)}'")
    assert "PROBE " in said, said
    return json.loads(said.split("PROBE ", 1)[1].splitlines()[0])  # type: ignore[no-any-return]


NOTIFY = ('curl -s -o /dev/null -w "%{http_code}" -X POST -H "authorization: Bearer $MCP_TOKEN" '
          '-H "x-uibus-session: $MCP_SESSION" -H "content-type: application/json" '
          '-H "accept: application/json, text/event-stream" '
          '-d \'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "notify_user", '
          '"arguments": {"message": "hi"}}}\' "$MCP_URL"')


@pytest.mark.redis
async def test_outbound_reaches_other_hosts_and_its_ports_but_not_the_hosts_loopback(
        tmp_path: Path, config: Config, test_host: ModelHost) -> None:
    redis = RedisProcess(tmp_path)
    try:
        async with listener("allowed") as allowed, listener("other") as other, abstract_socket() as abstract:
            app, _ = await hosted(tmp_path, config, loopback_ports=[allowed])  # network: the default
            try:
                seen = await probe(app, [
                    ("model", "tcp", [test_host.address, test_host.port]), ("redis", "tcp", ["127.0.0.1", redis.port]),
                    ("allowed", "tcp", ["127.0.0.1", allowed]), ("other", "tcp", ["127.0.0.1", other]),
                    ("abstract", "unix", abstract)])
                assert seen["model"].startswith("ok HTTP/1.0 200"), seen  # the world, through pasta
                assert seen["allowed"] == "ok hello from allowed", seen  # listed in loopback_ports
                assert seen["redis"].startswith("no ") and seen["other"].startswith("no "), seen  # the host's loopback
                assert seen["abstract"].startswith("no "), seen  # the host's abstract sockets
                assert redis.ping()
                # uibus's own /mcp, offered to it, stays reachable (its port forwarded), with its token
                assert (await turn(app, NOTIFY)).endswith("200"), "the agent's /mcp call failed"
                assert len(pastas()) == 1  # one pasta for its one sandbox
            finally:
                await app.aclose(grace=0.5)
            assert pastas() == []  # gone with the agent
    finally:
        redis.kill()


async def test_host_shares_the_hosts_loopback_and_false_has_no_network(
        tmp_path: Path, config: Config, test_host: ModelHost) -> None:
    async with listener("loopback") as port, abstract_socket() as abstract:
        targets = [("model", "tcp", [test_host.address, test_host.port]), ("loopback", "tcp", ["127.0.0.1", port]),
                   ("abstract", "unix", abstract)]
        app, _ = await hosted(tmp_path / "host", config, network="host")
        try:
            seen = await probe(app, targets)
            assert pastas() == []
        finally:
            await app.aclose(grace=0.5)
        assert seen == {"model": seen["model"], "loopback": "ok hello from loopback",
                        "abstract": "ok hello from the abstract socket"}, seen
        assert seen["model"].startswith("ok HTTP/1.0 200"), seen
        app, _ = await hosted(tmp_path / "none", config, network=False)
        try:
            seen = await probe(app, targets)
            assert pastas() == []
        finally:
            await app.aclose(grace=0.5)
        assert all(v.startswith("no ") for v in seen.values()), seen


async def test_network_options_are_checked_and_outbound_that_cannot_work_stops_start_up(
        tmp_path: Path, config: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    from uibus.agents import network
    from uibus.agents.config import load_agents

    work = tmp_path / "work"
    work.mkdir()

    def agents(**options: Any) -> str:
        return write_agents(tmp_path, [shell_agent(work, **options)])

    for options, said in (({"network": "bogus"}, "option network must be \"outbound\" (also true), \"host\" or false"),
                          ({"network": "host", "loopback_ports": [80]}, "option loopback_ports needs network = "
                                                                         "\"outbound\""),
                          ({"loopback_ports": ["80"]}, "option loopback_ports must be a list of TCP port numbers"),
                          ({"loopback_ports": [0]}, "option loopback_ports must be a list of TCP port numbers")):
        with pytest.raises(InvalidConfig, match=r"agent 'shell': " + said.replace("(", r"\(").replace(")", r"\)")):
            load_agents(agents(**options))
    with pytest.raises(InvalidConfig, match="option loopback_ports needs sandbox = true"):
        load_agents(write_agents(tmp_path, [{"name": "a", "backend": "acp", "options": {
            "command": ["/bin/cat"], "loopback_ports": [80]}}]))
    monkeypatch.setattr(network, "find_pasta", lambda: str(tmp_path / "no-pasta"))
    with pytest.raises(InvalidConfig, match=r"agent 'shell': option network = \"outbound\" \(the default\) cannot "
                                            r"work here: .*no-pasta is not an executable file .*passt"):
        load_agents(agents())
    with pytest.raises(InvalidConfig, match=r"option network = \"outbound\" cannot work here"):
        load_agents(agents(network=True))  # `true` is "outbound" now
    await (await asyncio.to_thread(load_agents, agents(network="host"))).aclose()  # no pasta needed
    await (await asyncio.to_thread(load_agents, agents(network=False))).aclose()


async def test_a_launch_that_ends_leaves_no_pasta_and_the_agent_waits_for_its_network(tmp_path: Path) -> None:
    """The launcher alone: the agent's first instruction already sees its interface configured
    (bwrap holds it until pasta is up), and when it ends, pasta ends."""
    require("pasta (Debian's passt package: .ci/setup --system installs it)", shutil.which("pasta") is not None)
    from uibus.agents.launcher import Launch, Sandbox
    from uibus.agents.local_launcher import LOCAL

    (tmp_path / "home").mkdir()
    box = Sandbox(bwrap=require_binary("bwrap"), network="outbound", homes_dir=str(tmp_path / "homes"))
    launch = Launch(agent="a", session="s", tenant="t", argv=("/bin/cat", "/proc/net/route"), cwd=str(tmp_path),
                    env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path / "home")}, sandbox=box)
    async with LOCAL.start(launch) as proc:  # (its watcher holds its output open: the group goes at the end)
        await asyncio.wait_for(proc.wait(), 30)
    assert proc.stdout is not None
    out = await asyncio.wait_for(proc.stdout.read(), 30)
    routes = out.decode().splitlines()[1:]
    assert any(line.split()[1] == "00000000" for line in routes), routes  # a default route, from the start
    assert pastas() == []


UNPRIVILEGED = """
import asyncio, sys, tempfile, os
sys.path.insert(0, sys.argv[1])
from uibus.agents import network
from uibus.agents.launcher import Launch, Sandbox
from uibus.agents.local_launcher import LOCAL
problem = network.network_problem(sys.argv[2], network.find_pasta())
print("problem", problem)
async def main():
    d = tempfile.mkdtemp()
    os.mkdir(d + "/home")
    box = Sandbox(bwrap=sys.argv[2], network="outbound", homes_dir=d + "/homes")
    launch = Launch(agent="a", session="s", tenant="t", argv=("/bin/cat", "/proc/net/route"), cwd=d,
                    env={"PATH": "/usr/bin:/bin", "HOME": d + "/home"}, sandbox=box)
    async with LOCAL.start(launch) as proc:
        await proc.wait()
    print("routes", (await proc.stdout.read()).decode().replace("\\n", "|"))
if not problem:
    asyncio.run(main())
"""


def test_an_unprivileged_uibus_gets_outbound_where_pasta_may_open_its_tun() -> None:
    """uibus as `nobody`: pasta joins the user namespace bwrap made (nested, as for root) and
    configures the sandbox's interface — where /dev/net/tun is open to every user (0666, as on a
    normal host); where it is not (some containers), start-up's probe says why."""
    setpriv = shutil.which("setpriv")
    require("root and setpriv (util-linux), to run uibus as nobody", os.geteuid() == 0 and setpriv is not None)
    require("pasta (Debian's passt package: .ci/setup --system installs it)", shutil.which("pasta") is not None)
    done = subprocess.run([setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                           UNPRIVILEGED, str(Path(__file__).resolve().parents[1]), require_binary("bwrap")],
                          capture_output=True, text=True, timeout=60, check=False, cwd="/")
    lines = done.stdout.splitlines()
    assert lines and lines[0].startswith("problem"), (done.stdout, done.stderr)
    if os.stat("/dev/net/tun").st_mode & 0o006 == 0o006:
        assert lines[0] == "problem ", lines
        routes = lines[1].split("|")[1:]
        assert any(r.split()[1:2] == ["00000000"] for r in routes if r), lines  # connected, as for root
    else:
        assert "pasta could not connect the sandbox's network: Failed to open tun socket" in lines[0], lines
