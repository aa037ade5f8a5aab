"""A Docker engine and the stand-in base images for tests/test_container.py, on a machine that
has Debian's packages but reaches no image registry.

* The engine: the one DOCKER_HOST (or the default socket) names when it answers; else a `dockerd`
  started here (vfs storage, which needs no kernel support beyond a plain directory), owned by the
  test session and stopped after it. Its data root is kept in the cache directory, so images built
  once are there for the next run on the same machine.
* The stand-in bases: `debootstrap --variant=minbase` roots from Debian's mirror (the one apt
  already uses), imported as images: bookworm with python3 (stands in for python:3.11-slim), and
  trixie with redis-server and nginx 1.26 (bookworm's 1.22 lacks `http2 on;`) for the compose
  stack's redis and nginx. Each is made once per machine (cached rootfs tarball and image).
* The CLI: Debian's `/usr/bin/docker` when present: it builds with BuildKit's own client
  (`DOCKER_BUILDKIT=1`), which the Dockerfile's `RUN --mount` needs; a newer CLI needs buildx.

`python3 tests/dockerenv.py --prepare` (stdlib only) does all of that ahead of the tests: `.ci/setup
--system` runs it beside its own installs, so the minutes of debootstrap and image builds overlap
the downloads instead of adding to the test run. A dockerd it starts stays up for the tests (found
at SOCKET; its pid in STARTED) until `python3 tests/dockerenv.py --stop`, which `.ci/test` runs
when it ends, passed or failed; the tests then find everything built and only check that it is
current.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STATE = Path(os.environ.get("UIBUS_DOCKERD_DIR") or "/tmp/uibus-dockerd")  # a dockerd started here: its files
SOCKET = STATE / "docker.sock"  # where it listens
STARTED = STATE / "started-by-prepare.pid"  # the dockerd `--prepare` started, which `--stop` stops

CACHE = Path(os.environ.get("UIBUS_DOCKER_CACHE")
             or ("/var/cache/uibus-tests" if os.geteuid() == 0 else Path.home() / ".cache" / "uibus-tests"))
MIRROR = "http://deb.debian.org/debian"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")  # the machine's, for pip inside a build (a proxy's CA)
ROOTS = {  # image name -> (suite, packages)
    "uibus-standin/bookworm": ("bookworm", "python3,python3-venv,ca-certificates"),
    "uibus-standin/trixie": ("trixie", "redis-server,nginx"),
}
STANDINS = {  # image -> (Dockerfile under tests/docker, the rootfs image it starts from)
    "uibus-standin/python:3.11": ("python.Dockerfile", "uibus-standin/bookworm"),
    "uibus-standin/redis": ("redis.Dockerfile", "uibus-standin/trixie"),
    "uibus-standin/nginx": ("nginx.Dockerfile", "uibus-standin/trixie"),
}
# The tests' name for this checkout's image (not a version: one name, so repeated runs replace it rather
# than keep an image per commit; its label and `uibus --version` carry the version); the compose test
# hands compose its tag as UIBUS_IMAGE_TAG. Another name only to build a second checkout's image on
# the same engine without replacing the one a running suite uses.
IMAGE = os.environ.get("UIBUS_TEST_IMAGE") or "uibus:checkout"


def package_version() -> str | None:
    """What setuptools-scm makes of this checkout, i.e. the version pip builds it as: the image is built
    with it as its VERSION argument, so its label, `uibus --version` in it and its uibus_build_info
    say what the checkout is (the build context has no .git to derive it from). None while no
    interpreter here has setuptools-scm (`--prepare` runs beside the venv's install): the image then
    gets the Dockerfile's default, and the tests' build redoes only the layers that use it."""
    for python in (REPO / ".venv" / "bin" / "python", Path(sys.executable)):
        if not python.exists():
            continue
        done = subprocess.run([str(python), "-m", "setuptools_scm", "--root", str(REPO)], capture_output=True,
                              text=True, timeout=60, cwd=REPO)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip().splitlines()[-1]
    return None


class Docker:
    """The engine the tests talk to, and the commands they run against it."""

    def __init__(self) -> None:
        self.cli = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else (shutil.which("docker") or "docker")
        self.env = {**os.environ, "DOCKER_BUILDKIT": "1"}
        self._daemon: subprocess.Popen[bytes] | None = None
        self.built_version: str | None = None  # the VERSION `build_uibus` gave the image (None: the default)

    def run(self, *args: str, timeout: float = 120, check: bool = True,
            **kw: object) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([self.cli, *args], capture_output=True, text=True, env=self.env, timeout=timeout,
                              **kw)  # type: ignore[call-overload]
        if check and done.returncode:
            raise AssertionError(f"docker {' '.join(args)[:200]}: exit {done.returncode}\n{done.stderr[-3000:]}")
        return done  # type: ignore[no-any-return]

    def answers(self) -> bool:
        return self.run("info", "--format", "{{.ServerVersion}}", check=False, timeout=20).returncode == 0

    def start(self) -> None:
        """Uses a running engine (DOCKER_HOST's, the default one, or one `--prepare` left at SOCKET),
        or starts one, owned by this object (`stop()`)."""
        if self.answers():
            return
        if "DOCKER_HOST" not in os.environ and SOCKET.exists():
            self.env["DOCKER_HOST"] = f"unix://{SOCKET}"
            if self.answers():
                return
            del self.env["DOCKER_HOST"]
        _need(shutil.which("dockerd") is not None, "dockerd (Debian's docker.io)")
        _need(os.geteuid() == 0, "root (to start dockerd)")
        sock = SOCKET
        sock.parent.mkdir(parents=True, exist_ok=True)
        (CACHE / "docker").mkdir(parents=True, exist_ok=True)
        log = (sock.parent / "dockerd.log").open("wb")
        self._daemon = subprocess.Popen(
            ["dockerd", "--storage-driver=vfs", f"--data-root={CACHE / 'docker'}",
             f"--exec-root={sock.parent / 'exec'}", f"--pidfile={sock.parent / 'dockerd.pid'}",
             f"--host=unix://{sock}"], stdout=log, stderr=subprocess.STDOUT)
        self.env["DOCKER_HOST"] = f"unix://{sock}"
        deadline = time.monotonic() + 60
        while not self.answers():
            if self._daemon.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("dockerd did not start: " + (sock.parent / "dockerd.log").read_text()[-3000:])
            time.sleep(0.5)

    def stop(self) -> None:
        if self._daemon is not None and self._daemon.poll() is None:
            self._daemon.terminate()
            try:
                self._daemon.wait(30)
            except subprocess.TimeoutExpired:
                self._daemon.kill()
                self._daemon.wait()

    def has_image(self, name: str) -> bool:
        return self.run("image", "inspect", name, check=False).returncode == 0

    def rootfs(self, name: str) -> None:
        """The debootstrap root `name` stands for, as an image (made once per machine)."""
        if self.has_image(name):
            return
        suite, packages = ROOTS[name]
        tarball = CACHE / f"rootfs-{suite}.tar"
        if not tarball.exists():
            _need(shutil.which("debootstrap") is not None, "debootstrap")
            target = CACHE / f"rootfs-{suite}"
            shutil.rmtree(target, ignore_errors=True)
            subprocess.run(["debootstrap", "--variant=minbase", f"--include={packages}", suite, str(target), MIRROR],
                           check=True, capture_output=True, timeout=900)
            subprocess.run(["tar", "-C", str(target), "-cf", f"{tarball}.part", "."], check=True, timeout=300)
            os.replace(f"{tarball}.part", tarball)
            shutil.rmtree(target, ignore_errors=True)
        with tarball.open("rb") as data:
            self.run("import", "-", name, stdin=data, timeout=300)

    def standins(self) -> None:
        for name, (dockerfile, root) in STANDINS.items():
            self.rootfs(root)
            self.run("build", "-q", "--build-arg", f"ROOTFS={root}", "-t", name, "-f",
                     str(REPO / "tests" / "docker" / dockerfile), str(REPO / "tests" / "docker"), timeout=600)

    def build_uibus(self) -> None:
        """The project's image from its Dockerfile, on the stand-in base, as this checkout's version; the
        machine's CA bundle (if any) as the build secret pip uses in the build stage."""
        secret = ["--secret", f"id=ca,src={CA_BUNDLE}"] if CA_BUNDLE.exists() else []
        version = package_version()
        args = ["--build-arg", f"VERSION={version}"] if version else []
        self.run("build", "-q", *secret, "--build-arg", "BASE=uibus-standin/python:3.11", *args, "-t", IMAGE,
                 str(REPO), timeout=900)
        self.built_version = version


def _need(ok: bool, what: str) -> None:
    """Missing on this machine: a skip in tests (a failure under UIBUS_REQUIRE_ALL), an exit here."""
    if ok:
        return
    if __name__ == "__main__":
        raise SystemExit(f"dockerenv: {what} is missing")
    from tests.conftest import require

    require(what, False, "docker")


def prepare() -> None:
    """Engine up, stand-ins and the uibus image built: what the tests need, ahead of them. The
    engine stays up after this process; when it started one, its pid is kept for `stop_prepared`."""
    docker = Docker()
    try:
        docker.start()
    finally:  # even when it started but never answered: `--stop` ends it
        if docker._daemon is not None:
            STARTED.write_text(f"{docker._daemon.pid}\n")
    docker.standins()
    # The image is built as this checkout's version, which setuptools-scm in the venv says: `.ci/setup`
    # installs it beside this run, so wait for it (bounded; set-up ends this process if it fails)
    # rather than build with the default and have the tests build the image's last layers again.
    deadline = time.monotonic() + 600
    while package_version() is None and time.monotonic() < deadline:
        time.sleep(5)
    docker.build_uibus()


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for a parent that does not reap)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def stop_prepared(patience: float = 30.0) -> str:
    """Stops the dockerd that `prepare` started (and only that one: the pid must still be a dockerd
    on SOCKET), SIGTERM first (it stops its containerd and containers), SIGKILL after `patience`."""
    try:
        pid = int(STARTED.read_text())
    except (FileNotFoundError, ValueError):
        return "dockerenv: no dockerd of --prepare's to stop"
    STARTED.unlink()
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except FileNotFoundError:
        return f"dockerenv: dockerd {pid} had already ended"
    if f"--host=unix://{SOCKET}".encode() not in argv:
        return f"dockerenv: pid {pid} is no longer the dockerd --prepare started; left alone"
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + patience
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
        return f"dockerenv: dockerd {pid} did not stop within {patience:g} s of SIGTERM: killed"
    return f"dockerenv: dockerd {pid} stopped"


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--stop"]:
        print(stop_prepared())
        raise SystemExit(0)
    if sys.argv[1:] != ["--prepare"]:
        raise SystemExit("usage: python3 tests/dockerenv.py --prepare | --stop")
    started = time.monotonic()
    prepare()
    print(f"dockerenv: engine, stand-ins and {IMAGE} ready in {time.monotonic() - started:.0f} s")
