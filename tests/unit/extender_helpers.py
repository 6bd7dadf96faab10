"""The scheduler extender's aiohttp app on a fake state and a fake API, for unit tests
(fixture ``harness`` in conftest.py): three simulated nodes (``NODES``, 2 cards x 20,000 MiB),
one pool (split 4), the ``kvgpu.kube`` calls the extender makes patched to :class:`FakeKube`."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from kvgpu import kube
from kvgpu.core.inventory import SimulatedCardSpec, SimulatedNode
from kvgpu.devcluster.fakenodes import node_manifest
from kvgpu.extender.server import Extender
from kvgpu.metrics import OperatorMetrics
from kvgpu.reconcile.state import OperatorState

NODES = ["n0", "n1", "n2"]
UID = "11111111-2222-3333-4444-555555555555"


class FakeKube:
    """Stands in for the API: ``get_pod`` answers the pod under test; writes are recorded."""

    def __init__(self) -> None:
        self.pod: Any = None
        self.calls: list[str] = []
        self.fail_binding = False
        self.binding_annotations: dict[str, str] | None = None

    async def get_pod(self, api: Any, ns: str, name: str) -> Any:
        self.calls.append("get_pod")
        return copy_json(self.pod)

    async def create_claim(self, api: Any, ns: str, body: dict[str, Any]) -> str:
        self.calls.append("create_claim")
        return f"uid-of-{body['metadata']['name']}"

    async def get_claim(self, api: Any, ns: str, name: str) -> None:
        return None

    async def delete_claim(self, api: Any, ns: str, name: str) -> bool:
        self.calls.append("delete_claim")
        return True

    async def patch_pod_metadata(self, api: Any, ns: str, name: str, *, annotations: Any) -> dict[str, Any]:
        self.calls.append("patch_pod")
        return {}

    async def create_binding(self, api: Any, ns: str, name: str, uid: str, node: str,
                             annotations: dict[str, str] | None = None) -> None:
        self.calls.append("binding")
        self.binding_annotations = annotations
        if self.fail_binding:
            from kubernetes_asyncio.client.exceptions import ApiException

            raise ApiException(status=409, reason="Conflict")

    async def patch_claim_status(self, api: Any, ns: str, name: str, status: Any) -> dict[str, Any]:
        return {}

    async def post_event(self, api: Any, obj: Any, **kw: Any) -> None:
        return None


def copy_json(x: Any) -> Any:
    return json.loads(json.dumps(x)) if x is not None else None


def make_state() -> OperatorState:
    st_ = OperatorState()
    st_.set_pool({"apiVersion": "kvgpu.io/v1alpha1", "kind": "VGPUPool", "metadata": {"name": "default"},
                  "spec": {"nodeSelector": {"matchLabels": {"kvgpu.io/gpu-node": "true"}}, "splitCount": 4}})
    for n in NODES:
        st_.set_node(node_manifest(SimulatedNode(n, (SimulatedCardSpec(memory_mib=20000, count=2),))))
    st_.ready = True
    return st_


class Harness:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fake = FakeKube()
        for name in ("get_pod", "create_claim", "get_claim", "delete_claim", "patch_pod_metadata",
                     "create_binding", "patch_claim_status", "post_event"):
            monkeypatch.setattr(kube, name, getattr(self.fake, name))
        self.state = make_state()
        self.ext = Extender(self.state, api=None, metrics=OperatorMetrics())
        self.loop = asyncio.new_event_loop()
        self.client = TestClient(TestServer(self.ext.app()), loop=self.loop)
        self.loop.run_until_complete(self.client.start_server())

    def post(self, verb: str, body: bytes) -> tuple[int, Any]:
        async def go() -> tuple[int, Any]:
            r = await self.client.post(f"/scheduler/{verb}", data=body,
                                       headers={"Content-Type": "application/json"})
            text = await r.text()
            try:
                return r.status, json.loads(text)
            except ValueError:
                return r.status, text

        return self.loop.run_until_complete(go())

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())
        self.loop.run_until_complete(asyncio.sleep(0))
        self.loop.close()
