"""`tests/dockerenv.py --stop`, which .ci/test runs when it ends: it stops the dockerd that
`--prepare` (started by .ci/setup) left running for the tests, and nothing else. A stand-in
process takes the dockerd's place here (its command line names the socket as dockerd's does):
the real engine is the container tests' (tests/test_container.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO


def _stop(state: Path) -> str:
    done = subprocess.run([sys.executable, str(REPO / "tests" / "dockerenv.py"), "--stop"], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "UIBUS_DOCKERD_DIR": str(state)})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _stand_in(*argv: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", *argv])


def test_stop_ends_the_dockerd_prepare_started_and_only_that(tmp_path: Path) -> None:
    assert _stop(tmp_path) == "dockerenv: no dockerd of --prepare's to stop"

    daemon = _stand_in(f"--host=unix://{tmp_path / 'docker.sock'}")
    other = _stand_in("--host=unix:///somewhere/else.sock")
    try:
        (tmp_path / "started-by-prepare.pid").write_text(f"{other.pid}\n")  # a pid since reused
        assert _stop(tmp_path) == f"dockerenv: pid {other.pid} is no longer the dockerd --prepare started; left alone"
        assert other.poll() is None

        (tmp_path / "started-by-prepare.pid").write_text(f"{daemon.pid}\n")
        started = time.monotonic()
        assert _stop(tmp_path) == f"dockerenv: dockerd {daemon.pid} stopped"
        assert daemon.wait(5) == -15 and time.monotonic() - started < 10  # SIGTERM
        assert not (tmp_path / "started-by-prepare.pid").exists()
        assert _stop(tmp_path) == "dockerenv: no dockerd of --prepare's to stop"  # once
    finally:
        for proc in (daemon, other):
            proc.kill()
            proc.wait()


def test_ci_stops_it_whatever_the_outcome() -> None:
    """.ci/test (which .ci/run runs) stops it in an EXIT trap set before the set-up starts it, and
    no longer `exec`s pytest (an exec'd shell runs no trap)."""
    script = (REPO / ".ci" / "test").read_text()
    trap = script.index("trap stop_daemons EXIT")
    assert re.search(r'stop_daemons\(\) \{ .*tests/dockerenv.py --stop', script)
    assert trap < script.index("bash .ci/setup")
    assert not re.search(r"^\s*exec\b", script, re.MULTILINE)
