"""Fuzzing the scheduler extender's inputs (hypothesis).

* ``parse_args`` / ``parse_binding`` on any JSON value: a result or :class:`ProtocolError`
  naming what is wrong, nothing else;
* the aiohttp app (``Extender.app()``) over HTTP with a fake state (three simulated nodes,
  one pool) and a fake API (``kvgpu.kube`` calls patched): random bytes, invalid JSON,
  JSON of the wrong shape, and well-formed requests carrying random pods, for ``filter``,
  ``prioritize`` and ``bind``. Every answer is JSON with the shape kube-scheduler expects or
  an ``error`` string; never a 500, never an exception out of the handler; a failed bind leaves
  nothing reserved in the ledger.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from kvgpu import kube
from kvgpu.extender.protocol import ProtocolError, parse_args, parse_binding

from tests.unit.extender_helpers import NODES, UID, Harness, copy_json
from tests.unit.test_fuzz_admission import broken_pods, json_any, pods, valid_pods

FUZZ = settings(max_examples=250, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


# ----------------------------------------------------------------------------- pure parsers
@FUZZ
@given(doc=json_any)
def test_parse_args_any_json(doc: Any) -> None:
    try:
        args = parse_args(doc)
    except ProtocolError as e:
        assert str(e).startswith("extender args"), str(e)
        return
    assert isinstance(args.pod, dict) and isinstance(args.pod["metadata"], dict)
    assert all(isinstance(n, str) for n in args.node_names)


@FUZZ
@given(pod=st.one_of(pods(), broken_pods(), json_any),
       names=st.one_of(st.none(), st.lists(st.text(max_size=6), max_size=4), json_any),
       nodes=st.one_of(st.none(), json_any, st.fixed_dictionaries({"items": st.lists(json_any, max_size=3)})))
def test_parse_args_shaped_json(pod: Any, names: Any, nodes: Any) -> None:
    doc: dict[str, Any] = {"pod": pod}
    if names is not None:
        doc["nodenames"] = names
    if nodes is not None:
        doc["nodes"] = nodes
    try:
        parse_args(doc)
    except ProtocolError as e:
        assert "extender args" in str(e)


@FUZZ
@given(doc=st.one_of(json_any, st.fixed_dictionaries({}, optional={
    "podName": json_any, "podNamespace": json_any, "podUID": json_any, "node": json_any,
    "PodName": json_any})))
def test_parse_binding_any_json(doc: Any) -> None:
    try:
        b = parse_binding(doc)
    except ProtocolError as e:
        assert str(e).startswith("binding args"), str(e)
        return
    assert all(isinstance(v, str) and v for v in (b.pod_name, b.pod_namespace, b.pod_uid, b.node))


# ----------------------------------------------------------------------------- the HTTP app
def _check_filter(status: int, data: Any) -> None:
    assert status == 200, (status, data)
    assert isinstance(data, dict), data
    if "error" in data and not data.get("nodenames"):
        assert isinstance(data["error"], str) and data["error"].strip()
        return
    assert isinstance(data.get("nodenames"), list)
    assert isinstance(data.get("failedAndUnresolvableNodes", {}), dict)
    for reason in data.get("failedAndUnresolvableNodes", {}).values():
        assert isinstance(reason, str) and reason.strip()


def _check_prioritize(status: int, data: Any) -> None:
    assert status in (200, 400), (status, data)
    if status == 400 or isinstance(data, dict):
        assert isinstance(data, dict) and isinstance(data.get("error"), str) and data["error"].strip()
        return
    assert isinstance(data, list)
    for h in data:
        assert set(h) == {"host", "score"} and 0 <= h["score"] <= 10


raw_bodies = st.one_of(
    st.binary(max_size=200),
    st.text(max_size=100).map(str.encode),
    json_any.map(lambda x: json.dumps(x).encode()),
    st.sampled_from([b"", b"{", b"null", b"[]", b'{"pod": null}', b'{"pod": {"metadata": 1}}',
                     b'{"nodenames": "n0"}', b"\xff\xfe", b'{"pod": {"metadata": {}}, "nodenames": [1]}']),
)


@FUZZ
@given(body=raw_bodies, verb=st.sampled_from(["filter", "prioritize", "bind"]))
def test_http_garbage(harness: Harness, body: bytes, verb: str) -> None:
    status, data = harness.post(verb, body)
    if verb == "filter":
        _check_filter(status, data)
    elif verb == "prioritize":
        _check_prioritize(status, data)
    else:
        assert status == 200 and isinstance(data, dict) and isinstance(data.get("error"), str), (status, data)


def _with_uid(pod: Any) -> Any:
    if isinstance(pod, dict) and isinstance(pod.get("metadata"), dict):
        pod["metadata"].setdefault("uid", UID)
    return pod


@FUZZ
@given(pod=st.one_of(pods(), valid_pods(), broken_pods()),
       names=st.lists(st.sampled_from([*NODES, "unknown", ""]), max_size=5))
def test_http_filter_and_prioritize_random_pods(harness: Harness, pod: Any, names: list[str]) -> None:
    body = json.dumps({"pod": _with_uid(pod), "nodenames": names}).encode()
    status, data = harness.post("filter", body)
    _check_filter(status, data)
    if isinstance(data, dict) and isinstance(data.get("nodenames"), list):
        got, failed = set(data["nodenames"]), set(data.get("failedAndUnresolvableNodes", {}))
        assert got <= set(names)
        # every known node passes or has its reason, except that a GPU pod gets only the best
        # of the nodes that fit (kvgpu.extender.choice)
        assert got | failed >= {n for n in names if n in NODES} or len(got) == 1 or data.get("error")
    _check_prioritize(*harness.post("prioritize", body))


@FUZZ
@given(pod=st.one_of(pods(), valid_pods()), node=st.sampled_from([*NODES, "unknown"]),
       bound_to=st.sampled_from([None, "n0", "n1"]), same_uid=st.booleans(),
       fail_binding=st.booleans(), via_filter=st.booleans())
def test_http_bind_random_pods(harness: Harness, pod: dict[str, Any], node: str, bound_to: str | None,
                               same_uid: bool, fail_binding: bool, via_filter: bool) -> None:
    """Bind a random pod (optionally after filter cached its request); success books exactly
    the claims of that pod; any failure leaves no reservation behind. The live pod is
    well-formed (the API server validates pods); its annotations and limits are random."""
    harness.state.release_pod(UID)
    before = dict(harness.state.ledger.reservations())
    pod = _with_uid(pod)
    if via_filter and isinstance(pod, dict):
        harness.post("filter", json.dumps({"pod": pod, "nodenames": NODES}).encode())
    live = copy_json(pod)
    if isinstance(live, dict):
        if isinstance(live.get("metadata"), dict) and not same_uid:
            live["metadata"]["uid"] = "another-uid"
        if bound_to and isinstance(live.get("spec"), dict):
            live["spec"]["nodeName"] = bound_to
    harness.fake.pod = live
    harness.fake.fail_binding = fail_binding
    args = {"podName": "p", "podNamespace": "ns", "podUID": UID, "node": node}
    status, data = harness.post("bind", json.dumps(args).encode())
    assert status == 200 and isinstance(data, dict), (status, data)
    after = harness.state.ledger.reservations()
    if data.get("error"):
        event("bind refused")
        assert isinstance(data["error"], str) and data["error"].strip()
        assert after == before, "a failed bind left reservations"
    else:
        event("bind succeeded")
        new = {k: v for k, v in after.items() if k not in before}
        assert all(v.pod_uid == UID and v.node == node for v in new.values())
    harness.state.release_pod(UID)  # the next example starts from an empty ledger


# ----------------------------------------------------------------------------- regressions
# Found by the scale bench and the chaos tests; pinned here with the same fake API.
def _gpu_pod(uid: str = UID, mem: str = "3000") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "namespace": "ns", "uid": uid, "annotations": {"kvgpu.io/gpumem": mem},
                         "labels": {"kvgpu.io/managed": "true"}},
            "spec": {"containers": [{"name": "main", "image": "x"}]}}


def _bind_args(node: str) -> bytes:
    return json.dumps({"podName": "p", "podNamespace": "ns", "podUID": UID, "node": node}).encode()


def test_bind_reserves_before_its_first_api_call(harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """While bind waits for the API, the cards it will take are already out of filter's view
    (before: a burst piled onto one node and most of its binds failed). After filter, bind does
    not read the pod at all: its first call creates the claim."""
    pod = _gpu_pod(mem="20000")  # a whole card of n0's two
    harness.post("filter", json.dumps({"pod": pod, "nodenames": ["n0"]}).encode())
    seen: list[str | None] = []
    reads: list[str] = []

    async def create_claim(api: Any, ns: str, body: dict[str, Any]) -> None:
        seen.append(harness.state.ledger.pod_node(UID))

    async def get_pod(api: Any, ns: str, name: str) -> Any:
        reads.append(name)
        return copy_json(pod)

    monkeypatch.setattr(kube, "create_claim", create_claim)
    monkeypatch.setattr(kube, "get_pod", get_pod)
    status, data = harness.post("bind", _bind_args("n0"))
    assert (status, data) == (200, {}), data
    assert seen == ["n0"], "the reservation was not made before the claim was created"
    assert reads == [], "bind read the pod although filter had just parsed it"


def test_bind_after_filter_reads_the_pod_when_its_claim_exists(harness: Harness,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The unread path meets an existing claim (the pod was bound by an earlier attempt): it
    reads the pod, and a pod bound to another node is refused with nothing left reserved."""
    from kubernetes_asyncio.client.exceptions import ApiException

    pod = _gpu_pod()
    harness.post("filter", json.dumps({"pod": pod, "nodenames": ["n0"]}).encode())
    bound = copy_json(pod)
    bound["spec"]["nodeName"] = "n1"

    async def create_claim(api: Any, ns: str, body: dict[str, Any]) -> None:
        raise ApiException(status=409, reason="AlreadyExists")

    async def get_pod(api: Any, ns: str, name: str) -> Any:
        return copy_json(bound)

    monkeypatch.setattr(kube, "create_claim", create_claim)
    monkeypatch.setattr(kube, "get_pod", get_pod)
    status, data = harness.post("bind", _bind_args("n0"))
    assert status == 200 and "already bound to n1" in data.get("error", ""), data
    assert harness.state.ledger.pod_node(UID) is None


def test_bind_replaces_a_stale_claim_of_the_same_pod(harness: Harness,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """An operator killed mid-bind leaves a claim towards n1 for an unbound pod; the retry
    towards n0 replaces it instead of failing for ever."""
    from kubernetes_asyncio.client.exceptions import ApiException

    harness.fake.pod = _gpu_pod()
    stale = {"metadata": {"name": "p-main-11111", "namespace": "ns"},
             "spec": {"podUID": UID, "node": "n1", "podName": "p"}}
    calls = {"create": 0}

    async def create_claim(api: Any, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        calls["create"] += 1
        if calls["create"] == 1:
            raise ApiException(status=409, reason="AlreadyExists")
        return body

    async def get_claim(api: Any, ns: str, name: str) -> Any:
        return stale

    monkeypatch.setattr(kube, "create_claim", create_claim)
    monkeypatch.setattr(kube, "get_claim", get_claim)
    status, data = harness.post("bind", _bind_args("n0"))
    assert (status, data) == (200, {}), data
    assert "delete_claim" in harness.fake.calls and calls["create"] == 2
    assert harness.state.ledger.pod_node(UID) == "n0"


def test_retried_bind_of_a_bound_pod_fails_fast_and_keeps_the_first(harness: Harness) -> None:
    """kube-scheduler retries a bind that timed out; the first attempt had completed: the
    retry towards another node is refused without touching the first reservation."""
    harness.fake.pod = _gpu_pod()
    assert harness.post("bind", _bind_args("n0")) == (200, {})
    before = len(harness.fake.calls)
    harness.fake.pod = {**_gpu_pod(), "spec": {**_gpu_pod()["spec"], "nodeName": "n0"}}
    _, data = harness.post("bind", _bind_args("n1"))
    assert "already bound to n0" in data.get("error", ""), data
    assert len(harness.fake.calls) == before, "the retry made API calls"
    assert harness.state.ledger.pod_node(UID) == "n0"


def test_concurrent_binds_of_one_pod_run_one_at_a_time(harness: Harness,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    harness.fake.pod = _gpu_pod()
    inside = {"now": 0, "max": 0}
    real_get_pod = harness.fake.get_pod

    async def get_pod(api: Any, ns: str, name: str) -> Any:
        inside["now"] += 1
        inside["max"] = max(inside["max"], inside["now"])
        await asyncio.sleep(0.05)
        inside["now"] -= 1
        return await real_get_pod(api, ns, name)

    monkeypatch.setattr(kube, "get_pod", get_pod)

    async def both() -> list[Any]:
        async def one(node: str) -> Any:
            r = await harness.client.post("/scheduler/bind", data=_bind_args(node))
            return await r.json()
        return list(await asyncio.gather(one("n0"), one("n1")))

    results = harness.loop.run_until_complete(both())
    assert inside["max"] == 1, "two binds of the same pod ran at once"
    assert sum(1 for r in results if not r.get("error")) == 1, results
    assert harness.state.ledger.pod_node(UID) in ("n0", "n1")
    assert len(harness.state.ledger.pod_keys(UID)) == 1


def test_bind_restores_a_replaced_claim_when_the_pod_was_bound_after_all(
        harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """An attempt cut short (operator killed) left a claim towards n1 and its Binding landed
    late. The retry towards n0 judged the claim stale and replaced it, then its own Binding
    failed: it puts the n1 claim back and holds it in the ledger, and the old object's DELETED
    event, still in the claims watch, does not free it."""
    from kubernetes_asyncio.client.exceptions import ApiException
    from kvgpu.api.requests import parse_pod
    from kvgpu.core.requests import PodRequest
    from kvgpu.extender.binder import claim_body
    from kvgpu.runtime import OperatorConfig, Runtime

    pod = _gpu_pod()
    harness.fake.pod = copy_json(pod)
    parsed = parse_pod(pod)
    assert parsed is not None
    req = PodRequest("ns", "p", UID, parsed.containers, parsed.node_policy, parsed.gpu_policy)
    old = claim_body(pod, harness.state.ledger.allocate(req, "n1"), "main")
    old["metadata"]["uid"] = "old-claim-uid"
    created: list[str] = []

    async def create_claim(api: Any, ns: str, body: dict[str, Any]) -> str:
        created.append(body["spec"]["node"])
        if len(created) == 1:
            raise ApiException(status=409, reason="AlreadyExists")
        return f"claim-uid-{len(created)}"  # each created object its own UID

    async def get_claim(api: Any, ns: str, name: str) -> Any:
        return copy_json(old)

    async def create_binding(api: Any, ns: str, name: str, uid: str, node: str,
                             annotations: dict[str, str] | None = None) -> None:
        harness.fake.pod["spec"]["nodeName"] = "n1"  # the earlier attempt's Binding landed
        raise ApiException(status=409, reason="Conflict")

    monkeypatch.setattr(kube, "create_claim", create_claim)
    monkeypatch.setattr(kube, "get_claim", get_claim)
    monkeypatch.setattr(kube, "create_binding", create_binding)
    status, data = harness.post("bind", _bind_args("n0"))
    assert status == 200 and data.get("error"), data
    assert created == ["n0", "n0", "n1"], "replaced towards n0, then the n1 claim created again"
    assert harness.state.ledger.pod_node(UID) == "n1"

    rt = Runtime(OperatorConfig())
    rt.state = harness.state
    rt.on_claim("DELETED", copy_json(old))  # the replaced object's deletion arrives late
    assert harness.state.ledger.pod_node(UID) == "n1", "a stale DELETED freed the restored claim"
    again = copy_json(old)
    again["metadata"]["uid"] = "claim-uid-3"  # the restored object
    rt.on_claim("DELETED", again)  # the restored claim's own deletion does free it
    assert harness.state.ledger.pod_node(UID) is None
