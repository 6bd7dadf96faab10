"""One way to watch: the agent's node, pool and pod streams are ListWatches (field selectors, a
404 as "no objects yet", a cache read only while the stream is current), their event handlers
keep the caches and kick as before; the bind's reservation is a plain function; the operator's
state is changed through its methods."""

from __future__ import annotations

import asyncio
import inspect
import json
from typing import Any

import pytest
from kvgpu import watch
from kvgpu.agent.kube import KubeApi
from kvgpu.agent.pods import PodCache
from kvgpu.core import keys
from kvgpu.core.requests import ContainerRequest, PodRequest
from kvgpu.extender.binder import Binder, claim_keys
from kvgpu.reconcile.state import OperatorState


class _Resp:
    def __init__(self, status: int, body: bytes) -> None:
        self.status, self._body = status, body

    async def read(self) -> bytes:
        return self._body

    def release(self) -> None:
        pass


class ScriptedApi:
    """Answers each list with the next of ``lists`` (a status and items); watches hang."""

    def __init__(self, lists: list[tuple[int, list[dict[str, Any]]]]) -> None:
        self.lists = lists
        self.queries: list[dict[str, Any]] = []

    async def call_api(self, path: str, method: str, query_params: list[tuple[str, Any]], **kw: Any) -> Any:
        q = dict(query_params)
        self.queries.append(q)
        if "watch" in q:
            await asyncio.Event().wait()
        status, items = self.lists.pop(0) if self.lists else (200, [])
        return _Resp(status, json.dumps({"metadata": {"resourceVersion": "5"}, "items": items}).encode())


def _obj(uid: str) -> dict[str, Any]:
    return {"metadata": {"name": uid, "uid": uid, "resourceVersion": "1"}}


async def _run_until(lw: watch.ListWatch, cond: Any) -> None:
    task = asyncio.create_task(lw.run())
    try:
        for _ in range(200):
            await asyncio.sleep(0.005)
            if cond():
                return
        raise AssertionError("condition not reached")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_field_selector_goes_to_list_and_watch() -> None:
    api = ScriptedApi([(200, [_obj("a")])])
    lw = watch.ListWatch(api, "/api/v1/pods", lambda t, o: None, field_selector="spec.nodeName=n1")
    asyncio.run(_run_until(lw, lambda: len(api.queries) >= 2))
    assert [q.get("fieldSelector") for q in api.queries[:2]] == ["spec.nodeName=n1", "spec.nodeName=n1"]
    assert "watch" in api.queries[1]
    assert lw.current()


def test_missing_resource_counts_as_empty_and_deletes_what_was_known(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 404 (the CRD not installed, or removed) with ``missing_retry_s``: the objects known are
    handed over as DELETED, the stream is synced and current (empty), and it lists again later."""
    seen: list[tuple[str, str]] = []
    api = ScriptedApi([(404, [])])
    lw = watch.ListWatch(api, "/apis/kvgpu.io/v1alpha1/vgpupools", lambda t, o: seen.append((t, o["metadata"]["uid"])),
                         missing_retry_s=0.01)
    lw._known = {"a": {"metadata": {"uid": "a"}}}
    asyncio.run(_run_until(lw, lambda: len(api.queries) >= 3))  # 404, then a list (200) and its watch
    assert seen[0] == ("DELETED", "a")
    assert lw.synced.is_set() and lw.current()


def test_a_404_without_missing_retry_is_a_fault(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watch, "BACKOFF_MIN_S", 10.0)
    api = ScriptedApi([(404, [])])
    lw = watch.ListWatch(api, "/api/v1/nodes", lambda t, o: None)
    asyncio.run(_run_until(lw, lambda: lw.broken))
    assert not lw.current() and not lw.synced.is_set()


def _node(rv: str, labels: dict[str, str], inventory: str = "", heartbeat: str = "") -> dict[str, Any]:
    return {"metadata": {"name": "n1", "uid": "u1", "resourceVersion": rv, "labels": labels,
                         "annotations": {keys.NODE_INVENTORY: inventory, "hb": heartbeat}}}


def test_node_events_kick_on_relevant_changes_deletion_and_recreation() -> None:
    api = KubeApi(object())
    kicks: list[int] = []

    def kick() -> None:
        kicks.append(1)

    def ev(t: str, d: dict[str, Any]) -> None:
        api.on_node_event("n1", kick, t, d)

    ev("ADDED", _node("1", {"a": "1"}))
    assert len(kicks) == 1  # first sight
    ev("MODIFIED", _node("2", {"a": "1"}, heartbeat="x"))
    assert len(kicks) == 1  # a heartbeat: no kick
    ev("MODIFIED", _node("3", {"a": "2"}))
    ev("MODIFIED", _node("4", {"a": "2"}, inventory="{}"))
    assert len(kicks) == 3
    ev("DELETED", _node("5", {"a": "2"}))
    assert len(kicks) == 4 and "n1" not in api._nodes
    ev("ADDED", _node("6", {"a": "2"}))  # re-created
    assert len(kicks) == 5 and api._nodes["n1"]["metadata"]["resourceVersion"] == "6"


def test_node_cache_is_read_only_while_the_watch_is_current() -> None:
    api = KubeApi(object())
    api.on_node_event("n1", lambda: None, "ADDED", _node("1", {}))
    assert not api._node_cached("n1")  # no watch yet
    api.node_watch = watch.ListWatch(object(), "/api/v1/nodes", lambda t, o: None)
    api.node_watch.synced.set()
    assert api._node_cached("n1")
    api.node_watch.broken = True
    assert not api._node_cached("n1")


def test_pool_events_keep_a_new_dict_and_kick() -> None:
    api = KubeApi(object())
    kicks: list[int] = []
    api.on_pool_event(lambda: kicks.append(1), "ADDED", {"metadata": {"name": "p"}, "spec": {}})
    first = api._pools
    api.on_pool_event(lambda: kicks.append(1), "DELETED", {"metadata": {"name": "p"}})
    assert first == {"p": {"metadata": {"name": "p"}, "spec": {}}} and api._pools == {} and len(kicks) == 2


def test_pod_cache_events() -> None:
    pc = PodCache("n1")
    changes: list[int] = []
    pc.on_change = lambda: changes.append(1)
    pc.on_event("ADDED", {"metadata": {"uid": "p1"}})
    pc.on_event("MODIFIED", {"metadata": {"uid": "p1"}, "spec": {}})
    assert pc.pods == {"p1": {"metadata": {"uid": "p1"}, "spec": {}}}
    pc.on_event("DELETED", {"metadata": {"uid": "p1"}})
    assert pc.pods == {} and len(changes) == 3


def test_reserve_is_a_plain_function() -> None:
    """No await can come between allocate and reserve."""
    assert not inspect.iscoroutinefunction(Binder._reserve)
    assert not inspect.iscoroutinefunction(Binder._reserve_early)


def test_claim_keys_name_each_container_claim() -> None:
    req = PodRequest("ns", "pod", "abcdef", (ContainerRequest("main", cards=1, memory_mib=1000),))
    assert claim_keys(req) == {"main": "ns/pod-main-abcde"}


def test_state_methods_for_pending_and_claim_uids() -> None:
    st = OperatorState()
    st.add_pending("u", "ns", "p")
    assert st.pending == {"u": ("ns", "p")}
    st.forget_pending("u")
    st.forget_pending("u")
    assert st.pending == {}
    st.record_claim_uid("ns/c", "uid-1")
    assert st.claim_uids == {"ns/c": "uid-1"}
