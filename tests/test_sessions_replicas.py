"""The sessions API across two replicas on one real Redis: a dialog held by one replica is counted
and named in the listing another replica serves, and the sessions either writes are listed by both."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.redistarget import RedisTarget, redis_cluster, redis_cluster_clean, redis_server, redis_target
from tests.test_redis_replicas import Replica, two_replicas
from uibus.pb.uibus.v1 import extension_ui_pb2 as ext
from uibus.pb.uibus.v1 import extension_ui_pb2_grpc, sessions_pb2_grpc
from uibus.pb.uibus.v1 import sessions_pb2 as pb

__all__ = ["redis_cluster", "redis_cluster_clean", "redis_server", "redis_target"]


@pytest.fixture
async def replicas(redis_target: RedisTarget, tmp_path: Path) -> AsyncIterator[tuple[Replica, Replica]]:
    async with two_replicas(redis_target.url, tmp_path, Replica, cluster=redis_target.cluster) as pair:
        yield pair


async def test_a_dialog_on_one_replica_is_listed_by_the_other(replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    asking = asyncio.ensure_future(extension_ui_pb2_grpc.ExtensionUiServiceStub(a.connect("rs").channel).Confirm(
        ext.ConfirmRequest(title="Merge it?")))
    listing = sessions_pb2_grpc.SessionServiceStub(b.connect().channel)
    entry = None
    for _ in range(200):  # the shared entry is written right after the dialog opens
        listed = await listing.ListSessions(pb.ListSessionsRequest(prefix="rs"))
        entry = next((s for s in listed.sessions if s.session == "rs"), None)
        if entry is not None and entry.waiting_dialogs:
            break
        await asyncio.sleep(0.02)
    assert entry is not None and entry.waiting_dialogs == 1
    assert [(d.kind, d.title) for d in entry.waiting] == [("confirm", "Merge it?")]
    asking.cancel()
    for _ in range(500):  # closed (its caller went): gone from the other replica's listing too (a store
        # entry's delete is retried with backoff while a cold cluster settles)
        listed = await listing.ListSessions(pb.ListSessionsRequest(prefix="rs"))
        if not listed.sessions[0].waiting_dialogs:
            break
        await asyncio.sleep(0.02)
    assert listed.sessions[0].waiting_dialogs == 0
