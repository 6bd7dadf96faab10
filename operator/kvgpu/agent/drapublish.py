"""Keep this node's ResourceSlices of driver ``gpu.kvgpu.io`` equal to its inventory.

After every inventory (cards, health, the VGPUPools' slicing) :meth:`SlicePublisher.sync`
computes :func:`kvgpu.dra.slices.resource_slices` with each pool's :class:`DevicePolicy`
(``defaults.gpumem``, ``defaults.gpucores``, ``minSliceMemory``) and compares it with the slice
on the API server (read, not cached: a slice edited or deleted by someone else is repaired at
the next inventory): created when missing, replaced with ``pool.generation`` + 1 when its
devices changed (all of the node's slices with one new generation), deleted when the node has
no ``dra`` card left. Each slice is owned by the Node
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
from kvgpu.dra.slices import DRIVER, GROUP_VERSION, DevicePolicy, resource_slices
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
        self.written: dict[str, str] = {}  # slice name → the spec hash last written or seen

    def on_slice_event(self, on_change: Callable[[], None], etype: str, obj: Mapping[str, Any]) -> None:
        """One event of the node's slices: ``on_change()`` when one the agent wrote was deleted or
        is not what it last wrote (someone else edited it), or a slice of its driver it did not
        write appeared."""
        meta = obj.get("metadata") or {}
        if (obj.get("spec") or {}).get("driver", DRIVER) != DRIVER:
            return
        name = str(meta.get("name", ""))
        mine = self.written.get(name)
        if mine is None:
            if etype != "DELETED" and name.endswith(DRIVER) and name.startswith(self.node):
                on_change()
            return
        if etype == "DELETED" or (meta.get("annotations") or {}).get(SPEC_HASH) != mine:
            on_change()

    async def watch(self, api_client: Any, on_change: Callable[[], None]) -> None:
        """Watch the node's ResourceSlices until cancelled (faults retried by ListWatch)."""
        lw = ListWatch(api_client, f"/apis/{GROUP}/{VERSION}/{PLURAL}",
                       lambda etype, obj: self.on_slice_event(on_change, etype, obj),
                       field_selector=f"spec.nodeName={self.node}", name=f"resourceslices of {self.node}",
                       missing_retry_s=60.0)  # a cluster without resource.k8s.io/v1: quiet, looked for again
        await lw.run()

    async def _list(self) -> dict[str, dict[str, Any]]:
        """This node's slices of :data:`DRIVER` on the API server, by name."""
        got = await self.custom.list_cluster_custom_object(
            GROUP, VERSION, PLURAL, field_selector=f"spec.nodeName={self.node},spec.driver={DRIVER}")
        return {o["metadata"]["name"]: o for o in got.get("items", [])}

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
        """Make the API server's slices of this node match ``inv`` (a node with MIG cards has a
        counter slice too); returns whether anything was written. Every slice of the pool is
        written again with one new ``pool.generation`` when any of them changed; slices of the
        driver on this node that ``inv`` no longer names are deleted. Raises the API's errors
        (the caller retries at the next inventory)."""
        have = await self._list()
        want = resource_slices(inv, pool_policies(pools))
        self.written = {o["metadata"]["name"]: spec_hash(o) for o in want}
        if set(have) == set(self.written) and all(_same(have[o["metadata"]["name"]], o) for o in want):
            return False
        gen = max((int(((h.get("spec") or {}).get("pool") or {}).get("generation", 0) or 0)
                   for h in have.values()), default=0) + 1
        owner = [await self._owner()] if want else []
        for obj in want:
            await self._write(obj, have.get(obj["metadata"]["name"]), gen, owner)
        for name in sorted(set(have) - set(self.written)):
            await self.custom.delete_cluster_custom_object(GROUP, VERSION, PLURAL, name)
            log.info("deleted ResourceSlice %s of %s", name, self.node)
            self.writes += 1
        return True

    async def _write(self, obj: dict[str, Any], have: Mapping[str, Any] | None, gen: int,
                     owner: list[dict[str, Any]]) -> None:
        name = obj["metadata"]["name"]
        obj["metadata"]["ownerReferences"] = owner
        obj["metadata"]["annotations"] = {SPEC_HASH: spec_hash(obj)}
        obj["spec"]["pool"]["generation"] = gen
        if have is None:
            await self.custom.create_cluster_custom_object(GROUP, VERSION, PLURAL, obj)
        else:
            obj["metadata"]["resourceVersion"] = have["metadata"]["resourceVersion"]
            await self.custom.replace_cluster_custom_object(GROUP, VERSION, PLURAL, name, obj)
        log.info("published ResourceSlice %s: %d device(s), %d counter set(s), generation %d", name,
                 len(obj["spec"].get("devices") or []), len(obj["spec"].get("sharedCounters") or []), gen)
        self.writes += 1
