"""The admission webhooks' dispatch (:func:`kvgpu.admission.handlers.review`, pure) and their HTTP
adapter (:mod:`kvgpu.admission.server`): AdmissionReview v1 in and out, 400 for bodies that are
not reviews, fail closed when a decision raises, and the worker processes serving HTTPS."""

from __future__ import annotations

import base64
import copy
import json
import re
import socket
import ssl
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
from aiohttp.test_utils import TestClient, TestServer
from kvgpu.admission import server as srv
from kvgpu.admission.handlers import MUTATE_ID, REFUSAL_CODE, VALIDATE_ID, VALIDATE_WORKLOADS_ID, Decision, review
from kvgpu.admission.mutate import MANAGED_LABEL
from kvgpu.admission.server import make_app, response_body, start_workers
from kvgpu.core import keys
from kvgpu.devcluster.pki import make_pki
from kvgpu.procs import stop as stop_workers

OPERATOR = "system:serviceaccount:kvgpu-system:kvgpu-operator"
OPS = frozenset({OPERATOR})
SLICED = {"kvgpu.io/gpumem": "3000", "kvgpu.io/gpucores": "30"}


def pod(annotations: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "p", "namespace": "ns", "annotations": dict(annotations or {})},
        "spec": {"containers": [{"name": "main", "image": "cuda"}, {"name": "side", "image": "busybox"}], **spec},
    }


def request(operation: str, obj: dict[str, Any], old: dict[str, Any] | None = None, *, username: str = "alice",
            sub: str | None = None, resource: tuple[str, str] = ("", "pods"), uid: str = "rev-1") -> dict[str, Any]:
    req: dict[str, Any] = {
        "uid": uid, "operation": operation, "object": obj, "oldObject": old,
        "userInfo": {"username": username}, "resource": {"group": resource[0], "version": "v1",
                                                         "resource": resource[1]},
    }
    if sub:
        req["subResource"] = sub
    return req


def admission_review(req: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": req}


def mutated(p: dict[str, Any]) -> dict[str, Any]:
    """``p`` after the mutating webhook, applied by an independent RFC 6902 implementation."""
    d = review(MUTATE_ID, request("CREATE", p), OPS)
    return dict(jsonpatch.apply_patch(p, d.patch))


def edited(p: dict[str, Any], fn: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    p = copy.deepcopy(p)
    fn(p)
    return p


# --------------------------------------------------------------------------- review: mutate


def test_mutate_gpu_pod_create_returns_add_only_ops_that_make_a_kvgpu_pod() -> None:
    p = pod(SLICED)
    d = review(MUTATE_ID, request("CREATE", p), OPS)
    assert d.allowed
    assert d.patch
    assert {op["op"] for op in d.patch} == {"add"}
    out = jsonpatch.apply_patch(p, d.patch)
    assert out["spec"]["schedulerName"] == keys.SCHEDULER_NAME
    assert out["metadata"]["labels"][MANAGED_LABEL] == "true"
    assert p == pod(SLICED)  # the request's object is not modified
    # The mutated pod passes the validating webhook, and mutating it again adds nothing.
    assert review(VALIDATE_ID, request("CREATE", out), OPS) == Decision()
    assert review(MUTATE_ID, request("CREATE", out), OPS).patch == []


@pytest.mark.parametrize("p", [
    pod(),
    pod({"team": "web"}),
], ids=["plain", "other-annotations"])
def test_mutate_leaves_pods_without_a_gpu_request_alone(p: dict[str, Any]) -> None:
    d = review(MUTATE_ID, request("CREATE", p), OPS)
    assert d.allowed
    assert d.patch == []


def _env(name: str) -> Callable[[dict[str, Any]], Any]:
    return lambda q: q["spec"]["containers"][0].update(env=[{"name": name, "value": "0"}])


def _privileged(q: dict[str, Any]) -> None:
    q["spec"]["containers"][0]["securityContext"] = {"privileged": True}


@pytest.mark.parametrize(("p", "needle"), [
    (pod({"kvgpu.io/gpumem": "3Gx"}), "kvgpu.io/gpumem"),
    (edited(pod(SLICED), _env(keys.ENV_CLAIM)), keys.ENV_CLAIM),
    (edited(pod(SLICED), _privileged), "privileged"),
    (pod({**SLICED, keys.POD_NODE: "n1"}), keys.POD_NODE),
    (edited(pod(), lambda q: q["metadata"].update(labels={MANAGED_LABEL: "true"})), MANAGED_LABEL),
    (pod(SLICED, nodeName="n1"), "spec.nodeName"),
], ids=["bad-request", "reserved-env", "privileged", "forged-annotation", "managed-label", "node-name"])
def test_mutate_refuses_at_create_what_validation_refuses(p: dict[str, Any], needle: str) -> None:
    """A pod CREATE costs one webhook call: the mutating webhook makes the validating webhook's
    CREATE checks itself, on the pod as its injection leaves it, with the same message."""
    d = review(MUTATE_ID, request("CREATE", p), OPS)
    assert not d.allowed and d.patch == []
    assert needle in d.message
    out = dict(jsonpatch.apply_patch(p, _ops(p)))
    assert d.message == review(VALIDATE_ID, request("CREATE", out), OPS).message


def _ops(p: dict[str, Any]) -> list[dict[str, Any]]:
    from kvgpu.admission.mutate import mutate_pod

    return mutate_pod(p)


def test_mutate_warns_like_validation_did() -> None:
    d = review(MUTATE_ID, request("CREATE", pod({**SLICED, "kvgpu.io/team": "web"})), OPS)
    assert d.allowed and d.patch
    assert any("kvgpu.io/team" in w for w in d.warnings)


def test_mutate_only_acts_on_create_and_debug_containers() -> None:
    p = mutated(pod(SLICED))
    # A plain UPDATE, or another subresource, is never mutated.
    assert review(MUTATE_ID, request("UPDATE", p, p), OPS).patch == []
    assert review(MUTATE_ID, request("UPDATE", p, p, sub="status"), OPS).patch == []
    # kubectl debug on a GPU pod: the debug container gets NVIDIA_VISIBLE_DEVICES=none.
    dbg = edited(p, lambda q: q["spec"].update(ephemeralContainers=[{"name": "dbg", "image": "cuda"}]))
    d = review(MUTATE_ID, request("UPDATE", dbg, p, sub="ephemeralcontainers"), OPS)
    out = jsonpatch.apply_patch(dbg, d.patch)
    assert out["spec"]["ephemeralContainers"][0]["env"] == [{"name": keys.ENV_VISIBLE, "value": "none"}]


# --------------------------------------------------------------------------- review: validate pods


def test_validate_refuses_a_bad_gpumem_naming_the_key() -> None:
    d = review(VALIDATE_ID, request("CREATE", mutated(pod({"kvgpu.io/gpumem": "3Gx"}))), OPS)
    assert not d.allowed
    assert d.code == REFUSAL_CODE
    assert "kvgpu.io/gpumem" in d.message
    assert '"3Gx"' in d.message
    assert d.patch == []


def test_validate_reports_every_problem_in_one_message() -> None:
    d = review(VALIDATE_ID, request("CREATE", pod({"kvgpu.io/gpumem": "3Gx", "kvgpu.io/gpucores": "130"})), OPS)
    assert not d.allowed
    assert "kvgpu.io/gpumem" in d.message and "kvgpu.io/gpucores" in d.message
    m = re.match(r"(\d+) problems: \(1\) ", d.message)
    assert m is not None, d.message
    count = int(m.group(1))
    assert count >= 2
    assert f"; ({count}) " in d.message and f"({count + 1})" not in d.message


def test_validate_allows_plain_pods() -> None:
    assert review(VALIDATE_ID, request("CREATE", pod()), OPS) == Decision()


BOUND = edited(mutated(pod(SLICED)), lambda p: p["metadata"]["annotations"].update({
    keys.POD_NODE: "n1", keys.claim_annotation("main"): "v1;x", keys.devices_annotation("main"): "GPU-a"}))


@pytest.mark.parametrize("change", [
    lambda p: p["metadata"]["annotations"].update({keys.devices_annotation("main"): "GPU-b"}),
    lambda p: p["metadata"]["annotations"].pop(keys.claim_annotation("main")),
    lambda p: p["metadata"]["annotations"].update({keys.POD_NODE: "n2"}),
], ids=["change-devices", "remove-claim", "change-node"])
def test_only_the_operator_changes_allocation_annotations(change: Callable[[dict[str, Any]], Any]) -> None:
    new = edited(BOUND, change)
    by_user = review(VALIDATE_ID, request("UPDATE", new, BOUND, username="alice"), OPS)
    assert not by_user.allowed
    assert "operator" in by_user.message
    assert review(VALIDATE_ID, request("UPDATE", new, BOUND, username=OPERATOR), OPS).allowed
    # The username must be one of the operator's, not merely look like one.
    other_sa = "system:serviceaccount:kvgpu-system:someone-else"
    assert not review(VALIDATE_ID, request("UPDATE", new, BOUND, username=other_sa), OPS).allowed
    # Nobody is the operator when no operator usernames are configured.
    assert not review(VALIDATE_ID, request("UPDATE", new, BOUND, username=OPERATOR), ()).allowed


def test_a_users_other_updates_are_allowed() -> None:
    new = edited(BOUND, lambda p: p["metadata"]["labels"].update({"team": "ml"}))
    assert review(VALIDATE_ID, request("UPDATE", new, BOUND, username="alice"), OPS).allowed


# --------------------------------------------------------------------------- review: workloads


def deployment(annotations: dict[str, str]) -> dict[str, Any]:
    tpl = pod(annotations)
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d", "namespace": "ns"},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "d"}},
                     "template": {"metadata": {"labels": {"app": "d"}, "annotations": annotations},
                                  "spec": tpl["spec"]}}}


def test_workload_with_a_bad_template_is_refused() -> None:
    bad = deployment({"kvgpu.io/gpumem": "3Gx"})
    d = review(VALIDATE_WORKLOADS_ID, request("CREATE", bad, resource=("apps", "deployments")), OPS)
    assert not d.allowed
    assert "kvgpu.io/gpumem" in d.message
    assert "pod template" in d.message
    good = deployment(SLICED)
    assert review(VALIDATE_WORKLOADS_ID, request("CREATE", good, resource=("apps", "deployments")), OPS).allowed


@pytest.mark.parametrize("resource", [("example.com", "widgets"), ("", "configmaps"), ("apps", "widgets")])
def test_unknown_workload_kinds_are_allowed(resource: tuple[str, str]) -> None:
    bad = deployment({"kvgpu.io/gpumem": "3Gx"})  # refused as a Deployment (above)
    assert review(VALIDATE_WORKLOADS_ID, request("CREATE", bad, resource=resource), OPS) == Decision()


def test_unknown_webhook_id_raises_key_error() -> None:
    with pytest.raises(KeyError):
        review("kvgpu-mutate-nodes", request("CREATE", pod(SLICED)), OPS)


# --------------------------------------------------------------------------- response_body


def test_response_body_shapes() -> None:
    allowed = response_body({"uid": "u1"}, True)
    assert allowed == {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                       "response": {"uid": "u1", "allowed": True}}
    ops = [{"op": "add", "path": "/metadata/labels", "value": {"a": "b"}}]
    patched = response_body({"uid": "u2"}, True, patch=ops)["response"]
    assert patched["patchType"] == "JSONPatch"
    assert json.loads(base64.b64decode(patched["patch"])) == ops
    refused = response_body({"uid": "u3"}, False, message="no", code=403)["response"]
    assert refused["status"] == {"code": 403, "message": "no"}
    assert "patch" not in refused


# --------------------------------------------------------------------------- HTTP


async def post(cl: TestClient[Any, Any], path: str, body: Any) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = await cl.post(path, data=data, headers={"Content-Type": "application/json"})
    text = await resp.text()
    try:
        return resp.status, json.loads(text)
    except ValueError:
        return resp.status, text


async def test_http_mutate_answers_with_the_patch() -> None:
    p = pod(SLICED)
    req = request("CREATE", p, uid="0f1e2d3c-mutate")
    async with TestClient(TestServer(make_app(OPS))) as cl:
        status, body = await post(cl, f"/{MUTATE_ID}", admission_review(req))
    assert status == 200
    assert body["apiVersion"] == "admission.k8s.io/v1"
    assert body["kind"] == "AdmissionReview"
    resp = body["response"]
    assert resp["uid"] == "0f1e2d3c-mutate"
    assert resp["allowed"] is True
    assert resp["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(resp["patch"]))
    assert ops == review(MUTATE_ID, req, OPS).patch
    out = jsonpatch.apply_patch(p, ops)
    assert out["spec"]["schedulerName"] == keys.SCHEDULER_NAME
    assert out["metadata"]["labels"][MANAGED_LABEL] == "true"


async def test_http_plain_pod_gets_no_patch_and_refusals_carry_the_message() -> None:
    async with TestClient(TestServer(make_app(OPS))) as cl:
        _, plain = await post(cl, f"/{MUTATE_ID}", admission_review(request("CREATE", pod(), uid="u-plain")))
        _, refused = await post(cl, f"/{VALIDATE_ID}", admission_review(
            request("CREATE", mutated(pod({"kvgpu.io/gpumem": "3Gx"})), uid="u-bad")))
        # The operator usernames given to make_app are the ones review() gets.
        new = edited(BOUND, lambda p: p["metadata"]["annotations"].update({keys.POD_NODE: "n2"}))
        _, by_op = await post(cl, f"/{VALIDATE_ID}", admission_review(
            request("UPDATE", new, BOUND, username=OPERATOR, uid="u-op")))
        _, by_user = await post(cl, f"/{VALIDATE_ID}", admission_review(
            request("UPDATE", new, BOUND, username="alice", uid="u-user")))
    assert plain["response"] == {"uid": "u-plain", "allowed": True}
    assert refused["response"]["uid"] == "u-bad"
    assert refused["response"]["allowed"] is False
    assert refused["response"]["status"]["code"] == REFUSAL_CODE
    assert "kvgpu.io/gpumem" in refused["response"]["status"]["message"]
    assert by_op["response"]["allowed"] is True
    assert by_user["response"]["allowed"] is False


@pytest.mark.parametrize("body", [
    b"not json",
    b"",
    {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"},
    {"request": "a string"},
    {"request": None},
    [1, 2, 3],
], ids=["garbage", "empty", "no-request", "request-string", "request-null", "json-list"])
async def test_http_malformed_body_is_400(body: Any) -> None:
    async with TestClient(TestServer(make_app(OPS))) as cl:
        status, answer = await post(cl, f"/{VALIDATE_ID}", body)
    assert status == 400
    assert "not an AdmissionReview" in answer["error"]


async def test_http_unknown_path_is_404() -> None:
    async with TestClient(TestServer(make_app(OPS))) as cl:
        status, _ = await post(cl, "/kvgpu-mutate-nodes", admission_review(request("CREATE", pod(SLICED))))
        assert status == 404
        status, _ = await post(cl, f"/{MUTATE_ID}/extra", admission_review(request("CREATE", pod(SLICED))))
        assert status == 404


async def test_http_a_decision_that_raises_is_refused_with_500(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(webhook: str, req: dict[str, Any], operators: Any) -> Decision:
        raise RuntimeError("decision bug")

    monkeypatch.setattr(srv, "review", broken)
    async with TestClient(TestServer(make_app(OPS))) as cl:
        status, body = await post(cl, f"/{MUTATE_ID}", admission_review(request("CREATE", pod(SLICED), uid="u-x")))
    assert status == 200  # an answer the API server reads, not a transport error
    resp = body["response"]
    assert resp["uid"] == "u-x"
    assert resp["allowed"] is False  # fail closed
    assert resp["status"]["code"] == 500
    assert "decision bug" in resp["status"]["message"]
    assert "patch" not in resp


def test_handlers_ids_are_the_served_paths() -> None:
    app = make_app(OPS)
    paths = {r.resource.canonical for r in app.router.routes() if r.method == "POST" and r.resource is not None}
    assert paths == {f"/{MUTATE_ID}", f"/{VALIDATE_ID}", f"/{VALIDATE_WORKLOADS_ID}"}


# --------------------------------------------------------------------------- worker processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _https_review(port: int, ca: Path, path: str, review_body: dict[str, Any]) -> dict[str, Any]:
    ctx = ssl.create_default_context(cafile=str(ca))  # verifies the chain and the 127.0.0.1 SAN
    req = urllib.request.Request(f"https://127.0.0.1:{port}{path}", data=json.dumps(review_body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, context=ctx, timeout=30) as r:
        assert r.status == 200
        return dict(json.loads(r.read()))


def test_start_workers_rejects_an_ephemeral_port(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fixed port"):
        start_workers(1, "127.0.0.1", 0, str(tmp_path / "c"), str(tmp_path / "k"), OPS)


def test_worker_processes_serve_https_and_stop(tmp_path: Path) -> None:
    make_pki(tmp_path)
    port = _free_port()
    procs = start_workers(2, "127.0.0.1", port, str(tmp_path / "webhook.crt"), str(tmp_path / "webhook.key"),
                          [OPERATOR])
    try:
        assert len(procs) == 2
        assert all(p.is_alive() for p in procs)
        bad = mutated(pod({"kvgpu.io/gpumem": "3Gx"}))
        new = edited(BOUND, lambda p: p["metadata"]["annotations"].update({keys.POD_NODE: "n2"}))
        # Several connections: SO_REUSEPORT spreads them over both workers; each must answer.
        for i in range(6):
            body = _https_review(port, tmp_path / "ca.crt", f"/{VALIDATE_ID}",
                                 admission_review(request("CREATE", bad, uid=f"u-{i}")))
            assert body["kind"] == "AdmissionReview"
            assert body["response"]["uid"] == f"u-{i}"
            assert body["response"]["allowed"] is False
            assert "kvgpu.io/gpumem" in body["response"]["status"]["message"]
        # The operator usernames reach the worker processes.
        by_op = _https_review(port, tmp_path / "ca.crt", f"/{VALIDATE_ID}",
                              admission_review(request("UPDATE", new, BOUND, username=OPERATOR)))
        assert by_op["response"]["allowed"] is True
    finally:
        stop_workers(procs)
    assert all(not p.is_alive() for p in procs)
    assert all(p.exitcode is not None for p in procs)
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass  # nobody listens any more


def test_start_workers_refuses_a_port_someone_else_holds() -> None:
    """Another process listening on the port (without SO_REUSEPORT) is an error at once, not
    a readiness probe answered by that process while every worker fails to bind."""
    import socket

    from kvgpu.admission.server import start_workers

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        with pytest.raises(OSError):
            start_workers(1, "127.0.0.1", other.getsockname()[1], "unused.crt", "unused.key", [])


def _pool(uid: str, name: str, mib: Any) -> dict[str, Any]:
    return {"apiVersion": "kvgpu.io/v1alpha1", "kind": "VGPUPool", "metadata": {"name": name, "uid": uid},
            "spec": {"minSliceMemory": mib}}


def test_the_pool_view_follows_added_changed_and_deleted_pools() -> None:
    """The webhook workers' minimum slice, fed by the VGPUPool watch's events: the smallest valid
    pool's, kvgpu's default again once every pool is gone; a pool that does not validate
    counts for nothing, and a deletion carries only the metadata (a relist's synthesized one)."""
    view = srv.PoolView()
    default = view.minimum
    view.on_event("ADDED", _pool("u1", "big", 1024))
    view.on_event("ADDED", _pool("u2", "small", 512))
    assert (view.minimum.mib, view.minimum.pool) == (512, "small")
    view.on_event("MODIFIED", _pool("u2", "small", 2048))
    assert (view.minimum.mib, view.minimum.pool) == (1024, "big")
    view.on_event("ADDED", _pool("u3", "broken", "lots"))
    assert view.minimum.pool == "big"
    view.on_event("DELETED", {"metadata": {"name": "big", "uid": "u1"}})
    assert (view.minimum.mib, view.minimum.pool) == (2048, "small")
    view.on_event("DELETED", {"metadata": {"name": "small", "uid": "u2"}})
    view.on_event("DELETED", {"metadata": {"name": "broken", "uid": "u3"}})
    assert view.minimum == default
