"""Real Redis processes on free loopback ports, which a test can kill: one `redis-server`
(`redis_server`, restartable in place), a Redis Cluster of 3 masters and 3 replicas
(`redis_cluster`, `fresh_redis_cluster`) and a master set behind three sentinels (`redis_sentinel`).
Every process is SIGKILLed in teardown."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import free_port, require_binary
from tests.support import needs


class RedisProcess:
    def __init__(self, workdir: Path) -> None:
        self.binary = require_binary("redis-server")
        self.port = free_port()
        self.workdir = workdir
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        """Starts (or restarts on the same port) an empty, non-persistent server."""
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not self.ping():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None


@pytest.fixture
@needs("redis")
def redis_server(tmp_path: Path) -> Iterator[RedisProcess]:
    server = RedisProcess(tmp_path)
    try:
        yield server
    finally:
        server.kill()


# ---- Redis Cluster: 3 masters + 3 replicas ------------------------------------------------------

CLUSTER_NODE_TIMEOUT_MS = 1000  # how long a master may be silent before the others mark it failed


def _command(port: int, *args: str, timeout: float = 1.0) -> Any:
    """One command to the node on `port` (a fresh connection, so a dead node is a quick OSError)."""
    import redis

    client = redis.Redis(port=port, socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        return client.execute_command(*args)
    finally:
        client.close()


def _cluster_port() -> int:
    """A free port P whose cluster bus port P+10000 is free too (and still a port)."""
    while True:
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


def _slot_map(port: int) -> dict[tuple[int, int], int]:
    """{(first slot, last slot): master port} as the node on `port` sees the cluster."""
    return {(int(r[0]), int(r[1])): int(r[2][1]) for r in _command(port, "CLUSTER", "SLOTS")}


class RedisClusterProcess:
    """A real Redis Cluster on loopback: six `redis-server --cluster-enabled yes` (3 masters, each
    with one replica) joined by `redis-cli --cluster create`. A test may SIGKILL a master and wait
    for its replica to take over (the node timeout is 1 s, so a failover takes a few seconds)."""

    def __init__(self, workdir: Path, masters: int = 3) -> None:
        self.binary = require_binary("redis-server")
        self.cli = require_binary("redis-cli")
        self.workdir = workdir
        self.ports = [_cluster_port() for _ in range(masters * 2)]
        while len(set(self.ports)) < len(self.ports):
            self.ports = [_cluster_port() for _ in range(masters * 2)]
        self.url = f"redis://127.0.0.1:{self.ports[0]}/0"
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.killed: set[int] = set()
        try:
            for port in self.ports:
                self._start_node(port)
            self._create(masters)
            self.wait_ok(30)
        except BaseException:
            self.kill()
            raise

    def _start_node(self, port: int) -> None:
        node_dir = self.workdir / str(port)
        node_dir.mkdir(parents=True, exist_ok=True)
        self.procs[port] = subprocess.Popen(
            [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-config-file", str(node_dir / "nodes.conf"),
             "--cluster-node-timeout", str(CLUSTER_NODE_TIMEOUT_MS), "--save", "", "--appendonly", "no",
             "--repl-diskless-sync-delay", "0",
             "--dir", str(node_dir), "--logfile", str(node_dir / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                if _command(port, "PING"):
                    return
            except Exception:
                pass
            if self.procs[port].poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"cluster node did not start on port {port}")
            time.sleep(0.02)

    def _create(self, masters: int) -> None:
        done = subprocess.run(
            [self.cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
             "--cluster-replicas", str(len(self.ports) // masters - 1), "--cluster-yes"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)
        if done.returncode != 0:
            raise AssertionError(f"redis-cli --cluster create failed: {done.stdout.decode()[-2000:]}")

    def live_ports(self) -> list[int]:
        return [p for p in self.ports if p not in self.killed]

    def _settled(self) -> dict[tuple[int, int], int] | None:
        """The slot map when every live node says cluster_state:ok, all of them agree on it, it
        covers all 16384 slots and names no killed node, and every live replica has synced with its
        master (a replica that never synced cannot take over); else None."""
        maps = []
        for port in self.live_ports():
            try:
                if b"cluster_state:ok" not in _command(port, "CLUSTER", "INFO"):
                    return None
                replication = _command(port, "INFO", "replication")  # parsed by redis-py into a dict
                if replication["role"] == "slave" and replication["master_link_status"] != "up":
                    return None
                maps.append(_slot_map(port))
            except Exception:
                return None
        first = maps[0]
        if any(m != first for m in maps) or sum(b - a + 1 for a, b in first) != 16384:
            return None
        if set(first.values()) & self.killed:
            return None
        return first

    def wait_ok(self, timeout: float) -> float:
        """Waits until the cluster is settled (see `_settled`); returns the seconds it took."""
        start = time.monotonic()
        while self._settled() is None:
            if time.monotonic() - start > timeout:
                raise AssertionError(f"the Redis Cluster did not settle within {timeout}s")
            time.sleep(0.05)
        return time.monotonic() - start

    def masters(self) -> list[tuple[int, list[tuple[int, int]]]]:
        """(port, slot ranges) of each master now, by port."""
        by_port: dict[int, list[tuple[int, int]]] = {}
        for port in self.live_ports():
            try:
                slots = _slot_map(port)
            except Exception:
                continue
            for rng, master in sorted(slots.items()):
                by_port.setdefault(master, []).append(rng)
            return sorted(by_port.items())
        raise AssertionError("no cluster node answers")

    def master_of(self, key_or_slot: str | bytes | int) -> int:
        from redis.crc import key_slot

        slot = key_or_slot if isinstance(key_or_slot, int) else key_slot(
            key_or_slot.encode() if isinstance(key_or_slot, str) else key_or_slot)
        for port, ranges in self.masters():
            if any(a <= slot <= b for a, b in ranges):
                return port
        raise AssertionError(f"no master serves slot {slot}")

    def kill_master_of(self, key_or_slot: str | bytes | int) -> int:
        """SIGKILLs the master that owns the key's (or the) slot; returns its port."""
        port = self.master_of(key_or_slot)
        self.kill_node(port)
        return port

    def kill_node(self, port: int) -> None:
        proc = self.procs.get(port)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        self.killed.add(port)

    def wait_failover(self, timeout: float = 20.0) -> float:
        """Waits until every slot has a master again (a replica of each killed master promoted,
        every live node at cluster_state:ok); returns the seconds it took."""
        return self.wait_ok(timeout)

    def flush(self) -> None:
        """FLUSHALL on every master (test isolation on the shared cluster)."""
        for port, _ in self.masters():
            _command(port, "FLUSHALL", timeout=5)

    def kill(self) -> None:
        for port in list(self.procs):
            self.kill_node(port)
        self.procs.clear()


_SHARED_CLUSTER: list[RedisClusterProcess] = []


@pytest.fixture(scope="session")
@needs("redis")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcess]:
    """One cluster for the whole session (creating one takes seconds). Modules that import this
    fixture each get a fixture definition of their own, so the cluster is kept module-global and
    shared by all of them; whichever teardown runs first at the end of the session kills it.
    Never kill a node of it: use `fresh_redis_cluster`."""
    if not _SHARED_CLUSTER:
        _SHARED_CLUSTER.append(RedisClusterProcess(tmp_path_factory.mktemp("redis-cluster")))
    try:
        yield _SHARED_CLUSTER[0]
    finally:
        if _SHARED_CLUSTER:
            _SHARED_CLUSTER.pop().kill()


@pytest.fixture
@needs("redis")
def redis_cluster_clean(redis_cluster: RedisClusterProcess) -> RedisClusterProcess:
    """The shared cluster, emptied for this test (and checked to still be whole)."""
    if redis_cluster._settled() is None:
        raise AssertionError("the shared Redis Cluster is broken (did a test kill a node of it?)")
    redis_cluster.flush()
    return redis_cluster


@pytest.fixture
@needs("redis")
def fresh_redis_cluster(tmp_path: Path) -> Iterator[RedisClusterProcess]:
    """A cluster of this test's own, which it may break."""
    cluster = RedisClusterProcess(tmp_path / "cluster")
    try:
        yield cluster
    finally:
        cluster.kill()


# ---- Sentinel: one master, one replica, three sentinels -----------------------------------------

SENTINEL_MASTER = "uibus"


class RedisSentinelProcess:
    """A real master set behind sentinels: a master, a replica of it (`--replicaof`) and three
    sentinels (quorum 2, master down after 1 s). Each sentinel has a conf file of its own in the
    workdir, since a sentinel rewrites its config as it learns the set."""

    def __init__(self, workdir: Path) -> None:
        self.binary = require_binary("redis-server")
        self.workdir = workdir
        self.data_ports = [free_port(), free_port()]
        self.sentinel_ports = [free_port() for _ in range(3)]
        while len(set(self.data_ports + self.sentinel_ports)) < 5:
            self.sentinel_ports = [free_port() for _ in range(3)]
        self.url = "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports) + \
            f"/{SENTINEL_MASTER}/0"
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.killed: set[int] = set()
        try:
            master, replica = self.data_ports
            self._start(master, [])
            self._start(replica, ["--replicaof", "127.0.0.1", str(master)])
            self._wait(lambda: _command(replica, "INFO", "replication")["master_link_status"] == "up",
                       10, "the replica to sync")
            for port in self.sentinel_ports:
                conf = workdir / f"sentinel-{port}.conf"
                conf.write_text(
                    f"port {port}\nbind 127.0.0.1\ndir {workdir}\nsentinel resolve-hostnames no\n"
                    f"sentinel monitor {SENTINEL_MASTER} 127.0.0.1 {master} 2\n"
                    f"sentinel down-after-milliseconds {SENTINEL_MASTER} 1000\n"
                    f"sentinel failover-timeout {SENTINEL_MASTER} 3000\n"
                    f"logfile {workdir / f'sentinel-{port}.log'}\n")
                self._start(port, [], conf=conf)
            # every sentinel knows the replica and the other sentinels, so a failover can be agreed on
            self._wait(self._sentinels_ready, 15, "the sentinels to find each other and the replica")
        except BaseException:
            self.kill()
            raise

    def _start(self, port: int, args: list[str], conf: Path | None = None) -> None:
        if conf is not None:
            cmd = [self.binary, str(conf), "--sentinel"]
        else:
            node_dir = self.workdir / str(port)
            node_dir.mkdir(parents=True, exist_ok=True)
            cmd = [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                   "--repl-diskless-sync-delay", "0", "--dir", str(node_dir),
                   "--logfile", str(node_dir / "redis.log"), *args]
        self.procs[port] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def up() -> bool:
            if self.procs[port].poll() is not None:
                raise AssertionError(f"redis-server {' '.join(cmd[1:])} exited {self.procs[port].returncode}")
            return bool(_command(port, "PING"))
        self._wait(up, 10, f"port {port} to answer")

    @staticmethod
    def _wait(predicate: Any, timeout: float, what: str) -> float:
        start = time.monotonic()
        while True:
            try:
                if predicate():
                    return time.monotonic() - start
            except AssertionError:
                raise
            except Exception:
                pass
            if time.monotonic() - start > timeout:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}")
            time.sleep(0.05)

    def _sentinels_ready(self) -> bool:
        for port in self.sentinel_ports:
            reply = _command(port, "SENTINEL", "MASTER", SENTINEL_MASTER)
            info = reply if isinstance(reply, dict) else dict(zip(reply[::2], reply[1::2], strict=True))
            info = {(k.decode() if isinstance(k, bytes) else k): v for k, v in info.items()}
            if int(info["num-slaves"]) < 1 or int(info["num-other-sentinels"]) < 2:
                return False
        return True

    def master_port(self) -> int:
        """The master's port as a live sentinel names it now."""
        for port in self.sentinel_ports:
            if port in self.killed:
                continue
            try:
                _host, master = _command(port, "SENTINEL", "get-master-addr-by-name", SENTINEL_MASTER)
                return int(master)
            except Exception:
                continue
        raise AssertionError("no sentinel answers")

    def kill_master(self) -> int:
        """SIGKILLs the current master; returns its port."""
        port = self.master_port()
        proc = self.procs[port]
        proc.kill()
        proc.wait(10)
        self.killed.add(port)
        return port

    def wait_promoted(self, old_port: int, timeout: float = 30.0) -> float:
        """Waits until every sentinel names a new master (not `old_port`) and that node says it is
        a master; returns the seconds it took."""
        def promoted() -> bool:
            named = {int(_command(p, "SENTINEL", "get-master-addr-by-name", SENTINEL_MASTER)[1])
                     for p in self.sentinel_ports}
            if len(named) != 1 or old_port in named:
                return False
            return bool(_command(named.pop(), "INFO", "replication")["role"] == "master")
        return self._wait(promoted, timeout, "a replica to be promoted")

    def kill(self) -> None:
        for port, proc in list(self.procs.items()):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            self.killed.add(port)
        self.procs.clear()


@pytest.fixture
@needs("redis")
def redis_sentinel(tmp_path: Path) -> Iterator[RedisSentinelProcess]:
    sentinel = RedisSentinelProcess(tmp_path / "sentinel")
    try:
        yield sentinel
    finally:
        sentinel.kill()
