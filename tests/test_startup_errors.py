"""`uibus serve` refuses a setting that cannot work with one line on stderr, never a traceback.

Each case runs the real command (`python -m uibus serve`, or the installed `uibus` script) and checks
the exit code (2 for a bad flag, env var or file; 1 when the machine refuses, e.g. a port in use)
and that stderr is exactly `uibus serve: <flag or env var>: <what is wrong>`. The table doubles as
the list of start-up errors and their exact wording.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import clean_env

UIBUS = str(Path(sys.executable).parent / "uibus")
# Flags every case gets, unless it sets that flag or its env var itself.
BASE = {"--host": "127.0.0.1", "--port": "0", "--http-port": "0", "--store": "{tmp}/uibus.db"}

# The agents files the cases name, written into the test's tmp directory.
AGENTS_FILES = {
    "bad.json": '{\n  "agents": [\n    {"name": "a",}\n  ]\n}\n',
    "bad.toml": "[[agents]]\nname = \n",
    "shape.json": '{"agents": {"name": "a"}}\n',
    "backend.json": '{"agents": [{"name": "x", "backend": "nope"}]}\n',
    "rpc-missing.json": '{"agents": [{"name": "pi", "backend": "rpc", "options": {"command": ["no-such-agent-x", '
                        '"--mode", "rpc"]}}]}\n',
    "rpc-no-command.json": '{"agents": [{"name": "pi", "backend": "rpc"}]}\n',
}

# (id, extra args, env, exit code, the one stderr line; a trailing "…" means "starts with").
CASES: list[tuple[str, list[str], dict[str, str], int, str]] = [
    ("env-port-not-int", [], {"UIBUS_PORT": "abc"}, 2, "uibus serve: UIBUS_PORT: 'abc' is not an integer"),
    ("flag-port-not-int", ["--port", "abc"], {}, 2, "uibus serve: --port: 'abc' is not an integer"),
    ("flag-shadows-bad-env", ["--port", "0", "--queue-size", "0"], {"UIBUS_PORT": "abc"}, 2,
     "uibus serve: --queue-size: must be at least 1"),
    ("port-range", ["--port", "70000"], {}, 2, "uibus serve: --port: must be within 0..65535"),
    ("loop", ["--loop", "trio"], {}, 2, "uibus serve: --loop: 'trio' is not one of auto, asyncio, uvloop"),
    ("env-loop", [], {"UIBUS_LOOP": "gevent"}, 2,
     "uibus serve: UIBUS_LOOP: 'gevent' is not one of auto, asyncio, uvloop"),
    ("queue-size", ["--queue-size", "0"], {}, 2, "uibus serve: --queue-size: must be at least 1"),
    ("env-queue-size", [], {"UIBUS_QUEUE_SIZE": "0"}, 2, "uibus serve: UIBUS_QUEUE_SIZE: must be at least 1"),
    ("several-at-once", ["--port", "70000", "--queue-size", "0"], {}, 2,
     "uibus serve: --port: must be within 0..65535; --queue-size: must be at least 1"),
    ("chat-context", ["--chat-context-bytes", "3000000"], {}, 2,
     "uibus serve: --chat-context-bytes: must be at most half of --max-message-bytes (2097152), as a reply "
     "carries the context and the answer"),
    ("tls-cert-alone", ["--tls-cert", "{tmp}/cert.pem"], {}, 2, "uibus serve: --tls-cert: needs --tls-key as well"),
    ("same-ports", ["--port", "5000", "--http-port", "5000"], {}, 2,
     "uibus serve: --http-port: must differ from --port"),
    ("agents-missing", ["--agents", "{tmp}/missing.json"], {}, 2,
     "uibus serve: --agents: {tmp}/missing.json: cannot read it: no such file or directory"),
    ("agents-bad-json", ["--agents", "{tmp}/bad.json"], {}, 2,
     "uibus serve: --agents: {tmp}/bad.json: line 3, column 18: not valid JSON: …"),
    ("agents-bad-toml", ["--agents", "{tmp}/bad.toml"], {}, 2,
     "uibus serve: --agents: {tmp}/bad.toml: line 2, column 8: not valid TOML: …"),
    ("agents-wrong-shape", ["--agents", "{tmp}/shape.json"], {}, 2,
     "uibus serve: --agents: {tmp}/shape.json: `agents` must be a non-empty list"),
    ("agents-bad-backend", ["--agents", "{tmp}/backend.json"], {}, 2,
     "uibus serve: --agents: {tmp}/backend.json: agents[0] (x): backend 'nope' is not one of local, openai, "
     "neuro-san, rpc, acp"),
    ("agents-rpc-missing-binary", ["--agents", "{tmp}/rpc-missing.json"], {}, 2,
     "uibus serve: --agents: {tmp}/rpc-missing.json: agent 'pi': option command: 'no-such-agent-x' is not an "
     "executable on PATH; install the agent or fix command"),
    ("agents-rpc-no-command", ["--agents", "{tmp}/rpc-no-command.json"], {}, 2,
     "uibus serve: --agents: {tmp}/rpc-no-command.json: agent 'pi' (backend 'rpc') needs option 'command'"),
    ("env-agents", [], {"UIBUS_AGENTS": "{tmp}/shape.json"}, 2,
     "uibus serve: UIBUS_AGENTS: {tmp}/shape.json: `agents` must be a non-empty list"),
    ("redis-scheme", ["--redis-url", "http://user:pw@x"], {}, 2,
     "uibus serve: --redis-url: must start with redis://, rediss://, redis+sentinel:// or unix:// (got 'http')"),
    ("bus-shards", ["--redis-url", "redis://127.0.0.1:1/0", "--bus-shards", "0"], {}, 2,
     "uibus serve: --bus-shards: must be within 1..16384"),
    ("cluster-without-url", [], {"UIBUS_REDIS_CLUSTER": "1"}, 2,
     "uibus serve: UIBUS_REDIS_CLUSTER: needs --redis-url (any node of the cluster)"),
    ("sentinel-no-master", ["--redis-url", "redis+sentinel://127.0.0.1:26379"], {}, 2,
     "uibus serve: --redis-url: cannot be parsed: no master set name: redis+sentinel://host:port/MASTER"),
    ("store-missing-dir", ["--store", "{tmp}/missing/dir/x.db"], {}, 2,
     "uibus serve: --store: directory {tmp}/missing/dir does not exist"),
    ("env-store-missing-dir", [], {"UIBUS_STORE": "{tmp}/missing/dir/x.db"}, 2,
     "uibus serve: UIBUS_STORE: directory {tmp}/missing/dir does not exist"),
    ("workers-range", ["--workers", "65"], {}, 2, "uibus serve: --workers: must be within 1..64"),
    ("env-workers-without-redis", [], {"UIBUS_WORKERS": "2"}, 2,
     "uibus serve: UIBUS_WORKERS: more than 1 needs --redis-url (the workers share sessions and events through Redis)"),
    ("log-max-events", ["--log-max-events", "-1"], {}, 2, "uibus serve: --log-max-events: must be 0 (off) or more"),
    ("env-log-max-bytes", [], {"UIBUS_LOG_MAX_BYTES": "8MiB"}, 2,
     "uibus serve: UIBUS_LOG_MAX_BYTES: '8MiB' is not an integer"),
    ("env-log-max-age", [], {"UIBUS_LOG_MAX_AGE_SECONDS": "-5"}, 2,
     "uibus serve: UIBUS_LOG_MAX_AGE_SECONDS: must be 0 (off) or more"),
    ("log-level", ["--log-level", "LOUD"], {}, 2,
     "uibus serve: --log-level: 'LOUD' is not one of DEBUG, INFO, WARNING, ERROR"),
    ("env-keepalive", [], {"UIBUS_KEEPALIVE_SECONDS": "x"}, 2,
     "uibus serve: UIBUS_KEEPALIVE_SECONDS: 'x' is not a number"),
    ("env-keepalive-nan", [], {"UIBUS_KEEPALIVE_SECONDS": "nan"}, 2,
     "uibus serve: UIBUS_KEEPALIVE_SECONDS: 'nan' is not a finite number"),
    # A bind other machines can reach never serves without tokens by accident (docs/security.md).
    ("every-interface-without-token", ["--host", "0.0.0.0"], {}, 2,
     "uibus serve: --host: 0.0.0.0 is not a loopback address and neither --auth-token nor --tokens-file is set, "
     "so anyone who can reach this machine could drive every API: set a token, or add --trust-network if every "
     "host on this network is trusted"),
    ("env-lan-address-without-token", [], {"UIBUS_HOST": "::"}, 2,
     "uibus serve: UIBUS_HOST: :: is not a loopback address and neither --auth-token nor --tokens-file is set, …"),
    ("trust-network-not-a-switch-value", ["--trust-network=maybe"], {}, 2,
     "uibus serve: --trust-network: 'maybe' is not a switch value: 1, true, yes, on (or none) or 0, false, no, off"),
    ("trust-network-off", ["--host", "0.0.0.0", "--trust-network=no"], {}, 2,
     "uibus serve: --host: 0.0.0.0 is not a loopback address …"),
    ("allowed-hosts-entry", ["--allowed-hosts", "ide.example, a/b"], {}, 2,
     "uibus serve: --allowed-hosts: 'a/b' is not a host name or address (with an optional :port; `*.example.com` "
     "for subdomains)"),
    ("env-cors-origins-entry", [], {"UIBUS_CORS_ORIGINS": "ide.example"}, 2,
     "uibus serve: UIBUS_CORS_ORIGINS: 'ide.example' is not an origin: scheme://host[:port] "
     "(`https://*.example.com` for subdomains, `*` for every page)"),
    ("grpc-port-taken", ["--port", "{taken}"], {}, 1,
     "uibus serve: --port: cannot listen on 127.0.0.1:{taken}: address in use"),
    ("http-port-taken", ["--http-port", "{taken}"], {}, 1,
     "uibus serve: --http-port: cannot listen on 127.0.0.1:{taken}: address in use"),
]


def env_name(flag: str) -> str:
    return "UIBUS_" + flag[2:].replace("-", "_").upper()


def serve(args: list[str], env: dict[str, str], *, script: bool = False) -> subprocess.CompletedProcess[str]:
    command = [UIBUS] if script else [sys.executable, "-m", "uibus"]
    return subprocess.run([*command, "serve", *args], env=env, capture_output=True, text=True, timeout=20)


def assert_one_line(stderr: str, expected: str) -> None:
    assert "Traceback" not in stderr, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    if expected.endswith("…"):
        assert lines[0].startswith(expected[:-1]), stderr
    else:
        assert lines[0] == expected


@pytest.mark.parametrize(("args", "env", "code", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_setting_is_one_line(tmp_path: Path, taken_port: int, args: list[str], env: dict[str, str],
                                   code: int, expected: str) -> None:
    for name, text in AGENTS_FILES.items():
        (tmp_path / name).write_text(text)

    def fill(text: str) -> str:
        return text.replace("{tmp}", str(tmp_path)).replace("{taken}", str(taken_port))

    base = [part for flag, value in BASE.items() if flag not in args and env_name(flag) not in env
            for part in (flag, fill(value))]
    proc = serve([*base, *(fill(a) for a in args)], clean_env(tmp_path, **{k: fill(v) for k, v in env.items()}))
    assert proc.returncode == code, proc.stderr
    assert_one_line(proc.stderr, fill(expected))
    assert not (tmp_path / "missing").exists()  # an explicit --store never creates directories


def test_help_survives_a_bad_env_var_and_hides_secrets(tmp_path: Path) -> None:
    env = clean_env(tmp_path, UIBUS_PORT="abc", UIBUS_AUTH_TOKEN="s3cret-value",
                    UIBUS_REDIS_URL="redis://:redis-pass@db:6379/0")
    proc = serve(["--help"], env, script=True)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    out = " ".join(proc.stdout.split())  # argparse wraps the help text
    assert "s3cret-value" not in out and "redis-pass" not in out
    assert "(env UIBUS_AUTH_TOKEN, default: set)" in out
    assert "(env UIBUS_METRICS_TOKEN, default: not set)" in out
    assert "(env UIBUS_PORT, default: 'abc' from the env)" in out
    assert "'redis://:***@db:6379/0' from the env" in out


def test_an_unknown_flag_shows_the_serve_usage(tmp_path: Path) -> None:
    proc = serve(["--no-such-flag"], clean_env(tmp_path), script=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("usage: uibus serve ")
    assert proc.stderr.splitlines()[-1] == "uibus serve: error: unrecognized arguments: --no-such-flag"


def test_the_default_store_directory_is_still_created(tmp_path: Path) -> None:
    """Only an explicit --store must exist: the default one under XDG_STATE_HOME is made on first start
    (here the start then fails on the agents file, after the store opened)."""
    (tmp_path / "shape.json").write_text(AGENTS_FILES["shape.json"])
    proc = serve(["--host", "127.0.0.1", "--port", "0", "--http-port", "0", "--agents", str(tmp_path / "shape.json")],
                 clean_env(tmp_path))
    assert proc.returncode == 2
    assert_one_line(proc.stderr, f"uibus serve: --agents: {tmp_path}/shape.json: `agents` must be a non-empty list")
    assert (tmp_path / "state" / "uibus").is_dir()
