"""Runs the docs' blocks as printed (tests/docs_blocks.py says which and how) and writes one result
per block as JSON: `python -m tests.docs_run RESULTS.json`.

It runs in a network namespace of its own where it can make one (as root: CI), so the documented
ports (26040, 8080) are free whatever else runs on the machine, and no block can reach another
host; where it cannot, it runs on this machine's loopback and needs those ports free. The reader
is new: a HOME of their own (the default store, ~/.pi, … start empty) and no UIBUS_* variables.
tests/test_docs_run.py runs this and turns each result into a test; `python -m tests.docs_run
RESULTS.json PAGE.md…` runs the given pages instead (its test of the runner itself).
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.docs_blocks import ROOT, Block, all_blocks, page_blocks

SERVER_PORTS = (26040, 8080)  # what the server block serves on by default (README.md, .ci/serve)
SERVER_START = 120.0  # seconds for the server block to serve (an install may come first)
SETTLE = 0.5  # after a background block connects: its call reaches the server
BACKGROUND_UP = 20.0  # seconds a background block may take to connect
OUTPUT_TAIL = 6000
# Blocks run as printed; a python block as `python -m asyncio` runs input: top-level await allowed.
PY_RUNNER = (
    "import ast, asyncio, sys\n"
    "src = open(sys.argv[1], encoding='utf-8').read()\n"
    "code = compile(src, sys.argv[2], 'exec', flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)\n"
    "result = eval(code, {'__name__': '__main__'})\n"
    "if asyncio.iscoroutine(result):\n"
    "    asyncio.run(result)\n"
)


def own_network() -> bool:
    """A network namespace of our own with loopback up; False where this process may not make one."""
    libc = ctypes.CDLL(None, use_errno=True)
    clone_newnet = 0x40000000
    if libc.unshare(clone_newnet) != 0:
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
        ifreq = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(s, siocgifflags, ifreq))[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sH14s", b"lo", flags | iff_up, b""))
    return True


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def reader_env(home: str) -> dict[str, str]:
    """A new reader's environment: the venv on PATH (as `source .venv/bin/activate` puts it), an
    empty HOME, none of uibus's variables."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("UIBUS_", "XDG_", "PYTEST", "VIRTUAL_ENV")) and k not in ("PYTHONPATH",)}
    venv = ROOT / ".venv"
    env.update(HOME=home, VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}",
               PYTHONUNBUFFERED="1")
    return env


def command(block: Block, workdir: Path) -> list[str]:
    if block.lang == "python":
        src = workdir / f"block-{block.line}.py"
        src.write_text(block.text, encoding="utf-8")
        return [str(ROOT / ".venv" / "bin" / "python"), "-c", PY_RUNNER, str(src), block.where]
    return ["bash", "-e", "-c", block.script()]


def _socket_inodes(pgid: int) -> set[str]:
    inodes: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) != pgid:
                continue
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    return inodes


def connected(pgid: int) -> bool:
    """Whether a process of the group holds an established TCP connection to the server's ports."""
    inodes = _socket_inodes(pgid)
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            remote_port = int(cols[2].rsplit(":", 1)[1], 16)
            if cols[3] == "01" and remote_port in SERVER_PORTS and cols[9] in inodes:
                return True
    return False


@dataclass
class Running:
    block: Block
    proc: subprocess.Popen[bytes]
    out: Path


def start(block: Block, env: dict[str, str], workdir: Path) -> Running:
    out = workdir / f"out-{block.line}-{time.monotonic_ns()}.log"
    with out.open("wb") as f:
        proc = subprocess.Popen(command(block, workdir), cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    return Running(block, proc, out)


def stop(running: Running, grace: float = 10.0) -> int | None:
    """Ctrl-C to the block's process group, then SIGKILL after `grace`; its own exit code when it
    had ended before being stopped, else None."""
    rc = running.proc.poll()
    if rc is not None:
        return rc
    for sig, wait in ((signal.SIGINT, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(running.proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            running.proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    return None


def tail(path_or_text: Path | str) -> str:
    text = path_or_text.read_text(errors="replace") if isinstance(path_or_text, Path) else path_or_text
    return text if len(text) <= OUTPUT_TAIL else "…" + text[-OUTPUT_TAIL:]


def result(block: Block, status: str, reason: str = "", output: str = "", seconds: float = 0.0) -> dict[str, object]:
    return {"where": block.where, "status": status, "reason": reason, "output": tail(output),
            "seconds": round(seconds, 2)}


def missing(block: Block, output: str) -> str:
    lost = [e for e in block.expect if e not in output]
    return f"its output lacks {', '.join(repr(e) for e in lost)}" if lost else ""


def run_all(results_file: Path, only: list[Path] | None = None) -> None:
    isolated = own_network()
    results: list[dict[str, object]] = []
    server: Running | None = None
    with tempfile.TemporaryDirectory(prefix="uibus-docs-") as tmp:
        home, workdir = Path(tmp, "home"), Path(tmp, "work")
        home.mkdir()
        workdir.mkdir()
        env = reader_env(str(home))
        blocks = [b for page in only for b in page_blocks(page)] if only else all_blocks()
        taken = [p for p in SERVER_PORTS if not isolated and any(b.server for b in blocks) and port_open(p)]
        background: list[Running] = []
        try:
            page = ""
            for block in blocks:
                if block.page != page:
                    results += finish_page(background)
                    background = []
                    page = block.page
                t0 = time.monotonic()
                if block.skip:
                    results.append(result(block, "skip", block.skip))
                elif taken:
                    results.append(result(block, "unrunnable", f"ports {taken} are taken on this machine and "
                                                              "no network namespace could be made (not root?)"))
                elif block.server and server is not None:
                    same = block.text.strip() == server.block.text.strip()
                    results.append(result(block, "ok" if same else "fail",
                                          f"the server ({server.block.where}) is running" if same else
                                          f"a second, different server block; the one running is {server.block.where}"))
                elif block.server:
                    server = start(block, env, workdir)
                    status, reason = wait_serving(server)
                    results.append(result(block, status, reason, tail(server.out), time.monotonic() - t0))
                elif block.background:
                    background.append(start_background(block, env, workdir))
                else:
                    results.append(run_one(block, env, workdir))
            results += finish_page(background)
            background = []
        finally:
            for running in background:  # a page cut short by an error: its streams end too
                stop(running)
            if server is not None:
                stop(server)
                results.append({"where": "server", "status": "log", "reason": "", "output": tail(server.out),
                                "seconds": 0})
    results_file.write_text(json.dumps({"isolated": isolated, "results": results}, indent=1))


def start_background(block: Block, env: dict[str, str], workdir: Path) -> Running:
    """Starts a background block and returns once it is up: connected to the server (a stream's
    call is on its way), or printing, or ended; at most BACKGROUND_UP seconds."""
    running = start(block, env, workdir)
    deadline = time.monotonic() + min(block.timeout, BACKGROUND_UP)
    while running.proc.poll() is None and time.monotonic() < deadline:
        if connected(running.proc.pid) or running.out.stat().st_size:
            time.sleep(SETTLE)
            break
        time.sleep(0.1)
    return running


def wait_serving(server: Running) -> tuple[str, str]:
    deadline = time.monotonic() + SERVER_START
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            return "fail", f"the server exited ({server.proc.returncode}) before serving"
        if all(port_open(p) for p in SERVER_PORTS):
            return "ok", ""
        time.sleep(0.2)
    return "fail", f"the server did not serve on {SERVER_PORTS} within {SERVER_START:.0f} s"


def run_one(block: Block, env: dict[str, str], workdir: Path) -> dict[str, object]:
    t0 = time.monotonic()
    running = start(block, env, workdir)
    try:
        rc: int | None = running.proc.wait(block.timeout)
    except subprocess.TimeoutExpired:
        stop(running, grace=2.0)
        rc = None
    output = running.out.read_text(errors="replace")
    took = time.monotonic() - t0
    if rc is None:
        return result(block, "fail", f"still running after {block.timeout:.0f} s (a stream? mark it "
                                     "`docs-test: background`)", output, took)
    if rc != 0:
        return result(block, "fail", f"exit status {rc}", output, took)
    lacks = missing(block, output)
    return result(block, "fail" if lacks else "ok", lacks, output, took)


def finish_page(background: list[Running]) -> list[dict[str, object]]:
    """Stops the page's background blocks (Ctrl-C) and judges them: one that ended on its own with
    a failure, or whose output lacks what it expects, fails."""
    out = []
    for running in background:
        rc = stop(running)
        output = running.out.read_text(errors="replace")
        if rc not in (None, 0):
            out.append(result(running.block, "fail", f"exit status {rc} before the page ended", output))
        else:
            lacks = missing(running.block, output)
            out.append(result(running.block, "fail" if lacks else "ok", lacks, output))
    return out


if __name__ == "__main__":
    run_all(Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]] or None)
