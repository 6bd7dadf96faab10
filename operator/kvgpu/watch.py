"""List-and-watch streams: every watch of the operator and the agent.

Kopf's per-event machinery (causes, diffs, handler bookkeeping, logging) cost 25–35 % of the
operator's CPU during bursts (py-spy, docs/benchmarks.md), although the handlers act on few of
those events. These streams hand each event's object, as plain JSON, straight to a handler —
what a client-go informer does, without its cache of whole objects:

* **list** (paginated, ``limit`` 500) and hand every object over as ``ADDED``; objects known from
  an earlier list that are gone now are handed over as ``DELETED`` (their last *projection*, see
  below), so a watch that broke for a while never leaves a deletion unseen;
* **watch** from the list's ``resourceVersion`` with bookmarks (``allowWatchBookmarks``), server
  timeout 300 s, resuming from the last resourceVersion handed over (also after a connection
  broke mid-stream: no event is replayed); ``410 Gone`` (the version was compacted away) → list
  again; connection errors → retry after a back-off (0.2 s doubling to 5 s).
* **per-object order**: a handler that is a coroutine function runs as one worker per object
  (key = UID); events of one object never overlap, and events that arrive while its handler runs
  are coalesced to the latest (level-based handlers need only the latest state; a ``DELETED``
  is always the latest); a handler that raises is called again for the object's latest state
  after a back-off (0.2 s doubling to 60 s). Different objects run concurrently. Plain
  functions run inline.

The operator's main process (Nodes, VGPUClaims, quotas), its claim-phase worker (Pods) and the
node agent (its Node, the VGPUPools, the Pods bound to its node) all watch through this class;
Kopf watches only the operator's VGPUPools, for their handler.

``project`` keeps, per object, what a synthesized ``DELETED`` needs (e.g. a claim's spec) and
what :meth:`ListWatch.known` returns to periodic checks instead of listing the cluster again.

The stream is read in chunks and split on newlines here, so no line length limit of the HTTP
client's reader applies (a pod may carry 256 KiB of annotations; an object up to etcd's 1.5 MiB).
Wire format: one JSON object per line, ``{"type": "ADDED|MODIFIED|DELETED|BOOKMARK|ERROR",
"object": {...}}`` (Kubernetes API concepts, "Efficient detection of changes").
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import structlog
from kubernetes_asyncio.client.exceptions import ApiException

from kvgpu import faults
from kvgpu.kube import read_checked

log = structlog.get_logger("kvgpu.watch")

Handler = Callable[[str, dict[str, Any]], Awaitable[None] | None]
Projection = Callable[[dict[str, Any]], dict[str, Any]]

PAGE = 500
SERVER_TIMEOUT_S = 300
BACKOFF_MIN_S = 0.2
BACKOFF_MAX_S = 5.0
RETRY_MAX_S = 60.0  # a failing handler is retried for its object at most this far apart


class Gone(Exception):
    """The watch's resourceVersion is too old (HTTP 410): list again."""


def metadata_only(obj: dict[str, Any]) -> dict[str, Any]:
    """Default projection: name, namespace, UID, labels and annotations."""
    meta = obj.get("metadata") or {}
    keep = {k: meta[k] for k in ("name", "namespace", "uid", "labels", "annotations", "creationTimestamp")
            if k in meta}
    return {"metadata": keep}


class ListWatch:
    """One resource's list-and-watch loop feeding ``handler(event_type, obj)``.

    ``path``: the collection URL (``/api/v1/pods``, ``/apis/kvgpu.io/v1alpha1/vgpuclaims``);
    ``label_selector``/``field_selector``: as for ``kubectl -l``/``--field-selector``.
    ``missing_retry_s``: a resource the API server does not serve (404, a CRD not installed yet)
    counts as empty (known objects are handed over as ``DELETED``, :attr:`synced` is set) and is
    listed again after this many seconds; ``None`` (default): a 404 is a fault like any other.
    :meth:`run` never returns (cancel it); handler exceptions are logged and do not stop the
    stream.
    """

    def __init__(self, api: Any, path: str, handler: Handler, *, label_selector: str | None = None,
                 field_selector: str | None = None, project: Projection = metadata_only, name: str = "",
                 missing_retry_s: float | None = None) -> None:
        self.api = api
        self.path = path
        self.handler = handler
        self.label_selector = label_selector
        self.field_selector = field_selector
        self.missing_retry_s = missing_retry_s
        self.project = project
        self.name = name or path.rsplit("/", 1)[-1]
        self.synced = asyncio.Event()  # set after the first list was handed over
        self.events = 0  # objects handed over (list items and watch events)
        self.relists = 0
        #: True from a failed list or watch until the next one succeeds: :meth:`known` may lag
        self.broken = False
        self._known: dict[str, dict[str, Any]] = {}
        self._rv = ""  # the last resourceVersion handed over (list, event or bookmark)
        self._async = inspect.iscoroutinefunction(handler)
        self._latest: dict[str, tuple[str, dict[str, Any]]] = {}
        self._workers: dict[str, asyncio.Task[None]] = {}
        self._faults = faults.FaultLog(log)

    # ----- public ---------------------------------------------------------------------------
    def known(self) -> dict[str, dict[str, Any]]:
        """UID → projection of every object the stream currently knows (a live view; copy it
        before awaiting)."""
        return self._known

    def current(self) -> bool:
        """True when :meth:`known` is up to date as far as this stream can tell: listed at
        least once, and neither list nor watch failing since (callers fall back to a read)."""
        return self.synced.is_set() and not self.broken

    async def run(self) -> None:
        delay = BACKOFF_MIN_S
        rv: str | None = None
        while True:
            try:
                if rv is None:
                    rv = await self._list()
                    self.broken = False
                    self.synced.set()
                rv = await self._watch(rv)
                delay = BACKOFF_MIN_S
            except asyncio.CancelledError:
                raise
            except ApiException as e:
                if e.status != 404 or self.missing_retry_s is None:
                    rv, delay = await self._broke(e, rv, delay)
                    continue
                self._missing()
                rv = None
                await asyncio.sleep(self.missing_retry_s)
            except Gone:
                log.info("watch expired: listing again", resource=self.name)
                self.relists += 1
                rv = None
            except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:
                rv, delay = await self._broke(e, rv, delay)

    async def _broke(self, e: BaseException, rv: str | None, delay: float) -> tuple[str | None, float]:
        """After a failed list or watch: log the fault (rate-limited), wait ``delay``; returns
        where to go on from (the last event handed over, not a replay from the list) and the
        next delay."""
        self.broken = True
        if rv is not None and self._rv:
            rv = self._rv
        why = faults.expected(e) or repr(e)[:200]
        self._faults.fault("stream", f"{self.name} watch broke, retrying", why)
        await asyncio.sleep(delay)
        return rv, min(delay * 2, BACKOFF_MAX_S)

    def _missing(self) -> None:
        """The resource is not served (404): hand every known object over as ``DELETED``."""
        if not self.synced.is_set() or self._known:
            log.info("resource not served: empty until it is", resource=self.name, retry_s=self.missing_retry_s)
        gone, self._known = self._known, {}
        self.broken = False
        self.synced.set()
        self._faults.ok("stream", f"{self.name} watch")
        for uid, last in gone.items():
            self._dispatch(uid, "DELETED", last)

    async def drain(self) -> None:
        """Wait until every handler started so far has finished (tests, shutdown)."""
        while self._workers:
            await asyncio.gather(*list(self._workers.values()), return_exceptions=True)

    # ----- list and watch ---------------------------------------------------------------------
    async def _get(self, query: list[tuple[str, Any]], request_timeout_s: float) -> Any:
        if self.label_selector:
            query = [*query, ("labelSelector", self.label_selector)]
        if self.field_selector:
            query = [*query, ("fieldSelector", self.field_selector)]
        resp = await self.api.call_api(
            self.path, "GET", query_params=query, header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"], _preload_content=False, _request_timeout=request_timeout_s)
        if not 200 <= resp.status <= 299:
            await read_checked(resp)  # raises ApiException with the API server's Status
        return resp

    async def _list(self) -> str:
        seen: dict[str, dict[str, Any]] = {}
        items: list[dict[str, Any]] = []
        cont = ""
        while True:
            query: list[tuple[str, Any]] = [("limit", PAGE)]
            if cont:
                query.append(("continue", cont))
            page = json.loads(await read_checked(await self._get(query, 120)))
            items.extend(page.get("items") or [])
            meta = page.get("metadata") or {}
            cont = meta.get("continue") or ""
            if not cont:
                rv = str(meta.get("resourceVersion", ""))
                self._rv = rv
                break
        for obj in items:
            uid = (obj.get("metadata") or {}).get("uid", "")
            seen[uid] = self.project(obj)
            self._dispatch(uid, "ADDED", obj)
        gone = [(uid, last) for uid, last in self._known.items() if uid not in seen]
        self._known = seen
        for uid, last in gone:
            self._dispatch(uid, "DELETED", last)
        return rv

    async def _watch(self, rv: str) -> str:
        query = [("watch", "true"), ("resourceVersion", rv), ("allowWatchBookmarks", "true"),
                 ("timeoutSeconds", SERVER_TIMEOUT_S)]
        try:
            resp = await self._get(query, SERVER_TIMEOUT_S + 30)
        except ApiException as e:
            if e.status == 410:
                raise Gone(str(e.reason)) from e
            raise
        self.broken = False
        self._faults.ok("stream", f"{self.name} watch")
        try:
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                if b"\n" not in chunk:
                    continue
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if line.strip():
                        rv = self._event(json.loads(line)) or rv
            if buf.strip():
                rv = self._event(json.loads(buf)) or rv
        finally:
            resp.release()
        return rv

    def _event(self, ev: dict[str, Any]) -> str | None:
        etype, obj = ev.get("type", ""), ev.get("object") or {}
        if etype == "ERROR":
            if obj.get("code") == 410:
                raise Gone(obj.get("message", ""))
            raise ValueError(f"watch error: {obj.get('message', obj)}")
        meta = obj.get("metadata") or {}
        rv = meta.get("resourceVersion")
        if rv:
            self._rv = str(rv)
        if etype == "BOOKMARK":
            return rv
        uid = meta.get("uid", "")
        if etype == "DELETED":
            self._known.pop(uid, None)
        else:
            self._known[uid] = self.project(obj)
        self._dispatch(uid, etype, obj)
        return rv

    # ----- handing over -----------------------------------------------------------------------
    def _dispatch(self, key: str, etype: str, obj: dict[str, Any]) -> None:
        self.events += 1
        if not self._async:
            try:
                self.handler(etype, obj)
            except Exception:
                log.exception("watch handler failed", resource=self.name, event_type=etype)
            return
        self._latest[key] = (etype, obj)
        if key not in self._workers:
            self._workers[key] = asyncio.create_task(self._work(key), name=f"kvgpu-{self.name}-{key}")

    async def _work(self, key: str) -> None:
        delay = BACKOFF_MIN_S
        try:
            while key in self._latest:
                etype, obj = self._latest.pop(key)
                try:
                    await self.handler(etype, obj)  # type: ignore[misc]
                    delay = BACKOFF_MIN_S
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    # Level-based handlers: try the object's state again after a back-off,
                    # unless a newer event has come meanwhile (a failed write, e.g. a claim's
                    # Released while the API server restarts, would otherwise wait for an
                    # event that may never come).
                    if (why := faults.expected(e)) is None:
                        log.exception("watch handler failed: retrying", resource=self.name, event_type=etype,
                                      after_s=delay)
                    else:
                        self._faults.fault("handler", f"{self.name} handler failed, retrying", why)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, RETRY_MAX_S)
                    self._latest.setdefault(key, (etype, obj))
        finally:
            self._workers.pop(key, None)


async def periodically(synced: asyncio.Event, fn: Callable[[], Awaitable[None]], interval_s: float,
                       what: str) -> None:
    """Once ``synced`` is set (a stream's first list), run ``fn`` every ``interval_s`` seconds
    for ever; a failure is logged (``what`` failed) and the next round runs as planned."""
    await synced.wait()
    while True:
        try:
            await fn()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception(f"{what} failed")
        await asyncio.sleep(interval_s)
