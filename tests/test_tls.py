"""TLS on both ports, with real certificates made by the `openssl` CLI for each test run: a
throwaway CA, a server certificate for 127.0.0.1/localhost, and a client certificate.

With `--tls-cert`, the HTTP port speaks only HTTPS/WSS (gRPC-Web, the neuro-san API, the CodeBolt
WebSocket and the page) and the gRPC port only TLS; with `--tls-client-ca`, both refuse a client
without a certificate that CA signed. Bad files are a ConfigError naming the flag.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import InvalidHandshake

from tests.conftest import free_port, require_binary, running
from tests.webclient import call
from uibus.app import App
from uibus.infra.config import Config
from uibus.infra.errors import ConfigError
from uibus.pb.cline import common_pb2


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_cert: Path  # a client certificate of another CA
    other_key: Path


def _run(openssl: str, *args: str | Path) -> None:
    subprocess.run([openssl, *map(str, args)], check=True, capture_output=True, timeout=30)


def _ca(openssl: str, d: Path, name: str) -> tuple[Path, Path]:
    cert, key = d / f"{name}.pem", d / f"{name}.key"
    _run(openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", key, "-out", cert, "-days", "2", "-subj", f"/CN={name}",
         "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return cert, key


def _leaf(openssl: str, d: Path, name: str, ca: tuple[Path, Path], extensions: str) -> tuple[Path, Path]:
    cert, key, csr, ext = d / f"{name}.pem", d / f"{name}.key", d / f"{name}.csr", d / f"{name}.ext"
    ext.write_text(extensions + "\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n")
    _run(openssl, "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", key, "-out", csr, "-subj", f"/CN={name}")
    _run(openssl, "x509", "-req", "-in", csr, "-CA", ca[0], "-CAkey", ca[1], "-CAcreateserial",
         "-out", cert, "-days", "2", "-extfile", ext)
    return cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    openssl = require_binary("openssl")
    d = tmp_path_factory.mktemp("pki")
    ca = _ca(openssl, d, "ca")
    server = _leaf(openssl, d, "server", ca, "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                             "extendedKeyUsage=serverAuth")
    client = _leaf(openssl, d, "client", ca, "extendedKeyUsage=clientAuth")
    other = _leaf(openssl, d, "other", _ca(openssl, d, "other-ca"), "extendedKeyUsage=clientAuth")
    return Pki(ca[0], *server, *client, *other)


def tls_config(config: Config, pki: Pki, **kw: object) -> Config:
    fields: dict[str, object] = {"http_port": free_port(), "tls_cert": str(pki.server_cert),
                                 "tls_key": str(pki.server_key), **kw}
    return replace(config, **fields)  # type: ignore[arg-type]


def client_context(pki: Pki, cert: tuple[Path, Path] | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    if cert is not None:
        ctx.load_cert_chain(str(cert[0]), str(cert[1]))
    return ctx


def grpc_credentials(pki: Pki, cert: tuple[Path, Path] | None = None) -> grpc.ChannelCredentials:
    if cert is None:
        return grpc.ssl_channel_credentials(pki.ca.read_bytes())
    return grpc.ssl_channel_credentials(pki.ca.read_bytes(), cert[1].read_bytes(), cert[0].read_bytes())


async def health(app: App, creds: grpc.ChannelCredentials | None) -> int:
    """The gRPC health status over a TLS channel (or a plaintext one with None)."""
    target = f"127.0.0.1:{app.port}"
    channel = (grpc.aio.insecure_channel(target) if creds is None else
               grpc.aio.secure_channel(target, creds, options=[("grpc.ssl_target_name_override", "localhost")]))
    async with channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status  # type: ignore[no-any-return]


async def grpc_web(http: httpx.AsyncClient, base: str) -> int:
    reply = await call(http, f"{base}/cline.UiService/scrollToSettings",
                       common_pb2.StringRequest(value="general").SerializeToString())
    assert reply.http_status == 200
    return reply.status


async def codebolt_round_trip(port: int, ctx: ssl.SSLContext) -> dict[str, object]:
    async with ws_connect(f"wss://127.0.0.1:{port}/agent-to-app?session=tls", ssl=ctx, open_timeout=5) as ws:
        await ws.send(json.dumps({"type": "chatEvent", "action": "getChatHistory", "requestId": "t", "message": {}}))
        return json.loads(await asyncio.wait_for(ws.recv(), 5))  # type: ignore[no-any-return]


async def plaintext_answer(port: int) -> bytes:
    """What a plaintext HTTP request to the port gets back before the server closes (bounded)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /healthz HTTP/1.1\r\nhost: localhost\r\n\r\n")
    data = b""
    deadline = time.monotonic() + 5
    try:
        while chunk := await asyncio.wait_for(reader.read(65536), max(0.01, deadline - time.monotonic())):
            data += chunk
    except (ConnectionError, TimeoutError):
        pass
    writer.close()
    return data


async def test_tls_on_both_ports(config: Config, pki: Pki) -> None:
    async with running(tls_config(config, pki)) as app:
        base = f"https://127.0.0.1:{app.http_port}"
        async with httpx.AsyncClient(verify=client_context(pki), timeout=5) as http:
            assert await grpc_web(http, base) == 0
            page = await http.get(f"{base}/")
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            chat = await http.post(f"{base}/api/v1/hello_world/streaming_chat", json={"user_message": {"text": "hi"}})
            assert chat.status_code == 200 and "hi" in chat.text
        assert await health(app, grpc_credentials(pki)) == health_pb2.HealthCheckResponse.SERVING
        reply = await codebolt_round_trip(app.http_port, client_context(pki))
        assert reply["success"] is True and reply["requestId"] == "t", reply

        # Plaintext gets no HTTP answer on either port.
        assert not (await plaintext_answer(app.http_port)).startswith(b"HTTP/")
        async with httpx.AsyncClient(timeout=5) as http:
            with pytest.raises(httpx.TransportError):
                await http.get(f"http://127.0.0.1:{app.http_port}/healthz")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await health(app, None)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # A server certificate no trusted CA signed is refused by the client, as it should be.
        async with httpx.AsyncClient(timeout=5) as http:
            with pytest.raises(httpx.ConnectError):
                await http.get(f"{base}/healthz")


async def test_silent_tls_connections_are_closed_at_the_header_timeout(config: Config, pki: Pki) -> None:
    """The header timer starts once the TLS handshake is done, so the handshake itself is bounded by
    the same timeout: neither a silent TCP connection nor a silent TLS session stays open."""
    async def closed_after(reader: asyncio.StreamReader, since: float) -> float:
        try:
            while await asyncio.wait_for(reader.read(65536), 5):
                pass
        except ConnectionError:
            pass
        return time.monotonic() - since

    async with running(tls_config(config, pki, http_header_timeout_seconds=1.0)) as app:
        start = time.monotonic()
        tcp_reader, tcp_writer = await asyncio.open_connection("127.0.0.1", app.http_port)  # no ClientHello
        tls_reader, tls_writer = await asyncio.open_connection("127.0.0.1", app.http_port, ssl=client_context(pki))
        handshaken = time.monotonic()
        took = await asyncio.gather(closed_after(tcp_reader, start), closed_after(tls_reader, handshaken))
        tcp_writer.close()
        tls_writer.close()
        assert all(0.9 <= t <= 2.5 for t in took), took


async def test_http_tls_cert_covers_the_http_port_only(config: Config, pki: Pki) -> None:
    cfg = replace(config, http_port=free_port(), http_tls_cert=str(pki.server_cert), http_tls_key=str(pki.server_key))
    async with running(cfg) as app:
        async with httpx.AsyncClient(verify=client_context(pki), timeout=5) as http:
            assert (await http.get(f"https://127.0.0.1:{app.http_port}/healthz")).text == "ok\n"
        assert not (await plaintext_answer(app.http_port)).startswith(b"HTTP/")
        assert await health(app, None) == health_pb2.HealthCheckResponse.SERVING  # gRPC stays plaintext


async def test_mtls_requires_a_client_certificate_of_the_ca(config: Config, pki: Pki) -> None:
    client = (pki.client_cert, pki.client_key)
    other = (pki.other_cert, pki.other_key)
    async with running(tls_config(config, pki, tls_client_ca=str(pki.ca))) as app:
        base = f"https://127.0.0.1:{app.http_port}"
        # With the client certificate: every door opens.
        async with httpx.AsyncClient(verify=client_context(pki, client), timeout=5) as http:
            assert await grpc_web(http, base) == 0
            assert (await http.get(f"{base}/healthz")).text == "ok\n"
        assert await health(app, grpc_credentials(pki, client)) == health_pb2.HealthCheckResponse.SERVING
        assert (await codebolt_round_trip(app.http_port, client_context(pki, client)))["success"] is True

        # Without one, or with one of another CA: refused on both ports.
        for cert in (None, other):
            async with httpx.AsyncClient(verify=client_context(pki, cert), timeout=5) as http:
                with pytest.raises(httpx.TransportError):
                    await http.get(f"{base}/healthz")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await health(app, grpc_credentials(pki, cert))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises((OSError, InvalidHandshake)):  # TLS alert; or the socket closes before a response
                await codebolt_round_trip(app.http_port, client_context(pki, cert))


@pytest.mark.parametrize(("overrides", "flag", "what"), [
    ({"tls_cert": "/nonexistent/c.pem"}, "--tls-cert", "cannot read /nonexistent/c.pem: No such file or directory"),
    ({"tls_key": "/nonexistent/k.pem"}, "--tls-key", "cannot read /nonexistent/k.pem: No such file or directory"),
    ({"tls_client_ca": "/nonexistent/ca.pem"}, "--tls-client-ca", "cannot read /nonexistent/ca.pem"),
    ({"http_tls_cert": "/nonexistent/h.pem", "http_tls_key": "/nonexistent/h.key"}, "--http-tls-cert",
     "cannot read /nonexistent/h.pem"),
    ({"tls_key": "CLIENT_KEY"}, "--tls-cert", "not a PEM certificate chain and its private key"),
    ({"tls_client_ca": "SERVER_KEY"}, "--tls-client-ca", "not a PEM CA bundle"),
])
async def test_bad_tls_files_name_their_flag(config: Config, pki: Pki, overrides: dict[str, str], flag: str,
                                             what: str) -> None:
    paths = {"CLIENT_KEY": str(pki.client_key), "SERVER_KEY": str(pki.server_key)}
    cfg = tls_config(config, pki, **{k: paths.get(v, v) for k, v in overrides.items()})
    app = App(cfg)
    with pytest.raises(ConfigError) as err:
        await app.start()
    assert err.value.source == flag and what in err.value.what, err.value
    with socket.socket() as s:  # nothing was left bound
        s.bind(("127.0.0.1", cfg.http_port))
