"""Thin kubernetes_asyncio adapters: everything the operator reads or writes goes through here.

All functions take an ``ApiClient`` and plain dicts; they raise ``ApiException`` from
kubernetes_asyncio unchanged unless documented. Merge patches carry their content type
explicitly (kubernetes_asyncio would default dict patches on custom objects to JSON patch).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import aiohttp
import tenacity
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from kvgpu.core import keys
from kvgpu.core.eventcorrelator import Decision, EventCorrelator, aggregate_key

MERGE = "application/merge-patch+json"


def _transient(e: BaseException) -> bool:
    if isinstance(e, ApiException):
        return e.status in (429, 500, 502, 503, 504)
    return isinstance(e, OSError | asyncio.TimeoutError)


#: Retry policy for calls that must eventually succeed (start-up listing): transient API
#: errors (429 "storage is (re)initializing", 5xx) and connection errors, for up to 2 minutes.
retry_transient = tenacity.retry(
    retry=tenacity.retry_if_exception(_transient),
    wait=tenacity.wait_exponential(multiplier=0.1, max=2.0),
    stop=tenacity.stop_after_delay(120),
    reraise=True,
)


PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def api_client(configuration: client.Configuration) -> client.ApiClient:
    """An ``ApiClient`` whose HTTP session looks up proxies and ``.netrc`` only when a proxy
    variable is set. kubernetes_asyncio opens its aiohttp session with ``trust_env=True``, and
    aiohttp then runs the proxy and netrc lookup in a thread for every request: ~6 % of the
    operator's CPU during a burst (py-spy), for nothing when no proxy is configured."""
    api = client.ApiClient(configuration=configuration)
    if not any(os.environ.get(v) for v in PROXY_VARIABLES):
        rest = api.rest_client
        old = rest.pool_manager
        rest.pool_manager = aiohttp.ClientSession(
            connector=old.connector, connector_owner=True, trust_env=False, read_bufsize=2**21)
        old._connector = None  # handed over; closing the old session must not close it
        old._connector_owner = False
    return api


async def connect(kubeconfig: str | None) -> client.ApiClient:
    """An :func:`api_client` from ``kubeconfig`` (None: the in-cluster service account), with
    a connection pool of 64 (bursts keep many writes in flight)."""
    cfg = client.Configuration()
    if kubeconfig:
        await config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    else:
        config.load_incluster_config(client_configuration=cfg)
    cfg.connection_pool_maxsize = 64
    return api_client(cfg)


async def read_checked(resp: Any) -> bytes:
    """The body of a ``_preload_content=False`` answer, released to the pool; ``ApiException``
    for a status outside 2xx. (kubernetes_asyncio checks the status only when it preloads the
    content: without this, a 404 or a 409 would read as a success.)"""
    try:
        data: bytes = await resp.read()
    finally:
        resp.release()
    if not 200 <= resp.status <= 299:
        e = ApiException(status=resp.status, reason=data.decode(errors="replace")[:1000])
        e.body = data
        raise e
    return data


async def _discard(resp: Any) -> None:
    """Read and drop a ``_preload_content=False`` answer; ``ApiException`` outside 2xx."""
    await read_checked(resp)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _plain(api: client.ApiClient, obj: Any) -> dict[str, Any]:
    return obj if isinstance(obj, dict) else api.sanitize_for_serialization(obj)


async def _raw(resp: Any) -> Any:
    """The JSON body of a ``_preload_content=False`` answer (``ApiException`` outside 2xx).
    Reading pods as plain JSON skips the generated models (deserialize + sanitize cost ~1 ms of
    CPU per pod, on the bind path)."""
    return json.loads(await read_checked(resp))


def _seg(text: str) -> str:
    """One URL path segment (a namespace or a name), escaped as the generated client does."""
    return quote(text, safe="")


#: No client-side timeout, as the generated client sends its calls (``aiohttp.ClientTimeout()``)
NO_TIMEOUT = aiohttp.ClientTimeout()


async def send(api: client.ApiClient, method: str, path: str, body: bytes | None = None,
               content_type: str = "application/json") -> bytes:
    """One API call through ``api``'s HTTP session (its connection pool, TLS and credentials),
    without the generated client's layers: the body is sent as given (already JSON) and the
    answer returned as bytes, ``ApiException`` outside 2xx. The bind writes go through here: the
    generated client's parameter handling and ``sanitize_for_serialization`` of the body cost
    about as much CPU as the HTTP request itself, in the process that answers kube-scheduler."""
    cfg = api.configuration
    headers = {**api.default_headers, "Accept": "application/json", "Content-Type": content_type}
    if cfg.api_key:  # a bearer token (in-cluster: re-read by the configuration's refresh hook)
        for auth in (await cfg.auth_settings()).values():
            headers[auth["key"]] = auth["value"]
    rest = api.rest_client
    extra: dict[str, Any] = {}
    if rest.proxy:
        extra["proxy"] = rest.proxy
        if rest.proxy_headers:
            extra["proxy_headers"] = rest.proxy_headers
    if rest.server_hostname:
        extra["server_hostname"] = rest.server_hostname
    resp = await rest.pool_manager.request(method, cfg.host + path, data=body, headers=headers,
                                           timeout=NO_TIMEOUT, **extra)
    return await read_checked(resp)


async def get_pod(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        resp = await client.CoreV1Api(api).read_namespaced_pod(name, namespace, _preload_content=False)
        return await _raw(resp)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


async def patch_pod_metadata(
    api: client.ApiClient, namespace: str, name: str, *, annotations: Mapping[str, str | None]
) -> dict[str, Any]:
    body = {"metadata": {"annotations": dict(annotations)}}
    return await _raw(await client.CoreV1Api(api).patch_namespaced_pod(
        name, namespace, body, _content_type=MERGE, _preload_content=False))


async def create_binding(
    api: client.ApiClient, namespace: str, name: str, uid: str, node: str,
    annotations: dict[str, str] | None = None,
) -> None:
    """Bind the pod to ``node``. ``annotations`` are merged into the pod's by the API server in
    the same write that sets ``spec.nodeName`` (the Binding subresource does that)."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "uid": uid}
    if annotations:
        meta["annotations"] = annotations
    body = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": meta,
        "target": {"apiVersion": "v1", "kind": "Node", "name": node},
    }
    await send(api, "POST", f"/api/v1/namespaces/{_seg(namespace)}/pods/{_seg(name)}/binding",
               json.dumps(body, separators=(",", ":")).encode())


@retry_transient
async def list_all(api: client.ApiClient, kind: str) -> list[dict[str, Any]]:
    """List ``nodes``, ``vgpupools``, ``vgpuclaims``, ``vgpuquotas``, ``resourcequotas`` (all
    namespaces) or kvgpu-managed ``pods``."""
    if kind == "nodes":
        nodes = await _raw(await client.CoreV1Api(api).list_node(_preload_content=False))
        return list(nodes.get("items") or [])
    if kind == "pods":
        res = await client.CoreV1Api(api).list_pod_for_all_namespaces(
            label_selector=f"{keys.POD_MANAGED_LABEL}=true", _preload_content=False
        )
        return list((await _raw(res)).get("items") or [])
    co = client.CustomObjectsApi(api)
    if kind == "vgpupools":
        return (await co.list_cluster_custom_object(keys.GROUP, keys.VERSION, "vgpupools"))["items"]
    if kind == "vgpuclaims":
        return (await co.list_cluster_custom_object(keys.GROUP, keys.VERSION, "vgpuclaims"))["items"]
    if kind == "vgpuquotas":
        return (await co.list_cluster_custom_object(keys.GROUP, keys.VERSION, "vgpuquotas"))["items"]
    if kind == "resourcequotas":
        res = await client.CoreV1Api(api).list_resource_quota_for_all_namespaces(_preload_content=False)
        return list((await _raw(res)).get("items") or [])
    raise ValueError(kind)


async def get_path(api: client.ApiClient, path: str) -> dict[str, Any] | None:
    """GET one object by its URL path (``/apis/resource.k8s.io/v1/deviceclasses/gpu.kvgpu.io``);
    None for 404 (the object, or its API, is not there)."""
    resp = await api.call_api(path, "GET", header_params={"Accept": "application/json"},
                              auth_settings=["BearerToken"], _preload_content=False)
    try:
        data = await read_checked(resp)
    except ApiException as e:
        if e.status == 404:
            return None
        raise
    out: dict[str, Any] = json.loads(data)
    return out


async def create_claim(api: client.ApiClient, namespace: str, body: dict[str, Any]) -> str:
    """Create a VGPUClaim; returns the new object's UID."""
    created = json.loads(await send(
        api, "POST", f"/apis/{keys.GROUP}/{keys.VERSION}/namespaces/{_seg(namespace)}/vgpuclaims",
        json.dumps(body, separators=(",", ":")).encode()))
    return str((created.get("metadata") or {}).get("uid") or "")


async def get_claim(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return await client.CustomObjectsApi(api).get_namespaced_custom_object(
            keys.GROUP, keys.VERSION, namespace, "vgpuclaims", name
        )
    except ApiException as e:
        if e.status == 404:
            return None
        raise


async def delete_claim(api: client.ApiClient, namespace: str, name: str) -> bool:
    """Delete a claim; False when it was already gone."""
    try:
        await client.CustomObjectsApi(api).delete_namespaced_custom_object(
            keys.GROUP, keys.VERSION, namespace, "vgpuclaims", name
        )
        return True
    except ApiException as e:
        if e.status == 404:
            return False
        raise


async def _patch_namespaced_status(api: client.ApiClient, plural: str, namespace: str, name: str,
                                   status: dict[str, Any]) -> bool:
    """Merge ``status`` into the status of one of our namespaced objects (``plural``); False when
    it is gone (the answer is not decoded)."""
    try:
        await _discard(await client.CustomObjectsApi(api).patch_namespaced_custom_object_status(
            keys.GROUP, keys.VERSION, namespace, plural, name, {"status": status}, _content_type=MERGE,
            _preload_content=False))
        return True
    except ApiException as e:
        if e.status == 404:
            return False
        raise


async def patch_claim_status(api: client.ApiClient, namespace: str, name: str, status: dict[str, Any]) -> bool:
    """Merge ``status`` into a claim's status; False when the claim is gone."""
    return await _patch_namespaced_status(api, "vgpuclaims", namespace, name, status)


async def patch_vgpuquota_status(api: client.ApiClient, namespace: str, name: str,
                                 status: dict[str, Any]) -> bool:
    """Merge ``status`` into a VGPUQuota's status; False when the quota is gone."""
    return await _patch_namespaced_status(api, "vgpuquotas", namespace, name, status)


async def patch_pool_status(api: client.ApiClient, name: str, status: dict[str, Any]) -> None:
    try:
        await client.CustomObjectsApi(api).patch_cluster_custom_object_status(
            keys.GROUP, keys.VERSION, "vgpupools", name, {"status": status}, _content_type=MERGE
        )
    except ApiException as e:
        if e.status != 404:
            raise


async def patch_node_annotations(api: client.ApiClient, name: str, annotations: dict[str, str | None]) -> None:
    try:
        await _discard(await client.CoreV1Api(api).patch_node(
            name, {"metadata": {"annotations": annotations}}, _content_type=MERGE, _preload_content=False))
    except ApiException as e:
        if e.status != 404:
            raise


async def patch_node_status(api: client.ApiClient, name: str, patch: dict[str, Any]) -> None:
    """Merge-patch a node's status (the extended resources the operator advertises); a node
    gone meanwhile is no error."""
    try:
        await _discard(await client.CoreV1Api(api).patch_node_status(
            name, patch, _content_type=MERGE, _preload_content=False))
    except ApiException as e:
        if e.status != 404:
            raise


def event_body(
    involved: dict[str, Any],
    namespace: str,
    *,
    reason: str,
    message: str,
    type_: str = "Normal",
    component: str = "kvgpu-operator",
    instance: str | None = None,
    host: str | None = None,
) -> dict[str, Any]:
    """A core/v1 Event about ``involved`` (``{apiVersion, kind, name, namespace?, uid}``), recorded
    in ``namespace``; the API server names it (``generateName``). Message cut to 1024 characters.
    Shared by the operator and the agent."""
    now = _now()[:19] + "Z"
    source: dict[str, str] = {"component": component}
    if host:
        source["host"] = host
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{involved.get('name') or 'obj'}.kvgpu-", "namespace": namespace},
        "involvedObject": {k: v for k, v in involved.items() if v is not None},
        "reason": reason,
        "message": message[:1024],
        "type": type_,
        "source": source,
        "reportingComponent": component,
        "reportingInstance": instance or component,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


async def post_event(
    api: client.ApiClient,
    obj: dict[str, Any],
    *,
    reason: str,
    message: str,
    type_: str = "Normal",
    component: str = "kvgpu-operator",
) -> None:
    """Record a core/v1 Event on ``obj`` (a Pod, Node or VGPUClaim dict). Never raises."""
    meta = obj.get("metadata", {})
    ns = meta.get("namespace") or "default"
    involved = {"apiVersion": obj.get("apiVersion", "v1"), "kind": obj.get("kind", "Pod"),
                "name": meta.get("name"), "namespace": meta.get("namespace"), "uid": meta.get("uid")}
    body = event_body(involved, ns, reason=reason, message=message, type_=type_, component=component)
    try:
        await RECORDER.record(api, ns, body)
    except (ApiException, OSError):
        pass


class EventRecorder:
    """Posts core/v1 Events through an :class:`~kvgpu.core.eventcorrelator.EventCorrelator`, as
    client-go's recorder does: a repeat patches the existing Event's ``count`` and
    ``lastTimestamp``, similar events become one combined Event, spam is skipped. One per process
    (or per agent); ``clock`` gives seconds since the epoch. Events of one correlation key are
    posted one at a time (a lock per aggregate key), so a repeat never races its Event's creation."""

    def __init__(self, correlator: EventCorrelator | None = None, clock: Any = None) -> None:
        import time

        self.correlator = correlator if correlator is not None else EventCorrelator()
        self.clock = clock if clock is not None else time.time
        self._locks: dict[str, asyncio.Lock] = {}

    async def record(self, api: client.ApiClient, namespace: str, body: dict[str, Any]) -> Decision:
        """Create or patch the Event for ``body`` in ``namespace`` (or skip it). Returns the
        decision taken. Raises ``ApiException``/``OSError`` from the API (the correlator then
        forgets the key: the next one is created anew); a patch of an Event that is gone (404,
        expired) or not allowed (403: RBAC without ``patch`` on events) becomes a create."""
        lock = self._locks.setdefault(aggregate_key(body), asyncio.Lock())
        async with lock:
            d = self.correlator.correlate(body, self.clock())
            decision = await self._post(api, namespace, d, body)
        if len(self._locks) > self.correlator.cache_size:
            for k in [k for k, v in self._locks.items() if not v.locked()]:
                del self._locks[k]
        return decision

    async def _post(self, api: client.ApiClient, ns: str, d: Decision, body: dict[str, Any]) -> Decision:
        core = client.CoreV1Api(api)
        if d.action == "skip":
            return d
        if d.action == "patch":
            try:
                await _discard(await core.patch_namespaced_event(
                    d.name, ns, d.patch, _content_type=MERGE, _preload_content=False))
                return d
            except ApiException as e:
                if e.status not in (403, 404):
                    raise
            # 404: expired or deleted; 403: RBAC without events/patch (an older install). Create.
            self.correlator.forget(d.key)
            d = self.correlator.correlate(body, self.clock())
            if d.action != "create":
                return d
        try:
            created = await _raw(await core.create_namespaced_event(ns, d.body, _preload_content=False))
        except BaseException:
            self.correlator.forget(d.key)
            raise
        self.correlator.created(d.key, str((created.get("metadata") or {}).get("name") or ""))
        return d


#: The operator's recorder (:func:`post_event`).
RECORDER = EventRecorder()


async def list_node_pods(api: client.ApiClient, node: str) -> list[dict[str, Any]]:
    """Every pod bound to ``node`` (GPU preemption reads their priorities and labels)."""
    res = await client.CoreV1Api(api).list_pod_for_all_namespaces(
        field_selector=f"spec.nodeName={node}", _preload_content=False)
    return list((await _raw(res)).get("items") or [])


async def list_pdbs(api: client.ApiClient, namespace: str) -> list[dict[str, Any]]:
    """The PodDisruptionBudgets of ``namespace``."""
    res = await client.PolicyV1Api(api).list_namespaced_pod_disruption_budget(namespace, _preload_content=False)
    return list((await _raw(res)).get("items") or [])


async def evict_pod(api: client.ApiClient, namespace: str, name: str, uid: str) -> None:
    """Evict a pod through the Eviction API (PodDisruptionBudgets apply: 429 when one forbids
    it), only the pod with ``uid``."""
    body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": namespace},
            "deleteOptions": {"preconditions": {"uid": uid}}}
    await _discard(await client.CoreV1Api(api).create_namespaced_pod_eviction(
        name, namespace, body, _preload_content=False))
