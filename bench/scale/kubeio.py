"""Lean API access for the scale bench: raw JSON in and out (no generated model objects, which
cost more CPU than the control plane on a 2-core machine), concurrent writes under a
semaphore, and a resumable raw watch that timestamps every event on arrival."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
from kvgpu.core import keys
from kvgpu.kube import read_checked

MERGE = "application/merge-patch+json"


async def bounded(items: list[Any], fn: Callable[[Any], Awaitable[Any]], limit: int) -> list[Any]:
    """Run ``fn`` over ``items`` with at most ``limit`` in flight; exceptions are returned, not raised."""
    sem = asyncio.Semaphore(limit)

    async def one(x: Any) -> Any:
        async with sem:
            try:
                return await fn(x)
            except Exception as e:  # the caller counts failures
                return e

    return await asyncio.gather(*(one(x) for x in items))


async def create_pod(api: client.ApiClient, ns: str, body: dict[str, Any]) -> None:
    resp = await client.CoreV1Api(api).create_namespaced_pod(ns, body, _preload_content=False)
    await read_checked(resp)


async def create_node(api: client.ApiClient, body: dict[str, Any]) -> None:
    try:
        resp = await client.CoreV1Api(api).create_node(body, _preload_content=False)
        await read_checked(resp)
    except ApiException as e:
        if e.status != 409:
            raise


async def mark_running(api: client.ApiClient, ns: str, name: str) -> None:
    body = {"status": {"phase": "Running", "podIP": "10.244.0.10",
                       "conditions": [{"type": "Ready", "status": "True"}]}}
    resp = await client.CoreV1Api(api).patch_namespaced_pod_status(
        name, ns, body, _content_type=MERGE, _preload_content=False)
    await read_checked(resp)


async def delete_pod(api: client.ApiClient, ns: str, name: str) -> None:
    try:
        resp = await client.CoreV1Api(api).delete_namespaced_pod(
            name, ns, grace_period_seconds=0, _preload_content=False)
        await read_checked(resp)
    except ApiException as e:
        if e.status != 404:
            raise


async def list_raw(api: client.ApiClient, kind: str, ns: str | None = None) -> dict[str, Any]:
    """List ``pods``, ``nodes`` or ``vgpuclaims`` as a plain dict (``items``, ``metadata``)."""
    core = client.CoreV1Api(api)
    if kind == "pods":
        resp = await (core.list_namespaced_pod(ns, _preload_content=False) if ns
                      else core.list_pod_for_all_namespaces(_preload_content=False))
    elif kind == "nodes":
        resp = await core.list_node(_preload_content=False)
    elif kind == "vgpuclaims":
        co = client.CustomObjectsApi(api)
        resp = await (co.list_namespaced_custom_object(keys.GROUP, keys.VERSION, ns, "vgpuclaims",
                                                       _preload_content=False) if ns
                      else co.list_cluster_custom_object(keys.GROUP, keys.VERSION, "vgpuclaims",
                                                         _preload_content=False))
    else:
        raise ValueError(kind)
    return dict(json.loads(await read_checked(resp)))


class Watch:
    """Watch ``kind`` (in ``ns``) and call ``on_event(type, obj, t)`` with the arrival time
    (``time.monotonic()``). Starts with a list (every existing object arrives as ``ADDED``),
    resumes from the last resourceVersion, relists after ``410 Gone`` or errors."""

    def __init__(self, api: client.ApiClient, kind: str, ns: str | None,
                 on_event: Callable[[str, dict[str, Any], float], None]) -> None:
        self.api, self.kind, self.ns, self.on_event = api, kind, ns, on_event
        self.synced = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> Watch:
        self._task = asyncio.create_task(self._run())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    async def _open(self, rv: str) -> Any:
        kw: dict[str, Any] = {"watch": True, "resource_version": rv, "timeout_seconds": 300,
                              "allow_watch_bookmarks": True, "_preload_content": False,
                              "_request_timeout": 330}
        core = client.CoreV1Api(self.api)
        if self.kind == "pods":
            return await (core.list_namespaced_pod(self.ns, **kw) if self.ns
                          else core.list_pod_for_all_namespaces(**kw))
        if self.kind == "nodes":
            return await core.list_node(**kw)
        co = client.CustomObjectsApi(self.api)
        return await co.list_namespaced_custom_object(keys.GROUP, keys.VERSION, self.ns, "vgpuclaims", **kw)

    async def _run(self) -> None:
        rv = ""
        while True:
            try:
                if not rv:
                    lst = await list_raw(self.api, self.kind, self.ns)
                    t = time.monotonic()
                    for obj in lst.get("items") or []:
                        self.on_event("ADDED", obj, t)
                    rv = lst["metadata"]["resourceVersion"]
                    self.synced.set()
                resp = await self._open(rv)
                try:
                    while True:
                        line = await resp.content.readline()
                        if not line:
                            break
                        t = time.monotonic()
                        ev = json.loads(line)
                        obj = ev.get("object") or {}
                        if ev.get("type") == "ERROR":
                            if obj.get("code") == 410:
                                rv = ""
                            break
                        rv = (obj.get("metadata") or {}).get("resourceVersion", rv)
                        if ev.get("type") != "BOOKMARK":
                            self.on_event(ev["type"], obj, t)
                finally:
                    resp.release()
            except asyncio.CancelledError:
                raise
            except Exception:
                await asyncio.sleep(0.5)
