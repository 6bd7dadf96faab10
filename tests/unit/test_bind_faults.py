"""Bind under faults (binder + Runtime.on_claim): afterwards the ledger holds exactly what the
claims say. Found by a review that tried to break today's code; each failed before its fix."""

from __future__ import annotations

import asyncio
import copy
import itertools
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio.client.exceptions import ApiException
from kvgpu import kube
from kvgpu.extender.binder import Binder
from kvgpu.extender.protocol import BindingArgs
from kvgpu.reconcile.state import allocation_from_claim
from kvgpu.runtime import OperatorConfig, Runtime

from tests.unit.extender_helpers import make_state

UID = "aaaaaaaa-2222-3333-4444-555555555555"


def gpu_pod(name: str = "p", uid: str = UID, mem: str = "15000") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "ns", "uid": uid, "labels": {"kvgpu.io/managed": "true"}},
            "spec": {"schedulerName": "kvgpu-scheduler", "containers": [
                {"name": "main", "image": "x", "resources": {"limits": {
                    "nvidia.com/gpu": 1, "nvidia.com/gpumem": mem}}}]}}


class FakeApi:
    """An in-memory API server: pods and claims by name; a Binding sets nodeName."""

    def __init__(self) -> None:
        self.pods: dict[str, dict[str, Any]] = {}
        self.claims: dict[str, dict[str, Any]] = {}
        self.binding_error: BaseException | None = None
        self.binding_lands = True
        self.events: list[tuple[str, dict[str, Any]]] = []  # the claim watch stream
        self._uids = itertools.count(1)

    async def get_pod(self, api: Any, ns: str, name: str) -> Any:
        await asyncio.sleep(0)
        return copy.deepcopy(self.pods.get(name))

    async def create_claim(self, api: Any, ns: str, body: dict[str, Any]) -> str:
        await asyncio.sleep(0)
        name = body["metadata"]["name"]
        if name in self.claims:
            raise ApiException(status=409, reason="AlreadyExists")
        obj = copy.deepcopy(body)
        obj["metadata"]["uid"] = f"claim-uid-{next(self._uids)}"  # each object its own, as the API server does
        self.claims[name] = obj
        self.events.append(("ADDED", copy.deepcopy(obj)))
        return str(obj["metadata"]["uid"])

    async def get_claim(self, api: Any, ns: str, name: str) -> Any:
        await asyncio.sleep(0)
        return copy.deepcopy(self.claims.get(name))

    async def delete_claim(self, api: Any, ns: str, name: str) -> bool:
        await asyncio.sleep(0)
        old = self.claims.pop(name, None)
        if old is not None:
            self.events.append(("DELETED", old))
        return old is not None

    async def create_binding(self, api: Any, ns: str, name: str, uid: str, node: str,
                             annotations: dict[str, str] | None = None) -> None:
        await asyncio.sleep(0)
        if self.binding_lands:
            pod = self.pods[name]
            pod["spec"]["nodeName"] = node
            pod["metadata"].setdefault("annotations", {}).update(annotations or {})
        if self.binding_error is not None:
            raise self.binding_error


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeApi:
    f = FakeApi()
    for n in ("get_pod", "create_claim", "get_claim", "delete_claim", "create_binding"):
        monkeypatch.setattr(kube, n, getattr(f, n))
    return f


def _ledger_matches_claims(state: Any, claims: dict[str, dict[str, Any]]) -> None:
    for c in claims.values():
        key, alloc = allocation_from_claim(c)
        assert state.ledger.reservation(key) == alloc, f"ledger {state.ledger.reservation(key)} != claim {alloc}"


def test_connection_cut_on_a_binding_that_landed_keeps_the_reservation(fake: FakeApi) -> None:
    """aiohttp.ServerDisconnectedError (a ClientError, not an OSError) from create_binding: the
    bind still asks whether the Binding landed; it did, so the pod is bound and held (before:
    released, and another pod could get the same memory)."""
    state = make_state()
    fake.pods["p"] = gpu_pod()
    fake.binding_error = aiohttp.ServerDisconnectedError()
    b = Binder(state, api=None)
    err = asyncio.run(b.bind(BindingArgs("p", "ns", UID, "n0")))
    assert err == "", err  # the Binding landed: a success
    assert fake.pods["p"]["spec"].get("nodeName") == "n0"
    assert state.ledger.pod_node(UID) == "n0", "bound pod's reservation released"
    _ledger_matches_claims(state, fake.claims)


def test_a_retry_does_not_keep_a_leftover_claim_naming_other_cards(fake: FakeApi) -> None:
    """A connection cut, the Binding did not land, and the claim's delete failed too (left
    behind). Another pod takes that card meanwhile; the retry onto the same node gets another
    card and finds the leftover claim (same pod, same node, other card): it replaces it, so the
    ledger, the claim and the pod's annotations agree (before: kept as is — a leak when the pod
    ends, an over-allocation after a restart)."""
    state = make_state()
    fake.pods["p"] = gpu_pod()
    fake.binding_error = aiohttp.ServerDisconnectedError()
    fake.binding_lands = False
    real_delete = fake.delete_claim

    async def delete_fails(api: Any, ns: str, name: str) -> bool:
        raise aiohttp.ServerDisconnectedError()

    kube.delete_claim = delete_fails  # type: ignore[assignment]  # (restored by the fixture's monkeypatch)
    b = Binder(state, api=None)
    assert asyncio.run(b.bind(BindingArgs("p", "ns", UID, "n0")))
    kube.delete_claim = real_delete  # type: ignore[assignment]
    assert list(fake.claims), "the failed attempt's claim was left behind"
    first_dev = next(iter(fake.claims.values()))["spec"]["devices"][0]["uuid"]
    # Another pod takes that card (15000 of 20000 MiB) before the retry.
    fake.pods["q"] = gpu_pod("q", uid="bbbbbbbb-0000-0000-0000-000000000000")
    fake.binding_error = None
    fake.binding_lands = True
    assert asyncio.run(b.bind(BindingArgs("q", "ns", "bbbbbbbb-0000-0000-0000-000000000000", "n0"))) == ""
    q_dev = next(c for n, c in fake.claims.items() if n.startswith("q-"))["spec"]["devices"][0]["uuid"]
    assert q_dev == first_dev
    assert asyncio.run(b.bind(BindingArgs("p", "ns", UID, "n0"))) == ""
    ann = fake.pods["p"]["metadata"]["annotations"]
    p_claim = next(c for n, c in fake.claims.items() if n.startswith("p-"))
    assert ann["kvgpu.io/devices.main"] == p_claim["spec"]["devices"][0]["uuid"] != first_dev
    _ledger_matches_claims(state, fake.claims)


def test_a_late_deleted_event_of_an_earlier_claim_frees_nothing(fake: FakeApi) -> None:
    """Bind attempt 1 creates claim C, its Binding fails (500, did not land) and it deletes C;
    the retry onto the same node gets the same card and creates C again, identical but a new
    object. Attempt 1's DELETED arriving late must not free the bound pod's reservation: the
    operator knows which object (UID) holds the key."""
    rt = Runtime(OperatorConfig())
    rt.state = make_state()
    fake.pods["p"] = gpu_pod()
    fake.binding_error = ApiException(status=500, reason="etcd timeout")
    fake.binding_lands = False
    b = Binder(rt.state, api=None)
    assert asyncio.run(b.bind(BindingArgs("p", "ns", UID, "n0")))
    fake.binding_error = None
    fake.binding_lands = True
    assert asyncio.run(b.bind(BindingArgs("p", "ns", UID, "n0"))) == ""
    assert fake.pods["p"]["spec"]["nodeName"] == "n0"
    _ledger_matches_claims(rt.state, fake.claims)  # holds here
    # The watch stream (in order) arrives late: ADDED(1), DELETED(1), ADDED(2).
    for etype, obj in fake.events:
        rt.on_claim(etype, obj)
    _ledger_matches_claims(rt.state, fake.claims)
