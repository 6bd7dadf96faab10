"""No ``%`` in anything the extender answers kube-scheduler: it uses filter's per-node reasons
and every ``error`` as a Go format string for its FailedScheduling event (``10 %!<(MISSING)``).
The operator's own NoGPUCapacity Event keeps the ``%``."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kvgpu import kube
from kvgpu.extender.protocol import ExtenderArgs, filter_result, scheduler_text

from tests.unit.extender_helpers import NODES, Harness

FILLER = {"kvgpu.io/gpu": "2", "kvgpu.io/gpumem": "12000", "kvgpu.io/gpucores": "60"}


def _pod(uid: str, ann: dict[str, str], **limits: str) -> dict[str, Any]:
    c: dict[str, Any] = {"name": "main", "image": "x"}
    if limits:
        c["resources"] = {"limits": {k.replace("_", "/", 1).replace("nvidia/", "nvidia.com/"): v
                                     for k, v in limits.items()}}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"p-{uid[:8]}", "namespace": "ns", "uid": uid, "annotations": ann,
                         "labels": {"kvgpu.io/managed": "true"}},
            "spec": {"schedulerName": "kvgpu-scheduler", "containers": [c]}}


def _uid(i: int) -> str:
    return f"{i:08d}-2222-3333-4444-555555555555"


def _answers(h: Harness, pod: dict[str, Any]) -> list[str]:
    """Every text of filter, prioritize and bind (to each node) for ``pod``."""
    texts: list[str] = []
    body = json.dumps({"pod": pod, "nodenames": NODES}).encode()
    _, data = h.post("filter", body)
    assert isinstance(data, dict), data
    texts += list((data.get("failedAndUnresolvableNodes") or {}).values())
    texts += list((data.get("failedNodes") or {}).values())
    texts.append(str(data.get("error", "")))
    _, data = h.post("prioritize", body)
    if isinstance(data, dict):
        texts.append(str(data.get("error", "")))
    h.fake.pod = pod
    for node in NODES:
        args = {"podName": pod["metadata"]["name"], "podNamespace": "ns",
                "podUID": pod["metadata"]["uid"], "node": node}
        _, data = h.post("bind", json.dumps(args).encode())
        texts.append(str(data.get("error", "")))
        h.state.release_pod(pod["metadata"]["uid"])
    return [t for t in texts if t]


def _fill(h: Harness) -> None:
    """Every card of every node: 12,000 of 20,000 MiB (60 percent) and 60 percent of cores used."""
    for i, node in enumerate(NODES):
        pod = _pod(_uid(100 + i), FILLER)
        h.fake.pod = pod
        _, data = h.post("filter", json.dumps({"pod": pod, "nodenames": [node]}).encode())
        assert data.get("nodenames") == [node], data
        args = {"podName": pod["metadata"]["name"], "podNamespace": "ns", "podUID": _uid(100 + i), "node": node}
        _, data = h.post("bind", json.dumps(args).encode())
        assert data == {}, data


CASES: list[tuple[dict[str, str], dict[str, str]]] = [
    ({"kvgpu.io/gpumem": "1000", "kvgpu.io/gpucores": "50"}, {}),  # most free cores 40 % < 50 %
    ({"kvgpu.io/gpumem-percentage": "50"}, {}),  # most free memory about 39 % < 50 %
    ({"kvgpu.io/gpumem-percentage": "50", "kvgpu.io/gpucores": "50"}, {}),
    ({"kvgpu.io/gpu": "2", "kvgpu.io/gpucores": "100"}, {}),  # exclusive
    ({"kvgpu.io/gpumem": "0"}, {}),  # whole card
    ({"kvgpu.io/gpumem": "15000"}, {}),
    ({"kvgpu.io/gpu": "3"}, {}),  # more cards than a node has
    ({"kvgpu.io/gpu-type": "A100"}, {}),
    ({"kvgpu.io/gpucores": "30%"}, {}),  # invalid: the user's own %
    ({"kvgpu.io/gpumem-percentage": "101%"}, {}),
    ({"kvgpu.io/gpu-policy": "50%"}, {}),
    ({}, {"nvidia_gpu": "1", "nvidia_gpumem": "1000", "nvidia_gpucores": "50"}),
    ({}, {"nvidia_gpu": "1", "nvidia_gpumem-percentage": "50"}),
    ({}, {"nvidia_gpu": "1", "nvidia_gpucores": "50%"}),
]


@pytest.mark.parametrize(("ann", "limits"), CASES, ids=[json.dumps(a or b) for a, b in CASES])
def test_no_percent_reaches_kube_scheduler(harness: Harness, monkeypatch: pytest.MonkeyPatch,
                                           ann: dict[str, str], limits: dict[str, str]) -> None:
    events: list[str] = []

    async def post_event(api: Any, obj: Any, **kw: Any) -> None:
        events.append(str(kw.get("message", "")))

    monkeypatch.setattr(kube, "post_event", post_event)
    _fill(harness)
    texts = _answers(harness, _pod(_uid(1), ann, **limits))
    assert texts, "expected failure reasons"
    assert not [t for t in texts if "%" in t], texts
    if "1000" in (ann.get("kvgpu.io/gpumem"), limits.get("nvidia_gpumem")):
        assert any("most free cores 40 percent < 50 percent" in t for t in texts), texts
        assert any("40 % < 50 %" in e for e in events), events  # the operator's Event keeps %


def test_not_ready_and_bad_bodies(harness: Harness) -> None:
    harness.state.ready = False
    pod = _pod(_uid(1), {"kvgpu.io/gpumem": "1000", "kvgpu.io/gpucores": "50"})
    assert not [t for t in _answers(harness, pod) if "%" in t]
    for verb in ("filter", "prioritize", "bind"):
        _, data = harness.post(verb, b"%d not json %")
        assert "%" not in json.dumps(data), data


@pytest.mark.parametrize(("text", "want"), [
    ("most free cores 10 % < 30 %", "most free cores 10 percent < 30 percent"),
    ("30% of memory", "30 percent of memory"),
    ("cores 5/100 %; 100%", "cores 5/100 percent; 100 percent"),
    ("no percent sign", "no percent sign"),
    ("%", " percent"),
])
def test_scheduler_text(text: str, want: str) -> None:
    assert scheduler_text(text) == want


def test_filter_result_cleans_every_reason_and_the_error() -> None:
    args = ExtenderArgs(pod={"metadata": {}}, node_names=["a", "b"], nodes=None)
    res = filter_result(args, [], {"a": "10 % < 30 %", "b": "fine"}, "boom 5%")
    assert res["failedAndUnresolvableNodes"] == {"a": "10 percent < 30 percent", "b": "fine"}
    assert res["error"] == "boom 5 percent"


def test_a_pod_the_webhook_never_saw_gets_no_node(harness: Harness) -> None:
    """A kube-system pod (the webhooks skip it) naming kvgpu-scheduler: no slice without the shim."""
    pod = _pod(_uid(99), {"kvgpu.io/gpumem": "1000"})
    del pod["metadata"]["labels"]
    _, data = harness.post("filter", json.dumps({"pod": pod, "nodenames": NODES}).encode())
    failed = data.get("failedAndUnresolvableNodes") or data.get("failedNodes") or {}
    assert data.get("nodenames") in (None, []) and set(failed) == set(NODES), data
    assert all("not admitted by kvgpu's webhook" in r for r in failed.values()), data
