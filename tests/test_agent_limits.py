"""Limits per agent and per tenant, enforced by the kernel (docs/hosting/isolation.md, "Limits";
uibus.agents.limits): a stand-in agent (tests/scripts/rpc_shell.py, pi's RPC mode) that runs the
shell command its prompt holds — as a hostile model steering a real agent would — forks 1,000
processes, allocates past its memory, writes past its disk. Real processes, real cgroups, real
uibus; every loop bounded in time and count.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.chatkit import Agent, request, write_agents
from tests.conftest import REPO, require, start_app, wait_for
from uibus.agents import cgroups, limits
from uibus.agents.config import load_agents
from uibus.app import App
from uibus.clients.connection import Connection
from uibus.infra import kinds
from uibus.infra.config import Config, InvalidConfig
from uibus.pb.cline import common_pb2, ui_pb2, ui_pb2_grpc

pytestmark = pytest.mark.timeout(90)

SHELL = REPO / "tests" / "scripts" / "rpc_shell.py"
PY = sys.executable


def shell_agent(work: Path, **options: Any) -> dict[str, Any]:
    return {"name": "shell", "backend": "rpc",
            "options": {"command": [PY, str(SHELL)], "cwd": str(work), "stop_timeout_seconds": 2, **options}}


def need_cgroups() -> None:
    problems = [cgroups.HIERARCHIES.problem(c) for c in ("pids", "memory", "cpu")]
    require(f"writable cgroups for pids, memory and cpu (root, cgroup v1, or a delegated v2): {problems}",
            not any(problems))


@pytest.fixture
async def hosted(config: Config, tmp_path: Path) -> AsyncIterator[Any]:
    """Starts uibus with the given agents; after the test every app is closed and no cgroup of
    this process is left."""
    need_cgroups()
    apps: list[App] = []

    async def start(*agents: dict[str, Any], **flags: Any) -> App:
        app = await start_app(replace(config, agents=write_agents(tmp_path, list(agents)), **flags))
        apps.append(app)
        return app

    try:
        yield start
    finally:
        for app in apps:
            await app.aclose()
        limits.set_tenant_totals(0, 0)  # process-wide: the next app sets its own
    assert cgroups.leftovers() == []


async def ask(app: App, session: str, text: str) -> str:
    async with Connection(f"127.0.0.1:{app.port}", session=session) as conn:
        return [r async for r in Agent(conn, "shell").StreamingChat(request(text))][-1].response.text


def agent_pid(app: App, session: str) -> int:
    live = app.core.agent_sessions.live_agent(session, "shell")
    assert live is not None and live.alive
    return live.process.proc.pid  # type: ignore[no-any-return]


FORK_1000 = (f"exec {PY} -c \"import os, signal, time\n"
             "kids = []\n"
             "for _ in range(1000):\n"
             "    try:\n"
             "        pid = os.fork()\n"
             "    except OSError:\n"
             "        break\n"
             "    if pid == 0:\n"
             "        time.sleep(20)\n"
             "        os._exit(0)\n"
             "    kids.append(pid)\n"
             "print('forked', len(kids))\n"
             "for pid in kids:\n"
             "    os.kill(pid, signal.SIGKILL)\n"
             "    os.waitpid(pid, 0)\n\"")


async def test_a_fork_bomb_is_capped_at_pids_and_the_agent_lives_on(hosted: Any, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    app = await hosted(shell_agent(work, limits={"pids": 64, "memory_mb": 512, "cpu": 0.5}))
    answer = await ask(app, "bomb", FORK_1000)
    forked = int(answer.split("forked ")[1].split()[0])
    # 64 in all: the watcher, the agent and the forking python take 3 of them
    assert 50 <= forked <= 61, answer
    # its cgroup: under this uibus and its tenant, with the limits written
    pid = agent_pid(app, "bomb")
    own = {line.split(":")[1]: line.split(":")[2] for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()}
    for controller in ("pids", "memory", "cpu"):
        assert f"/uibus-{os.getpid()}/t-" in own[controller] and "/a-shell-" in own[controller], own
    h = cgroups.HIERARCHIES.get("cpu")
    assert not isinstance(h, str)
    cpu_dir = Path(h.parent) / own["cpu"].split(f"/uibus-{os.getpid()}/", 1)[1]
    if h.version == 1:
        assert (cpu_dir / "cpu.cfs_quota_us").read_text().strip() == "50000"
    # the agent survived its failed forks: the same process takes the next turn
    assert (await ask(app, "bomb", "echo alive")) == "exit 0: alive\n"
    assert app.core.chat.agents.backends["shell"].started == 1


async def test_memory_past_its_limit_stops_the_agent_every_ui_sees_why_and_the_next_turn_works(
        hosted: Any, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    app = await hosted(shell_agent(work, limits={"memory_mb": 64}),
                       {"name": "other", "backend": "rpc", "options": {"command": [PY, str(SHELL)]}})
    async with Connection(f"127.0.0.1:{app.port}", session="oom") as conn, \
            Connection(f"127.0.0.1:{app.port}", session="oom") as watcher:
        # another UI of the session, watching as a webview does
        webview = ui_pb2_grpc.UiServiceStub(watcher.channel).subscribeToPartialMessage(common_pb2.EmptyRequest())
        await wait_for(lambda: app.bus.count(kinds.PARTIAL_MESSAGE, "oom") == 1, what="the webview")
        assert [r async for r in Agent(conn, "shell").StreamingChat(request("echo hi"))][-1].response.text \
            == "exit 0: hi\n"
        first = agent_pid(app, "oom")
        answer = [r async for r in Agent(conn, "shell").StreamingChat(
            request(f"exec {PY} -c 'b = bytearray(300 * 2**20); print(len(b))'"))][-1].response.text
        assert answer == "Error from shell: stopped: memory limit 64 MB during the turn"
        async with asyncio.timeout(10):
            while not ((m := await webview.read()).say == ui_pb2.ERROR and "stopped: memory limit 64 MB" in m.text):
                pass
        webview.cancel()
        # uibus and its other agents go on; this conversation goes on with a new process
        other = [r async for r in Agent(conn, "other").StreamingChat(request("echo fine"))][-1].response.text
        assert other == "exit 0: fine\n"
        assert [r async for r in Agent(conn, "shell").StreamingChat(request("echo again"))][-1].response.text \
            == "exit 0: again\n"
        assert agent_pid(app, "oom") != first
        assert app.core.chat.agents.backends["shell"].started == 2


def over_disk(answer: str) -> int:
    """The MB a disk stop says the agent held (measured while it wrote: more than 20, up to 30 and a
    little, as the file system allocates)."""
    found = re.fullmatch(r"Error from shell: stopped: disk limit 20 MB \(its workspace and home hold (\d+) MB\) "
                         r"during the turn", answer)
    assert found is not None, answer
    return int(found[1])


async def test_writing_past_disk_mb_fails_for_one_file_and_stops_the_agent_for_many(
        hosted: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "DISK_CHECK_S", 0.3)
    work = tmp_path / "work"
    work.mkdir()
    app = await hosted(shell_agent(work, limits={"disk_mb": 20}))
    # one file past disk_mb: the kernel refuses the write (RLIMIT_FSIZE: SIGXFSZ to the writer)
    one = await ask(app, "disk", "head -c 25000000 /dev/zero > big; echo code=$?; rm -f big")
    assert "code=153" in one  # 128 + SIGXFSZ
    # many files past it: measured, and the agent stopped with the reason
    many = await ask(app, "disk", "for i in $(seq 30); do head -c 1048576 /dev/zero > f$i; done; sleep 20")
    assert over_disk(many) > 20, many
    # the next turn is a new process, which may clean up
    assert await ask(app, "disk", "rm -f f*; echo cleaned") == "exit 0: cleaned\n"
    assert app.core.chat.agents.backends["shell"].started == 2


async def test_a_sandboxed_agent_is_limited_too_and_its_tenant_home_counts(
        hosted: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bwrap = shutil.which("bwrap")
    require("bubblewrap (bwrap: .ci/setup --system installs it)", bwrap is not None)
    monkeypatch.setattr(limits, "DISK_CHECK_S", 0.3)
    work = tmp_path / "work"
    work.mkdir()
    app = await hosted(shell_agent(work, sandbox=True, bwrap=bwrap, read_only=[str(SHELL.parent)],
                                   limits={"disk_mb": 20, "memory_mb": 64}), workspaces_dir=str(tmp_path / "ws"))
    assert await ask(app, "box", "echo $HOME") == f"exit 0: {Path.home()}\n"
    many = await ask(app, "box", "cd; for i in $(seq 30); do head -c 1048576 /dev/zero > f$i; done; sleep 20")
    assert over_disk(many) > 20, many
    assert (await ask(app, "box", f"exec {PY} -c 'b = bytearray(300 * 2**20)'")
            == "Error from shell: stopped: memory limit 64 MB during the turn")
    assert await ask(app, "box", "rm -f ~/f*; echo cleaned") == "exit 0: cleaned\n"
    assert app.core.chat.agents.backends["shell"].started == 3


async def test_the_tenant_total_is_the_parent_cgroup_of_its_agents(hosted: Any, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    app = await hosted(shell_agent(work), quota_tenant_memory_mb=1024, quota_tenant_pids=300)
    await ask(app, "tenant", "echo hi")
    pid = agent_pid(app, "tenant")
    own = {line.split(":")[1]: line.split(":")[2] for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()}
    for controller, file, value in (("pids", "pids.max", "300"),
                                    ("memory", "memory.limit_in_bytes", str(1024 * 2**20))):
        h = cgroups.HIERARCHIES.get(controller)
        assert not isinstance(h, str)
        if h.version == 2:
            file = file.replace("limit_in_bytes", "max")
        agent_dir = Path(h.parent) / own[controller].split(f"/uibus-{os.getpid()}/", 1)[1]
        assert (agent_dir.parent / file).read_text().strip() == value
        # the agent's own: the defaults (512 processes, 4096 MB)
        assert (agent_dir / file).read_text().strip() == ("512" if controller == "pids" else str(4096 * 2**20))


async def test_past_the_tenant_total_its_agent_is_stopped_saying_so(hosted: Any, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    app = await hosted(shell_agent(work), quota_tenant_memory_mb=64)
    assert await ask(app, "sum", "echo hi") == "exit 0: hi\n"
    live = app.core.agent_sessions.live_agent("sum", "shell")
    assert live is not None
    # the kernel's OOM killer picks the victim at the tenant's total; uibus then stops that agent
    answer = await ask(app, "sum", f"exec {PY} -c 'b = bytearray(300 * 2**20)'")
    why = "stopped: the tenant's memory limit 64 MB (--quota-tenant-memory-mb)"
    assert answer in ("exit -9: ", f"Error from shell: {why} during the turn"), answer
    await wait_for(lambda: live.process.gone != "", timeout=5, what="the agent stopped")
    assert live.process.gone == why
    assert await ask(app, "sum", "echo again") == "exit 0: again\n"


async def test_the_cgroups_go_when_the_session_ends(hosted: Any, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    app = await hosted(shell_agent(work, idle_seconds=1))
    # a daemon that leaves the agent's process group still dies with its cgroup
    await ask(app, "gone", f"setsid {PY} -c 'import time; time.sleep(60)' >/dev/null 2>&1 < /dev/null & echo ok")
    assert cgroups.leftovers()
    await wait_for(lambda: app.core.agent_sessions.count() == 0, timeout=10, what="the idle close")
    assert cgroups.leftovers() == []


UNPRIVILEGED = """
import json, sys, tempfile
sys.path.insert(0, sys.argv[1])
from uibus.agents.config import load_agents
for limits in ({"memory_mb": 256}, None):
    d = tempfile.mkdtemp()
    agent = {"name": "shell", "backend": "rpc", "options": {"command": ["/bin/sh", sys.argv[2]], "cwd": d}}
    if limits:
        agent["options"]["limits"] = limits
    with open(d + "/agents.json", "w") as f:
        json.dump({"workspaces_dir": d + "/ws", "agents": [agent]}, f)
    try:
        table = load_agents(d + "/agents.json")
        print("loaded", table.backends["shell"].options.isolation.limits)
    except ValueError as exc:
        print("refused", exc)
"""


def test_an_unprivileged_uibus_refuses_a_set_limit_and_runs_without_the_defaults() -> None:
    """For real: uibus as `nobody`, whose cgroups (v1 here, root's) it cannot write."""
    setpriv = shutil.which("setpriv")
    require("root and setpriv (util-linux), to run uibus as nobody", os.geteuid() == 0 and setpriv is not None)
    done = subprocess.run([setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", PY, "-c", UNPRIVILEGED,
                           str(REPO / "server" / ".."), str(SHELL)], capture_output=True, text=True, timeout=60,
                          check=False, cwd="/")
    refused, loaded = done.stdout.splitlines()[:2]
    assert refused.startswith("refused --agents: ") and ("agent 'shell': option limits.memory_mb cannot be enforced "
                                                         "here: no writable memory cgroup (cgroup v1 at ") in refused
    assert refused.endswith(": permission denied)"), refused
    assert loaded.startswith("loaded Limits(pids=0, memory_mb=0, cpu=0.0, disk_mb=10240,"), loaded
    assert "an agent limit's default cannot be enforced here" in done.stderr


def test_a_limit_that_cannot_be_enforced_stops_start_up_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """Here as on a machine whose cgroups are not uibus's to write (an unprivileged uibus under
    cgroup v1, or v2 not delegated): a set limit fails start-up naming it, a default is dropped
    with one warning."""
    nowhere = cgroups.Hierarchies()
    nowhere._found = {c: f"no writable {c} cgroup (permission denied)" for c in ("pids", "memory", "cpu")}
    monkeypatch.setattr(cgroups, "HIERARCHIES", nowhere)
    monkeypatch.setattr(limits, "_warned", set())
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(InvalidConfig) as error:
        load_agents(write_agents(tmp_path, [shell_agent(work, limits={"memory_mb": 256})]))
    assert ("agent 'shell': option limits.memory_mb cannot be enforced here: no writable memory cgroup "
            "(permission denied)") in str(error.value)
    with caplog.at_level("WARNING", logger="uibus.agents.limits"):
        table = load_agents(write_agents(tmp_path, [shell_agent(work, limits={"disk_mb": 100})]))
    got = table.backends["shell"].options.isolation.limits  # type: ignore[attr-defined]
    assert (got.pids, got.memory_mb, got.cpu, got.disk_mb) == (0, 0, 0, 100)  # disk_mb: measured, always
    assert [r.getMessage() for r in caplog.records].count(
        "an agent limit's default cannot be enforced here; agents run without it (set it to 0 in option limits "
        "to say so, or give uibus a writable cgroup)") == 3
    with pytest.raises(InvalidConfig, match="--quota-tenant-pids: 99 cannot be enforced here: no writable pids"):
        limits.tenant_totals(Config(quota_tenant_pids=99))
    limits.tenant_totals(Config())  # the defaults: dropped, said once
    assert "tenant pids" in limits._warned and "tenant memory_mb" in limits._warned
    for bad, why in (({"memory": 1}, "unknown name(s) memory"), ({"pids": 2}, "at least 8"),
                     ({"cpu": True}, "a number of at least 0.01")):
        with pytest.raises(InvalidConfig, match=r"option limits"):
            load_agents(write_agents(tmp_path, [shell_agent(work, limits=bad)]))
        with pytest.raises(ValueError, match=re.escape(why)):
            limits.parse_limits("shell", bad)


def test_the_hierarchies_are_found_and_written_in_either_cgroup_version(tmp_path: Path) -> None:
    """Without the kernel (these machines have no v2 memory controller): where each controller is
    looked for, from /proc's mountinfo and cgroup as a v2 host and a mixed v1 host write them, and
    what a limit writes in each version."""
    service = tmp_path / "v2" / "system.slice" / "uibus.service"
    service.mkdir(parents=True)
    (service / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (tmp_path / "v1" / "memory" / "abc").mkdir(parents=True)  # the mount's root is /docker
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "mountinfo").write_text(
        f"30 24 0:26 / {tmp_path}/v2 rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
        f"31 24 0:27 /docker {tmp_path}/v1/memory rw - cgroup cgroup rw,memory\n")
    (proc / "cgroup").write_text("4:memory:/docker/abc\n0::/system.slice/uibus.service\n")
    found = cgroups.Hierarchies(str(proc))
    pids, memory = found.get("pids"), found.get("memory")
    assert pids == cgroups.Hierarchy("pids", 2, f"{tmp_path}/v2/system.slice/uibus.service")
    assert memory == cgroups.Hierarchy("memory", 2, f"{tmp_path}/v2/system.slice/uibus.service")
    (proc / "cgroup").write_text("4:memory:/docker/abc\n0::/elsewhere\n")
    v1 = cgroups.Hierarchies(str(proc))
    assert v1.get("memory") == cgroups.Hierarchy("memory", 1, f"{tmp_path}/v1/memory/abc")
    assert v1.get("pids") == "no pids cgroup controller mounted"
    agent = tmp_path / "a-shell-1"
    agent.mkdir()
    for limit, value in (("pids", 64), ("memory_mb", 256), ("cpu", 1.5)):
        cgroups.set_limit(memory, str(agent), limit, value)  # type: ignore[arg-type]
    written = {f.name: f.read_text() for f in agent.iterdir()}
    assert written == {"pids.max": "64", "memory.max": str(256 * 2**20), "memory.swap.max": "0",
                       "memory.oom.group": "1", "cpu.max": "150000 100000"}
    old = tmp_path / "a-shell-2"
    old.mkdir()
    for limit, value in (("memory_mb", 256), ("cpu", 0.5)):
        cgroups.set_limit(v1.get("memory"), str(old), limit, value)  # type: ignore[arg-type]
    written = {f.name: f.read_text() for f in old.iterdir()}
    assert written == {"memory.limit_in_bytes": str(256 * 2**20), "memory.memsw.limit_in_bytes": str(256 * 2**20),
                       "memory.oom_control": "1", "cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "50000"}
