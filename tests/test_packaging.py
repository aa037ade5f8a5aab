"""The package as users get it — ONE slow end-to-end test (about a minute; more on a cold pip cache),
and fast checks that the dependencies are ranges pinned by the lock files every install uses.

`python -m build` (an sdist, then the wheel built FROM that sdist, each in an isolated build env),
`pip install` of that wheel into a fresh venv, then the installed `uibus serve` and
`python -m uibus serve` each serve (gRPC health SERVING) and exit 0 on SIGTERM, run from a folder
whose decoy `server/` and `clients/` raise when imported. `pip show -f uibus` lists only the
top-level name `uibus` (plus its .dist-info and the `uibus` script).

The build runs on a copy of the work tree as git sees it (tracked and new files, nothing ignored):
building in place would regenerate `server/pb/`, which this test session imports from.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import tomllib
from importlib import metadata
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from packaging.requirements import Requirement
from packaging.utils import NormalizedName, canonicalize_name
from packaging.version import Version

from tests.conftest import REPO, free_port
from tests.support import clean_env

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


def lock_pins(path: Path) -> dict[NormalizedName, Version]:
    """Each `name==version` line of a lock file; fails on any other requirement line, since a lock
    that holds a range or a marker no longer says exactly what gets installed."""
    pins: dict[NormalizedName, Version] = {}
    for line in path.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == "==" and not req.marker and not req.extras, \
            f"{path.name}: not an exact pin: {line!r}"
        name = canonicalize_name(req.name)
        assert name not in pins, f"{path.name}: {name} pinned twice"
        pins[name] = Version(specs[0].version)
    return pins


# The oldest Python requires-python admits: a marker such as redis's `python_full_version < "3.11.3"`
# (async-timeout) must be in the lock too, or Debian 12's python3 (3.11.2) installs an incomplete set.
OLDEST_PYTHON = {"python_version": "3.11", "python_full_version": "3.11.0"}


def closure(roots: list[Requirement]) -> set[NormalizedName]:
    """Every distribution `roots` pull in on this Python or on the oldest supported one (markers
    evaluated for both, extras only where a root names them), read from the metadata installed in
    this venv."""
    seen: set[NormalizedName] = set()
    todo = [(r, frozenset(r.extras)) for r in roots]
    while todo:
        req, extras = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        for line in metadata.requires(name) or []:
            sub = Requirement(line)
            if sub.marker is None or any(sub.marker.evaluate({**env, "extra": e})
                                         for env in ({}, OLDEST_PYTHON) for e in (extras or {""})):
                todo.append((sub, frozenset(sub.extras)))
    return seen


def test_dependencies_are_ranges_pinned_by_the_lock_files() -> None:
    """pyproject.toml states ranges (uibus installs beside other packages); requirements.lock and
    requirements-dev.lock pin, inside those ranges, every package that CI, `.ci/serve` and the image
    install, so a newcomer runs the versions CI ran."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    runtime = [Requirement(r) for r in project["dependencies"]]
    test_extra = [Requirement(r) for r in project["optional-dependencies"]["test"]]
    lock, dev = lock_pins(REPO / "requirements.lock"), lock_pins(REPO / "requirements-dev.lock")

    for req in runtime:
        operators = {s.operator for s in req.specifier}
        assert operators and not operators & {"==", "==="}, f"{req}: a runtime dependency is a range, not a pin"
        assert operators & {"<", "<=", "~="}, f"{req}: capped below the next release line that may break uibus"
        name = canonicalize_name(req.name)
        assert name in lock, f"{req.name} is missing from requirements.lock"
        assert req.specifier.contains(lock[name], prereleases=True), \
            f"requirements.lock pins {req.name}=={lock[name]}, outside {req.specifier}"
    # grpcio 1.84+ makes every unary call dearer (grpc/grpc#41796, bench/README.md).
    for name in ("grpcio", "grpcio-reflection", "grpcio-health-checking"):
        (req,) = [r for r in runtime if canonicalize_name(r.name) == name]
        assert not req.specifier.contains("1.84.0") and req.specifier.contains("1.83.2"), f"{req}: must stay below 1.84"

    # Complete (the whole transitive closure) and nothing more; the dev lock agrees on every shared pin.
    assert set(lock) == closure(runtime), "requirements.lock is not the runtime's transitive closure: regenerate it"
    assert set(dev) == closure(runtime + test_extra), "requirements-dev.lock is not runtime + test: regenerate it"
    assert {n: dev[n] for n in lock} == lock, "requirements-dev.lock pins a runtime package differently"
    # Every exact version anywhere in pyproject (the test extra) is the locked one.
    for extra, reqs in project["optional-dependencies"].items():
        for req in map(Requirement, reqs):
            pinned = [s.version for s in req.specifier if s.operator == "=="]
            if pinned:
                assert dev.get(canonicalize_name(req.name)) == Version(pinned[0]), \
                    f"[{extra}] {req}: not in requirements-dev.lock at that version"


def test_scripts_install_from_the_lock_files() -> None:
    """`.ci/setup` (tests, CI) and `.ci/serve` install the locked versions, then uibus without
    resolving again; only the build's own tools come from [build-system]."""
    def commands(script: str) -> str:
        lines = (REPO / ".ci" / script).read_text().splitlines()
        return "\n".join(line for line in lines if not line.lstrip().startswith("#"))

    setup, serve = commands("setup"), commands("serve")
    assert "-r requirements-dev.lock" in setup and "--no-deps -e ." in setup, setup
    assert ".[test]" not in setup, "setup must not resolve the test extra's ranges afresh"
    assert "-r requirements.lock" in serve and "--no-deps -e ." in serve, serve
    assert ".ci/setup" not in serve, "serving needs neither the test tools nor the client venvs"
