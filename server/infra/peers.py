"""A default `uibus serve` (loopback, no token) answers its own user only: the peer's uid.

Loopback alone keeps other machines out, not the other users of this one: any local account (or a
service running as `nobody`) could list and drive every session. So when uibus binds loopback and
no token is configured, every call — on every transport: gRPC, gRPC-Web, the HTTP API, MCP, the
WebSockets, the page — must come from a socket owned by uibus's own uid. The kernel says who owns
a socket: asked over netlink (sock_diag: the one socket whose local end is the peer's address and
port and whose remote end is ours, about 40 µs), or, where netlink is not allowed, from its row in
/proc/net/tcp (or tcp6: the same match, the `uid` column; reading it walks the kernel's whole
socket table, milliseconds on a large machine).

Why the peer's uid rather than a token in the printed page URL (Jupyter's way) or a Unix socket:
every client keeps working unchanged for its user — grpcurl, `uibus` commands, a browser tab,
an editor's ACP or MCP configuration, hosted agents calling back into /mcp — with nothing to copy
or leak (a URL token ends up in shell history, browser history and screenshots), while every other
local user is refused. Root is no exception: only uibus's own uid passes (a uibus run as root
answers root alone). An explicit `--auth-token` / `--tokens-file` replaces this rule with the
tokens' (to share a uibus, give out a token); a non-loopback bind already requires one.

The answer is cached per peer (address, port) for `TTL_S` so a busy connection does not re-read
the table on every call; rows without an owner (TIME_WAIT: inode 0) never count.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import time
from collections.abc import Iterable

from uibus.infra.errors import Unauthenticated

TTL_S = 1.0  # how long one peer's owner is remembered
MAX_CACHED = 4096
TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
INPROCESS = ("inprocess",)  # peers of uibus's own in-process channels: uibus itself


def parse_peer(peer: str) -> tuple[str, int] | None:
    """(address, port) of a grpc `peer()` string (`ipv4:127.0.0.1:5`, `ipv6:[::1]:5`, URL-escaped
    brackets too); None for any other kind of peer."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    rest = rest.replace("%5B", "[").replace("%5D", "]").replace("%5b", "[").replace("%5d", "]")
    host, _, port = rest.rpartition(":")
    host = host.strip("[]").split("%", 1)[0]  # a zone id (fe80::1%eth0) is no part of the row
    try:
        ip = ipaddress.ip_address(host)
        port_number = int(port)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # a dual-stack listener's view of an IPv4 client: its socket is IPv4's
    return str(ip), port_number


def _hex(address: str) -> list[tuple[str, str]]:
    """How /proc/net/tcp{,6} print `address`: (table, hex) pairs (an IPv4-mapped IPv6 address is
    looked up in both forms). The kernel prints each 32-bit word in host byte order."""
    ip = ipaddress.ip_address(address)
    forms: list[tuple[str, str]] = []
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        forms += _hex(str(ip.ipv4_mapped))
    if isinstance(ip, ipaddress.IPv4Address):
        forms.append((TABLES[0], _words(ip.packed)))
        forms.append((TABLES[1], _words(b"\0" * 10 + b"\xff\xff" + ip.packed)))  # as an IPv4-mapped address
    else:
        forms.append((TABLES[1], _words(ip.packed)))
    return forms


def _words(packed: bytes) -> str:
    return "".join(f"{struct.unpack('=I', packed[i:i + 4])[0]:08X}" for i in range(0, len(packed), 4))


# sock_diag (linux/sock_diag.h, linux/inet_diag.h): one exact lookup by the connection's four parts
_NETLINK_SOCK_DIAG, _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, _NLMSG_ERROR = 4, 20, 1, 2
_NOCOOKIE = 0xFFFFFFFF
_LISTEN = 10  # TCP_LISTEN: a listener on the peer's port is not the peer


def diag_owner(address: str, port: int, server: str, server_port: int) -> int | None:
    """The uid of the TCP socket `address:port` → `server:server_port` (the client's end of a
    connection to us), by sock_diag's exact lookup; None when there is none (or only a TIME_WAIT
    remnant). OSError when netlink cannot be used here."""
    src, dst = ipaddress.ip_address(address), ipaddress.ip_address(server)
    if src.version != dst.version:
        return None
    family = socket.AF_INET if src.version == 4 else socket.AF_INET6
    request = (struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF)
               + struct.pack("!HH", port, server_port) + src.packed.ljust(16, b"\0") + dst.packed.ljust(16, b"\0")
               + struct.pack("=III", 0, _NOCOOKIE, _NOCOOKIE))
    header = struct.pack("=IHHII", 16 + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(1.0)
        nl.sendto(header + request, (0, 0))
        data = nl.recv(8192)
    if len(data) < 16 + 72 or struct.unpack_from("=H", data, 4)[0] != _SOCK_DIAG_BY_FAMILY:
        return None  # NLMSG_ERROR: no such socket (ENOENT)
    state = data[17]
    uid, inode = struct.unpack_from("=II", data, 16 + 64)
    return None if state == _LISTEN or inode == 0 else uid


def owner_of(address: str, port: int, ours: Iterable[int] = (), servers: Iterable[str] = ()) -> int | None:
    """The uid owning the socket whose local end is `address:port` and whose remote port is one of
    `ours` (any, when empty): the client's side of a connection to this process. None when no
    such socket is found (gone already, or in another network namespace). Netlink first, for each
    of `servers` (the addresses uibus is bound to) and `ours` (its answer is final); /proc/net/tcp{,6}
    where netlink cannot be used, or without `servers`."""
    wanted_ports = {int(p) for p in ours if p}
    servers = tuple(servers)
    if servers and wanted_ports:
        try:
            for server in servers:
                for server_port in wanted_ports:
                    uid = diag_owner(address, port, server, server_port)
                    if uid is not None:
                        return uid
            return None  # netlink answered: no such connection (any more)
        except (OSError, ValueError, AttributeError):
            pass  # no netlink here (a seccomp profile, an old kernel): the table
    return _table_owner(address, port, wanted_ports)


def _table_owner(address: str, port: int, wanted_ports: set[int]) -> int | None:
    suffix = f":{port:04X}"
    for table, local_hex in _hex(address):
        local = local_hex + suffix
        try:
            with open(table, encoding="ascii") as f:
                next(f, None)  # the header
                for line in f:
                    fields = line.split()
                    if len(fields) < 10 or fields[1] != local:
                        continue
                    if wanted_ports and int(fields[2].rpartition(":")[2], 16) not in wanted_ports:
                        continue
                    if fields[9] == "0":  # no owner (TIME_WAIT and the like): says nothing
                        continue
                    return int(fields[7])
        except (OSError, ValueError):
            continue
    return None


class OwnUserOnly:
    """The rule of a loopback uibus without tokens: only sockets of uibus's own uid may call."""

    def __init__(self, host: str = "127.0.0.1", uid: int | None = None, ttl_s: float = TTL_S) -> None:
        self.uid = os.getuid() if uid is None else uid
        self.ttl_s = ttl_s
        self.ports: set[int] = set()  # the ports uibus listens on (set once they are bound)
        self.servers = bound_addresses(host)  # the addresses a client connects to
        self._cache: dict[tuple[str, int] | str, tuple[float, int | None]] = {}  # by (address, port) and peer

    def owner(self, address: str, port: int) -> int | None:
        now = time.monotonic()
        key = (address, port)
        hit = self._cache.get(key)
        if hit is not None and now - hit[0] < self.ttl_s:
            return hit[1]
        uid = owner_of(address, port, self.ports, self.servers)
        if len(self._cache) >= MAX_CACHED:
            self._cache = {k: v for k, v in self._cache.items() if now - v[0] < self.ttl_s}
            if len(self._cache) >= MAX_CACHED:
                self._cache.clear()
        self._cache[key] = (now, uid)
        return uid

    def refusal(self, peer: str) -> str | None:
        """Why a call from `peer` (grpc's `peer()` form) is refused; None when it is uibus's user's."""
        if peer in INPROCESS:
            return None
        hit = self._cache.get(peer)  # by the peer's own spelling first: no parsing on a busy connection
        if hit is not None and time.monotonic() - hit[0] < self.ttl_s:
            uid = hit[1]
        else:
            found = parse_peer(peer)
            uid = self.owner(*found) if found is not None else None
            self._cache[peer] = (time.monotonic(), uid)
        if uid == self.uid:
            return None
        who = f"uid {uid}" if uid is not None else f"{peer[:64]}, whose owner it cannot tell"
        return (f"this uibus serves its own user only (uid {self.uid}); pass --auth-token to share it "
                f"(refused: {who})")

    def check(self, peer: str) -> None:
        """Raises Unauthenticated unless `peer` is a socket of uibus's own uid."""
        why = self.refusal(peer)
        if why is not None:
            raise Unauthenticated(why)



def bound_addresses(host: str) -> tuple[str, ...]:
    """The loopback addresses `host` (a loopback --host) binds: itself when an address, else (a
    `localhost` name) IPv4's and IPv6's."""
    name = host.strip("[]")
    try:
        return (str(ipaddress.ip_address(name)),)
    except ValueError:
        return ("127.0.0.1", "::1")


def available() -> bool:
    """Whether this system can say who owns a loopback connection (Linux: netlink or /proc/net)."""
    return hasattr(socket, "AF_NETLINK") or os.path.exists(TABLES[0])
