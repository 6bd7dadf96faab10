"""The PodResources client against an in-process fake of the kubelet's PodResourcesLister
(unix-socket gRPC, this process). The real kubelet is exercised by tests/realnode."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

import grpc
import pytest
from grpc import aio
from kvgpu.agent.podidentity import KubeletPod
from kvgpu.agent.podresources import PodResourcesClient, PodResourcesError
from kvgpu.agent.proto import pr_pb2, pr_pb2_grpc

GPU = "nvidia.com/gpu"


class FakeLister(pr_pb2_grpc.PodResourcesListerServicer):
    def __init__(self, get_disabled: bool = False, refuse_lists: int = 0):
        self.get_disabled = get_disabled
        self.refuse_lists = refuse_lists  # the kubelet's rate limit: refuse this many List calls first
        self.gets = 0
        self.lists = 0
        self.pods = [
            pr_pb2.PodResources(
                name="run",
                namespace="default",
                containers=[
                    pr_pb2.ContainerResources(
                        name="a", devices=[pr_pb2.ContainerDevices(resource_name=GPU, device_ids=["GPU-1::0"])]
                    ),
                    pr_pb2.ContainerResources(
                        name="other", devices=[pr_pb2.ContainerDevices(resource_name="x.io/y", device_ids=["1"])]
                    ),
                    pr_pb2.ContainerResources(name="b"),
                ],
            ),
            pr_pb2.PodResources(name="new", namespace="default", containers=[pr_pb2.ContainerResources(name="m")]),
        ]

    async def Get(self, request, context):
        self.gets += 1
        if self.get_disabled:
            await context.abort(grpc.StatusCode.UNKNOWN, "PodResources API Get method disabled")
        for p in self.pods:
            if (p.namespace, p.name) == (request.pod_namespace, request.pod_name):
                return pr_pb2.GetPodResourcesResponse(pod_resources=p)
        # What the kubelet answers (a plain Go error: UNKNOWN).
        await context.abort(
            grpc.StatusCode.UNKNOWN, f"pod {request.pod_name} in namespace {request.pod_namespace} not found"
        )

    async def List(self, request, context):
        self.lists += 1
        if self.lists <= self.refuse_lists:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "rejected by rate limit")
        return pr_pb2.ListPodResourcesResponse(pod_resources=self.pods)


@contextlib.asynccontextmanager
async def lister(**kw):
    d = Path(tempfile.mkdtemp(prefix="kpr", dir="/tmp"))
    fake = FakeLister(**kw)
    server = aio.server()
    pr_pb2_grpc.add_PodResourcesListerServicer_to_server(fake, server)
    server.add_insecure_port(f"unix://{d / 'kubelet.sock'}")
    await server.start()
    try:
        yield fake, str(d / "kubelet.sock")
    finally:
        await server.stop(0)
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("get_disabled", [False, True])
async def test_lookup_get_and_list_fallback(get_disabled):
    async with lister(get_disabled=get_disabled) as (fake, sock):
        c = PodResourcesClient(GPU, sock)
        try:
            assert await c.lookup("default", "run") == KubeletPod(frozenset({"a"}))
            assert await c.lookup("default", "new") == KubeletPod()
            assert await c.lookup("default", "nope") is None
            assert c.use_list is get_disabled
            assert fake.gets == (1 if get_disabled else 3)
        finally:
            await c.close()


async def test_unreachable_kubelet_raises(tmp_path):
    c = PodResourcesClient(GPU, str(tmp_path / "none.sock"), timeout_s=0.5)
    with pytest.raises(PodResourcesError):
        await c.lookup("default", "x")
    await c.close()


async def test_lookup_many_is_one_list_call():
    async with lister() as (fake, sock):
        c = PodResourcesClient(GPU, sock)
        try:
            got = await c.lookup_many([("default", "run"), ("default", "new"), ("default", "nope")])
            assert got == {("default", "run"): KubeletPod(frozenset({"a"})), ("default", "new"): KubeletPod(),
                           ("default", "nope"): None}
            assert (fake.lists, fake.gets) == (1, 0)
        finally:
            await c.close()


async def test_lookup_many_waits_out_the_kubelets_rate_limit():
    async with lister(refuse_lists=3) as (fake, sock):
        c = PodResourcesClient(GPU, sock)
        try:
            assert (await c.lookup_many([("default", "run")]))[("default", "run")] == KubeletPod(frozenset({"a"}))
            assert fake.lists == 4
        finally:
            await c.close()
    async with lister(refuse_lists=1000) as (fake, sock):
        c = PodResourcesClient(GPU, sock, retry_s=0.3)
        try:
            with pytest.raises(PodResourcesError, match="RESOURCE_EXHAUSTED"):
                await c.lookup_many([("default", "run")])
        finally:
            await c.close()
