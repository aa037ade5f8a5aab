"""The package as users get it — ONE slow end-to-end test (about a minute; more on a cold pip cache).

`python -m build` (an sdist, then the wheel built FROM that sdist, each in an isolated build env),
`pip install` of that wheel into a fresh venv, then the installed `uibus serve` and
`python -m uibus serve` each serve (gRPC health SERVING) and exit 0 on SIGTERM, run from a folder
whose decoy `server/` and `clients/` raise when imported. `pip show -f uibus` lists only the
top-level name `uibus` (plus its .dist-info and the `uibus` script).

The build runs on a copy of the work tree as git sees it (tracked and new files, nothing ignored):
building in place would regenerate `server/pb/`, which this test session imports from.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import REPO, free_port

# Bounds for each step (generous: a cold pip cache downloads the build env and the dependencies).
BUILD_TIMEOUT = 300
VENV_TIMEOUT = 120
INSTALL_TIMEOUT = 300
READY_TIMEOUT = 60
STOP_TIMEOUT = 30

# Top-level names the old layout (or raw protoc output) would have put in site-packages.
FORBIDDEN_TOP = {"server", "clients", "uibus_pb", "cline", "neuro_san"}

# One bound for the whole test (~45 s warm): above the suite's default 180 s, for a cold pip cache.
pytestmark = pytest.mark.timeout(420)


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without this test session's venv or import path leaking into children."""
    env = {k: v for k, v in os.environ.items() if k not in {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"}}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONUNBUFFERED="1", **extra)
    return env


def run(cmd: list[str], timeout: float, **kw: object) -> str:
    """Runs `cmd`; fails the test with its output when it fails or overruns `timeout`."""
    try:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout, **kw)  # type: ignore[call-overload]
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout}s:\n{(exc.output or '')[-5000:]}")
    if done.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-5000:]}")
    return done.stdout


def copy_work_tree(dest: Path) -> None:
    """Copies what git would see (tracked + untracked, not ignored) of the work tree into `dest`."""
    listed = run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard", "-z"], 60)
    names = [n for n in listed.split("\0") if n]
    assert "setup.py" in names and "protos/cline/ui.proto" in names, "not a uibus git checkout"
    for name in names:
        src = REPO / name
        if src.is_file():  # a tracked file deleted in the work tree is listed but absent
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def installed_top_levels(venv: Path) -> tuple[set[str], set[Path], list[str]]:
    """From `pip show -f uibus` in `venv`: top-level names in site-packages, the files installed
    outside it (resolved), and every listed file."""
    out = run([str(venv / "bin" / "python"), "-m", "pip", "show", "-f", "uibus"], 60, env=clean_env())
    location = re.search(r"^Location: (.+)$", out, re.MULTILINE)
    assert location, out
    files = [line.strip() for line in out.split("Files:", 1)[1].splitlines() if line.strip()]
    tops, outside = set(), set()
    for f in files:
        if f.startswith(".."):
            outside.add((Path(location.group(1)) / f).resolve())
        else:
            tops.add(f.split("/", 1)[0])
    return tops, outside, files


def wait_serving(proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
    """Polls grpc.health.v1.Health/Check("") until SERVING; fails with the log if `proc` exits first."""
    deadline = time.monotonic() + READY_TIMEOUT
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited {proc.returncode} before serving:\n{log.read_text()[-5000:]}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not SERVING after {READY_TIMEOUT}s:\n{log.read_text()[-5000:]}")
            time.sleep(0.1)


def serve_then_sigterm(cmd: list[str], cwd: Path, tmp: Path, name: str) -> None:
    port = free_port()
    log = tmp / f"{name}.log"
    full = [*cmd, "serve", "--host", "127.0.0.1", "--port", str(port), "--http-port", "0",
            "--store", str(tmp / f"{name}.db")]
    # The decoys are on the import path of the console script too (`python -m` has cwd on it anyway).
    with log.open("wb") as out:
        proc = subprocess.Popen(full, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                env=clean_env(PYTHONPATH=str(cwd)))
    try:
        wait_serving(proc, port, log)
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name}: still running {STOP_TIMEOUT}s after SIGTERM:\n{log.read_text()[-5000:]}")
        assert rc == 0, f"{name}: exit {rc} after SIGTERM:\n{log.read_text()[-5000:]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_built_wheel_installs_one_package_and_serves(tmp_path: Path) -> None:
    """Slow end-to-end: build sdist -> wheel, install into a fresh venv, serve both ways."""
    timings: dict[str, float] = {}
    t0 = time.monotonic()

    # 1. Build: the default builds the sdist, then the wheel from the unpacked sdist.
    src, dist = tmp_path / "src", tmp_path / "dist"
    src.mkdir()
    copy_work_tree(src)
    run([sys.executable, "-m", "build", "--outdir", str(dist), str(src)], BUILD_TIMEOUT, cwd=src, env=clean_env())
    timings["build"] = time.monotonic() - t0
    sdists, wheels = sorted(dist.glob("uibus-*.tar.gz")), sorted(dist.glob("uibus-*.whl"))
    assert len(sdists) == 1 and len(wheels) == 1, sorted(p.name for p in dist.iterdir())
    with tarfile.open(sdists[0]) as tar:
        members = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
    assert "protos/cline/ui.proto" in members, "the sdist lacks the .proto sources the wheel is built from"
    assert not any(m.startswith("server/pb/") for m in members), "generated code leaked into the sdist"

    # 2. A fresh venv with only the wheel (and its dependencies) in it.
    t1 = time.monotonic()
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], VENV_TIMEOUT, env=clean_env())
    run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(wheels[0])], INSTALL_TIMEOUT,
        cwd=tmp_path, env=clean_env())
    timings["venv+install"] = time.monotonic() - t1

    # 3. Exactly one top-level import name.
    tops, outside, files = installed_top_levels(venv)
    assert not tops & FORBIDDEN_TOP, f"old top-level names installed: {sorted(tops & FORBIDDEN_TOP)}"
    dist_info = {t for t in tops if re.fullmatch(r"uibus-[^/]+\.dist-info", t)}
    assert len(dist_info) == 1 and tops == {"uibus", *dist_info}, f"unexpected top-level names: {sorted(tops)}"
    assert outside == {(venv / "bin" / "uibus").resolve()}, f"unexpected files outside site-packages: {outside}"
    assert "uibus/pb/cline/ui_pb2_grpc.py" in files and "uibus/clients/cli.py" in files, files

    # 4. Serve both ways from a folder with decoys of the old top-level packages.
    t2 = time.monotonic()
    work = tmp_path / "work"
    for decoy in ("server", "clients"):
        (work / decoy).mkdir(parents=True)
        (work / decoy / "__init__.py").write_text(
            f"raise ImportError('decoy {decoy}/ imported: the installed uibus must not import {decoy!r}')\n")
    serve_then_sigterm([str(venv / "bin" / "uibus")], work, tmp_path, "console-script")
    serve_then_sigterm([str(venv / "bin" / "python"), "-m", "uibus"], work, tmp_path, "python-m-uibus")
    timings["serve x2"] = time.monotonic() - t2
    print("timings:", {k: round(v, 1) for k, v in timings.items()}, f"total {time.monotonic() - t0:.1f}s")
