"""Keep this node's ResourceSlices of driver ``gpu.kvgpu.io`` equal to its inventory.

After every inventory (cards, health, the VGPUPools' slicing) :meth:`SlicePublisher.sync`
computes :func:`kvgpu.dra.slices.resource_slices` with each pool's :class:`DevicePolicy`
(``defaults.gpumem``, ``defaults.gpucores``, ``minSliceMemory``) and compares it with the slice
on the API server (read, not cached: a slice edited or deleted by someone else is repaired at
the next inventory): created when missing, replaced with ``pool.generation`` + 1 when its
devices changed, deleted when the node has no ``dra`` card left. Each slice is owned by the Node
(``ownerReferences``), so deleting the Node deletes it.

:meth:`SlicePublisher.watch` watches the node's slices (field selector ``spec.nodeName``) and
asks for a sync when one is deleted or no longer what the agent wrote: a starting kubelet
deletes every ResourceSlice of its node (it wipes what drivers published before it ran), and
the agent publishes again within moments, not at its next inventory interval.

RBAC: ``resource.k8s.io`` ``resourceslices`` get/list/watch/create/update/delete.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from kvgpu.core.inventory import NodeInventory
from kvgpu.dra.slices import GROUP_VERSION, DevicePolicy, resource_slices, slice_name
from kvgpu.watch import ListWatch

log = logging.getLogger(__name__)

GROUP, VERSION = GROUP_VERSION.split("/")
PLURAL = "resourceslices"


def pool_policies(pools: Iterable[Mapping[str, Any]]) -> dict[str, DevicePolicy]:
    """``{pool name: DevicePolicy}`` from VGPUPool API objects (missing fields: 0, see
    :class:`DevicePolicy`; a non-integer field counts as 0 and is logged)."""
    out: dict[str, DevicePolicy] = {}
    for p in pools:
        name = str((p.get("metadata") or {}).get("name", ""))
        spec = p.get("spec") or {}
        d = spec.get("defaults") or {}
        try:
            out[name] = DevicePolicy(int(d.get("gpumem", 0) or 0), int(d.get("gpucores", 0) or 0),
                                     int(spec.get("minSliceMemory", 0) or 0))
        except (TypeError, ValueError):
            log.warning("VGPUPool %s: defaults.gpumem/gpucores or minSliceMemory is not an integer", name)
            out[name] = DevicePolicy()
    return out


SPEC_HASH = "gpu.kvgpu.io/spec-sha256"
"""Annotation of a published slice: the hash of the spec the agent wrote (the API server may
normalize what it stores, so the agent compares its own words, not the stored object)."""


def spec_hash(obj: Mapping[str, Any]) -> str:
    """SHA-256 of a slice's spec without ``pool.generation``."""
    spec = dict(obj.get("spec") or {})
    spec["pool"] = {k: v for k, v in (spec.get("pool") or {}).items() if k != "generation"}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def _same(have: Mapping[str, Any], want: Mapping[str, Any]) -> bool:
    return bool(((have.get("metadata") or {}).get("annotations") or {}).get(SPEC_HASH) == spec_hash(want))


class SlicePublisher:
    """Publishes ``node``'s ResourceSlices through a kubernetes_asyncio ``ApiClient``.
    Counters: ``writes`` (creates, updates and deletes made)."""

    def __init__(self, node: str, api_client: Any) -> None:
        from kubernetes_asyncio import client

        self.node = node
        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self.writes = 0
        self.written: str | None = None  # the spec hash of the slice as last seen or written

    def on_slice_event(self, on_change: Callable[[], None], etype: str, obj: Mapping[str, Any]) -> None:
        """One event of the node's slices: ``on_change()`` when this node's slice was deleted or
        is not what the agent last wrote (someone else edited it)."""
        meta = obj.get("metadata") or {}
        if meta.get("name") != slice_name(self.node):
            return
        if etype == "DELETED" or (meta.get("annotations") or {}).get(SPEC_HASH) != self.written:
            on_change()

    async def watch(self, api_client: Any, on_change: Callable[[], None]) -> None:
        """Watch the node's ResourceSlices until cancelled (faults retried by ListWatch)."""
        lw = ListWatch(api_client, f"/apis/{GROUP}/{VERSION}/{PLURAL}",
                       lambda etype, obj: self.on_slice_event(on_change, etype, obj),
                       field_selector=f"spec.nodeName={self.node}", name=f"resourceslices of {self.node}",
                       missing_retry_s=60.0)  # a cluster without resource.k8s.io/v1: quiet, looked for again
        await lw.run()

    async def _get(self, name: str) -> dict[str, Any] | None:
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            obj: dict[str, Any] = await self.custom.get_cluster_custom_object(GROUP, VERSION, PLURAL, name)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return obj

    async def _owner(self) -> dict[str, Any]:
        node = await self.core.read_node(self.node)
        return {"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": node.metadata.uid, "controller": True}

    async def publish(self, inv: NodeInventory, pools: Callable[[], Awaitable[Iterable[Mapping[str, Any]]]]) -> None:
        """:meth:`sync` with the pools from ``pools()``; an error is logged (the next inventory,
        at the interval or after a kick, retries)."""
        try:
            await self.sync(inv, await pools())
        except Exception as e:  # the API server away, the DRA API not served
            log.warning("could not publish the ResourceSlice of %s: %s", self.node, e)

    async def sync(self, inv: NodeInventory, pools: Iterable[Mapping[str, Any]]) -> bool:
        """Make the API server's slice match ``inv``; returns whether anything was written.
        Raises the API's errors (the caller retries at the next inventory)."""
        name = slice_name(self.node)
        have = await self._get(name)
        want = resource_slices(inv, pool_policies(pools))
        if not want:
            self.written = None
            if have is None:
                return False
            await self.custom.delete_cluster_custom_object(GROUP, VERSION, PLURAL, name)
            log.info("deleted ResourceSlice %s: no dra card on %s", name, self.node)
            self.writes += 1
            return True
        (obj,) = want
        self.written = spec_hash(obj)
        if have is not None and _same(have, obj):
            return False
        obj["metadata"]["ownerReferences"] = [await self._owner()]
        obj["metadata"]["annotations"] = {SPEC_HASH: spec_hash(obj)}
        if have is None:
            await self.custom.create_cluster_custom_object(GROUP, VERSION, PLURAL, obj)
        else:
            gen = int(((have.get("spec") or {}).get("pool") or {}).get("generation", 0) or 0) + 1
            obj["spec"]["pool"]["generation"] = gen
            obj["metadata"]["resourceVersion"] = have["metadata"]["resourceVersion"]
            await self.custom.replace_cluster_custom_object(GROUP, VERSION, PLURAL, name, obj)
        log.info("published ResourceSlice %s: %d device(s), generation %d", name,
                 len(obj["spec"]["devices"]), obj["spec"]["pool"]["generation"])
        self.writes += 1
        return True
