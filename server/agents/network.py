"""A sandboxed agent's network (option `network`, docs/hosting/isolation.md "Network"):

* `"outbound"` (the default with `sandbox = true`; `true` means it too): a network namespace of the
  sandbox's own (bwrap `--unshare-net`) connected to the world by user-mode networking — Debian's
  `passt` package's `pasta`, attached from outside. The agent reaches other hosts (its model's API)
  through pasta's sockets, which are uibus's user's; its 127.0.0.1 is its own, so nothing bound to
  the host's loopback (a password-less Redis, uibus's own ports) and none of the host's abstract
  Unix sockets (they belong to a network namespace) can be reached — `--no-map-gw` keeps pasta
  from mapping the gateway's address to the host's loopback, and no port is forwarded in either
  direction but these: `-T P` for each of the option `loopback_ports` (a local model server the
  operator lets the agent use) and, for an ACP agent offered uibus's own `/mcp`, the port of
  uibus's HTTP server (uibus.agents.stdio); inside, 127.0.0.1:P leads to the host's 127.0.0.1:P,
  so URLs stay as they are.
* `"host"`: the host's network namespace, shared (what `network = true` meant before "outbound").
* `false`: a namespace of its own with only a loopback in it: nothing leaves.

How: bwrap is started with `--unshare-net --info-fd I --block-fd B`; uibus reads the sandbox's pid
from I, takes its network namespace and the user namespace that owns it (ioctl NS_GET_USERNS: an
unprivileged bwrap, or one that changes uid or forbids new user namespaces, nests a second user
namespace, so the process's own is not the one that owns its network), starts pasta on them
(`--userns`/`--netns` as /proc/self/fd paths, passed to it), waits until pasta has configured the
interface (it writes its pid file — a pipe — once the namespace is up), and only then writes to B:
the agent never runs before its network is there. pasta runs as uibus's user (as root with
`--runas 0`: it needs root's rights over the sandbox's user namespace; it keeps capabilities only
in the sandbox's user namespace, and confines itself: its own mount namespace, a seccomp filter).
It is not in the agent's process group (another session), so it gets a watcher of its own, like an
agent's (uibus.agents.local_launcher.WATCHED): its group is killed when the agent's launch ends, and when
uibus dies in any way. Measured here: ~15 ms more per agent start (pasta's own set-up; ~50 ms
on a loaded 2-core machine).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import ipaddress
import os
import re
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any
from urllib.parse import urlsplit

from uibus.agents.confinement import confinement

OUTBOUND, HOST, NONE = "outbound", "host", "none"
MODES = (OUTBOUND, HOST, NONE)
NS_GET_USERNS = 0xB701  # linux/nsfs.h: _IO(0xb7, 0x1), the user namespace that owns a namespace
ATTACH_TIMEOUT_S = 10.0  # bwrap to say its pid, pasta to bring the interface up
# pasta's options: its interface configured in the namespace, in the foreground, no forwarding of any
# port either way (-t/-u: host -> namespace; -U: UDP namespace -> host) but the TCP ones asked for
# (-T), and the gateway's address not mapped to the host's loopback.
PASTA_OPTIONS = ("--config-net", "--foreground", "--quiet", "--no-map-gw", "-t", "none", "-u", "none", "-U", "none")
# pasta's watcher: when uibus dies (the pipe's write end closes), pasta's group is killed.
WATCHER = ('fd=$1; shift; (trap "" TERM INT HUP; cd /; read _ < "/dev/fd/$fd"; kill -KILL 0) '
           '</dev/null >/dev/null 2>&1 & exec "$@"')


class NetworkUnavailable(OSError):
    """pasta could not give a sandbox its network (the launch fails with this)."""


def mode_of(value: Any) -> str:
    """A `Sandbox.network` as one of MODES: True (the dataclass's default, for callers that build a
    Sandbox themselves) is the host's network; the agents file maps `true` to "outbound" (`option`)."""
    if value is True:
        return HOST
    if value is False:
        return NONE
    return str(value)


def option(agent: str, value: Any) -> str:
    """The agents file's `network`, checked: "outbound" (also `true`, and the default), "host", or
    `false` ("none"). ValueError naming agent and option."""
    if value is True:
        return OUTBOUND
    if value is False:
        return NONE
    if value in (OUTBOUND, HOST):
        return str(value)
    raise ValueError(f"agent {agent!r}: option network must be \"outbound\" (also true), \"host\" or false, "
                     f"not {value!r}")


def ports_option(agent: str, value: Any, mode: str) -> tuple[int, ...]:
    """The agents file's `loopback_ports`, checked: TCP ports of the host's loopback an "outbound"
    agent may reach. ValueError naming agent and option."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536
                                              for p in value):
        raise ValueError(f"agent {agent!r}: option loopback_ports must be a list of TCP port numbers (1-65535)")
    if value and mode != OUTBOUND:
        raise ValueError(f"agent {agent!r}: option loopback_ports needs network = \"outbound\" (with \"host\" "
                         "every loopback port is reachable, with false none is)")
    return tuple(dict.fromkeys(value))


def loopback_port(url: str) -> int:
    """The port of uibus's own endpoint `url` when it is on the loopback (0 otherwise): what an
    "outbound" agent offered it needs forwarded."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port or 0
        loop = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return 0
    return port if loop and host not in ("::1",) else 0  # pasta's -T forwards IPv4 loopback connections


def find_pasta() -> str:
    return shutil.which("pasta") or "pasta"


def pasta_argv(pasta: str, ports: Sequence[int], userns_fd: int | None, netns_fd: int, pid_fd: int) -> list[str]:
    """pasta attached to a namespace by descriptors it inherits (opened by paths under /proc/self)."""
    spec = ",".join(str(p) for p in ports) or "none"
    return [pasta, *PASTA_OPTIONS, "-T", spec, "--pid", f"/proc/self/fd/{pid_fd}",
            *(["--runas", "0"] if os.getuid() == 0 else []),
            *([] if userns_fd is None else ["--userns", f"/proc/self/fd/{userns_fd}"]),
            "--netns", f"/proc/self/fd/{netns_fd}"]


def _why(log: IO[bytes] | None, code: int | None) -> str:
    text = ""
    if log is not None:
        with contextlib.suppress(ValueError, OSError):  # closed meanwhile: the launch ended
            log.seek(0)
            text = log.read(16384).decode(errors="replace")
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("Failed to send")]
    return lines[-1].strip() if lines else f"exit code {code}"


@dataclass
class Attachment:
    """One sandbox's network, from its bwrap argv to the end of its launch (`plan`, then `attach`
    once the process is started, `aclose` when it ends). The null one (no "outbound") does nothing."""

    argv: list[str]
    fds: tuple[int, ...] = ()  # the child's ends, passed to the agent's process
    ports: tuple[int, ...] = ()
    pasta: str = ""
    _info: int = -1  # our end of bwrap's --info-fd
    _block: int = -1  # our end of bwrap's --block-fd
    _proc: subprocess.Popen[bytes] | None = None
    _keep: int = -1  # the write end of pasta's watcher's pipe
    _log: IO[bytes] | None = None
    _fds: list[int] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)  # attach (a thread) against close
    _closed: bool = False

    def sent(self) -> None:
        """The agent's process has started (or failed to): the child's ends are closed here."""
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = ()

    async def attach(self, alive: Callable[[], bool] = lambda: True) -> None:
        """pasta on the sandbox's namespace, then the agent released; NetworkUnavailable if not."""
        if self._info >= 0:
            await asyncio.to_thread(self.attach_now, alive)

    def attach_now(self, alive: Callable[[], bool] = lambda: True) -> None:
        deadline = time.monotonic() + ATTACH_TIMEOUT_S
        pid = self._child_pid(deadline, alive)
        net = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        self._fds.append(net)
        owner: int | None = fcntl.ioctl(net, NS_GET_USERNS)
        assert owner is not None
        self._fds.append(owner)
        if os.fstat(owner).st_ino == os.stat("/proc/self/ns/user").st_ino:
            owner = None  # bwrap made no user namespace (root): the network namespace alone
        ready, ready_w = os.pipe()
        self._fds.append(ready)
        watch, self._keep = os.pipe()
        try:
            with self._lock:
                if self._closed:  # the launch ended (cancelled) while this thread went on: no pasta now
                    raise NetworkUnavailable("the launch ended before its network was connected")
                self._log = log = tempfile.TemporaryFile()  # closed in close()
                self._proc = proc = subprocess.Popen(
                    ["/bin/sh", "-c", WATCHER, "uibus-net", str(watch),
                     *pasta_argv(self.pasta, self.ports, owner, net, ready_w)],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True,
                    pass_fds=(watch, net, ready_w, *(() if owner is None else (owner,))), cwd="/")
        finally:
            os.close(ready_w)
            os.close(watch)
        # pasta writes its pid file once the namespace's interface is configured
        if not self._wait_readable(ready, deadline, lambda: alive() and proc.poll() is None) \
                or not os.read(ready, 64).strip():
            raise NetworkUnavailable(f"pasta could not connect the sandbox's network: {_why(log, proc.poll())}")
        os.write(self._block, b"1")  # the agent may run now
        self._close_fds()

    def _child_pid(self, deadline: float, alive: Callable[[], bool]) -> int:
        buf = b""
        while not (m := re.search(rb'"child-pid"\s*:\s*(\d+)\D', buf)):
            if not self._wait_readable(self._info, deadline, alive):
                raise NetworkUnavailable("the sandbox ended (or did not say its pid) before its network was "
                                         "connected")
            chunk = os.read(self._info, 4096)
            if not chunk:
                raise NetworkUnavailable("the sandbox ended before its network was connected")
            buf += chunk
        return int(m[1])

    @staticmethod
    def _wait_readable(fd: int, deadline: float, alive: Callable[[], bool]) -> bool:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if select.select([fd], [], [], min(left, 0.05))[0]:
                return True
            if not alive():
                return bool(select.select([fd], [], [], 0)[0])

    def _close_fds(self) -> None:
        for fd in (*self._fds, self._info, self._block):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fds, self._info, self._block = [], -1, -1

    def close(self) -> None:
        """Everything of this network gone: pasta's group killed and reaped, descriptors closed."""
        with self._lock:
            self._closed = True
            proc, self._proc = self._proc, None
        self.sent()
        self._close_fds()
        if proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if self._keep >= 0:
            os.close(self._keep)
            self._keep = -1
        if self._log is not None:
            self._log.close()
            self._log = None

    async def aclose(self) -> None:
        if self._proc is not None:
            await asyncio.to_thread(self.close)
        else:
            self.close()


def plan(sandbox: Any, argv: list[str]) -> Attachment:
    """What a launch with `sandbox` (a uibus.agents.launcher.Sandbox, or None) and its bwrap `argv`
    needs for its network: for "outbound", bwrap told to say its pid and wait (`--info-fd`,
    `--block-fd`, inserted after the program) until `attach` has connected it; else nothing."""
    if sandbox is None or getattr(sandbox, "runsc", "") or mode_of(sandbox.network) != OUTBOUND:
        return Attachment(argv)
    info_r, info_w = os.pipe()
    block_r, block_w = os.pipe()
    return Attachment([argv[0], "--info-fd", str(info_w), "--block-fd", str(block_r), *argv[1:]],
                      fds=(info_w, block_r), ports=tuple(sandbox.loopback_ports), pasta=sandbox.pasta or find_pasta(),
                      _info=info_r, _block=block_w)


def bwrap_args(sandbox: Any) -> list[str]:
    """bwrap's network arguments: a namespace of its own unless the host's is asked for."""
    return [] if mode_of(sandbox.network) == HOST else ["--unshare-net"]


def network_problem(bwrap: str, pasta: str, nested: bool = False) -> str:
    """Why `network = "outbound"` cannot work here ("" when it can): pasta missing, or it cannot
    attach to a sandbox made as agents' are (no /dev/net/tun it may open, user namespaces it may
    not join, …) — checked by doing it once, as `sandbox_problem` does for bwrap."""
    if not os.access(pasta, os.X_OK):
        return f"{pasta} is not an executable file (install Debian's passt package, which has pasta)"
    box = _ProbeBox(pasta=pasta)
    net = plan(box, [bwrap, *confinement(nested), "--unshare-net", "--ro-bind", "/", "/", "--proc", "/proc",
                     "--dev", "/dev", "--", "/bin/cat", "/proc/net/route", "/proc/net/ipv6_route"])
    try:
        proc = subprocess.Popen(net.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                pass_fds=net.fds, cwd="/")
    except OSError as exc:
        net.close()
        return f"{bwrap} cannot run: {exc}"
    try:
        net.sent()
        try:
            net.attach_now(lambda: proc.poll() is None)
        except (NetworkUnavailable, OSError) as exc:
            return str(exc)
        try:
            out, err = proc.communicate(timeout=ATTACH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return "the sandbox did not end"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        net.close()
    routes = out.decode(errors="replace")
    default = re.search(r"^\S+\s+00000000\s", routes, re.M) or re.search(r"^0{32} 00 ", routes, re.M)
    if proc.returncode != 0 or not default:
        why = err.decode(errors="replace").strip().splitlines()
        return "pasta connected the sandbox but it has no route out" + (f": {why[-1]}" if why else "")
    return ""


@dataclass(frozen=True)
class _ProbeBox:
    pasta: str
    network: str = OUTBOUND
    loopback_ports: tuple[int, ...] = ()
    runsc: str = ""


def settle(agent: str, options: dict[str, Any], bwrap: str, nested: bool = False) -> tuple[str, tuple[int, ...], str]:
    """A sandboxed agent's `network` and `loopback_ports` options, checked, and "outbound" tried
    once here (start-up fails naming the option when it cannot work): (mode, ports, pasta)."""
    mode = option(agent, options.get("network", True))
    ports = ports_option(agent, options.get("loopback_ports"), mode)
    if mode != OUTBOUND:
        return mode, ports, ""
    pasta = find_pasta()
    problem = network_problem(bwrap, pasta, nested)
    if problem:
        said = "network = \"outbound\"" if "network" in options else "network = \"outbound\" (the default)"
        raise ValueError(f"agent {agent!r}: option {said} cannot work here: {problem} (or set network = \"host\": "
                         "the host's network, its loopback included; false: none)")
    return mode, ports, pasta
