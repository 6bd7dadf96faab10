"""Claim phases from the pod (kvgpu.reconcile.phases): the table in its docstring."""

from __future__ import annotations

from typing import Any

import pytest
from kvgpu.api.vgpuclaim import claim_phase
from kvgpu.core import keys
from kvgpu.core.claimstr import ClaimDevice, ClaimString
from kvgpu.reconcile.phases import ClaimAction, actions, pod_claims, slices_message


def _pod(claims: str = "p-main-abcde", node: str = "", phase: str = "Pending") -> dict[str, Any]:
    ann = {keys.POD_CLAIMS: claims} if claims else {}
    if claims:
        cs = ClaimString("ns/p-main-abcde", 1, (ClaimDevice("GPU-1", 3000, 30), ClaimDevice("GPU-2", 3000, 30)))
        ann[keys.claim_annotation("main")] = cs.encode()
    return {"metadata": {"name": "p", "namespace": "ns", "uid": "u1", "annotations": ann},
            "spec": {"nodeName": node} if node else {}, "status": {"phase": phase}}


@pytest.mark.parametrize(("etype", "node", "phase", "want"), [
    ("ADDED", "", "Pending", []),
    ("MODIFIED", "n1", "Pending", []),  # bound: the claim was created so, nothing to write
    ("MODIFIED", "n1", "Running", []),  # running: the pod's phase says it
    ("MODIFIED", "n1", "Succeeded", [ClaimAction("p-main-abcde", phase="Released", message="pod Succeeded")]),
    ("MODIFIED", "", "Failed", [ClaimAction("p-main-abcde", phase="Released", message="pod Failed")]),
    ("DELETED", "n1", "Running", [ClaimAction("p-main-abcde", delete=True)]),
    ("DELETED", "", "Pending", [ClaimAction("p-main-abcde", delete=True)]),
])
def test_claims_follow_the_pod(etype: str, node: str, phase: str, want: list[ClaimAction]) -> None:
    assert actions(etype, _pod(node=node, phase=phase)) == want


def test_every_listed_claim_gets_the_action_and_a_pod_without_claims_gets_none() -> None:
    pod = _pod(claims="a,b,,c", node="n1", phase="Succeeded")
    assert pod_claims(pod) == ["a", "b", "c"]
    assert [a.claim for a in actions("MODIFIED", pod)] == ["a", "b", "c"]
    assert [a.claim for a in actions("DELETED", pod)] == ["a", "b", "c"]
    assert actions("DELETED", _pod(claims="")) == []
    assert actions("MODIFIED", _pod(claims="", node="n1", phase="Running")) == []


def test_slices_message_names_node_claim_and_cards() -> None:
    msg = slices_message(_pod(node="n1"))
    assert msg.startswith("bound to n1: p-main-abcde: ")
    assert "GPU-1 (3000 MiB, 30%)" in msg and "GPU-2 (3000 MiB, 30%)" in msg


def test_slices_message_skips_an_unreadable_claim_annotation() -> None:
    pod = _pod(node="n1")
    pod["metadata"]["annotations"][keys.claim_annotation("side")] = "not-a-claim"
    assert slices_message(pod).count("GPU-1") == 1


def _claim(name: str, phase: str | None, uid: str = "u1") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns"}, "spec": {"podUID": uid},
            **({"status": {"phase": phase}} if phase else {})}


def test_a_claim_without_a_written_phase_is_bound() -> None:
    assert claim_phase(_claim("a", None)) == "Bound"
    assert claim_phase(_claim("a", "Released")) == "Released"
    assert claim_phase(_claim("a", "Running")) == "Running"  # written by an earlier version
    assert claim_phase({}) == "Bound"


@pytest.mark.parametrize("bind_events", [True, False])
def test_a_bound_and_running_pod_costs_no_claim_write(monkeypatch: pytest.MonkeyPatch, bind_events: bool) -> None:
    """Bound, then Running, then the events replayed: nothing written to the claim; the
    GPUSlicesBound Event (when enabled) once; the end of the pod writes Released once."""
    import asyncio

    w, writes = _worker_with(monkeypatch, {"p-main-abcde": _claim("p-main-abcde", None)}, live=None,
                             bind_events=bind_events)
    for phase in ("Pending", "Running", "Running"):
        asyncio.run(w.on_pod("MODIFIED", _pod(node="n1", phase=phase)))
    assert writes == [("event", "GPUSlicesBound")] * bind_events
    asyncio.run(w.on_pod("MODIFIED", _pod(node="n1", phase="Succeeded")))
    asyncio.run(w.on_pod("MODIFIED", _pod(node="n1", phase="Succeeded")))
    assert writes == [("event", "GPUSlicesBound")] * bind_events + [("p-main-abcde", "Released")]


def test_no_event_again_for_pods_whose_claims_existed_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """A restarted worker lists the claims first: their pods had their Event already."""
    import asyncio

    from kvgpu import kube

    w, writes = _worker_with(monkeypatch, {"p-main-abcde": _claim("p-main-abcde", None)}, live=None)

    async def list_all(api: Any, kind: str) -> list[dict[str, Any]]:
        return [_claim("p-main-abcde", None)]

    async def no_watch() -> None:
        return None

    monkeypatch.setattr(kube, "list_all", list_all)
    monkeypatch.setattr(w.pods, "run", no_watch)
    monkeypatch.setattr(w, "_sweep_loop", no_watch)
    asyncio.run(w.run())
    asyncio.run(w.on_pod("MODIFIED", _pod(node="n1", phase="Running")))
    assert writes == []


def _worker_with(monkeypatch: pytest.MonkeyPatch, claims: dict[str, dict[str, Any]],
                 live: dict[str, Any] | None, *, bind_events: bool = True) -> tuple[Any, list[tuple[str, str]]]:
    from kvgpu import kube
    from kvgpu.reconcile.phaseworker import PhaseWorker, PhaseWorkerConfig

    writes: list[tuple[str, str]] = []

    async def get_claim(api: Any, ns: str, name: str) -> dict[str, Any] | None:
        return claims.get(name)

    async def get_pod(api: Any, ns: str, name: str) -> dict[str, Any] | None:
        return live

    async def patch_claim_status(api: Any, ns: str, name: str, status: dict[str, Any]) -> bool:
        writes.append((name, status["phase"]))
        return True

    async def delete_claim(api: Any, ns: str, name: str) -> bool:
        writes.append((name, "deleted"))
        return True

    async def post_event(api: Any, obj: Any, **kw: Any) -> None:
        writes.append(("event", kw["reason"]))

    for name, fn in (("get_claim", get_claim), ("get_pod", get_pod), ("patch_claim_status", patch_claim_status),
                     ("delete_claim", delete_claim), ("post_event", post_event)):
        monkeypatch.setattr(kube, name, fn)
    return PhaseWorker(PhaseWorkerConfig(bind_events=bind_events, dra_mirror=False), api=None), writes


def test_a_claim_of_another_pod_is_never_released(monkeypatch: pytest.MonkeyPatch) -> None:
    """An ended pod whose kvgpu.io/claims names a victim's claim (spec.podUID differs) releases
    and deletes nothing of the victim's."""
    import asyncio

    w, writes = _worker_with(monkeypatch, {"victim-main-fffff": _claim("victim-main-fffff", "Running", "victim")},
                             live=None)
    asyncio.run(w.on_pod("MODIFIED", _pod(claims="victim-main-fffff", node="n1", phase="Succeeded")))
    asyncio.run(w.on_pod("DELETED", _pod(claims="victim-main-fffff", node="n1", phase="Succeeded")))
    assert writes == []
    w, writes = _worker_with(monkeypatch, {"p-main-abcde": _claim("p-main-abcde", "Running")}, live=None)
    asyncio.run(w.on_pod("MODIFIED", _pod(node="n1", phase="Succeeded")))
    assert writes == [("p-main-abcde", "Released")]


def test_a_pod_leaving_the_labelled_watch_is_not_deleted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The label removed: the watch says DELETED, the pod still runs; its claim stays."""
    import asyncio

    running = _pod(node="n1", phase="Running")
    w, writes = _worker_with(monkeypatch, {"p-main-abcde": _claim("p-main-abcde", "Running")}, live=running)
    asyncio.run(w.on_pod("DELETED", running))
    assert ("p-main-abcde", "deleted") not in writes
    w, writes = _worker_with(monkeypatch, {"p-main-abcde": _claim("p-main-abcde", "Running")}, live=None)
    asyncio.run(w.on_pod("DELETED", running))
    assert writes == [("p-main-abcde", "deleted")]
