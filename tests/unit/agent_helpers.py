"""Fakes shared by the agent's unit tests: a NodeApi, VGPUPool dicts, a kubelet Registration server."""

from __future__ import annotations

import asyncio
import contextlib
import copy
from pathlib import Path

import grpc
from grpc import aio
from kvgpu.agent.proto import pb2, pb2_grpc


def pool(name, split=10, match=None, mode="hami-core", **devices):
    spec = {"splitCount": split, "mode": mode, "nodeSelector": {"matchLabels": match or {}}}
    if devices:
        spec["devices"] = devices
    return {"apiVersion": "kvgpu.io/v1alpha1", "kind": "VGPUPool", "metadata": {"name": name}, "spec": spec}


class FakeApi:
    def __init__(self, labels=None):
        self.node = {"metadata": {"name": "gpu-0", "labels": dict(labels or {}), "annotations": {}}}
        self.pools: list = []
        self.patches: list = []
        self.events: list = []

    async def get_node(self, name):
        return copy.deepcopy(self.node)

    async def patch_node_metadata(self, name, annotations, labels=None):
        self.patches.append((annotations, labels))
        meta = self.node["metadata"]
        for k, v in annotations.items():
            if v is None:
                meta["annotations"].pop(k, None)
            else:
                meta["annotations"][k] = v
        for k, v in (labels or {}).items():
            meta["labels"][k] = v

    async def list_pools(self):
        return list(self.pools)

    async def node_event(self, node, reason, message, type_="Normal"):
        self.events.append((reason, type_, message))


class FakeKubelet(pb2_grpc.RegistrationServicer):
    """The kubelet's side: accepts registrations and remembers them. With ``refuse``, it refuses
    the first ``refuse_times`` attempts (every attempt if None) with that message, counting them."""

    def __init__(self, refuse: str = "", refuse_times: int | None = None):
        self.requests: list[pb2.RegisterRequest] = []
        self.refuse, self.refuse_times = refuse, refuse_times
        self.refusals = 0
        self.registered = asyncio.Event()

    async def Register(self, request, context):
        if self.refuse and (self.refuse_times is None or self.refusals < self.refuse_times):
            self.refusals += 1
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.refuse)
        self.requests.append(request)
        self.registered.set()
        return pb2.Empty()


@contextlib.asynccontextmanager
async def kubelet(sock_dir: Path, refuse: str = "", refuse_times: int | None = None):
    fk = FakeKubelet(refuse, refuse_times)
    server = aio.server()
    pb2_grpc.add_RegistrationServicer_to_server(fk, server)
    server.add_insecure_port(f"unix://{sock_dir / 'kubelet.sock'}")
    await server.start()
    try:
        yield fk
    finally:
        await server.stop(0)
        with contextlib.suppress(FileNotFoundError):
            (sock_dir / "kubelet.sock").unlink()
