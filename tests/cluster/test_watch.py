"""The operator's list-and-watch streams (:class:`kvgpu.watch.ListWatch`) against the real
kube-apiserver: the initial list (paginated) as ``ADDED``, watch events in order, label
selectors, per-object serialisation and coalescing of async handlers, ``DELETED`` synthesized
after a relist, ``410 Gone`` on a compacted resourceVersion (and the relist it causes), lines
longer than aiohttp's ``readline`` limit, and handlers that raise.

What the server does with a too-old resourceVersion (kube-apiserver 1.36, checked here): it
answers HTTP 200 and a single ``ERROR`` event with ``code: 410`` ("Expired"), never an HTTP 410.
For resources served from the watch cache (ConfigMaps, Pods, custom resources) that happens only
once the cache has dropped events (it keeps every event fresher than 75 s); until then a watch
from an old version replays the cache's history instead, and compacting etcd does not change
that. Events are not cached by default, so the 410 tests use Events after compacting etcd.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException
from kvgpu import kube, watch
from kvgpu.devcluster import Cluster
from kvgpu.watch import Gone, ListWatch, metadata_only

WAIT_S = 15.0  # upper bound for anything to arrive (never asserted as a timing)

Event = tuple[str, dict[str, Any]]


# --------------------------------------------------------------------------- helpers


@pytest.fixture
async def api(cluster: Cluster) -> AsyncIterator[client.ApiClient]:
    cfg = client.Configuration()
    await config.load_kube_config(config_file=str(cluster.kubeconfig), client_configuration=cfg)
    a = kube.api_client(cfg)
    try:
        yield a
    finally:
        await a.close()


def cm_path(ns: str) -> str:
    return f"/api/v1/namespaces/{ns}/configmaps"


def name_of(obj: dict[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name", ""))


async def until(cond: Callable[[], Any], what: str) -> Any:
    """Poll ``cond`` until it is true (at most WAIT_S)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while True:
        v = cond()
        if v:
            return v
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def create_cm(api: client.ApiClient, ns: str, name: str, *, data: dict[str, str] | None = None,
                    labels: dict[str, str] | None = None) -> str:
    """Create a ConfigMap; returns its UID."""
    body: dict[str, Any] = {"metadata": {"name": name, "labels": labels or {}}}
    if data is not None:
        body["data"] = data
    made = await client.CoreV1Api(api).create_namespaced_config_map(ns, body)
    return str(made.metadata.uid)


async def patch_cm(api: client.ApiClient, ns: str, name: str, patch: dict[str, Any]) -> None:
    await client.CoreV1Api(api).patch_namespaced_config_map(name, ns, patch, _content_type=kube.MERGE)


async def delete_cm(api: client.ApiClient, ns: str, name: str) -> None:
    await client.CoreV1Api(api).delete_namespaced_config_map(name, ns)


async def get_json(cluster: Cluster, *args: str) -> dict[str, Any]:
    """``kubectl get ... -o json`` (the object exactly as the API server serves it)."""
    out = await asyncio.to_thread(cluster.kubectl, "get", *args, "-o", "json")
    return dict(json.loads(out.stdout))


@contextlib.asynccontextmanager
async def running(lw: ListWatch, *, wait_synced: bool = True) -> AsyncIterator[asyncio.Task[None]]:
    """Run ``lw.run()`` as a task (after its first list, when ``wait_synced``); cancel on exit."""
    task = asyncio.create_task(lw.run())
    try:
        if wait_synced:
            await until(lambda: lw.synced.is_set() or task.done(), "the first list")
            assert not task.done(), task  # run() never returns
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class Recorder:
    """A plain (inline) handler that records every event."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def __call__(self, etype: str, obj: dict[str, Any]) -> None:
        self.events.append((etype, obj))

    def of(self, name: str) -> list[Event]:
        return [(t, o) for t, o in self.events if name_of(o) == name]

    def types(self, name: str) -> list[str]:
        return [t for t, _ in self.of(name)]


# --------------------------------------------------------------------------- list


async def test_initial_list_hands_over_existing_objects_as_added(
        namespace: str, api: client.ApiClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watch, "PAGE", 2)  # five objects: three pages, the continue token is followed
    made = {f"pre-{i}": await create_cm(api, namespace, f"pre-{i}", data={"i": str(i)}) for i in range(5)}
    rec = Recorder()
    lw = ListWatch(api, cm_path(namespace), rec)
    assert not lw.synced.is_set()
    async with running(lw):
        at_sync = list(rec.events)  # the plain handler ran inline, before synced was set
    ours = [(t, o) for t, o in at_sync if name_of(o) in made]
    assert sorted(name_of(o) for _, o in ours) == sorted(made)  # each exactly once
    assert {t for t, _ in ours} == {"ADDED"}
    assert {t for t, _ in at_sync} == {"ADDED"}  # nothing but the list before the sync
    for _, o in ours:
        assert o["data"] == {"i": name_of(o).split("-")[1]}  # the whole object is handed over
        uid = made[name_of(o)]
        assert o["metadata"]["uid"] == uid
        assert lw.known()[uid] == metadata_only(o)  # known() holds the projection, not the object
        assert "data" not in lw.known()[uid]
    assert lw.events >= len(made)


# --------------------------------------------------------------------------- watch


async def test_create_update_delete_arrive_in_order(namespace: str, api: client.ApiClient) -> None:
    rec = Recorder()
    in_known: list[tuple[str, bool]] = []

    def handler(etype: str, obj: dict[str, Any]) -> None:
        rec(etype, obj)
        if name_of(obj) == "x":
            in_known.append((etype, obj["metadata"]["uid"] in lw.known()))

    lw = ListWatch(api, cm_path(namespace), handler)
    async with running(lw):
        uid = await create_cm(api, namespace, "x", data={"v": "1"})
        await patch_cm(api, namespace, "x", {"data": {"v": "2"}})
        await delete_cm(api, namespace, "x")
        await until(lambda: "DELETED" in rec.types("x"), "DELETED of x")
    assert rec.types("x") == ["ADDED", "MODIFIED", "DELETED"]
    assert [o["data"] for _, o in rec.of("x")] == [{"v": "1"}, {"v": "2"}, {"v": "2"}]
    assert all(o["metadata"]["uid"] == uid for _, o in rec.of("x"))
    # known() is updated before the handler runs: present while the object exists, gone at DELETED.
    assert in_known == [("ADDED", True), ("MODIFIED", True), ("DELETED", False)]
    assert uid not in lw.known()


async def test_label_selector_filters_list_and_watch(namespace: str, api: client.ApiClient) -> None:
    a1 = await create_cm(api, namespace, "a1", labels={"team": "a"})
    await create_cm(api, namespace, "b1", labels={"team": "b"})
    rec = Recorder()
    lw = ListWatch(api, cm_path(namespace), rec, label_selector="team=a")
    async with running(lw):
        assert [name_of(o) for _, o in rec.events] == ["a1"]
        await create_cm(api, namespace, "b2", labels={"team": "b"})
        a2 = await create_cm(api, namespace, "a2", labels={"team": "a"})
        # One ordered stream: b2 was written before a2, so had it passed the filter it came first.
        await until(lambda: rec.of("a2"), "ADDED of a2")
        assert set(lw.known()) == {a1, a2}
        # An object that stops matching leaves the stream as DELETED.
        await patch_cm(api, namespace, "a1", {"metadata": {"labels": {"team": "b"}}})
        await until(lambda: "DELETED" in rec.types("a1"), "a1 leaving the selection")
        assert set(lw.known()) == {a2}
    names = {name_of(o) for _, o in rec.events}
    assert names == {"a1", "a2"}
    assert all(o["metadata"]["labels"]["team"] == "a" for t, o in rec.events if t != "DELETED")


async def test_lines_longer_than_readline_limit_are_read(cluster: Cluster, namespace: str) -> None:
    big = "x" * 300_000  # one watch line of ~300 KiB
    rec = Recorder()
    # An HTTP session with a 64 KiB read buffer, whose readline refuses lines over 128 KiB (the
    # sessions of kubernetes_asyncio and kvgpu.kube read 2 MiB, which would hide a line reader).
    cfg = client.Configuration()
    await config.load_kube_config(config_file=str(cluster.kubeconfig), client_configuration=cfg)
    async with client.ApiClient(configuration=cfg) as small_buf_api:
        rest = small_buf_api.rest_client
        old = rest.pool_manager
        rest.pool_manager = aiohttp.ClientSession(connector=old.connector, connector_owner=True,
                                                  read_bufsize=2**16)
        old._connector, old._connector_owner = None, False
        await old.close()
        lw = ListWatch(small_buf_api, cm_path(namespace), rec)
        async with running(lw):
            await create_cm(small_buf_api, namespace, "big", data={"blob": big})
            await create_cm(small_buf_api, namespace, "after")
            await until(lambda: rec.of("after"), "the object after the big one")
    assert rec.types("big") == ["ADDED"]
    assert rec.of("big")[0][1]["data"]["blob"] == big


# --------------------------------------------------------------------------- async handlers


async def test_async_handler_serialises_and_coalesces_per_object(namespace: str, api: client.ApiClient) -> None:
    gates: dict[str, asyncio.Event] = {"a": asyncio.Event(), "b": asyncio.Event()}
    inflight: Counter[str] = Counter()
    peak: Counter[str] = Counter()
    both_running = asyncio.Event()
    calls: list[tuple[str, str, Any]] = []

    async def handler(etype: str, obj: dict[str, Any]) -> None:
        name = name_of(obj)
        if name not in gates:
            return
        inflight[name] += 1
        peak[name] = max(peak[name], inflight[name])
        if inflight["a"] and inflight["b"]:
            both_running.set()
        calls.append((name, etype, obj.get("data")))
        try:
            await gates[name].wait()
        finally:
            inflight[name] -= 1

    def project(obj: dict[str, Any]) -> dict[str, Any]:
        return {**metadata_only(obj), "data": obj.get("data")}

    lw = ListWatch(api, cm_path(namespace), handler, project=project)
    async with running(lw):
        uid_a = await create_cm(api, namespace, "a", data={"v": "0"})
        uid_b = await create_cm(api, namespace, "b", data={"v": "0"})
        # Different objects run concurrently: both handlers are blocked at the same time.
        await asyncio.wait_for(both_running.wait(), WAIT_S)

        # A burst of updates to a while its handler runs.
        for v in range(1, 6):
            await patch_cm(api, namespace, "a", {"data": {"v": str(v)}})
        await until(lambda: (lw.known().get(uid_a) or {}).get("data") == {"v": "5"}, "the last update of a")
        # b is updated and then deleted while its handler runs: the DELETED is the latest state.
        await patch_cm(api, namespace, "b", {"data": {"v": "1"}})
        await delete_cm(api, namespace, "b")
        await until(lambda: uid_b not in lw.known(), "the deletion of b")

        assert [(n, t) for n, t, _ in calls] in ([("a", "ADDED"), ("b", "ADDED")], [("b", "ADDED"), ("a", "ADDED")])
        gates["a"].set()
        gates["b"].set()
        await asyncio.wait_for(lw.drain(), WAIT_S)

    assert peak == {"a": 1, "b": 1}  # events of one object never overlapped
    assert [(t, d) for n, t, d in calls if n == "a"] == [("ADDED", {"v": "0"}), ("MODIFIED", {"v": "5"})]
    assert [(t, d) for n, t, d in calls if n == "b"] == [("ADDED", {"v": "0"}), ("DELETED", {"v": "1"})]
    final_a = await client.CoreV1Api(api).read_namespaced_config_map("a", namespace)
    assert final_a.data == {"v": "5"}  # the last state seen is the final object


# --------------------------------------------------------------------------- relist


async def test_relist_synthesizes_deleted_for_objects_gone_meanwhile(
        cluster: Cluster, namespace: str, api: client.ApiClient) -> None:
    def project(obj: dict[str, Any]) -> dict[str, Any]:
        return {**metadata_only(obj), "data": obj.get("data")}

    uid_x = await create_cm(api, namespace, "x", data={"keep": "me"}, labels={"l": "1"})
    uid_y = await create_cm(api, namespace, "y")
    rec = Recorder()
    lw = ListWatch(api, cm_path(namespace), rec, project=project)
    async with running(lw):
        assert {uid_x, uid_y} <= set(lw.known())
    x_before = await get_json(cluster, "configmap", "x", "-n", namespace)

    # The stream is stopped while x is deleted: no watch event can tell it.
    await asyncio.to_thread(cluster.kubectl, "delete", "configmap", "x", "-n", namespace)
    mark = len(rec.events)
    async with running(lw, wait_synced=False):  # the same instance
        await until(lambda: any(t == "DELETED" for t, _ in rec.events[mark:]), "a synthesized DELETED")
        await until(lambda: ("ADDED", "y") in [(t, name_of(o)) for t, o in rec.events[mark:]], "y listed again")
    after = [(t, o) for t, o in rec.events[mark:] if name_of(o) in ("x", "y")]
    deleted = [o for t, o in after if t == "DELETED"]
    assert deleted == [project(x_before)]  # the last projection, labels and kept data included
    assert deleted[0]["data"] == {"keep": "me"}
    assert ("ADDED", "x") not in [(t, name_of(o)) for t, o in after]
    assert uid_x not in lw.known()
    assert uid_y in lw.known()


# --------------------------------------------------------------------------- 410 Gone


def compact_etcd(cluster: Cluster, revision: str) -> None:
    """Compact etcd up to ``revision`` (what the API server does every 5 minutes by itself)."""
    port = cluster.components["etcd"].port
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v3/kv/compaction", method="POST",
                                 data=json.dumps({"revision": revision, "physical": True}).encode())
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200


async def create_event(api: client.ApiClient, ns: str, name: str) -> str:
    """Create a core/v1 Event (a resource the API server serves from etcd, not its watch
    cache); returns its resourceVersion."""
    body = {"metadata": {"name": name}, "involvedObject": {"kind": "ConfigMap", "name": "x", "namespace": ns},
            "reason": "WatchTest", "message": name, "type": "Normal"}
    made = await client.CoreV1Api(api).create_namespaced_event(ns, body)
    return str(made.metadata.resource_version)


async def event_then_compaction(cluster: Cluster, api: client.ApiClient, ns: str) -> None:
    """Event ``e1`` created, then etcd compacted up to it: a watch from an older version is
    answered 410 Gone."""
    rv = await create_event(api, ns, "e1")
    await asyncio.to_thread(compact_etcd, cluster, rv)


async def test_watch_from_a_compacted_version_raises_gone(
        cluster: Cluster, namespace: str, api: client.ApiClient) -> None:
    await event_then_compaction(cluster, api, namespace)
    rec = Recorder()
    lw = ListWatch(api, f"/api/v1/namespaces/{namespace}/events", rec)
    with pytest.raises(Gone):
        await asyncio.wait_for(lw._watch("1"), WAIT_S)
    assert rec.events == []
    assert lw.known() == {}


class StaleFirstList(ListWatch):
    """A ListWatch whose first list reports resourceVersion 1: its first watch starts from a
    version that is compacted away, as after a long outage."""

    async def _list(self) -> str:
        rv = await super()._list()
        return "1" if self.relists == 0 else rv


async def test_gone_makes_run_list_again_and_carry_on(
        cluster: Cluster, namespace: str, api: client.ApiClient) -> None:
    await event_then_compaction(cluster, api, namespace)
    rec = Recorder()
    lw = StaleFirstList(api, f"/api/v1/namespaces/{namespace}/events", rec)
    async with running(lw):
        await until(lambda: lw.relists == 1 and rec.types("e1") == ["ADDED", "ADDED"], "the second list")
        await create_event(api, namespace, "e2")
        await until(lambda: rec.of("e2"), "an event after the relist")
    assert lw.relists == 1
    assert rec.types("e1") == ["ADDED", "ADDED"]  # listed once per list, no DELETED: it still exists
    assert rec.types("e2") == ["ADDED"]


# --------------------------------------------------------------------------- failing handlers


async def test_a_raising_plain_handler_does_not_stop_the_stream(namespace: str, api: client.ApiClient) -> None:
    rec = Recorder()

    def handler(etype: str, obj: dict[str, Any]) -> None:
        rec(etype, obj)
        if name_of(obj) == "boom":
            raise RuntimeError("handler bug")

    lw = ListWatch(api, cm_path(namespace), handler)
    async with running(lw) as task:
        await create_cm(api, namespace, "boom")
        await until(lambda: rec.of("boom") or task.done(), "ADDED of boom")
        await patch_cm(api, namespace, "boom", {"data": {"v": "1"}})
        await create_cm(api, namespace, "fine")
        await until(lambda: (rec.of("fine") and "MODIFIED" in rec.types("boom")) or task.done(), "later events")
        assert not task.done(), task
    assert rec.types("boom") == ["ADDED", "MODIFIED"]
    assert rec.types("fine") == ["ADDED"]


async def test_a_raising_async_handler_goes_on_with_the_objects_next_state(
        namespace: str, api: client.ApiClient) -> None:
    gate = asyncio.Event()
    calls: list[tuple[str, str, Any]] = []

    async def handler(etype: str, obj: dict[str, Any]) -> None:
        calls.append((name_of(obj), etype, obj.get("data")))
        if name_of(obj) == "boom" and etype == "ADDED":
            await gate.wait()
            raise RuntimeError("handler bug")

    def project(obj: dict[str, Any]) -> dict[str, Any]:
        return {**metadata_only(obj), "data": obj.get("data")}

    lw = ListWatch(api, cm_path(namespace), handler, project=project)
    async with running(lw) as task:
        uid = await create_cm(api, namespace, "boom")
        await until(lambda: ("boom", "ADDED", None) in calls, "ADDED of boom")
        # An update arrives while the handler runs (and is about to fail): it waits its turn.
        await patch_cm(api, namespace, "boom", {"data": {"v": "1"}})
        await until(lambda: (lw.known().get(uid) or {}).get("data") == {"v": "1"}, "the update of boom")
        gate.set()
        await until(lambda: ("boom", "MODIFIED", {"v": "1"}) in calls, "the update handed over after the failure")
        await create_cm(api, namespace, "fine")
        await until(lambda: ("fine", "ADDED", None) in calls, "a later object")
        assert not task.done(), task
        await asyncio.wait_for(lw.drain(), WAIT_S)
    assert [(t, d) for n, t, d in calls if n == "boom"] == [("ADDED", None), ("MODIFIED", {"v": "1"})]


# --------------------------------------------------------------------------- error answers


async def test_an_error_answer_to_the_list_raises_and_keeps_known(namespace: str, api: client.ApiClient) -> None:
    uid = await create_cm(api, namespace, "x")
    rec = Recorder()
    lw = ListWatch(api, cm_path(namespace), rec)
    await lw._list()
    assert uid in lw.known()
    before = dict(lw.known())
    mark = len(rec.events)
    lw.path = f"/api/v1/namespaces/{namespace}/nosuchresources"  # answers 404, like a 403/429/5xx would
    raised: ApiException | None = None
    try:
        await lw._list()
    except ApiException as e:
        raised = e
    assert [t for t, _ in rec.events[mark:]] == []  # no DELETED synthesized for objects that still exist
    assert lw.known() == before
    assert raised is not None and raised.status == 404


async def test_an_error_answer_to_the_watch_raises(namespace: str, api: client.ApiClient) -> None:
    rec = Recorder()
    lw = ListWatch(api, f"/api/v1/namespaces/{namespace}/nosuchresources", rec)
    raised: ApiException | None = None
    try:
        await asyncio.wait_for(lw._watch("0"), WAIT_S)
    except ApiException as e:
        raised = e
    assert rec.events == []
    assert lw.known() == {}
    assert raised is not None and raised.status == 404
